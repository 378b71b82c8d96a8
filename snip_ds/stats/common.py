"""What every part of a statistics collection shares: the named sums, the layers, the batches' targets, the
collector's phases and the pricing of the all-reduced sums."""
from __future__ import annotations

import enum
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Iterable, Iterator, Mapping, Optional, Protocol, Tuple, Union

import torch
from torch import nn

from snip_ds.experts.points import ExpertPoint
from snip_ds.experts.model import expert_points
from snip_ds.linear import SnipLinear
from snip_ds.quant_config import QuantConfig
from snip_ds.swap import snip_layers

IGNORE_INDEX = -100
GLOBAL = "<global>"  # the Sums key of the model-wide (not per-layer) sums

Reduce = Callable[[torch.Tensor], torch.Tensor]
# A layer output's sequences: how many equal, contiguous ones (a linear's [B, L, n] output: B), or each token's
# sequence index (an MoE expert's routed tokens), as snip_ds.divergence.row_sums takes them.
Rows = Union[int, torch.Tensor]
# What a collection measures: a SnipLinear, or one (expert, projection) pair's ExpertPoint (the same interface).
Layer = Union[SnipLinear, ExpertPoint]


def select_layers(model: nn.Module, layers: Optional[Iterable[str]]) -> Dict[str, Layer]:
    """The layers a collection measures: ``layers`` (names), default every :class:`SnipLinear` and every
    (expert, projection) pair of the model's :class:`~snip_ds.experts.module.SnipExperts` (its
    :class:`~snip_ds.experts.points.ExpertPoint`)."""
    found: Dict[str, Layer] = dict(snip_layers(model))
    found.update(expert_points(model))
    if not found:
        raise ValueError("model has no SnipLinear layers; call snip_ds.swap.swap_linears(model) first")
    if layers is None:
        return found
    names = list(layers)
    unknown = [n for n in names if n not in found]
    if unknown:
        raise ValueError(f"layers: {unknown[:5]} are not SnipLinear layers or experts of the model; valid names "
                         f"look like {next(iter(found))!r} ({len(found)} in all)")
    return {n: found[n] for n in names}


def unpack(batch: Any) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """``(input_ids, attention_mask, labels)`` from a LongTensor ``[B, L]`` or a mapping with ``input_ids``."""
    if isinstance(batch, torch.Tensor):
        ids, mask, labels = batch, None, None
    elif isinstance(batch, Mapping) and "input_ids" in batch:
        ids, mask, labels = batch["input_ids"], batch.get("attention_mask"), batch.get("labels")
    else:
        raise ValueError("batches: each batch must be a LongTensor [B, L] of token ids or a mapping with "
                         f"'input_ids' (optional 'attention_mask', 'labels'); got {type(batch).__name__}")
    if ids.dim() != 2:
        raise ValueError(f"batches: input_ids must be [B, L], got shape {tuple(ids.shape)}")
    if labels is None:
        labels = ids if mask is None else ids.masked_fill(mask == 0, IGNORE_INDEX)
    return ids, mask, labels


def targets(logits: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Shifted next-token logits ``[N, V]`` and targets ``[N]`` of the valid positions."""
    lg = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    tg = labels[:, 1:].reshape(-1).to(logits.device)
    keep = tg != IGNORE_INDEX
    return lg[keep], tg[keep]


def device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@contextmanager
def fp32_matmuls(device: torch.device, tf32: bool) -> Iterator[None]:
    """FP32 matrix products on CUDA ``device`` on TF32 tensor cores while the block runs (``tf32``), cuBLAS's
    flag restored after; anything else runs unchanged.

    The statistics form most of their products in FP32 from operands that are exact in BF16 (a BF16 model's
    activations, weights and gradients) and so exact in TF32 too; the rest (dequantized operands with an FP32
    tensor scale, FP32 intermediates) are rounded to 10 mantissa bits, 2⁻¹¹ relative at most, against the
    2⁻⁴ (FP8) to 2⁻² (FP4) relative quantization errors they measure. Set through
    ``torch.backends.cuda.matmul.fp32_precision`` and restored to the value found there (which also serves
    callers of the older ``allow_tf32`` flag); a torch without that attribute gets ``allow_tf32``."""
    if not tf32 or torch.device(device).type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    attr, value = ("fp32_precision", "tf32") if hasattr(matmul, "fp32_precision") else ("allow_tf32", True)
    saved = getattr(matmul, attr)
    setattr(matmul, attr, value)
    try:
        yield
    finally:
        setattr(matmul, attr, saved)


class Phase(enum.Enum):
    """Which pass of a collection is running, so that each hook knows what it sees."""

    OFF = "off"  # between passes: the hooks do nothing
    FORWARD = "forward"  # the batch's first forward (with a graph)
    TRAIN = "train"  # the backward of the training loss: G_Y
    PROBE_FORWARD = "probe_forward"  # a fresh forward for one probe (retain_graph=False)
    PROBE = "probe"  # a Monte-Carlo Fisher probe's backward: g
    ISO = "iso"  # an isotropic probe's backward
    FWD_PASS = "fwd_pass"  # forward_drift: a forward whose layer outputs are shifted
    FWD_BACKWARD = "fwd_backward"  # forward_drift: that pass's backward
    ALPHA = "alpha"  # the isotropic curvature's forward passes


@dataclass(frozen=True)
class SumField:
    """A named sum that one estimator adds to and prices (:class:`Sums` holds it per layer, or under
    :data:`GLOBAL`). Every sum is summed over the batches of a rank and then over the ranks, all of them in one
    all-reduce (:meth:`Sums.reduce`).

    Attributes:
        name: the sum's name; a precision's (or an input group's) sum is ``name.suffix``.
        folded_into: for a per-channel vector: the per-layer scalar it becomes at the end of each batch, priced
            channel by channel with the batch's probes (``Σ_j v_j·m_j``), so that only scalars are all-reduced.
    """

    name: str
    folded_into: Optional["SumField"] = None

    def key(self, suffix: Optional[str] = None) -> str:
        return self.name if suffix is None else f"{self.name}.{suffix}"


# The collection's own sums: model-wide (GLOBAL) target tokens, rows and loss; per layer the probes' Σ_t g_tj²,
# which price the estimators' per-channel vectors at the end of each batch (SumField.folded_into).
N_TOKENS, N_ROWS, LOSS_SUM = SumField("n_tokens"), SumField("n_rows"), SumField("loss_sum")
CALL_ROWS = SumField("rows")  # per layer: the rows (tokens) of all its calls in a batch's forward
PROBE_SQ = SumField("probe_sq")


class Sums:
    """Named per-layer accumulators, packed into one flat vector for a single reduction."""

    def __init__(self) -> None:
        self.data: Dict[Tuple[str, str], torch.Tensor] = {}

    def add(self, fqn: str, key: str, value: torch.Tensor) -> None:
        value = value.detach().float().reshape(-1)
        k = (fqn, key)
        self.data[k] = self.data[k] + value if k in self.data else value.clone()

    def pop(self, fqn: str, key: str) -> Optional[torch.Tensor]:
        return self.data.pop((fqn, key), None)

    def get(self, fqn: str, key: str, default: float = 0.0) -> torch.Tensor:
        t = self.data.get((fqn, key))
        return torch.tensor([default]) if t is None else t

    def reduce(self, reduce: Optional[Reduce], device: torch.device) -> None:
        keys = sorted(self.data)  # the same order on every rank
        flat = torch.cat([self.data[k].to(device) for k in keys]) if keys else torch.zeros(0, device=device)
        if reduce is not None:
            flat = reduce(flat)
        sizes = [self.data[k].numel() for k in keys]
        for k, part in zip(keys, torch.split(flat.detach().float().cpu(), sizes)):
            self.data[k] = part


class StatisticsBackend(Protocol):
    """What the estimators ask of the backend that quantizes and multiplies for them
    (:func:`snip_ds.backend.statistics_backend`, the emulated backend's numerics): one operand quantized at a
    precision as FP32, the three GEMMs, and the exact moments of dgrad and wgrad over G_Y's stochastic
    rounding."""

    def quantize(self, t: torch.Tensor, precision: str, role: str, axis: int, cfg: QuantConfig,
                 generator: Optional[torch.Generator] = None,
                 amax: Optional[torch.Tensor] = None) -> torch.Tensor: ...

    def dgrad(self, g: torch.Tensor, w: torch.Tensor, precision: str, cfg: QuantConfig,
              generator: Optional[torch.Generator] = None, *,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    def wgrad(self, g: torch.Tensor, x: torch.Tensor, precision: str, cfg: QuantConfig,
              generator: Optional[torch.Generator] = None, *,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    def rounds_g_stochastically(self, precision: str, cfg: QuantConfig) -> bool: ...

    def dgrad_moments(self, g: torch.Tensor, w: torch.Tensor, precision: str, cfg: QuantConfig) -> Any: ...

    def wgrad_moments(self, g: torch.Tensor, x: torch.Tensor, precision: str, cfg: QuantConfig,
                      generator: Optional[torch.Generator] = None, price_tokens: Optional[torch.Tensor] = None,
                      gram: Optional[torch.Tensor] = None) -> Any: ...


@dataclass
class Shared:
    """What the estimators of one collection share: the named sums they add to, the GEMM backend that
    quantizes and multiplies, the precisions measured, and the current batch's target-token count (the
    training loss is their mean, so ``G_Y`` carries a factor ``1/n_local``)."""

    stats: Sums
    backend: StatisticsBackend
    precisions: Tuple[str, ...]
    n_local: float = 1.0
    # Tensor parallelism: whether this rank is its group's first (tp_index 0). A sum every rank of the group
    # holds whole (the batch's counts, a shard's sum already reduced over the group) is added there only, and
    # as zero elsewhere, so that the all-reduce over all ranks counts it once per data-parallel rank.
    tp_first: bool = True

    def once(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the tensor-parallel group's first rank, zeros of its shape on the others (:attr:`tp_first`)."""
        return t if self.tp_first else torch.zeros_like(t)


@dataclass(frozen=True)
class Pricing:
    """What turns one collection's all-reduced sums into the artifact's numbers; each estimator prices its own
    sums with it.

    Attributes:
        sums: the all-reduced sums.
        precisions: the quantized precisions measured.
        tokens: the target tokens of every batch on every rank (N).
        batches: batches per rank (B).
        ranks: data-parallel ranks (W).
        cover: how many times the reduced P-weighted norms cover each element (1 with a partitioned state's
            callable preconditioner, else W).
        callable_mode: the preconditioners were a partitioned state's callables.
        eta2: ``(lr·step_scale)²``.
        curvature: α of the isotropic ablation, else 1.
        probes: the probes per batch that priced the per-channel terms (1 for the empirical estimator).
        num_probes: the probes per batch asked for.
    """

    sums: Sums
    precisions: Tuple[str, ...]
    tokens: float
    batches: float
    ranks: float
    cover: float
    callable_mode: bool
    eta2: float
    curvature: float
    probes: float
    num_probes: int

    def value(self, fqn: str, field: SumField, suffix: Optional[str] = None) -> float:
        """A reduced sum as a number (0 where nothing was added)."""
        return float(self.sums.get(fqn, field.key(suffix))[0])


def rne_config(module: SnipLinear) -> QuantConfig:
    """The layer's quantization with round-to-nearest everywhere: the statistics' own rounding draws nothing
    (where training rounds G_Y stochastically the BWD estimator takes the exact expectation instead)."""
    return replace(module.quant_config, stochastic_rounding=False)


def flat(t: torch.Tensor) -> torch.Tensor:
    """``[..., n] -> [T, n]`` in FP32, detached (no copy when already FP32)."""
    return t.detach().reshape(-1, t.shape[-1]).float()
