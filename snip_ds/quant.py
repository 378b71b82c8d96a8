"""Fake quantization (quantize->dequantize in FP32) for the scaling recipes of docs/method.md (Formats and recipes).

A :class:`Recipe` is an element format plus a scale granularity:

* ``fp32`` -- per-tensor current scaling: ``s = amax / max_elem`` (``s = 1`` when ``amax = 0``),
  ``q = RNE(x / s)`` saturated, dequant ``q * s``.
* ``e8m0`` -- OCP Microscaling v1.0 (MXFP8 / MXFP4): blocks of 32 along the contraction axis share the
  power-of-two scale ``X = 2**(floor(log2 amax_block) - emax_elem)``; the exponent is clamped to E8M0's
  range [-127, 127]. Scaling by a power of two is exact, so only the element rounding loses information.
* ``nvfp4`` -- two-level scale: ``S = amax_tensor / (448 * 6)`` in FP32,
  ``s_b = E4M3_RNE(amax_block / (6 * S))``, ``d = s_b * S`` (FP32), ``q = RNE_E2M1(x / d)``, dequant
  ``q * d``. A block whose ``s_b`` rounds to zero dequantizes to zeros. With ``block_2d`` the blocks are
  16x16 tiles of a 2-D tensor, so one quantized weight serves fprop (blocks along k) and dgrad (along n).

Conventions of :func:`fake_quantize` (all recipes):

* Partial last block: when the block axis is not a multiple of the block size, the tensor is zero-padded to
  one, quantized and cropped. Zeros never change an amax, so the short last block is quantized with its own
  scale exactly as if it stood alone.
* All-zero blocks and tensors come back as exact zeros (signed zeros kept).
* Non-finite inputs poison their scale: a NaN or +-Inf makes every value that shares a scale with it NaN --
  the block for MX recipes, the whole tensor for per-tensor FP8 and for NVFP4 (whose FP32 tensor scale comes
  from the tensor amax). An overflowed operand thus stays visibly non-finite for overflow checks instead of
  being silently saturated. (Element-wise :func:`cast_to_format` has no scale and saturates Inf instead.)
* Computation is in FP32; the result has ``x``'s shape and dtype and records no autograd history. The
  straight-through gradient ("the backward of a quantizer is identity") is the caller's
  business (the quantized linear's autograd function).

:func:`quantize_parts` is the same computation stopped one step earlier, for GEMM backends that multiply the
quantized operands themselves: the grid values (times their block scale) and the tensor-level scale.

Also here: the 16x16 random Hadamard transform applied to both wgrad operands along the token axis. The
scales themselves (MX's E8M0, NVFP4's two levels) are :mod:`snip_ds.scales`'.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from snip_ds.formats import (E2M1, E4M3, E5M2, ElementFormat, get_format, round_magnitude_, round_signed_,
                             round_to_format, stochastic_moments_)
from snip_ds.scales import (F32_MIN_SUBNORMAL, exact_div, mx_scale, nvfp4_block_and_tensor_scales, nvfp4_div_mul,
                            poison_non_finite)

SCALE_KINDS = ("fp32", "e8m0", "nvfp4")
HADAMARD_SIZE = 16  # order of the block-diagonal Hadamard used on wgrad operands


@dataclass(frozen=True)
class Recipe:
    """An element format plus how its scales are computed.

    Attributes:
        name: preset name, e.g. ``"nvfp4"``.
        element: format of the quantized elements.
        block_size: elements per block along the block axis; 0 means one scale for the whole tensor.
        scale: ``"fp32"`` (per-tensor amax scaling), ``"e8m0"`` (MX power-of-two block scale) or
            ``"nvfp4"`` (E4M3 block scale times an FP32 tensor scale).
        block_2d: blocks are ``block_size x block_size`` tiles of a 2-D tensor (NVFP4 weights).
    """

    name: str
    element: ElementFormat
    block_size: int = 0
    scale: str = "fp32"
    block_2d: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name: expected a non-empty string, got {self.name!r}")
        if not isinstance(self.element, ElementFormat):
            raise ValueError(f"element: expected an ElementFormat, got {self.element!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 0:
            raise ValueError(f"block_size: expected an int >= 0 (0 = per-tensor), got {self.block_size!r}")
        if self.scale not in SCALE_KINDS:
            raise ValueError(f"scale: unknown scale kind {self.scale!r}; valid: {', '.join(SCALE_KINDS)}")
        if (self.scale == "fp32") != (self.block_size == 0):
            raise ValueError(f"block_size: scale {self.scale!r} needs "
                             f"{'block_size 0' if self.scale == 'fp32' else 'block_size > 0'}, "
                             f"got {self.block_size}")
        if not isinstance(self.block_2d, bool):
            raise ValueError(f"block_2d: expected true or false, got {self.block_2d!r}")
        if self.block_2d and self.block_size == 0:
            raise ValueError("block_2d: 2-D blocks need block_size > 0")


RECIPES: Dict[str, Recipe] = {r.name: r for r in (
    Recipe("fp8_e4m3", E4M3),
    Recipe("fp8_e5m2", E5M2),
    Recipe("mxfp8", E4M3, block_size=32, scale="e8m0"),
    Recipe("mxfp8_e5m2", E5M2, block_size=32, scale="e8m0"),
    Recipe("mxfp4", E2M1, block_size=32, scale="e8m0"),
    Recipe("nvfp4", E2M1, block_size=16, scale="nvfp4"),
    Recipe("nvfp4_2d", E2M1, block_size=16, scale="nvfp4", block_2d=True),
)}


def get_recipe(name: str) -> Recipe:
    """The preset recipe called ``name``; a ValueError lists the valid names."""
    try:
        return RECIPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"recipe: unknown recipe {name!r}; valid: {', '.join(RECIPES)}") from None


@torch.no_grad()
def cast_to_format(x: torch.Tensor, fmt: Union[str, ElementFormat]) -> torch.Tensor:
    """Round every element of ``x`` to ``fmt``'s grid (RNE, saturating at +-max), with no scaling.

    Args:
        x: floating-point tensor (bf16, fp16, fp32, ...); computed in FP32.
        fmt: ``"e4m3"``, ``"e5m2"``, ``"e2m1"`` or an :class:`ElementFormat`.

    Returns:
        Tensor of ``x``'s shape and dtype. NaN stays NaN, +-Inf saturates to +-max.
    """
    _check_floating(x)
    fmt = fmt if isinstance(fmt, ElementFormat) else get_format(fmt)
    return round_to_format(x.float(), fmt).to(x.dtype)


@torch.no_grad()
def fake_quantize(x: torch.Tensor, recipe: Union[str, Recipe], axis: int = -1, stochastic: bool = False,
                  generator: Optional[torch.Generator] = None,
                  tensor_amax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Quantize ``x`` with ``recipe`` and dequantize it again (see the module docstring for conventions).

    Args:
        x: floating-point tensor; not modified.
        recipe: a :data:`RECIPES` name or a :class:`Recipe`.
        axis: the block axis (the GEMM's contraction axis). Must be a valid dimension of ``x``. Ignored by
            per-tensor recipes; for 2-D-block recipes ``x`` must be 2-D and either axis gives the same tiles.
        stochastic: round elements stochastically (scales are always RNE).
        generator: random source for stochastic rounding.
        tensor_amax: the amax of the *whole* tensor ``x`` is a slice of, for the recipes with a tensor-level
            scale (per-tensor FP8, NVFP4's FP32 scale). Quantizing a tensor slice by slice with the whole
            tensor's amax gives exactly the result of quantizing it at once, along the non-block axis; MX
            recipes have no tensor-level scale and ignore it. None: the amax of ``x``.

    Returns:
        The dequantized tensor, with ``x``'s shape and dtype.

    Raises:
        TypeError: ``x`` is not floating point.
        ValueError: unknown recipe, bad ``axis``, or a 2-D-block recipe on a tensor that is not 2-D.
    """
    recipe, axis, x32 = _checked(x, recipe, axis)
    if x.numel() == 0:
        return x.clone()
    if recipe.block_size == 0 and not stochastic:
        values, scale = _per_tensor_rne(x32, recipe, tensor_amax)
        return values.mul_(scale).to(x.dtype)
    sc = _scaled_magnitudes(x32, recipe, axis, tensor_amax)
    out = sc.finish(_round_scaled_(sc.mag, sc.signed, sc.div, sc.mul, recipe, stochastic, generator))
    return out.to(x.dtype)


@dataclass(frozen=True)
class QuantParts:
    """A quantized tensor split into what a low-precision GEMM consumes (see :func:`quantize_parts`).

    Attributes:
        values: ``x``'s shape, FP32. Per-tensor FP8 recipes: the element grid values ``q`` (unscaled). Block
            recipes (mxfp8, mxfp4, nvfp4, nvfp4_2d): ``q * s_b``, the grid value times its block's scale
            (exact in FP32 and in BF16: a product of a 2-4 significant-bit element and a power of two or an
            E4M3 scale).
        tensor_scale: 0-d FP32: the per-tensor FP8 scale ``s``; NVFP4's FP32 tensor scale ``S``; 1.0 for MX.
    """

    values: torch.Tensor
    tensor_scale: torch.Tensor


@torch.no_grad()
def quantize_parts(x: torch.Tensor, recipe: Union[str, Recipe], axis: int = -1, stochastic: bool = False,
                   generator: Optional[torch.Generator] = None,
                   tensor_amax: Optional[torch.Tensor] = None) -> QuantParts:
    """:func:`fake_quantize`'s computation, stopped before the tensor-level scale is applied.

    The arguments and the rounding (including the random draws of stochastic rounding, for the same
    ``generator`` state) are those of :func:`fake_quantize`, through the same code, so:

    * per-tensor FP8 and MX: ``values * tensor_scale == fake_quantize(x)`` bit for bit (MX: ``tensor_scale``
      is 1; per-tensor: ``fake_quantize`` is ``fl(q * s)``);
    * NVFP4: ``fake_quantize(x) == fl(q * fl(s_b * S))`` while ``values * tensor_scale`` is
      ``fl(q * s_b * S)``: equal up to the second FP32 rounding of the former; ``values / s_b == q`` exactly.

    Returns:
        A :class:`QuantParts`; ``values`` is FP32 whatever ``x``'s dtype, ``tensor_scale`` a 0-d FP32 tensor
        on ``x``'s device.
    """
    recipe, axis, x32 = _checked(x, recipe, axis)
    if x.numel() == 0:
        return QuantParts(x32.clone(), torch.ones((), dtype=torch.float32, device=x.device))
    if recipe.block_size == 0 and not stochastic:
        values, scale = _per_tensor_rne(x32, recipe, tensor_amax)
        return QuantParts(values, scale.reshape(()).to(torch.float32))
    sc = _scaled_magnitudes(x32, recipe, axis, tensor_amax)
    values = sc.finish(_round_scaled_(sc.mag, sc.signed, sc.div, sc.value_mul, recipe, stochastic, generator))
    tensor_scale = sc.tensor_scale.reshape(()).to(torch.float32)
    return QuantParts(values, tensor_scale)  # values is a new buffer (built from |x|)


@torch.no_grad()
def stochastic_moments(x: torch.Tensor, recipe: Union[str, Recipe], axis: int = -1,
                       tensor_amax: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance, element by element, of ``fake_quantize(x, recipe, axis, stochastic=True)``.

    The scales are deterministic (RNE) and the elements round independently, so the moments are exact and
    cost one pass, with no random draw: the mean is ``x`` wherever nothing saturates or flushes (stochastic
    rounding is unbiased inside the range), and the variance is ``d²·q²·f·(1 - f)`` for an element between
    grid points a quantum ``q`` apart at fraction ``f``, ``d`` its block's dequantization multiplier.

    Args:
        x: floating-point tensor; not modified.
        recipe, axis, tensor_amax: as for :func:`fake_quantize`.

    Returns:
        ``(mean, var)``, FP32 tensors of ``x``'s shape.
    """
    recipe, axis, x32 = _checked(x, recipe, axis)
    if x.numel() == 0:
        return x32.clone(), x32.clone()
    mag, signed, div, mul, finish = _scaled_magnitudes(x32, recipe, axis, tensor_amax)[:5]
    mag.div_(div)
    var = stochastic_moments_(mag, recipe.element)
    return finish(mag.mul_(mul).copysign_(signed)), finish(var.mul_(mul * mul))


def _checked(x: torch.Tensor, recipe: Union[str, Recipe], axis: int) -> Tuple[Recipe, int, torch.Tensor]:
    """The arguments of :func:`fake_quantize` and :func:`stochastic_moments`, checked: the recipe, the
    normalised axis and ``x`` in FP32."""
    _check_floating(x)
    recipe = recipe if isinstance(recipe, Recipe) else get_recipe(recipe)
    axis = _normalize_axis(axis, x.ndim, allow_scalar=recipe.block_size == 0)
    return recipe, axis, (x if x.dtype == torch.float32 else x.float())


# --------------------------------------------------------------------------------------------------------
# granularities: each gives |x| in blocks (a new buffer), its signed view, the (divisor, multiplier) that
# broadcast over the blocks, the map from the blocked layout back to x's shape, and for quantize_parts the
# multiplier that leaves the tensor-level scale out (None: 1) and that tensor-level scale
# --------------------------------------------------------------------------------------------------------

class Scaled(NamedTuple):
    mag: torch.Tensor
    signed: torch.Tensor
    div: torch.Tensor
    mul: torch.Tensor
    finish: Callable[[torch.Tensor], torch.Tensor]
    value_mul: Optional[torch.Tensor]  # values = round(mag / div) * value_mul (None: no multiplication)
    tensor_scale: torch.Tensor  # mul = value_mul * tensor_scale (per-tensor FP8: mul = tensor_scale)


def _scaled_magnitudes(x32: torch.Tensor, recipe: Recipe, axis: int,
                       tensor_amax: Optional[torch.Tensor]) -> Scaled:
    if recipe.block_size == 0:
        return _per_tensor(x32, recipe, tensor_amax)
    if recipe.block_2d:
        if x32.ndim != 2:
            raise ValueError(f"x: recipe {recipe.name!r} uses {recipe.block_size}x{recipe.block_size} blocks "
                             f"and needs a 2-D tensor, got shape {tuple(x32.shape)}")
        return _tiles_2d(x32, recipe, tensor_amax)
    return _blocks(x32, recipe, axis, tensor_amax)


def _per_tensor(x32: torch.Tensor, recipe: Recipe, tensor_amax: Optional[torch.Tensor] = None) -> Scaled:
    mag = x32.abs()
    if tensor_amax is not None:
        amax = tensor_amax.float()
    else:
        amax = mag.amax() if mag.numel() else mag.new_zeros(())
    scale = _per_tensor_scale(amax, recipe)
    return Scaled(mag, x32, scale, scale, lambda t: t, None, scale)


def _per_tensor_scale(amax: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    scale = torch.where(amax > 0, exact_div(amax, recipe.element.max_normal), 1.0).clamp_min_(F32_MIN_SUBNORMAL)
    return poison_non_finite(scale, amax)


def _per_tensor_rne(x32: torch.Tensor, recipe: Recipe,
                    tensor_amax: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor scaling with round-to-nearest in one pass fewer than the magnitude path (no ``|x|`` copy
    when the amax is given): ``(q, s)`` with ``q = RNE(x / s)`` saturated (a new tensor) and ``s`` the
    scale; ``q * s`` is :func:`fake_quantize`'s result bit for bit (RNE is symmetric in the sign)."""
    amax = tensor_amax.float() if tensor_amax is not None else x32.abs().amax()
    scale = _per_tensor_scale(amax, recipe)
    return round_signed_(torch.div(x32, scale), recipe.element, x32), scale


def _blocks(x32: torch.Tensor, recipe: Recipe, axis: int, tensor_amax: Optional[torch.Tensor] = None) -> Scaled:
    length = x32.shape[axis]
    padded = _pad_axis(x32, axis, recipe.block_size)
    xb = padded.unflatten(axis, (-1, recipe.block_size))  # [..., n_blocks, block, ...]
    mag = xb.abs()
    amax = _block_amax(mag, axis + 1)  # [..., n_blocks, 1, ...]
    div, mul, value_mul, tensor_scale = _block_scales(amax, recipe, tensor_amax)

    def finish(t: torch.Tensor) -> torch.Tensor:
        out = t.flatten(axis, axis + 1)
        return out if out.shape[axis] == length else out.narrow(axis, 0, length).contiguous()
    return Scaled(mag, xb, div, mul, finish, value_mul, tensor_scale)


def _tiles_2d(x32: torch.Tensor, recipe: Recipe, tensor_amax: Optional[torch.Tensor] = None) -> Scaled:
    rows, cols = x32.shape
    bs = recipe.block_size
    padded = _pad_axis(_pad_axis(x32, 0, bs), 1, bs)
    xb = padded.reshape(padded.shape[0] // bs, bs, padded.shape[1] // bs, bs)  # [row_blocks, bs, col_blocks, bs]
    mag = xb.abs()
    # two cheap passes instead of one slow reduction over dims (1, 3)
    amax = _block_amax(mag.amax(dim=1, keepdim=True), 3)  # [row_blocks, 1, col_blocks, 1]
    div, mul, value_mul, tensor_scale = _block_scales(amax, recipe, tensor_amax)

    def finish(t: torch.Tensor) -> torch.Tensor:
        out = t.reshape(padded.shape)
        return out if out.shape == x32.shape else out[:rows, :cols].contiguous()
    return Scaled(mag, xb, div, mul, finish, value_mul, tensor_scale)


def _round_scaled_(mag: torch.Tensor, signed: torch.Tensor, div: torch.Tensor, mul: Optional[torch.Tensor],
                   recipe: Recipe, stochastic: bool, generator: Optional[torch.Generator]) -> torch.Tensor:
    """``round(|x| / div) * mul`` with x's sign, in place in ``mag``; div/mul broadcast over blocks (mul None:
    no multiplication)."""
    mag.div_(div)
    round_magnitude_(mag, recipe.element, stochastic=stochastic, generator=generator)
    return (mag if mul is None else mag.mul_(mul)).copysign_(signed)


# --------------------------------------------------------------------------------------------------------
# scales
# --------------------------------------------------------------------------------------------------------

def _block_scales(amax: torch.Tensor, recipe: Recipe, tensor_amax: Optional[torch.Tensor] = None
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(divisor, multiplier, block scale, tensor scale) from the block amaxes, for the recipe's scale kind:
    the multiplier is the block scale times the tensor scale (MX: the tensor scale is 1)."""
    if recipe.scale == "e8m0":
        div, mul = mx_scale(amax, recipe.element.emax)
        return div, mul, mul, torch.ones((), dtype=torch.float32, device=amax.device)
    block_scale, tensor_scale = nvfp4_block_and_tensor_scales(amax, recipe.element, tensor_amax)
    div, mul = nvfp4_div_mul(block_scale, tensor_scale)
    return div, mul, block_scale, tensor_scale


def _block_amax(mag: torch.Tensor, dim: int) -> torch.Tensor:
    """Max over ``dim`` (keepdim); NaN propagates. A reduction over a short last dim is slow in torch on
    CPU, so that case goes through max_pool1d (which also propagates NaN)."""
    if dim != mag.ndim - 1 or not mag.is_contiguous():
        return mag.amax(dim=dim, keepdim=True)
    block = mag.shape[-1]
    pooled = F.max_pool1d(mag.reshape(-1, 1, mag.shape[-2] * block), block, block)
    return pooled.view(*mag.shape[:-1], 1)


def _pad_axis(x: torch.Tensor, axis: int, block: int) -> torch.Tensor:
    """Zero-pad ``x`` along ``axis`` to a multiple of ``block`` (no copy when it already is one)."""
    extra = -x.shape[axis] % block
    if extra == 0:
        return x
    pad = [0, 0] * (x.ndim - 1 - axis) + [0, extra]
    return F.pad(x, pad)


# --------------------------------------------------------------------------------------------------------
# random Hadamard transform (wgrad operands, along the token axis)
# --------------------------------------------------------------------------------------------------------

def hadamard_matrix(n: int = HADAMARD_SIZE, device: Optional[torch.device] = None) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix of order ``n`` (a power of two), entries +-1/sqrt(n)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"n: Hadamard order must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float32, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return exact_div(h, n ** 0.5)


def random_signs(n: int, generator: Optional[torch.Generator] = None,
                 device: Optional[Union[str, torch.device]] = None) -> torch.Tensor:
    """``n`` independent +-1 values (FP32) drawn from ``generator`` and placed on ``device``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n: expected an int >= 0, got {n!r}")
    draw_device = generator.device if generator is not None else device
    bits = torch.randint(0, 2, (n,), generator=generator, device=draw_device)
    return (bits * 2 - 1).to(device=device, dtype=torch.float32)


def hadamard_transform(x: torch.Tensor, axis: int, signs: torch.Tensor) -> torch.Tensor:
    """Apply ``H D`` along ``axis``: D = diag(signs), H = block-diagonal orthonormal 16x16 Hadamards.

    The transform is orthogonal, so applying it to both operands along the contracted axis leaves their
    product unchanged in exact arithmetic: ``(H D a)^T (H D b) = a^T b``. When the axis length ``n`` is not
    a multiple of 16, the last ``n % 16`` positions form an identity block (they are only sign-flipped),
    which keeps the transform orthogonal and the shape unchanged.

    Args:
        x: floating-point tensor; computed in FP32, returned in ``x``'s dtype.
        axis: the axis to transform (the token axis for wgrad).
        signs: 1-D tensor of +-1 of length ``x.shape[axis]``, e.g. from :func:`random_signs`; use the same
            one for both operands.
    """
    _check_floating(x)
    axis = _normalize_axis(axis, x.ndim, allow_scalar=False)
    n = x.shape[axis]
    if signs.ndim != 1 or signs.shape[0] != n:
        raise ValueError(f"signs: expected shape ({n},) to match x.shape[{axis}], got {tuple(signs.shape)}")
    shape = [1] * x.ndim
    shape[axis] = n
    out = x.float() * signs.to(device=x.device, dtype=torch.float32).view(shape)
    full = n - n % HADAMARD_SIZE
    if full:
        h = hadamard_matrix(HADAMARD_SIZE, device=x.device)
        outer = out.shape[:axis].numel() * (full // HADAMARD_SIZE)
        inner = out.shape[axis + 1:].numel()
        main = out.narrow(axis, 0, full).reshape(outer, HADAMARD_SIZE, inner)  # [outer, 16, inner]
        # H is symmetric: the last-axis case is a right product, the others a batched left product
        mixed = main.squeeze(-1) @ h if inner == 1 else h @ main
        out.narrow(axis, 0, full).copy_(mixed.reshape(out.narrow(axis, 0, full).shape))
    return out.to(x.dtype)


# --------------------------------------------------------------------------------------------------------
# argument checks
# --------------------------------------------------------------------------------------------------------

def _check_floating(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor (float32, bfloat16, float16), got {x.dtype}")


def _normalize_axis(axis: int, ndim: int, allow_scalar: bool) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise ValueError(f"axis: expected an int, got {axis!r}")
    if ndim == 0 and allow_scalar:
        return 0
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis: {axis} is out of range for a tensor with {ndim} dimension(s); "
                         f"valid: {-ndim} .. {ndim - 1}")
    return axis % ndim
