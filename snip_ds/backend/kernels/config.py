"""The launch configuration of the Triton quantization kernels: tiles, grids and compile-time arguments.

Worked out once per shape, recipe and layout (:func:`launch_config`, cached), so that a launch decides nothing:
the kinds of scale (per tensor, MX, NVFP4 in 1-D or 16 x 16 blocks) and output encodings as the kernels'
compile-time constants, the tile edges (whole blocks along the block axis), the 1-D grid, the amax pass's
programs, and the views the kernels read and write through. Needs Triton (imported by :mod:`.quantize`).
"""
from __future__ import annotations

import functools
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple, Tuple

import torch
import triton
import triton.language as tl

from snip_ds.formats import E2M1, E4M3
from snip_ds.quant import Recipe, get_recipe

# KIND: the recipe's scale granularity
PER_TENSOR = tl.constexpr(0)
MX = tl.constexpr(1)
NVFP4 = tl.constexpr(2)
NVFP4_2D = tl.constexpr(3)
# OUT: what the values are written as
OUT_FP32 = tl.constexpr(0)
OUT_BF16 = tl.constexpr(1)
OUT_FP8 = tl.constexpr(2)  # the element format's own codes (per-tensor FP8 recipes)
# BOTH: a second layout, transposed, written by the same launch
BOTH_NONE = tl.constexpr(0)
BOTH_SAME = tl.constexpr(1)  # the same values (per-tensor recipes, whose values do not depend on the axis)
BOTH_AXES = tl.constexpr(2)  # blocks along the other axis (block recipes: X for fprop and wgrad; G_Y)
MX_KIND = int(MX)  # (a plain int: comparing with the tl.constexpr builds objects on every call)
FP8_CODES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}  # element format -> the torch dtype
MAX_TILE = 64  # tile edge (elements) on the GPU; small tensors get the smallest power of two that covers them
NVFP4_TENSOR_DIVISOR = E4M3.max_normal * E2M1.max_normal  # S = amax / (448 * 6)


def kind(recipe: Recipe) -> int:
    """The kernels' KIND of ``recipe``'s scales: per tensor, MX, NVFP4 in 1-D or in 16 x 16 blocks."""
    if recipe.block_size == 0:
        return int(PER_TENSOR)
    if recipe.scale == "e8m0":
        return int(MX)
    return int(NVFP4_2D) if recipe.block_2d else int(NVFP4)


def tile(length: int, block: int) -> int:
    """Tile edge along an axis: a power of two covering ``length`` up to :data:`MAX_TILE`, holding whole
    blocks of ``block`` elements (1: no block along this axis)."""
    return max(block, 16, min(MAX_TILE, triton.next_power_of_2(max(length, 1))))


# stage 1 of the tensor amax: at most this many partial maxima for stage 2 to read (a power of 2)
MAX_AMAX_PROGRAMS = 512


def amax_programs(rows: int, cols: int, br: int, bc: int) -> int:
    """The amax pass's programs for a ``rows`` x ``cols`` tensor in ``br`` x ``bc`` tiles."""
    return min(MAX_AMAX_PROGRAMS, triton.cdiv(rows, br) * triton.cdiv(cols, bc))


def amax_tiles(rows: int, cols: int, br: int, bc: int, programs: int) -> int:
    """Tiles per program of the amax pass over ``programs`` programs: the power of two covering the tiles'
    share of each program (plain integer arithmetic: Triton's ``cdiv`` and ``next_power_of_2`` are constexpr
    functions, microseconds a call)."""
    per_program = -(-(-(-rows // br) * -(-cols // bc)) // programs)  # cdiv(tiles, programs), at least 1
    return 1 << (per_program - 1).bit_length()


class LaunchConfig(NamedTuple):
    kind: int
    br: int
    bc: int
    grid: Tuple[int]
    out_view: torch.dtype  # the integer (or FP32) view the kernel writes the values through
    constants: Mapping[str, Any]  # the quantization kernel's compile-time arguments but STOCHASTIC (read-only)
    shape: Tuple[int, int]  # the values' shape (transposed where the layout is)
    out_dtype: torch.dtype
    in_view: torch.dtype  # the integer view the kernels read the input through
    in_bf16: bool
    both: bool  # the values are written in both layouts
    write_amax: bool  # the tensor amax is written out too
    amax_programs: int  # the amax pass's programs (partial maxima), where it runs
    products: int = 0  # products of the tensor scale with other operands' scales written out (0, 1 or 2)
    amax_tiles: int = 1  # tiles per program of the amax pass (a power of 2: a compile-time argument)
    amax_constants: Mapping[str, Any] = MappingProxyType({})  # the amax pass's compile-time arguments (read-only)


@functools.lru_cache(maxsize=1024)
def amax_constants(in_bf16: bool, br: int, bc: int, tiles: int) -> Mapping[str, Any]:
    """The amax kernel's compile-time arguments, read-only and one object per value (cached): the direct
    launcher works out their part of a launch's class once per object (:func:`snip_ds.backend.kernels.direct.
    launch`)."""
    return MappingProxyType(dict(IN_BF16=in_bf16, BR=br, BC=bc, TILES_PER_PROGRAM=tiles))


@functools.lru_cache(maxsize=4096)
def cached_launch_config(rows: int, cols: int, recipe: str, axis: int, out_dtype: torch.dtype, transpose: bool,
                         in_bf16: bool, dequantize: bool, both: bool = False, amax_given: bool = False,
                         write_amax: bool = False, products: int = 0) -> LaunchConfig:
    """The tiles, grids and compile-time arguments of one quantization (worked out once per shape and
    recipe: the launch's host time). ``both``: write the values in both layouts -- a per-tensor recipe's
    values, which do not depend on the layout's axis, or a block recipe's in blocks along the other axis
    (``axis`` 1 not transposed, the second layout along axis 0, transposed); ``amax_given``: the tensor amax
    is passed in; ``write_amax``: :func:`snip_ds.backend.kernels.quantize.launch` returns the tensor amax
    (else None); ``products``: it writes the tensor scale times this many other scales."""
    recipe = get_recipe(recipe)
    k = kind(recipe)
    bs = recipe.block_size
    both_axes = both and k != PER_TENSOR
    br = tile(rows, bs if k == NVFP4_2D or (k != PER_TENSOR and (axis == 0 or both_axes)) else 1)
    bc = tile(cols, bs if k == NVFP4_2D or (k != PER_TENSOR and (axis == 1 or both_axes)) else 1)
    out = int(OUT_FP8) if out_dtype in FP8_CODES.values() else int(OUT_BF16) if out_dtype == torch.bfloat16 \
        else int(OUT_FP32)
    element = recipe.element
    programs = amax_programs(rows, cols, br, bc) if isinstance(rows, int) and isinstance(cols, int) else \
        MAX_AMAX_PROGRAMS
    tiles = amax_tiles(rows, cols, br, bc, programs) if isinstance(rows, int) and isinstance(cols, int) else 1
    amax_mapping = amax_constants if isinstance(br, int) and isinstance(bc, int) else amax_constants.__wrapped__
    # stage 2 reads a fixed 512 slots (masked), whatever the shape: shapes that vary from step to step (an
    # expert's tokens) compile no new variant for it
    constants = MappingProxyType(dict(  # (read-only: the direct launcher keeps its work by identity)
        KIND=k, AXIS=axis, BS=max(bs, 1), MBITS=element.mbits, EMIN=element.emin, EMAX=element.emax,
        MAXN=element.max_normal, TENSOR_DIVISOR=NVFP4_TENSOR_DIVISOR if k in (NVFP4, NVFP4_2D) else element.max_normal,
        TRANSPOSE=transpose, IN_BF16=in_bf16, OUT=out, BR=br, BC=bc, DEQUANT=bool(dequantize),
        BOTH=int(BOTH_AXES if both_axes else BOTH_SAME if both else BOTH_NONE),
        AMAX_BLOCK=2 if amax_given else MAX_AMAX_PROGRAMS, WRITE_AMAX=bool(write_amax), PRODUCTS=int(products)))
    return LaunchConfig(k, br, bc, (triton.cdiv(rows, br) * triton.cdiv(cols, bc),),
                        (torch.float32, torch.int16, torch.uint8)[out], constants,
                        (cols, rows) if transpose else (rows, cols), out_dtype,
                        torch.int16 if in_bf16 else torch.int32, in_bf16, both, write_amax, programs,
                        int(products), tiles, amax_mapping(in_bf16, br, bc, tiles))


def takes_amax_pass(cfg: LaunchConfig) -> bool:
    """Whether a quantization launched with ``cfg`` takes an amax pass: a tensor-scaled recipe (not MX) whose
    tensor amax is not given."""
    return cfg.kind != MX_KIND and cfg.constants["AMAX_BLOCK"] == MAX_AMAX_PROGRAMS


def launch_config(rows: int, cols: int, recipe: str, axis: int, out_dtype: torch.dtype, transpose: bool,
                  in_bf16: bool, *, both: bool = False, amax_given: bool = False,
                  write_amax: bool = False, products: int = 0) -> LaunchConfig:
    """The configuration :func:`launch` runs a quantization with (see :func:`cached_launch_config`); ValueError
    where ``both`` is asked of a block recipe other than along axis 1 untransposed (the second layout is
    along axis 0, transposed), or ``products`` is not 0, 1 or 2."""
    if both and get_recipe(recipe).block_size != 0 and (axis % 2 != 1 or transpose):
        raise ValueError(f"both: recipe {recipe!r} has blocks along one axis; both layouts are written from "
                         f"axis 1 untransposed (the second along axis 0, transposed), not axis {axis} with "
                         f"transpose={transpose}")
    if products not in (0, 1, 2):
        raise ValueError(f"products: expected 0, 1 or 2 products of tensor scales, got {products!r}")
    return cached_launch_config(rows, cols, recipe, axis % 2, out_dtype, transpose, in_bf16, False, both, amax_given,
                                write_amax, products)
