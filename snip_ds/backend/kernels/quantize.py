"""Fused Triton quantization of 2-D GEMM operands: :func:`snip_ds.quant.quantize_parts` in two passes.

Pass 1 (only for recipes with a tensor-level scale, and only when ``tensor_amax`` is not given): partial
tensor amaxes, the max of the int32 bit patterns of ``|x|`` over a strided set of tiles per program, one slot
per program (at most :data:`MAX_AMAX_PROGRAMS`; every slot written, so no zero-fill launch precedes it) -- for
non-negative floats the integer order is the float order, and a NaN's pattern is above +Inf's, so NaN
propagates as in ``torch.amax``.

Pass 2: one program per tile reduces the partial maxima (a few hundred integers at most: the amax's second
stage, fused here), loads ``x`` once, computes its block amaxes (the same integer max), the scales
(:mod:`.grid`), rounds every element and writes ``values`` -- in FP32 or BF16 or a per-tensor recipe's FP8
codes, in ``x``'s layout or transposed, or in both layouts at once (per-tensor recipes: the same values,
which do not depend on the axis; block recipes: blocked along the rows in ``x``'s layout and along the columns
transposed, each rounded stochastically from its own seed: the two GEMMs that read X, or G_Y) -- and the first
program writes ``tensor_scale``, the tensor amax, which a later quantization of the same tensor (the weight in
backward) passes back as ``tensor_amax``, and where asked the products of the tensor scale with other
operands' scales that the GEMMs multiply their results by. Tiles hold whole blocks along the block axes;
masked loads read the partial last block as zeros, which is the reference's zero padding.

Both passes run on a 1-D grid (tile ``pid`` is row tile ``pid // n_col_tiles``, column tile
``pid % n_col_tiles``): CUDA caps a grid's second dimension at 65535 programs, which a 2-D grid of
64-wide tiles would pass at about 4.2M columns. Offsets are 64-bit, so tensors of more than 2**31
elements are quantized whole.

Stochastic rounding draws Philox-4x32-10 (:func:`.grid.draw`) with the 64-bit element index split into two
32-bit counter words, written out there rather than through ``tl.randint``, whose 64-bit offsets changed
meaning in Triton 3.4 (older releases run Philox-4x64 on them): the draws are the same under every
supported Triton, and :mod:`snip_ds.backend.cpu` draws the same stream. The seed is read from a one-element
int64 tensor on the device, so a seed drawn from a CUDA generator never waits for the device.

A layer step launches two independent amax passes, or two quantizations, as one launch (:mod:`.grouped`):
pass 2's body is :func:`quantize_tile`, which both kernels run.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, Optional, Tuple, Union

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from snip_ds.backend.base import check_kernel_arguments, check_kernel_input
from snip_ds.backend.kernels import direct, grid as g
from snip_ds.backend.kernels.config import (BOTH_AXES, BOTH_SAME, FP8_CODES, MX_KIND, LaunchConfig,
                                            amax_constants, amax_programs, amax_tiles, cached_launch_config, kind,
                                            launch_config, takes_amax_pass, tile)
from snip_ds.quant import QuantParts, Recipe, get_recipe

# the public API, the configuration's kind and launch_config included (used through this module)
__all__ = ["quantize_parts", "fake_quantize", "tensor_amax", "launch", "launch_config", "kind", "seed_tensor",
           "takes_amax_pass", "operands", "INTERPRETED", "triton_quantize", "triton_amax"]


@triton.jit
def _tile_index(pid, C, BC: tl.constexpr):
    """(row tile, column tile) of tile ``pid`` (int64) on the 1-D grid."""
    n_col_tiles = tl.cdiv(C, BC)
    return pid // n_col_tiles, pid % n_col_tiles


@triton.jit
def partial_max(x_ptr, R, C, stride_r, stride_c, pid, n_programs, IN_BF16: tl.constexpr, BR: tl.constexpr,
                 BC: tl.constexpr, TILES_PER_PROGRAM: tl.constexpr):
    """Program ``pid`` of ``n_programs``'s partial maximum (int32 bits) of ``|x|`` over tiles ``pid, pid + P,
    ..., pid + (TILES_PER_PROGRAM - 1) P`` (``P = n_programs``; those past the last tile read nothing)."""
    n_col_tiles = tl.cdiv(C, BC)
    best = tl.zeros([BR, BC], dtype=tl.int32)
    for i in range(TILES_PER_PROGRAM):
        t = pid + i * n_programs
        rows = (t // n_col_tiles) * BR + tl.arange(0, BR).to(tl.int64)
        cols = (t % n_col_tiles) * BC + tl.arange(0, BC).to(tl.int64)
        mask = (rows[:, None] < R) & (cols[None, :] < C)  # (a tile past the last one: rows past R)
        bits = g.load_bits(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask, IN_BF16)
        best = tl.maximum(best, bits & 0x7FFFFFFF)
    return tl.max(tl.max(best, axis=1), axis=0)


@triton.jit
def _amax_kernel(x_ptr, partials_ptr, R, C, stride_r, stride_c, IN_BF16: tl.constexpr, BR: tl.constexpr,
                 BC: tl.constexpr, TILES_PER_PROGRAM: tl.constexpr):
    """Stage 1 of the tensor amax: program ``p`` of ``P`` writes its partial maximum (:func:`partial_max`)
    to ``partials[p]`` -- every slot written, so the buffer needs no zero-fill launch. Stage 2 (the max of the
    ``P`` partials) is fused into the quantization kernel. The trip count is a power of two, a compile-time
    constant (1 for up to :data:`MAX_AMAX_PROGRAMS` tiles), so few shapes compile a variant of their own."""
    pid = tl.program_id(0).to(tl.int64)
    n_programs = tl.num_programs(0).to(tl.int64)
    tl.store(partials_ptr + pid, partial_max(x_ptr, R, C, stride_r, stride_c, pid, n_programs, IN_BF16, BR, BC,
                                              TILES_PER_PROGRAM))


@triton.jit
def quantize_tile(pid, x_ptr, out_ptr, out2_ptr, amax_ptr, n_amax, scale_out_ptr, amax_out_ptr, R, C, stride_r,
                   stride_c, seed_ptr, seed2_ptr, offset, KIND: tl.constexpr, AXIS: tl.constexpr,
                   BS: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
                   MAXN: tl.constexpr, TENSOR_DIVISOR: tl.constexpr, STOCHASTIC: tl.constexpr,
                   TRANSPOSE: tl.constexpr, IN_BF16: tl.constexpr, OUT: tl.constexpr, BR: tl.constexpr,
                   BC: tl.constexpr, DEQUANT: tl.constexpr, BOTH: tl.constexpr, AMAX_BLOCK: tl.constexpr,
                   WRITE_AMAX: tl.constexpr):
    """Tile ``pid`` (int64) of one quantization: its values in every layout asked, and, for tile 0, the tensor
    scale (and amax where ``WRITE_AMAX``). Returns the tensor scale, for the caller's products of scales. The
    body of :func:`_quantize_kernel` and of each half of the grouped launch (:mod:`.grouped`): the same code."""
    pid_r, pid_c = _tile_index(pid, C, BC)
    rows = pid_r * BR + tl.arange(0, BR).to(tl.int64)
    cols = pid_c * BC + tl.arange(0, BC).to(tl.int64)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    bits = g.load_bits(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask, IN_BF16)
    mag_bits = bits & 0x7FFFFFFF
    sign_bits = bits ^ mag_bits
    mag = mag_bits.to(tl.float32, bitcast=True)

    amax, scale = g.amax_and_scale(amax_ptr, n_amax, KIND, TENSOR_DIVISOR, AMAX_BLOCK)
    values = g.rounded(mag, mag_bits, sign_bits, scale, rows, cols, C, seed_ptr, offset, KIND, AXIS, BS, MBITS,
                       EMIN, EMAX, MAXN, STOCHASTIC, OUT, BR, BC, DEQUANT)
    if TRANSPOSE:
        tl.store(out_ptr + cols[None, :] * R + rows[:, None], values, mask=mask)
    else:
        tl.store(out_ptr + rows[:, None] * C + cols[None, :], values, mask=mask)
    if BOTH == BOTH_SAME:  # the same values in the other layout too: the transposed operand of a second GEMM
        tl.store(out2_ptr + cols[None, :] * R + rows[:, None], values, mask=mask)
    elif BOTH == BOTH_AXES:  # blocks along the other axis, transposed, with their own draws: a second GEMM's
        values2 = g.rounded(mag, mag_bits, sign_bits, scale, rows, cols, C, seed2_ptr, offset, KIND, 1 - AXIS,
                            BS, MBITS, EMIN, EMAX, MAXN, STOCHASTIC, OUT, BR, BC, DEQUANT)
        tl.store(out2_ptr + cols[None, :] * R + rows[:, None], values2, mask=mask)
    if pid == 0:
        tl.store(scale_out_ptr, scale)
        if WRITE_AMAX:
            tl.store(amax_out_ptr, amax)
    return scale


@triton.jit
def write_products(products_ptr, scale, partner, partner2_ptr, PRODUCTS: tl.constexpr):
    """The GEMMs' products of tensor scales, fl(S * S_partner) as torch multiplies them: ``scale`` times
    ``partner`` (a 0-d FP32 value) and, where ``PRODUCTS`` is 2, times the scale at ``partner2_ptr``."""
    tl.store(products_ptr, scale * partner)
    if PRODUCTS == 2:
        tl.store(products_ptr + 1, scale * tl.load(partner2_ptr))


@triton.jit(do_not_specialize=["n_amax"])  # (its value varies with the shape: no variant per value class)
def _quantize_kernel(x_ptr, out_ptr, out2_ptr, amax_ptr, n_amax, scale_out_ptr, amax_out_ptr, R, C, stride_r,
                     stride_c, seed_ptr, seed2_ptr, offset, partner_ptr, partner2_ptr, products_ptr,
                     KIND: tl.constexpr, AXIS: tl.constexpr, BS: tl.constexpr,
                     MBITS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr, MAXN: tl.constexpr,
                     TENSOR_DIVISOR: tl.constexpr,
                     STOCHASTIC: tl.constexpr, TRANSPOSE: tl.constexpr, IN_BF16: tl.constexpr,
                     OUT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, DEQUANT: tl.constexpr,
                     BOTH: tl.constexpr, AMAX_BLOCK: tl.constexpr, WRITE_AMAX: tl.constexpr,
                     PRODUCTS: tl.constexpr):
    """One quantization, one program per tile (:func:`quantize_tile`); the first program also writes the
    ``PRODUCTS`` products of the tensor scale with the partner scales at ``partner_ptr``, ``partner2_ptr``."""
    pid = tl.program_id(0).to(tl.int64)
    scale = quantize_tile(pid, x_ptr, out_ptr, out2_ptr, amax_ptr, n_amax, scale_out_ptr, amax_out_ptr, R, C,
                           stride_r, stride_c, seed_ptr, seed2_ptr, offset, KIND, AXIS, BS, MBITS, EMIN, EMAX,
                           MAXN, TENSOR_DIVISOR, STOCHASTIC, TRANSPOSE, IN_BF16, OUT, BR, BC, DEQUANT, BOTH,
                           AMAX_BLOCK, WRITE_AMAX)
    if PRODUCTS >= 1:
        if pid == 0:
            write_products(products_ptr, scale, tl.load(partner_ptr), partner2_ptr, PRODUCTS)


def quantize_parts(x: torch.Tensor, recipe: Union[str, Recipe], axis: int = -1, *,
                   tensor_amax: Optional[torch.Tensor] = None, stochastic: bool = False,
                   seed: Union[int, torch.Tensor] = 0, offset: int = 0, out_dtype: torch.dtype = torch.float32,
                   transpose: bool = False) -> QuantParts:
    """:func:`snip_ds.quant.quantize_parts` for a 2-D ``x``, in at most two passes over memory.

    With ``stochastic=False`` the result equals the reference bit for bit (``values`` converted to
    ``out_dtype`` and, with ``transpose``, transposed). Stochastic rounding draws Philox at index
    ``offset + i * cols + j`` for element ``(i, j)`` (:func:`.grid.draw`): reproducible from ``(seed, offset)``
    whatever the tiling,
    so a tensor quantized slice by slice (rows ``r0:``, ``offset = r0 * cols``, the whole ``tensor_amax``)
    gets the draws it would get at once. It cannot match torch's generator.

    Args:
        x: 2-D FP32 or BF16 tensor on the kernels' device (CUDA; CPU under ``TRITON_INTERPRET=1``), any
            strides.
        recipe: a :data:`snip_ds.quant.RECIPES` name or a :class:`~snip_ds.quant.Recipe`.
        axis: the block axis, 0 or 1 (or -2, -1): the GEMM's contraction axis. Per-tensor and 16x16-tile
            recipes give the same result for both.
        tensor_amax: amax of the whole tensor ``x`` is a slice of (per-tensor FP8 and NVFP4); skips the amax
            pass. None: ``x``'s own amax.
        stochastic, seed, offset: stochastic element rounding (scales stay round-to-nearest-even). ``seed``:
            an int in [0, 2**63), or a one-element int64 tensor holding one (on ``x``'s device: read by the
            kernel, so a seed drawn on the GPU costs no host synchronisation).
        out_dtype: ``torch.float32`` or ``torch.bfloat16`` (exact for the values of every recipe except
            where an MX scale pushes a value into BF16's subnormal range, where BF16 rounds); for a
            per-tensor FP8 recipe also its own ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``: the codes
            themselves, what an FP8 GEMM reads.
        transpose: write ``values`` as ``[cols, rows]`` (contiguous), the layout of the transposed operand.

    Returns:
        :class:`~snip_ds.quant.QuantParts` on ``x``'s device.

    Raises:
        ValueError / TypeError: a bad argument; the message names it.
    """
    return _quantize(x, recipe, axis, tensor_amax, stochastic, seed, offset, out_dtype, transpose, False)


def _quantize(x, recipe, axis, tensor_amax, stochastic, seed, offset, out_dtype, transpose,
              dequantize: bool) -> QuantParts:
    """:func:`quantize_parts`; with ``dequantize`` the values carry the tensor scale (:func:`fake_quantize`)
    and the returned tensor scale is 1. The arguments are checked here, the launches run in
    :func:`_quantize_launch` -- through the ``snip_ds::triton_quantize`` op when ``torch.compile`` traces."""
    recipe = recipe if isinstance(recipe, Recipe) else get_recipe(recipe)
    codes = out_dtype in FP8_CODES.values()
    if codes and (recipe.block_size != 0 or FP8_CODES.get(recipe.element.name) != out_dtype or dequantize):
        raise ValueError(f"out_dtype: {out_dtype} holds the codes of a per-tensor recipe of that format only, "
                         f"not of {recipe.name!r}")
    _check_args(x, axis, tensor_amax, seed, offset, torch.bfloat16 if codes else out_dtype, transpose, INTERPRETED)
    if x.numel() == 0:
        rows, cols = x.shape
        values = torch.empty((cols, rows) if transpose else (rows, cols), dtype=out_dtype, device=x.device)
        return QuantParts(values, torch.ones((), dtype=torch.float32, device=x.device))
    if tensor_amax is not None and recipe.scale != "e8m0":
        if (tensor_amax.dtype != torch.float32 or tensor_amax.device != x.device or tensor_amax.dim()
                or tensor_amax.requires_grad):
            tensor_amax = tensor_amax.detach().to(device=x.device, dtype=torch.float32).reshape(())
    else:
        tensor_amax = None  # MX: unused
    seed = seed_tensor(seed, x.device) if stochastic else None
    run = triton_quantize if torch.compiler.is_compiling() else _quantize_launch
    values, scale = run(x, tensor_amax, seed, recipe.name, axis % 2, offset, out_dtype, transpose, dequantize)
    return QuantParts(values, scale)


def _quantize_launch(x: torch.Tensor, tensor_amax: Optional[torch.Tensor], seed: Optional[torch.Tensor],
                     recipe: str, axis: int, offset: int, out_dtype: torch.dtype, transpose: bool,
                     dequantize: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """The launches of :func:`_quantize` for a non-empty ``x`` whose arguments are checked: the amax kernel
    (only where the recipe needs a tensor amax that is not given), then the quantization kernel. ``seed``:
    None rounds to nearest, else the one-element int64 tensor on ``x``'s device the kernel reads."""
    rows, cols = x.shape
    in_bf16 = x.dtype == torch.bfloat16
    config = cached_launch_config if isinstance(rows, int) and isinstance(cols, int) else \
        cached_launch_config.__wrapped__
    cfg = config(rows, cols, recipe, axis, out_dtype, transpose, in_bf16, dequantize, False,
                 tensor_amax is not None)  # (symbolic shapes: uncached)
    values, _, scale, _ = launch(cfg, x, tensor_amax, seed, offset)
    if dequantize:
        scale = torch.ones((), dtype=torch.float32, device=x.device)
    return values, scale


def launch(cfg: LaunchConfig, x: torch.Tensor, tensor_amax: Optional[torch.Tensor],
           seed: Optional[torch.Tensor], offset: int = 0, *, seed2: Optional[torch.Tensor] = None,
           partners: Tuple[torch.Tensor, ...] = (), products: Optional[torch.Tensor] = None,
           partials: Optional[torch.Tensor] = None
           ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """One quantization of a non-empty, checked ``x`` whose launch configuration ``cfg`` was worked out
    already (:func:`launch_config`): at most two launches, and nothing else decided here. Returns the values
    (in ``cfg``'s dtype and layout), the values in the other layout where ``cfg.both`` (else None; blocks
    along the other axis where the recipe has blocks, rounded stochastically from ``seed2``), the tensor scale
    and the tensor amax the scale was made from (0-d FP32; 0 for MX recipes, which have none): what a later
    quantization of the same tensor passes as ``tensor_amax`` to skip the amax pass; None unless
    ``cfg.write_amax``). Where ``cfg.products``, the tensor scale times each of ``partners`` (0-d FP32 scales
    of the other operands of the GEMMs that read ``x``) is written into ``products`` (FP32, one per partner).
    ``partials``: ``x``'s amax pass run already, its ``cfg.amax_programs`` partial maxima (int32; from
    :func:`snip_ds.backend.kernels.grouped.grouped_amax_partials`), which the quantization reduces instead of
    launching the pass itself."""
    if len(partners) != cfg.products or (products is None) != (not cfg.products):
        raise ValueError(f"partners: the configuration writes {cfg.products} products of scales, got "
                         f"{len(partners)} partner scales and {'no' if products is None else 'a'} products tensor")
    args, values, values2, scale, amax_out = operands(cfg, x, tensor_amax, partials)
    if partners or products is not None:
        scales_in = (tuple(partners) + (scale, scale))[:2]
        products_out = scale if products is None else products
    else:  # (rounding to nearest reads no seed; no partners: their slots are placeholders the kernel reads not)
        scales_in, products_out = (scale, scale), scale
    run_kernel(_quantize_kernel, cfg.grid, (*args, scale if seed is None else seed,
                                            scale if seed2 is None else seed2, offset, *scales_in, products_out),
               cfg.constants, STOCHASTIC[seed is not None])
    return values, values2, scale, amax_out


def operands(cfg: LaunchConfig, x: torch.Tensor, tensor_amax: Optional[torch.Tensor],
             partials: Optional[torch.Tensor]
             ) -> Tuple[tuple, torch.Tensor, Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]:
    """One quantization's runtime arguments of :func:`quantize_tile` from ``x_ptr`` to ``stride_c`` (the seeds
    and offset are the caller's), its amax pass launched where it takes one that did not run already, and its
    outputs allocated: ``(arguments, values, values2, scale, amax_out)``, the last four as :func:`launch`
    returns them. Shared by :func:`launch` and the grouped launch (:mod:`.grouped`); ``partials`` checked as
    :func:`launch` documents."""
    if partials is not None and (cfg.kind == MX_KIND or tensor_amax is not None):
        raise ValueError("partials: given for a quantization that takes no amax pass (an MX recipe or the "
                         "tensor amax given)")
    rows, cols = x.shape
    device = x.device
    values = torch.empty(cfg.shape, dtype=cfg.out_dtype, device=device)
    values2 = torch.empty(cfg.shape[::-1], dtype=cfg.out_dtype, device=device) if cfg.both else None
    x_bits = x.view(cfg.in_view)  # the kernels convert by bit shifting
    scale = torch.empty((), dtype=torch.float32, device=device)  # the kernel's first program writes both
    amax_out = torch.empty((), dtype=torch.float32, device=device) if cfg.write_amax else None
    if cfg.kind == MX_KIND:  # (a plain int: comparing with the tl.constexpr builds objects on every call)
        amax, n_amax = scale, 0  # unused
    elif tensor_amax is not None:
        amax, n_amax = tensor_amax.view(torch.int32), 1
    elif partials is not None:
        amax, n_amax = partials, cfg.amax_programs
    else:
        amax, n_amax = _amax_partials(x_bits, cfg), cfg.amax_programs
    out_bits = values.view(cfg.out_view)
    stride_r, stride_c = x.stride()
    args = (x_bits, out_bits, out_bits if values2 is None else values2.view(cfg.out_view), amax, n_amax, scale,
            scale if amax_out is None else amax_out, rows, cols, stride_r, stride_c)
    return args, values, values2, scale, amax_out


def fake_quantize(x: torch.Tensor, recipe: Union[str, Recipe], axis: int = -1, *,
                  tensor_amax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`snip_ds.quant.fake_quantize` of a 2-D ``x`` with round-to-nearest, as FP32, bit for bit: the
    dequantized values, the tensor-level scale multiplied in as the reference multiplies it (NVFP4:
    ``fl(q * fl(s_b * S))``, not the split's ``fl((q * s_b) * S)``). ``x``, ``recipe``, ``axis`` and
    ``tensor_amax`` as in :func:`quantize_parts`."""
    return _quantize(x, recipe, axis, tensor_amax, False, 0, 0, torch.float32, False, True).values


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """``x.abs().amax()`` in FP32 (0-d; NaN if ``x`` holds one) from the amax kernel alone: the
    ``tensor_amax`` to pass to :func:`quantize_parts` for the slices of ``x``. ``x``: 2-D FP32 or BF16."""
    _check_args(x, -1, None, 0, 0, torch.float32, False, INTERPRETED)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return (triton_amax if torch.compiler.is_compiling() else _amax_launch)(x)


def _amax_launch(x: torch.Tensor) -> torch.Tensor:
    in_bf16 = x.dtype == torch.bfloat16
    br, bc = tile(x.shape[0], 1), tile(x.shape[1], 1)
    programs = amax_programs(x.shape[0], x.shape[1], br, bc)
    partials = _amax(x.view(torch.int16 if in_bf16 else torch.int32), in_bf16, br, bc, programs)
    return partials.view(torch.float32).amax()


def _amax_partials(x_bits: torch.Tensor, cfg: LaunchConfig) -> torch.Tensor:
    """Stage 1 of the tensor amax of a quantization launched with ``cfg``, whose amax pass's tiles and programs
    it decided: ``cfg.amax_programs`` partial maxima of ``|x|`` as int32 bit patterns (see :func:`_amax`)."""
    partials = torch.empty(cfg.amax_programs, dtype=torch.int32, device=x_bits.device)
    run_kernel(_amax_kernel, (cfg.amax_programs,), (x_bits, partials, *x_bits.shape, *x_bits.stride()),
               cfg.amax_constants)
    return partials


def bit_view(x: torch.Tensor) -> torch.Tensor:  # (FP32 or BF16: as the integers the kernels read it through)
    return x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)


def _amax(x_bits: torch.Tensor, in_bf16: bool, br: int, bc: int, programs: int) -> torch.Tensor:
    """Stage 1 of the tensor amax: ``programs`` partial maxima of ``|x|`` as int32 bit patterns (every slot
    written by its program: no zero-fill)."""
    rows, cols = x_bits.shape
    partials = torch.empty(programs, dtype=torch.int32, device=x_bits.device)
    run_kernel(_amax_kernel, (programs,), (x_bits, partials, rows, cols, x_bits.stride(0), x_bits.stride(1)),
               amax_constants(in_bf16, br, bc, amax_tiles(rows, cols, br, bc, programs)))
    return partials


def seed_tensor(seed: Union[int, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The seed as the one-element int64 tensor on ``device`` that the kernel reads (an int becomes one by a
    fill kernel, which needs no host synchronisation either)."""
    if isinstance(seed, torch.Tensor):
        return seed.reshape(()).to(device=device, non_blocking=True)
    return torch.full((), seed, dtype=torch.int64, device=device)


INTERPRETED = isinstance(_quantize_kernel, InterpretedFunction)  # TRITON_INTERPRET=1 was set at import


def _check_args(x, axis, tensor_amax, seed, offset, out_dtype, transpose, interpreting: bool) -> None:
    check_kernel_input(x, "Triton", None if interpreting else "cuda")
    check_kernel_arguments(axis, tensor_amax, seed, offset, out_dtype)
    if not isinstance(transpose, bool):
        raise ValueError(f"transpose: expected true or false, got {transpose!r}")


# ------------------------------------------------------------------------------------------------------
# the launches as torch custom ops, for torch.compile
# ------------------------------------------------------------------------------------------------------

def launchable(kernel):
    """``kernel`` as the launches here run it: through ``torch.library.wrap_triton`` while a trace is on
    (:func:`_tracing`: so that dynamo, and inductor where it traces a ``triton_op``, see the launch), else
    :func:`snip_ds.backend.kernels.direct.launcher`'s direct launcher (the kernel itself where the Triton version
    is not one it supports). An eager launch through ``wrap_triton`` would dispatch its higher-order operator,
    flattening every argument, 55-120 µs a launch (bench_layer_host's ``triton_launch_us``). Under the
    interpreter, or not a JITFunction (a wrapper counting launches): the kernel itself."""
    if INTERPRETED or not isinstance(kernel, triton.runtime.JITFunction):
        return kernel
    if _tracing():
        return torch.library.wrap_triton(kernel)
    return direct.launcher(kernel)


STOCHASTIC = (MappingProxyType({"STOCHASTIC": False}), MappingProxyType({"STOCHASTIC": True}))  # (by rounding)


def run_kernel(kernel, grid, args: tuple, constants: Mapping, extra: Mapping = direct.NO_EXTRA) -> None:
    """``launchable(kernel)[grid](*args, **extra, **constants)``; eager launches of a compiled kernel through
    :func:`snip_ds.backend.kernels.direct.launch` (``constants``: a launch configuration's, ``extra``: one of a
    few fixed read-only mappings, e.g. :data:`STOCHASTIC`: the constexprs' part of the class worked out once)."""
    if INTERPRETED or type(kernel) is not triton.runtime.JITFunction or _tracing():
        launchable(kernel)[grid](*args, **extra, **constants)
    else:
        direct.launch(kernel, grid, args, constants, extra)


def _tracing() -> bool:
    """Whether a launch now is traced rather than run: dynamo compiling, or a dispatch mode on (make_fx's proxy
    mode, fake tensors, functionalization: how AOTAutograd and inductor trace a ``triton_op``'s body). A user's
    own dispatch mode around an eager step counts as a trace too: the launch then takes ``wrap_triton``'s
    slower path, which is correct either way."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def _define(name: str, fn, fake):
    """``fn`` as the op ``snip_ds::<name>``: a ``torch.library.triton_op`` (inductor traces into it and
    schedules its kernels itself) for compiled kernels; under the interpreter an opaque ``custom_op`` with the
    shape function ``fake``."""
    if INTERPRETED:
        op = torch.library.custom_op(f"snip_ds::{name}", fn, mutates_args=())
        op.register_fake(fake)
        return op
    return torch.library.triton_op(f"snip_ds::{name}", fn, mutates_args=())


def _triton_quantize(x: torch.Tensor, tensor_amax: Optional[torch.Tensor], seed: Optional[torch.Tensor],
                     recipe: str, axis: int, offset: int, out_dtype: torch.dtype, transpose: bool,
                     dequantize: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    return _quantize_launch(x, tensor_amax, seed, recipe, axis, offset, out_dtype, transpose, dequantize)


def _triton_quantize_fake(x, tensor_amax, seed, recipe, axis, offset, out_dtype, transpose, dequantize):
    rows, cols = x.shape
    return (x.new_empty((cols, rows) if transpose else (rows, cols), dtype=out_dtype),
            x.new_empty((), dtype=torch.float32))


def _triton_amax(x: torch.Tensor) -> torch.Tensor:
    return _amax_launch(x)


def _triton_amax_fake(x):
    return x.new_empty((), dtype=torch.float32)


triton_quantize = _define("triton_quantize", _triton_quantize, _triton_quantize_fake)
triton_amax = _define("triton_amax", _triton_amax, _triton_amax_fake)
