"""The torch backend on the CPU: each GEMM's streamed operand quantized slice by slice, and the GEMMs' epilogue.

On the CPU the streamed operand of each GEMM (X or G_Y along rows, both wgrad operands along the tokens) is
quantized slice by slice with the whole operand's amax, as the emulated backend does, which gives the whole
operand's values and draws while keeping temporaries small (:class:`Streamed`: the fused C++ kernels of
:mod:`snip_ds.backend.cpu` when they built, else :func:`snip_ds.quant.quantize_parts`). :func:`scaled` and
:func:`finish` apply the tensor scales, the bias and the output dtype after a GEMM of grid values, on every
device.
"""
from __future__ import annotations

from typing import Optional

import torch

from snip_ds.backend import cpu as cpu_kernels
from snip_ds.backend import operands
from snip_ds.backend.base import kernel_seed
from snip_ds.backend.operands import gemm_recipe, hadamard_pair, tensor_amax
from snip_ds.quant import QuantParts, get_recipe, quantize_parts


def fprop(x, w, precision, cfg, bias, out_dtype):
    """fprop with X streamed (the torch backend on the CPU)."""
    ox, ow = gemm_recipe("fprop", precision, cfg).operands
    op_dtype = torch.bfloat16 if cpu_bf16_gemm(out_dtype) else torch.float32
    pw = Streamed(w, ow).whole(op_dtype)
    qx = Streamed(x, ox)
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    for rows in operands.chunks(x.shape[0], x.shape[1]):
        mm_into(y[rows], qx.rows(rows, op_dtype).values, pw.values.t())
    return scaled(y, qx.tensor_scale, pw.tensor_scale, bias, out_dtype, unit_scales(ox, ow))


def dgrad(g, w, precision, cfg, generator, out_dtype):
    """dgrad with G_Y streamed."""
    og, ow = gemm_recipe("dgrad", precision, cfg).operands
    op_dtype = torch.bfloat16 if cpu_bf16_gemm(out_dtype) else torch.float32
    pw = Streamed(w, ow).whole(op_dtype)
    qg = Streamed(g, og, generator)
    out = torch.empty(g.shape[0], w.shape[1], dtype=torch.float32)
    for rows in operands.chunks(g.shape[0], g.shape[1]):
        mm_into(out[rows], qg.rows(rows, op_dtype).values, pw.values)
    return scaled(out, qg.tensor_scale, pw.tensor_scale, None, out_dtype, unit_scales(og, ow))


def wgrad(g, x, precision, cfg, generator, out_dtype):
    """wgrad with both operands streamed along the tokens."""
    recipe = gemm_recipe("wgrad", precision, cfg)
    if recipe.hadamard:
        g, x = hadamard_pair(g, x, generator)
    qg, qx = Streamed(g, recipe.a, generator), Streamed(x, recipe.b)
    g_w = torch.zeros(g.shape[1], x.shape[1], dtype=torch.float32)
    for tokens in operands.chunks(g.shape[0], g.shape[1] + x.shape[1]):
        g_w.addmm_(qg.rows(tokens).values.t(), qx.rows(tokens).values)
    return scaled(g_w, qg.tensor_scale, qx.tensor_scale, None, out_dtype, unit_scales(recipe.a, recipe.b))


_fast_bf16: Optional[bool] = None


def cpu_bf16_gemm(out_dtype: torch.dtype) -> bool:
    """Whether a CPU GEMM whose result is wanted in ``out_dtype`` runs in BF16: only for a BF16 result (an
    FP16 result has 3 more significant bits than a BF16 GEMM's) and only where oneDNN has native BF16
    (AVX512-BF16 or AMX); elsewhere a BF16 GEMM is many times slower than FP32, and the FP32 GEMM of the same
    exact values is the more accurate result anyway."""
    global _fast_bf16
    if out_dtype != torch.bfloat16:
        return False
    if _fast_bf16 is None:
        try:
            _fast_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            _fast_bf16 = False
    return _fast_bf16


class Streamed:
    """One CPU operand quantized slice by slice along its rows with the whole operand's amax (exactly the
    whole operand's quantization, stochastic draws included): through the fused kernels of
    :mod:`snip_ds.backend.cpu` when they are built (stochastic rounding from one seed drawn from
    ``generator``, each slice at its first element's offset), else :func:`snip_ds.quant.quantize_parts`
    (drawing from ``generator`` slice by slice, as the emulated backend does)."""

    def __init__(self, t: torch.Tensor, operand: operands.Operand, generator: Optional[torch.Generator] = None):
        self.fused = cpu_kernels.available()
        self.t = t if not self.fused or t.dtype in (torch.float32, torch.bfloat16) else t.float()
        if self.fused:
            self.t = self.t.contiguous()  # (the kernels' layout; a slice of rows of it stays contiguous)
        self.recipe = get_recipe(operand.recipe)
        self.axis = operand.axis
        stochastic = self.stochastic = operand.stochastic
        self.generator = generator if stochastic else None
        self.seed = kernel_seed(generator, "cpu") if stochastic and self.fused else 0
        self.amax = None
        if self.recipe.scale != "e8m0":  # MX has no tensor-level scale
            self.amax = operands.reduced(cpu_kernels.tensor_amax(self.t)) if self.fused else tensor_amax(self.t)
        self.tensor_scale = None  # the quantizer's, from the first slice (a streamed operand is never empty)

    def rows(self, rows: slice, out_dtype: torch.dtype = torch.float32) -> QuantParts:
        part = self.t[rows]
        if self.fused:  # the arguments are the kernels' already: no second check per slice
            p = cpu_kernels.quantize_checked(part, self.recipe, self.axis % 2, self.amax, self.stochastic, self.seed,
                                             rows.start * self.t.shape[1], out_dtype)
        else:
            p = quantize_parts(part, self.recipe, axis=self.axis, stochastic=self.stochastic,
                               generator=self.generator, tensor_amax=self.amax)
            if out_dtype != torch.float32:
                p = QuantParts(p.values.to(out_dtype), p.tensor_scale)
        self.tensor_scale = p.tensor_scale
        return p

    def whole(self, out_dtype: torch.dtype = torch.float32) -> QuantParts:
        return self.rows(slice(0, self.t.shape[0]), out_dtype)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b`` (FP32 ``out``; a BF16 product is rounded to BF16 once, then widened exactly)."""
    if a.dtype == torch.float32:
        torch.mm(a, b, out=out)
    else:
        out.copy_(torch.mm(a, b))


def unit_scales(op_a: operands.Operand, op_b: operands.Operand) -> bool:
    """Whether both operands' tensor scales are 1 by their recipes (MX: block scales only)."""
    return get_recipe(op_a.recipe).scale == "e8m0" and get_recipe(op_b.recipe).scale == "e8m0"


def scaled(y: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, bias: Optional[torch.Tensor],
           out_dtype: torch.dtype, unit_scales: bool, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``fl(y * fl(scale_a * scale_b)) (+ bias)`` in ``out_dtype``; ``y``: a GEMM result in FP32 (written over)
    or in BF16 (a BF16 GEMM's, its sum rounded to BF16 once: the same value as that result widened to FP32,
    taken without the widening); ``scale``: the product ``fl(scale_a * scale_b)`` where a kernel wrote it
    already. MX recipes' tensor scales are 1 (``unit_scales``): nothing is multiplied (a BF16 ``y`` wanted in
    BF16 is the result as it is). Without a bias the product is written in ``out_dtype`` in the same pass
    (:func:`_mul_into`): one operator instead of a widening, a multiplication and a narrowing."""
    if unit_scales:
        return finish(y, bias, out_dtype)
    scale = scale_a * scale_b if scale is None else scale
    if bias is None and (out_dtype != y.dtype or y.dtype != torch.float32):
        return _mul_into(y, scale, out_dtype)
    return finish(fp32(y).mul_(scale), bias, out_dtype)


def _mul_into(y: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``fl_out(fp32(y) * scale)`` (``scale``: one FP32 element), one operator writing ``out_dtype``: the FP32
    product of ``y`` widened exactly, rounded once as it is written. How the operator computes in FP32 for a
    BF16 ``y``: a 0-d scale on the CPU is a CPU scalar, which the CPU kernel multiplies in FP32 as it is
    (``opmath``), reading ``y`` in place; on another device a 0-d scale would not take part in type promotion
    (the product would be BF16, the scale rounded to BF16), so it is made one-dimensional: the product is
    computed in FP32 (TensorIterator's common dtype) and narrowed once as it is stored."""
    if not scale.dim() and scale.device == y.device and y.device.type != "cpu":
        scale = scale.reshape(1)
    return torch.mul(y, scale, out=torch.empty(y.shape, dtype=out_dtype, device=y.device))


def finish(y: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    if bias is not None:
        y = fp32(y) + bias.float()
    return y.to(out_dtype)


def fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()
