"""Two independent jobs of one layer step in one Triton launch: each launch saved is the host's work of one.

* :func:`grouped_amax_partials`: two tensors' amax passes (stage 1; a layer's X and W in forward) --
  ``_grouped_amax_kernel``, programs ``0 .. PA - 1`` over the first tensor, the rest over the second, into one
  int32 buffer of partial maxima.
* :func:`launch_pair`: two quantizations (``_grouped_quantize_kernel``): programs ``0 .. PA - 1`` are the first
  quantization's tiles with its own compile-time arguments, the rest the second's -- each program runs
  :func:`~snip_ds.backend.kernels.quantize.quantize_tile`, the code of the single quantization kernel, so
  the values, scales and amaxes are those of two launches bit for bit. Forward: X (both layouts) and W for
  fprop after their grouped amax pass; backward: W for dgrad (from the kept amax) and G_Y.

Where the second quantization writes products of tensor scales (NVFP4: fprop's ``S_W * S_X``, dgrad's
``S_G * S_W``), its first partner is the first tensor's scale -- which the first tensor's own first program
writes in the same launch, so reading it would race. The second's first program computes that scale itself
from the first tensor's amax (its partials or given amax, :func:`~snip_ds.backend.kernels.grid.amax_and_scale`:
the same FP32 operations, so the same bits) and multiplies it in.

The configurations (:func:`grouped_amax_config`, :func:`quantize_pair_config`) are worked out once per pair of
launch configurations (cached); a launch decides nothing.
"""
from __future__ import annotations

import functools
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from snip_ds.backend.kernels import grid as g, quantize as kq
from snip_ds.backend.kernels.config import LaunchConfig, takes_amax_pass
from snip_ds.backend.kernels.quantize import bit_view, partial_max, quantize_tile, write_products

__all__ = ["GroupedAmaxConfig", "grouped_amax_config", "grouped_amax_partials", "QuantizePairConfig",
           "quantize_pair_config", "launch_pair"]


# ------------------------------------------------------------------------------------------------------
# two amax passes
# ------------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["PA", "PB"])  # (program counts vary with the shapes: no variant per value class)
def _grouped_amax_kernel(a_ptr, b_ptr, partials_ptr, RA, CA, stride_ra, stride_ca, RB, CB, stride_rb, stride_cb,
                         PA, PB, A_BF16: tl.constexpr, BRA: tl.constexpr, BCA: tl.constexpr,
                         TILES_A: tl.constexpr, B_BF16: tl.constexpr, BRB: tl.constexpr, BCB: tl.constexpr,
                         TILES_B: tl.constexpr):
    """Stage 1 of two tensors' amaxes in one launch (a layer's X and W): programs ``0 .. PA - 1`` are
    ``_amax_kernel``'s ``PA`` programs over ``a``, programs ``PA .. PA + PB - 1`` its ``PB`` programs over
    ``b``, each tensor with its own shape, strides, dtype and tiles; partial ``p`` goes to ``partials[p]``, so
    ``a``'s are the first ``PA`` slots and ``b``'s the ``PB`` after them -- each the same integers as
    ``_amax_kernel``'s launch over that tensor alone."""
    pid = tl.program_id(0).to(tl.int64)
    if pid < PA:
        best = partial_max(a_ptr, RA, CA, stride_ra, stride_ca, pid, PA, A_BF16, BRA, BCA, TILES_A)
    else:
        best = partial_max(b_ptr, RB, CB, stride_rb, stride_cb, pid - PA, PB, B_BF16, BRB, BCB, TILES_B)
    tl.store(partials_ptr + pid, best)


class GroupedAmaxConfig(NamedTuple):
    """The launch of two tensors' amax passes as one (:func:`grouped_amax_config`)."""

    programs: Tuple[int, int]  # each tensor's programs (partial maxima): the first's slots first
    grid: Tuple[int]
    constants: Mapping[str, Any]  # the grouped amax kernel's compile-time arguments (read-only)


def grouped_amax_config(first: LaunchConfig, second: LaunchConfig) -> GroupedAmaxConfig:
    """One launch of the amax passes of two quantizations launched with ``first`` and ``second``, whose tiles,
    programs and tiles per program it keeps (so each tensor's partial maxima are those of its own pass); worked
    out once per pair (cached). ValueError where either configuration takes no amax pass (an MX recipe, or the
    tensor amax given)."""
    for name, cfg in (("first", first), ("second", second)):
        if not takes_amax_pass(cfg):
            raise ValueError(f"{name}: its quantization takes no amax pass (an MX recipe or the amax given)")
    return _cached_grouped_amax_config(first.amax_programs, first.amax_tiles, first.br, first.bc, first.in_bf16,
                                       second.amax_programs, second.amax_tiles, second.br, second.bc,
                                       second.in_bf16)


@functools.lru_cache(maxsize=1024)
def _cached_grouped_amax_config(programs_a: int, tiles_a: int, br_a: int, bc_a: int, bf16_a: bool,
                                programs_b: int, tiles_b: int, br_b: int, bc_b: int, bf16_b: bool
                                ) -> GroupedAmaxConfig:
    return GroupedAmaxConfig((programs_a, programs_b), (programs_a + programs_b,),
                             MappingProxyType(dict(A_BF16=bf16_a, BRA=br_a, BCA=bc_a, TILES_A=tiles_a,
                                                   B_BF16=bf16_b, BRB=br_b, BCB=bc_b, TILES_B=tiles_b)))


def grouped_amax_partials(cfg: GroupedAmaxConfig, a: torch.Tensor, b: torch.Tensor
                          ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Stage 1 of the tensor amaxes of two non-empty, checked 2-D tensors in one launch (``cfg``: their
    quantizations' :func:`grouped_amax_config`): ``a``'s partial maxima and ``b``'s in one int32 buffer, to pass
    as ``partials`` to :func:`~snip_ds.backend.kernels.quantize.launch` or :func:`launch_pair` -- the integers
    each tensor's own amax pass writes, so the quantizations are bit for bit those with a pass each. ``a``'s are
    the buffer's first ``cfg.programs[0]`` slots, returned as the buffer itself (its quantization reads that
    many; a slice would cost the host a microsecond), ``b``'s a view of the slots after them."""
    a_bits, b_bits = bit_view(a), bit_view(b)
    programs_a, programs_b = cfg.programs
    partials = torch.empty(cfg.grid[0], dtype=torch.int32, device=a.device)
    (rows_a, cols_a), (rows_b, cols_b) = a_bits.shape, b_bits.shape
    (stride_ra, stride_ca), (stride_rb, stride_cb) = a_bits.stride(), b_bits.stride()
    kq.run_kernel(_grouped_amax_kernel, cfg.grid, (a_bits, b_bits, partials, rows_a, cols_a, stride_ra, stride_ca,
                                                   rows_b, cols_b, stride_rb, stride_cb, programs_a, programs_b),
                  cfg.constants)
    return partials, partials[programs_a:]


# ------------------------------------------------------------------------------------------------------
# two quantizations
# ------------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["n_amax_a", "n_amax_b", "PA"])  # (they vary with the shapes: no variant per value)
def _grouped_quantize_kernel(
        a_ptr, a_out_ptr, a_out2_ptr, a_amax_ptr, n_amax_a, a_scale_out_ptr, a_amax_out_ptr, RA, CA, stride_ra,
        stride_ca, b_ptr, b_out_ptr, b_out2_ptr, b_amax_ptr, n_amax_b, b_scale_out_ptr, b_amax_out_ptr, RB, CB,
        stride_rb, stride_cb, b_seed_ptr, b_seed2_ptr, partner2_ptr, products_ptr, PA,
        KIND_A: tl.constexpr, AXIS_A: tl.constexpr, BS_A: tl.constexpr, MBITS_A: tl.constexpr,
        EMIN_A: tl.constexpr, EMAX_A: tl.constexpr, MAXN_A: tl.constexpr, TENSOR_DIVISOR_A: tl.constexpr,
        TRANSPOSE_A: tl.constexpr, IN_BF16_A: tl.constexpr, OUT_A: tl.constexpr, BR_A: tl.constexpr,
        BC_A: tl.constexpr, BOTH_A: tl.constexpr, AMAX_BLOCK_A: tl.constexpr, WRITE_AMAX_A: tl.constexpr,
        KIND_B: tl.constexpr, AXIS_B: tl.constexpr, BS_B: tl.constexpr, MBITS_B: tl.constexpr,
        EMIN_B: tl.constexpr, EMAX_B: tl.constexpr, MAXN_B: tl.constexpr, TENSOR_DIVISOR_B: tl.constexpr,
        STOCHASTIC_B: tl.constexpr, TRANSPOSE_B: tl.constexpr, IN_BF16_B: tl.constexpr, OUT_B: tl.constexpr,
        BR_B: tl.constexpr, BC_B: tl.constexpr, BOTH_B: tl.constexpr, AMAX_BLOCK_B: tl.constexpr,
        WRITE_AMAX_B: tl.constexpr, PRODUCTS_B: tl.constexpr):
    """Two quantizations in one launch: programs ``0 .. PA - 1`` quantize ``a``'s tiles, the rest ``b``'s
    (:func:`quantize_tile`, each with its own arguments; both from element offset 0, neither dequantizing,
    ``a`` rounding to nearest: its seed slots are placeholders it reads not). ``b``'s first program also writes
    its ``PRODUCTS_B`` products of tensor scales: with ``a``'s scale, computed here from ``a``'s amax (not read:
    ``a``'s first program writes it in this same launch), and with the scale at ``partner2_ptr``. (Every argument
    costs the host's launch path time: none is passed that the pairs a layer step launches do not vary.)"""
    pid = tl.program_id(0).to(tl.int64)
    if pid < PA:
        quantize_tile(pid, a_ptr, a_out_ptr, a_out2_ptr, a_amax_ptr, n_amax_a, a_scale_out_ptr, a_amax_out_ptr,
                       RA, CA, stride_ra, stride_ca, a_scale_out_ptr, a_scale_out_ptr, 0, KIND_A, AXIS_A, BS_A,
                       MBITS_A, EMIN_A, EMAX_A, MAXN_A, TENSOR_DIVISOR_A, False, TRANSPOSE_A, IN_BF16_A, OUT_A,
                       BR_A, BC_A, False, BOTH_A, AMAX_BLOCK_A, WRITE_AMAX_A)
    else:
        scale = quantize_tile(pid - PA, b_ptr, b_out_ptr, b_out2_ptr, b_amax_ptr, n_amax_b, b_scale_out_ptr,
                               b_amax_out_ptr, RB, CB, stride_rb, stride_cb, b_seed_ptr, b_seed2_ptr, 0, KIND_B,
                               AXIS_B, BS_B, MBITS_B, EMIN_B, EMAX_B, MAXN_B, TENSOR_DIVISOR_B, STOCHASTIC_B,
                               TRANSPOSE_B, IN_BF16_B, OUT_B, BR_B, BC_B, False, BOTH_B, AMAX_BLOCK_B,
                               WRITE_AMAX_B)
        if PRODUCTS_B >= 1:
            if pid == PA:
                _, partner = g.amax_and_scale(a_amax_ptr, n_amax_a, KIND_A, TENSOR_DIVISOR_A, AMAX_BLOCK_A)
                write_products(products_ptr, scale, partner, partner2_ptr, PRODUCTS_B)


class QuantizePairConfig(NamedTuple):
    """The launch of two quantizations as one (:func:`quantize_pair_config`)."""

    first: LaunchConfig  # each quantization's own configuration: its outputs' shapes, dtypes and views
    second: LaunchConfig
    programs: int  # the first's programs (tiles); the second's follow
    grid: Tuple[int]
    constants: Mapping[str, Any]  # the grouped kernel's compile-time arguments but STOCHASTIC_B (read-only)


def quantize_pair_config(first: LaunchConfig, second: LaunchConfig) -> QuantizePairConfig:
    """One launch of the quantizations launched with ``first`` and ``second`` (each as
    :func:`~snip_ds.backend.kernels.quantize.launch_config` worked it out), worked out once per pair (cached).
    The first rounds to nearest and writes no products of scales; the second may write one or two, the first
    of them with the first tensor's scale; neither dequantizes (:func:`~snip_ds.backend.kernels.quantize.
    fake_quantize`'s launches are not paired). ValueError otherwise."""
    if first.products:
        raise ValueError(f"first: writes {first.products} products of scales; in a pair only the second writes "
                         f"products (the first of them with the first tensor's scale)")
    for name, cfg in (("first", first), ("second", second)):
        if cfg.constants["DEQUANT"]:
            raise ValueError(f"{name}: dequantizes (fake_quantize's launches are not paired)")
    return _cached_pair(_Keyed(first), _Keyed(second))


class _Keyed:
    """A launch configuration hashed and compared by its fields (its constants' dict as items), for the cache:
    equal configurations share one pair, which holds the first of them seen."""

    __slots__ = ("cfg", "key")

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg, self.key = cfg, tuple(cfg._replace(constants=tuple(cfg.constants.items()),
                                                     amax_constants=tuple(cfg.amax_constants.items())))

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Keyed) and self.key == other.key


@functools.lru_cache(maxsize=1024)
def _cached_pair(first: _Keyed, second: _Keyed) -> QuantizePairConfig:
    first, second = first.cfg, second.cfg
    constants = {f"{name}_A": value for name, value in first.constants.items()
                 if name not in ("PRODUCTS", "DEQUANT")}
    constants.update({f"{name}_B": value for name, value in second.constants.items() if name != "DEQUANT"})
    return QuantizePairConfig(first, second, first.grid[0], (first.grid[0] + second.grid[0],),
                              MappingProxyType(constants))  # (read-only: direct launches keep their work by identity)


STOCHASTIC_B = (MappingProxyType({"STOCHASTIC_B": False}), MappingProxyType({"STOCHASTIC_B": True}))  # (rounding)


def launch_pair(cfg: QuantizePairConfig, a: torch.Tensor, a_amax: Optional[torch.Tensor], b: torch.Tensor,
                b_amax: Optional[torch.Tensor], *, a_partials: Optional[torch.Tensor] = None,
                b_partials: Optional[torch.Tensor] = None, b_seed: Optional[torch.Tensor] = None,
                b_seed2: Optional[torch.Tensor] = None, partner2: Optional[torch.Tensor] = None,
                products: Optional[torch.Tensor] = None) -> Tuple[list, list]:
    """The quantizations of ``a`` with ``cfg.first`` and ``b`` with ``cfg.second`` in one launch (after the amax
    pass of either where it takes one not run already: ``*_partials`` and ``*_amax`` as
    :func:`~snip_ds.backend.kernels.quantize.launch`'s ``partials`` and ``tensor_amax``). ``a`` rounds to
    nearest; ``b`` stochastically from ``b_seed`` (and ``b_seed2`` for its second layout) where given. Where
    ``cfg.second.products``: ``b``'s scale times ``a``'s, and times ``partner2`` for a second, written into
    ``products``. Returns each quantization's ``(values, values2, scale, amax)`` as
    :func:`~snip_ds.backend.kernels.quantize.launch` returns them: the same bits."""
    if (products is None) != (not cfg.second.products) or (partner2 is None) != (cfg.second.products < 2):
        raise ValueError(f"products: the configuration writes {cfg.second.products} products of scales, got "
                         f"{'no' if products is None else 'a'} products tensor and "
                         f"{'no' if partner2 is None else 'a'} second partner")
    a_args, *a_out = kq.operands(cfg.first, a, a_amax, a_partials)
    b_args, *b_out = kq.operands(cfg.second, b, b_amax, b_partials)
    placeholder = b_out[2]  # (b's scale: slots the kernel reads not)
    kq.run_kernel(_grouped_quantize_kernel, cfg.grid, (
        *a_args, *b_args, placeholder if b_seed is None else b_seed, placeholder if b_seed2 is None else b_seed2,
        placeholder if partner2 is None else partner2, placeholder if products is None else products,
        cfg.programs), cfg.constants, STOCHASTIC_B[b_seed is not None])
    return a_out, b_out
