"""What each operand of a quantized GEMM is, resolved once from ``(precision, QuantConfig)`` for every backend.

A linear layer's three GEMMs multiply two operands each (:data:`snip_ds.types.GEMM_OPERANDS`), each quantized
along the GEMM's contraction axis. At a precision and under a :class:`~snip_ds.quant_config.QuantConfig`,
:func:`gemm_recipe` says for one GEMM: each operand's role, recipe (:data:`snip_ds.quant.RECIPES`), block axis
and whether it rounds stochastically, and whether both operands first go through one random Hadamard transform
along the tokens (:func:`hadamard_pair`). Every backend and the statistics take these answers from here; none
decides them itself.

Also here, because every backend that streams its operands shares them: how an operand is cut into slices
(:func:`chunks`) and its amax taken without a full-size temporary (:func:`tensor_amax`).

An operand may be one shard of a larger tensor (tensor parallelism). Its per-tensor scale must then come from the
whole tensor's amax, so that the quantized values do not depend on how the tensor is split: inside
:func:`shared_amax` every amax a backend takes (:func:`tensor_amax`, :func:`whole_amax`) goes through the given
reduction (a MAX all-reduce over the shards' ranks) before any scale is formed from it.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterator, Optional, Tuple

import torch

from snip_ds.quant import get_recipe, hadamard_transform, random_signs
from snip_ds.quant_config import QuantConfig
from snip_ds.types import GEMM_OPERAND_AXES, GEMM_OPERANDS, GEMMS


@dataclass(frozen=True)
class OperandRecipes:
    """Recipe names for the input X, the weight W and the output gradient G_Y at one precision."""

    x: str
    w: str
    g: str
    stochastic_g: bool


def operand_recipes(precision: str, cfg: QuantConfig) -> OperandRecipes:
    """The recipes a precision uses for each operand role (x, w, g) and whether g rounds stochastically:
    fp8 ``fp8_hybrid`` is E4M3 for x and w, E5M2 for g; ``mxfp8`` MXFP8 for all three; fp4 ``nvfp4`` is NVFP4
    (the weight in 2-D blocks with ``weight_2d``), ``mxfp4`` MXFP4; FP4 rounds g stochastically when
    ``stochastic_rounding`` is set (docs/method.md)."""
    if precision == "fp8":
        if cfg.fp8_recipe == "fp8_hybrid":
            return OperandRecipes("fp8_e4m3", "fp8_e4m3", "fp8_e5m2", False)
        return OperandRecipes("mxfp8", "mxfp8", "mxfp8", False)
    if precision == "fp4":
        if cfg.fp4_recipe == "nvfp4":
            return OperandRecipes("nvfp4", "nvfp4_2d" if cfg.weight_2d else "nvfp4", "nvfp4",
                                  cfg.stochastic_rounding)
        return OperandRecipes("mxfp4", "mxfp4", "mxfp4", cfg.stochastic_rounding)
    raise ValueError(f"precision: no quantized recipes for {precision!r}; valid: fp8, fp4")


def hadamard_wgrad(precision: str, cfg: QuantConfig) -> bool:
    """Whether wgrad at ``precision`` transforms both operands along the tokens first: FP4 with ``hadamard``
    set (the transform spreads outliers before the coarse FP4 blocks; FP8 does not need it)."""
    return precision == "fp4" and cfg.hadamard


@dataclass(frozen=True)
class Operand:
    """One operand of a quantized GEMM: its role (``x``, ``w``, ``g``), recipe, block axis (``-1``: along its
    rows, ``0``: along its columns, i.e. the tokens) and whether it rounds stochastically."""

    role: str
    recipe: str
    axis: int
    stochastic: bool


@dataclass(frozen=True)
class GemmRecipe:
    """How one GEMM quantizes at one precision: operands ``a`` and ``b`` (the GEMM multiplies ``a`` and
    ``b`` as :mod:`snip_ds.backend.base` lists them), and ``hadamard``: both go through one random Hadamard
    transform along the tokens first (:func:`hadamard_pair`)."""

    gemm: str
    precision: str
    a: Operand
    b: Operand
    hadamard: bool

    @property
    def operands(self) -> Tuple[Operand, Operand]:
        return self.a, self.b


@lru_cache(maxsize=None)
def gemm_recipe(gemm: str, precision: str, cfg: QuantConfig) -> GemmRecipe:
    """The operands of ``gemm`` at a quantized ``precision`` under ``cfg`` (cached: both arguments are
    immutable).

    Raises:
        ValueError: an unknown GEMM, or a precision that does not quantize (``bf16``), naming it.
    """
    if gemm not in GEMMS:
        raise ValueError(f"gemm: unknown GEMM {gemm!r}; valid: {', '.join(GEMMS)}")
    recipes = operand_recipes(precision, cfg)
    ops = tuple(Operand(role, getattr(recipes, role), axis, role == "g" and recipes.stochastic_g)
                for role, axis in zip(GEMM_OPERANDS[gemm], GEMM_OPERAND_AXES[gemm]))
    return GemmRecipe(gemm, precision, ops[0], ops[1], gemm == "wgrad" and hadamard_wgrad(precision, cfg))


def hadamard_pair(g: torch.Tensor, x: torch.Tensor,
                  generator: Optional[torch.Generator]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Both wgrad operands through the same random Hadamard transform along the tokens, in FP32 (signs drawn
    from ``generator`` before any stochastic rounding draws)."""
    signs = random_signs(g.shape[0], generator=generator, device=g.device)
    return hadamard_transform(_fp32(g), axis=0, signs=signs), hadamard_transform(_fp32(x), axis=0, signs=signs)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


# ------------------------------------------------------------------------------------------------------
# streaming an operand in slices
# ------------------------------------------------------------------------------------------------------

# Quantization works on slices of about this many elements, so its temporaries stay small next to the GEMM
# operands (peak memory); slices along the token axis are whole multiples of every block size.
CHUNK_ELEMENTS = 3 << 18  # CPU: 3 Mi elements (12 MiB in FP32), measured best balance of GEMM speed and temporaries
# CUDA: 48 Mi elements (192 MiB in FP32). On an H100 a statistics collection at Llama-70B widths took 1.05 s with
# these slices against 1.81 s with the CPU's (benchmarks/bench_scale.py --chunk_elements), whose small GEMMs
# leave most of the GPU idle; next to a step's tens of GiB the larger temporaries are small.
CUDA_CHUNK_ELEMENTS = 3 << 24
_ALIGN = 32


def chunks(length: int, width: int, device: Optional[torch.device] = None):
    """Slices of ``range(length)`` covering about CHUNK_ELEMENTS / width rows each (CUDA_CHUNK_ELEMENTS on a
    CUDA ``device``), multiples of 32."""
    elements = CUDA_CHUNK_ELEMENTS if device is not None and torch.device(device).type == "cuda" else CHUNK_ELEMENTS
    rows = max(_ALIGN, (elements // max(width, 1)) // _ALIGN * _ALIGN)
    return [slice(start, min(start + rows, length)) for start in range(0, length, rows)]


AmaxReduce = Callable[[torch.Tensor], torch.Tensor]
_AMAX_REDUCE: ContextVar[Optional[AmaxReduce]] = ContextVar("snip_ds_amax_reduce", default=None)


@contextmanager
def shared_amax(reduce: Optional[AmaxReduce]) -> Iterator[None]:
    """Within this context every operand's amax is ``reduce(local amax)`` (None: the operand's own amax): the
    quantized GEMMs of one shard of a tensor-parallel layer then scale each operand by the whole tensor's amax.
    ``reduce`` must be called by every rank of the shard group alike (same operands, same order)."""
    token = _AMAX_REDUCE.set(reduce)
    try:
        yield
    finally:
        _AMAX_REDUCE.reset(token)


def amax_shared() -> bool:
    """Whether a :func:`shared_amax` reduction is in force."""
    return _AMAX_REDUCE.get() is not None


def reduced(amax: torch.Tensor) -> torch.Tensor:
    """``amax`` (one operand's own, FP32) through the :func:`shared_amax` reduction in force, if any."""
    reduce = _AMAX_REDUCE.get()
    return amax if reduce is None else reduce(amax)


def tensor_amax(t: torch.Tensor) -> torch.Tensor:
    """max |t| without a full-size temporary (NaN propagates); under :func:`shared_amax`, the whole tensor's."""
    if t.numel() == 0:
        return reduced(torch.zeros((), dtype=torch.float32, device=t.device))
    lo, hi = torch.aminmax(t)
    return reduced(torch.maximum(-lo, hi).float())


def whole_amax(t: torch.Tensor, recipe) -> Optional[torch.Tensor]:
    """The amax to quantize all of ``t`` with under ``recipe`` (a name or :class:`~snip_ds.quant.Recipe`): None
    (the quantizer takes ``t``'s own, fused into its pass) unless a :func:`shared_amax` reduction is in force
    and the recipe has a tensor-level scale (MX recipes have none), then the whole tensor's."""
    if not amax_shared() or get_recipe(recipe).scale == "e8m0":
        return None
    return tensor_amax(t)
