"""What any eager Python FP8 linear pays before it quantizes anything: bench_layer_host's ``fp8_gemms_only`` row.

:class:`Fp8GemmsOnly` runs an fp8_hybrid layer step's three FP8 GEMMs alone -- ``torch._scaled_mm`` on the
operands fp8_hybrid's step hands it, in the same layouts (fprop: X's E4M3 codes row-major, W's column-major;
dgrad: G_Y's E5M2 codes row-major, W's transposed codes column-major; wgrad: G_Yᵀ row-major, X's codes
column-major), quantized once when the module is made -- in a Python autograd function that keeps what the
fp8_hybrid step keeps (X's transposed codes and scale, W and its amax). No amax, cast or launch in the step: its
host time over BF16's ``nn.Linear`` is the floor under any eager fp8 layer written in Python, what a host target
leaves for the quantizations.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from snip_ds.backend.fp8_step import scaled_mm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class Operands(NamedTuple):
    """The GEMMs' operands, quantized once (unit scales: the values here are in range)."""

    x: torch.Tensor  # [tokens, k] E4M3, row-major
    x_t: torch.Tensor  # [k, tokens] E4M3: X's codes transposed (kept for wgrad)
    w: torch.Tensor  # [n, k] E4M3
    w_t: torch.Tensor  # [k, n] E4M3: W's codes transposed (dgrad's)
    g: torch.Tensor  # [tokens, n] E5M2
    g_t: torch.Tensor  # [n, tokens] E5M2
    scale: torch.Tensor  # 0-d FP32, 1
    amax: torch.Tensor  # 0-d FP32 (W's, kept as the fp8_hybrid step keeps it)


class _Gemms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, ops: Operands):
        ctx.save_for_backward(ops.x_t, ops.scale, w, ops.amax)
        ctx.ops = ops
        return scaled_mm(ops.x, ops.w.t(), ops.scale, ops.scale, None, x.dtype)

    @staticmethod
    def backward(ctx, g):
        x_t, x_scale, w, _ = ctx.saved_tensors
        ops = ctx.ops
        g_x = scaled_mm(ops.g, ops.w_t.t(), ops.scale, ops.scale, None, g.dtype)
        g_w = scaled_mm(ops.g_t, x_t.t(), ops.scale, x_scale, None, w.dtype)
        return g_x, g_w, None


class Fp8GemmsOnly(torch.nn.Module):
    """``linear``'s weight, and a forward + backward that run only the three FP8 GEMMs of operands made from
    ``x``, ``linear.weight`` and ``g`` (what the step will be called with)."""

    def __init__(self, linear: torch.nn.Linear, x: torch.Tensor, g: torch.Tensor) -> None:
        super().__init__()
        self.weight = linear.weight
        with torch.no_grad():
            x8, w8, g8 = x.to(E4M3), linear.weight.to(E4M3), g.to(E5M2)
            self.ops = Operands(x8, x8.t().contiguous(), w8, w8.t().contiguous(), g8, g8.t().contiguous(),
                                torch.ones((), device=x.device), linear.weight.abs().amax().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Gemms.apply(x, self.weight, self.ops)
