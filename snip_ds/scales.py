"""Scales from amaxes, for the recipes of :mod:`snip_ds.quant`: the OCP MX shared power-of-two scale
(:func:`mx_scale`, E8M0), NVFP4's two-level scale (an E4M3 block scale times an FP32 tensor scale,
:func:`nvfp4_scales`), and the correctly rounded division by a constant both need (:func:`exact_div`). A
non-finite amax gives a NaN scale (:func:`poison_non_finite`).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from snip_ds.formats import E2M1, E4M3, ElementFormat, round_to_format

E8M0_MIN_EXP = -127  # smallest E8M0 scale, 2**-127
E8M0_MAX_EXP = 127  # largest E8M0 scale, 2**127
F32_MIN_SUBNORMAL = 2.0 ** -149  # floor for FP32 scales so tiny non-zero amaxes never divide by zero


def mx_scale(amax: torch.Tensor, emax: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """OCP MX shared scale ``X = 2**clamp(floor(log2 amax) - emax, -127, 127)``, returned twice.

    Dividing by a power of two is exact, so the divisor and the multiplier are the same ``X``. Blocks with
    amax 0 get ``X = 1``; blocks with a non-finite amax get NaN.
    """
    _, exponent = torch.frexp(amax)  # amax = m * 2**exponent, m in [0.5, 1): floor(log2 amax) = exponent - 1
    exp = (exponent.to(torch.int64) - 1 - emax).clamp_(E8M0_MIN_EXP, E8M0_MAX_EXP)
    exp = torch.where(amax > 0, exp, 0)
    # 2**exp built from float64 bits: exact, also for 2**-127 (an FP32 subnormal)
    scale = ((exp + 1023) << 52).view(torch.float64).to(torch.float32)
    scale = poison_non_finite(scale, amax)
    return scale, scale


def nvfp4_scales(amax: torch.Tensor, element: ElementFormat = E2M1,
                 tensor_amax: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 per-block ``d = s_b * S`` as (divisor, multiplier), from the block amaxes.

    ``S = amax_tensor / (448 * 6)``, ``s_b = E4M3_RNE(amax_block / (6 * S))``. A block with ``s_b = 0``
    (all zero, or negligible next to the tensor amax) divides by +Inf and multiplies by 0, giving zeros.
    ``tensor_amax`` overrides ``amax_tensor`` when the blocks are a slice of a larger tensor.
    """
    return nvfp4_div_mul(*nvfp4_block_and_tensor_scales(amax, element, tensor_amax))


def nvfp4_block_and_tensor_scales(amax: torch.Tensor, element: ElementFormat,
                                   tensor_amax: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's E4M3 block scales ``s_b`` (held in FP32) and FP32 tensor scale ``S``."""
    amax_t = amax.amax() if tensor_amax is None else tensor_amax.float()
    six = element.max_normal
    tensor_scale = torch.where(amax_t > 0, exact_div(amax_t, E4M3.max_normal * six), 1.0).clamp_min_(F32_MIN_SUBNORMAL)
    tensor_scale = poison_non_finite(tensor_scale, amax_t)
    block_scale = round_to_format(amax / (tensor_scale * six), E4M3)
    return block_scale, tensor_scale


def nvfp4_div_mul(block_scale: torch.Tensor, tensor_scale: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's (divisor, multiplier) ``d = s_b * S``; a zero ``d`` divides by +Inf (the block quantizes to zeros)."""
    mul = block_scale * tensor_scale
    div = torch.where(mul == 0, float("inf"), mul)
    return div, mul


def exact_div(t: torch.Tensor, constant: float) -> torch.Tensor:
    """``t / constant`` correctly rounded on every device. (CUDA divides by a Python number as a product with
    its rounded reciprocal, which is one ulp off for some ``t``: the scales, and so the quantized values,
    would then differ between a GPU and the CPU.)"""
    return t / t.new_full((), constant)  # a fill kernel: no host-to-device copy, no synchronization


def poison_non_finite(scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """``scale`` where ``amax`` is finite, NaN where it is not (a non-finite input poisons its scale)."""
    return torch.where(torch.isfinite(amax), scale, float("nan"))
