"""Small floating-point element formats and the one routine that rounds FP32 values onto their grids.

The formats (docs/method.md, Formats and recipes): FP8 E4M3 (OCP "fn" variant, no Inf), FP8 E5M2 and FP4 E2M1
(OCP Microscaling Formats (MX) Specification v1.0, section 5.3). Everything is emulated: values stay FP32
and are rounded onto the format's grid, so ``round_to_format(x, E4M3)`` equals
``x.clamp(-448, 448).to(torch.float8_e4m3fn).float()`` bit for bit.

Non-finite inputs (a choice of this module, shared by every format):

* NaN stays NaN.
* +-Inf saturates to +-max_normal, like every other out-of-range value (the formats are used with
  saturating conversion, so E5M2's own Inf is never produced).
* The sign of zero is kept: -0.0 -> -0.0, and values that round to zero keep their sign.

This module is pure torch and imports nothing distributed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch

_F32_EXP_MASK = 0x7F800000  # exponent field of an IEEE binary32
_F32_MANT_BITS = 23  # explicit mantissa bits of an IEEE binary32
_F32_BIAS = 127  # exponent bias of an IEEE binary32


@dataclass(frozen=True)
class ElementFormat:
    """A small binary floating-point format with sign, exponent and mantissa bits.

    Attributes:
        name: short name, ``"e4m3"``, ``"e5m2"`` or ``"e2m1"``.
        ebits: exponent bits.
        mbits: explicit mantissa bits.
        bias: exponent bias.
        max_normal: largest finite magnitude; conversion saturates here.
        min_normal: smallest normal magnitude, ``2**(1 - bias)``.
        min_subnormal: smallest non-zero magnitude, ``2**(1 - bias - mbits)``.
        has_inf: whether the format encodes Inf (conversions here saturate instead of producing it).
        has_nan: whether the format encodes NaN.
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    max_normal: float
    min_normal: float
    min_subnormal: float
    has_inf: bool
    has_nan: bool

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal, ``1 - bias``."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest normal, ``floor(log2(max_normal))`` (the MX spec's ``emax_elem``)."""
        return math.floor(math.log2(self.max_normal))


E4M3 = ElementFormat("e4m3", ebits=4, mbits=3, bias=7,
                     max_normal=448.0,  # 1.75 * 2**8 (S.1111.111 is NaN, so 480 is not finite)
                     min_normal=2.0 ** -6,
                     min_subnormal=2.0 ** -9,
                     has_inf=False, has_nan=True)
E5M2 = ElementFormat("e5m2", ebits=5, mbits=2, bias=15,
                     max_normal=57344.0,  # 1.75 * 2**15
                     min_normal=2.0 ** -14,
                     min_subnormal=2.0 ** -16,
                     has_inf=True, has_nan=True)
E2M1 = ElementFormat("e2m1", ebits=2, mbits=1, bias=1,
                     max_normal=6.0,  # 1.5 * 2**2; magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}
                     min_normal=1.0,
                     min_subnormal=0.5,
                     has_inf=False, has_nan=False)

FORMATS: Dict[str, ElementFormat] = {f.name: f for f in (E4M3, E5M2, E2M1)}


def get_format(name: str) -> ElementFormat:
    """The element format called ``name``.

    Raises:
        ValueError: ``name`` is not one of :data:`FORMATS`; the message lists the valid names.
    """
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"format: unknown element format {name!r}; valid: {', '.join(FORMATS)}") from None


def round_to_format(x: torch.Tensor, fmt: ElementFormat, *, stochastic: bool = False,
                    generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Round FP32 values onto ``fmt``'s grid (normals and subnormals), saturating at +-max_normal.

    Args:
        x: FP32 tensor (any shape). Not modified.
        fmt: target element format.
        stochastic: round up with probability equal to the distance to the grid point below, measured in
            quanta (unbiased: ``E[round(x)] = x`` inside the range); otherwise round to nearest, ties to even.
        generator: random source for stochastic rounding (``torch.rand``); ``None`` uses torch's default.

    Returns:
        A new FP32 tensor of ``x``'s shape holding exactly representable ``fmt`` values. NaN stays NaN,
        +-Inf becomes +-max_normal, signed zeros are kept.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"x: round_to_format expects a float32 tensor, got {x.dtype}")
    mag = round_magnitude_(x.abs(), fmt, stochastic=stochastic, generator=generator)
    return mag.copysign_(x)


def round_magnitude_(mag: torch.Tensor, fmt: ElementFormat, *, stochastic: bool = False,
                     generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """In-place core of :func:`round_to_format` for non-negative FP32 magnitudes (NaN allowed).

    The caller owns ``mag`` and restores the sign afterwards (``copysign_``); working on magnitudes in place
    keeps the hot path at one allocation for the exponent tensor.

    How: after saturating, every magnitude ``a`` has a quantum ``q = 2**(max(e, emin) - mbits)`` with
    ``e = floor(log2 a)`` read from the float32 exponent bits. RNE uses FP32's own RNE addition:
    ``(a + K) - K`` with ``K = q * 2**23`` is ``a`` rounded to a multiple of ``q``, because ``a < 2K`` keeps
    the sum inside K's binade, whose spacing is ``q``. Stochastic rounding is ``floor(a / q + u) * q`` with
    ``u ~ U[0, 1)``; division by a power of two is exact, so the only bias is FP32 rounding of ``a/q + u``
    (below 2**-20 of a quantum).

    Returns:
        ``mag``, rounded.
    """
    mag.clamp_max_(fmt.max_normal)  # saturate first: max_normal lies on the grid, so rounding stays <= max
    # Biased float32 exponent of each magnitude, floored at the format's subnormal binade (zeros and FP32
    # subnormals included). NaN has an all-ones exponent; its result is NaN whatever K is.
    exp_bits = mag.view(torch.int32).bitwise_and(_F32_EXP_MASK)
    exp_bits.clamp_min_((fmt.emin + _F32_BIAS) << _F32_MANT_BITS)
    if not stochastic:
        magic = exp_bits.add_((_F32_MANT_BITS - fmt.mbits) << _F32_MANT_BITS).view(torch.float32)
        return mag.add_(magic).sub_(magic)
    noise = torch.rand(mag.shape, generator=generator, dtype=torch.float32,
                       device=generator.device if generator is not None else mag.device).to(mag.device)
    quantum = exp_bits.sub_(fmt.mbits << _F32_MANT_BITS).view(torch.float32)
    return mag.div_(quantum).add_(noise).floor_().mul_(quantum)


def round_signed_(v: torch.Tensor, fmt: ElementFormat, sign_of: torch.Tensor) -> torch.Tensor:
    """:func:`round_magnitude_` (round to nearest, ties to even) on signed FP32 values, in place, with the
    sign of ``sign_of`` (same shape; any tensor of ``v``'s signs, e.g. the unscaled input) for every result.

    One pass fewer than rounding magnitudes (no ``abs`` copy): RNE is symmetric, and the magic number
    ``K = 1.5 * q * 2**23`` rounds either sign, because ``|v| < 2**(e+1) <= K / 3`` keeps ``v + K`` inside
    K's binade, whose spacing is ``q``. Only the sign of a zero result is lost (``K - K = +0``), which the
    final ``copysign_`` restores, so the result is bit for bit ``copysign(round_magnitude_(|v|), v)``.

    Returns:
        ``v``, rounded.
    """
    v.clamp_(-fmt.max_normal, fmt.max_normal)
    exp_bits = v.view(torch.int32).bitwise_and(_F32_EXP_MASK)  # |v|'s exponent (the sign bit is masked)
    exp_bits.clamp_min_((fmt.emin + _F32_BIAS) << _F32_MANT_BITS)
    magic = exp_bits.add_(((_F32_MANT_BITS - fmt.mbits) << _F32_MANT_BITS) | (1 << (_F32_MANT_BITS - 1)))
    magic = magic.view(torch.float32)
    return v.add_(magic).sub_(magic).copysign_(sign_of)


def stochastic_moments_(mag: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Mean and variance of :func:`round_magnitude_`'s stochastic rounding, exactly, without drawing.

    Stochastic rounding sends a magnitude ``a`` (after saturation at max_normal) to ``l = floor(a/q)·q`` or
    ``l + q`` with probability ``f = a/q - floor(a/q)`` (``q``: ``a``'s quantum), so its mean is ``a`` itself
    and its variance ``q²·f·(1 - f)``. Division by the power of two ``q`` and ``floor`` are exact, so both
    moments are exact up to the FP32 rounding of the final product.

    Args:
        mag: non-negative FP32 magnitudes, modified in place: on return they are saturated (the mean).

    Returns:
        The variance, a new tensor of ``mag``'s shape.
    """
    mag.clamp_max_(fmt.max_normal)
    exp_bits = mag.view(torch.int32).bitwise_and(_F32_EXP_MASK)
    exp_bits.clamp_min_((fmt.emin + _F32_BIAS) << _F32_MANT_BITS)
    quantum = exp_bits.sub_(fmt.mbits << _F32_MANT_BITS).view(torch.float32)
    var = torch.div(mag, quantum).frac_()  # f: non-negative, so frac is x - floor(x)
    return var.addcmul_(var, var, value=-1.0).mul_(quantum).mul_(quantum)  # f - f² = f(1 - f), in place
