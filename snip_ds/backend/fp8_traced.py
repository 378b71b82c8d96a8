"""A per-tensor FP8 layer under ``torch.compile`` as ordinary operators, which inductor fuses with its neighbours.

Eagerly, the torch backend runs a per-tensor FP8 (``fp8_hybrid``) layer through its Triton kernels
(:mod:`.fp8_step`); under ``torch.compile`` the layer is otherwise one opaque custom operator
(:mod:`.custom_ops`), around which inductor can fuse nothing. Where the eager layer would run that step with
every GEMM on ``torch._scaled_mm`` (:func:`applies`), the compiled layer is instead this autograd function of
plain operators -- ``abs``/``amax`` for the tensor amax, the scale, a division, a clamp and the cast to the FP8
dtype for each operand, ``torch._scaled_mm`` for each GEMM -- so inductor can fuse a cast into the RMSNorm or
SiLU that produces its input, compute the amax and scale of one input read by several layers (query, key and
value; gate and up) once, and choose what to keep for backward.

The operators compute :func:`snip_ds.quant.quantize_parts`'s per-tensor codes and scale (the same formula:
``s = max(amax / max_normal, 2**-149)``, 1 for a zero amax, NaN for a non-finite one; codes ``RNE(x / s)``
saturated), so the compiled layer's results equal the eager layer's bit for bit where the division is IEEE
round-to-nearest: in inductor's C++ code on a CPU (``tests/test_fp8_traced_memory.py``: a layer;
``tests/test_step_costs.py``: a Llama block, with ``emulate_precision_casts``, torch 2.13's inductor; 2.11's
rounds a plain BF16 block elsewhere than eager already), and in its Triton code on
a GPU with ``torch._inductor.config.eager_numerics.division_rounding`` set (inductor's Triton division is
otherwise the approximate one: codes may then differ by a rounding step in rare elements; not measured yet).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from snip_ds.backend.fp8_step import scaled_mm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_MAX = {E4M3: 448.0, E5M2: 57344.0}
_TINY = 2.0 ** -149  # FP32's smallest subnormal: the smallest scale


def codes(t: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """``t``'s per-tensor FP8 codes in ``dtype`` and its scale, as ordinary operators."""
    amax = t.abs().amax().float()
    # NaN where amax is not finite: inf - inf and NaN - NaN are NaN, made positive (float("nan")'s sign) by abs,
    # a no-op on the positive finite scales. (Not a NaN constant, nor ones_like: the graph's common
    # subexpression elimination matches no NaN argument and no factory operator, which kept the identical casts
    # of one X read by several layers -- query, key and value -- apart, each with its own buffers.)
    scale = torch.where(amax > 0, amax / _MAX[dtype], 1.0).clamp_min(_TINY)
    scale = torch.where(torch.isfinite(amax), scale, amax - amax).abs()
    return cast(t, dtype, scale), scale


def cast(t: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """``t``'s FP8 codes in ``dtype`` at ``scale``: ``RNE(t / scale)``, saturated."""
    maxn = _MAX[dtype]
    return (t.float() / scale).clamp(-maxn, maxn).to(dtype)


class Fp8Linear(torch.autograd.Function):
    """``Y = X Wᵀ + b`` with all three GEMMs in per-tensor FP8 on ``torch._scaled_mm``, in ordinary operators:
    X and W in E4M3, G_Y in E5M2.

    What backward keeps is X and W themselves with their scales (as torchao's ``Float8Linear`` keeps its
    high-precision inputs), and backward casts them again: the same values at the same scales, the same codes.
    The partitioner then chooses what the compiled graph keeps -- X's codes where X is kept for nothing else
    (one byte an element), nothing more where X is recomputed for other operators anyway (an RMSNorm's output:
    its input and reciprocal root are kept). A compiled Llama block then keeps the tensors torchao's tensorwise
    float8 keeps, four-byte scales aside (``benchmarks/bench_layer_host.py``: 0.70x BF16's bytes)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = codes(x2, E4M3)
        wq, ws = codes(w, E4M3)
        y = scaled_mm(xq, wq.t(), xs, ws, bias, x.dtype)
        ctx.save_for_backward(x2, xs, w, ws)
        ctx.has_bias, ctx.x_shape = bias is not None, x.shape
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x2, xs, w, ws = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        gq, gs = codes(g2, E5M2)
        g_x = g_w = g_b = None
        if ctx.needs_input_grad[0]:  # dgrad: G_Y [T, n] row-major x W [n, k] column-major
            w_t = cast(w.t().contiguous(), E4M3, ws)  # (W's codes written transposed: [k, n] row-major)
            g_x = scaled_mm(gq, w_t.t(), gs, ws, None, x2.dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:  # wgrad: G_Yᵀ [n, T] row-major x X [T, k] column-major
            x_t = cast(x2.t().contiguous(), E4M3, xs)
            # (G_Y's codes transposed, not a second cast of G_Y: in a block's SwiGLU backward that one kept the
            # FP32 gradient it casts alive until the second cast, the compiled block's peak +5.6 KB)
            g_w = scaled_mm(gq.t().contiguous(), x_t.t(), gs, xs, None, w.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            g_b = g2.sum(0)
        return g_x, g_w, g_b


@torch.compiler.assume_constant_result
def applies(spec: str, shard: bool, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a layer of ``spec`` (:func:`snip_ds.backend.custom_ops.op_spec`: its precisions and config) on
    input ``x`` with matrix ``w`` would run the eager per-tensor FP8 step with every GEMM on
    ``torch._scaled_mm``: then it runs :class:`Fp8Linear` under ``torch.compile`` (``shard``: a tensor-parallel
    shard, whose amaxes are the whole tensor's: not). Decided outside the traced graph, from the layer's settings
    and ``x``'s device, shape and dtype (a change of them recompiles, as a change of precision does); its
    arguments a string, a bool and tensors, which every supported torch's dynamo hands such a function (torch
    2.11's takes no module or frozen dataclass)."""
    from snip_ds.backend.base import layer_backends
    from snip_ds.backend.custom_ops import parse_spec
    from snip_ds.backend.torch_native import TorchBackend

    prec, cfg = parse_spec(spec)
    if prec.uniform != "fp8" or cfg.fp8_recipe != "fp8_hybrid" or shard:
        return False
    backends = layer_backends(prec, cfg, x.device)
    if not all(isinstance(b, TorchBackend) for b in backends):
        return False
    step = backends[0].decided_fp8_step(x.reshape(-1, x.shape[-1]), w, prec, cfg)
    return step is not None and step.scaled
