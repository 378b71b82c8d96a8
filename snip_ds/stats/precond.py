"""The preconditioner P of the drift ``lr·c·ΔG_W ⊙ P``: from a torch Adam/AdamW optimizer's state, from a
partitioned (ZeRO) optimizer state through a callable, or a fallback before the first optimizer step.

Distributed conventions (exact for one rank; for several, rank-local quantization errors are taken as
independent, so the error of the averaged gradient has ``1/W`` of a rank's squared norm):

* ``precond={fqn: P}`` (full weight shape, e.g. from :func:`adam_precond`): every rank computes the full
  ``‖ΔG_W,r ⊙ P‖²``; after the sum over ranks it is divided by ``W²``.
* ``precond=callable`` (partitioned optimizer states, ZeRO 1-3; :mod:`snip_ds.engine.adam_state` builds it):
  ``precond(fqn, t) -> 0-dim tensor`` = ``Σ (t ⊙ P)²`` over the elements of the flattened weight whose
  optimizer state **this rank owns**, with ``P = 1/(sqrt(exp_avg_sq/(1-β₂ᵗ)) + eps)`` of that partition
  (``t`` is a full ``[n, k]`` FP32 tensor, rank-local). The sum over ranks then covers every element once;
  it is divided by ``W``. The loss-unit price then assumes P constant within the layer (scaled by
  ``‖ΔG⊙P‖²/‖ΔG‖²``). A mapping may also hold such callables per fqn.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from snip_ds import divergence as dv
from snip_ds.experts.points import ExpertPoint
from snip_ds.types import full_shape
from snip_ds.linear import SnipLinear
from snip_ds.stats.common import select_layers

PrecondFn = Callable[[str, torch.Tensor], torch.Tensor]
Precond = Union[None, Mapping[str, Union[torch.Tensor, PrecondFn]], PrecondFn]


class AdamPreconditioners(Mapping):
    """``{fqn: P}``, ``P = 1/(sqrt(v̂) + eps)``, each computed from the optimizer's ``exp_avg_sq`` when it is
    read and not kept: a collection holds one layer's P at a time, not an FP32 copy of the whole optimizer
    state (a model's size: as much again as the activations of a small model's step). P reflects the state
    at the time it is read; the optimizer must not step between :func:`adam_precond` and the collection."""

    def __init__(self, entries: Dict[str, Tuple[torch.Tensor, int, float, float]]) -> None:
        self._entries = entries  # fqn -> (exp_avg_sq or an expert's slice of it, step, beta2, eps)

    def __getitem__(self, fqn: str) -> torch.Tensor:
        v, step, beta2, eps = self._entries[fqn]
        return dv.adam_preconditioner(v, step, beta2, eps)

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def shape(self, fqn: str) -> Tuple[int, ...]:
        """P's shape for ``fqn`` without computing it."""
        return tuple(self._entries[fqn][0].shape)


@dataclass(frozen=True)
class AdamPrecond:
    """Adam preconditioners read from a torch optimizer.

    Attributes:
        precond: ``{fqn: P}`` with ``P = 1/(sqrt(v̂) + eps)`` (:class:`AdamPreconditioners`: computed when
            read); empty when the optimizer has no state yet.
        step: optimizer steps taken (0 before the first).
        step_scale: ``(1-β₁)/(1-β₁^(step+1))``, the share of a gradient change in the next update.
        lr: the learning rate of the layers' param group.
    """

    precond: Mapping[str, torch.Tensor]
    step: int
    step_scale: float
    lr: float


def adam_precond(model: nn.Module, optimizer: torch.optim.Optimizer,
                 layers: Optional[Iterable[str]] = None) -> AdamPrecond:
    """Reads ``exp_avg_sq`` and ``step`` of the layers' weights from a torch Adam/AdamW optimizer (an MoE expert's
    (expert, projection) pair: its ``[out, in]`` part of its 3-D Parameter's state)."""
    mods = select_layers(model, layers)
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    entries, steps, lrs, beta1 = {}, set(), set(), None
    for fqn, mod in mods.items():
        param = mod.parameter  # a linear's weight; an expert's 3-D Parameter
        group = group_of.get(id(param))
        if group is None:
            raise ValueError(f"optimizer: layer {fqn!r}'s weight is in no param group")
        if "betas" not in group or "eps" not in group:
            raise ValueError(f"optimizer: param group of {fqn!r} has no 'betas'/'eps'; expected Adam or AdamW")
        beta1, beta2 = group["betas"]
        lrs.add(float(group["lr"]))
        state = optimizer.state.get(param, {})
        if "exp_avg_sq" not in state:
            continue
        step = int(state["step"])
        steps.add(step)
        v = mod.slice(state["exp_avg_sq"])  # its [out, in] part, as the GEMM's matrix
        entries[fqn] = (v, step, beta2, group["eps"])
    step = max(steps) if steps else 0
    if entries and len(entries) != len(mods):
        raise ValueError(f"optimizer: only {len(entries)} of {len(mods)} layers have Adam state")
    step_scale = dv.adam_step_scale(step, beta1 if beta1 is not None else 0.9)
    return AdamPrecond(AdamPreconditioners(entries), step, step_scale, max(lrs) if lrs else 0.0)


def check_precond(precond: Precond, mods: Dict[str, SnipLinear], forward_drift: bool, estimator: str) -> Precond:
    """Checks ``precond`` against the measured layers; returns it, or None where it is an empty mapping (no
    optimizer state yet: the fallback). ``forward_drift`` needs weight-shaped preconditioners."""
    if isinstance(precond, Mapping) and not precond:
        precond = None  # no optimizer state yet (adam_precond before the first step): the fallback
    if isinstance(precond, Mapping):
        missing = [f for f in mods if f not in precond]
        if missing:
            raise ValueError(f"precond: no preconditioner for {len(missing)} layer(s), e.g. {missing[:3]}")
        lazy = isinstance(precond, AdamPreconditioners)  # its shapes are known without computing P
        for fqn in mods:
            shape = precond.shape(fqn) if lazy else getattr(precond[fqn], "shape", None)  # None: a callable
            if shape is not None and tuple(shape) != tuple(mods[fqn].matrix.shape):
                raise ValueError(f"precond[{fqn!r}] has shape {tuple(shape)}, the layer's [out, in] matrix "
                                 f"{tuple(mods[fqn].matrix.shape)}")
    elif precond is not None and not callable(precond):
        raise ValueError(f"precond must be None, a mapping fqn -> tensor/callable, or a callable; "
                         f"got {type(precond).__name__}")
    if forward_drift:
        if estimator != "mc_fisher":
            raise ValueError(f"forward_drift needs estimator='mc_fisher' (its probes price the drift), "
                             f"got {estimator!r}")
        if precond is not None and not isinstance(precond, AdamPreconditioners) and (
                not isinstance(precond, Mapping) or not all(isinstance(precond[f], torch.Tensor) for f in mods)):
            raise ValueError("forward_drift needs weight-shaped preconditioners (a mapping fqn -> tensor, or None "
                             "for the fallback); partitioned optimizer states (a callable) are not supported")
    return precond


def layer_precond(precond: Precond, fallback: str, fqn: str, gw: torch.Tensor, sources: set,
                  module: Optional[nn.Module] = None) -> Tuple[Optional[torch.Tensor], Optional[PrecondFn]]:
    """Layer ``fqn``'s preconditioner: ``(P, None)`` for a weight-shaped one (a given tensor, or the fallback
    computed from its weight gradient ``gw``; a tensor-parallel ``module``'s shard completes the fallback's
    sums over its group), ``(None, fn)`` for a partitioned state's callable. Adds where it came from to
    ``sources``."""
    pc = precond
    if pc is None:
        shard = getattr(module, "tp_shard", None)
        p, source = dv.fallback_preconditioner(gw, gw.shape, fallback,
                                               row_sum=module.tp_sum if shard == "row" else None,
                                               col_sum=module.tp_sum if shard == "column" else None)
        sources.add(source)
        return p.to(gw.device), None
    entry = pc if callable(pc) and not isinstance(pc, Mapping) else pc[fqn]
    if isinstance(entry, torch.Tensor):
        sources.add("tensor")
        return entry.to(gw.device, torch.float32), None
    sources.add("callable")
    return None, entry


def in_storage_order(precond: PrecondFn, layers: Mapping[str, Any]) -> PrecondFn:
    """A partitioned state's callable for layers whose weight is stored ``[in, out]`` (GPT-2's ``Conv1D``):
    ``precond(fqn, t)`` reads the Parameter's state element by element in its storage order, and the statistics
    hand it ``[out, in]`` tensors, so those are put in the Parameter's order first (``layer.to_storage``); every
    other layer's tensor goes through unchanged."""
    stored = {f: m for f, m in layers.items() if getattr(m, "transposed", False)}
    if not stored:
        return precond

    def fn(fqn: str, t: torch.Tensor) -> torch.Tensor:
        layer = stored.get(fqn)
        return precond(fqn, t if layer is None else layer.to_storage(t).contiguous())
    return fn


def with_experts(precond: PrecondFn, points: Mapping[str, ExpertPoint]) -> PrecondFn:
    """A partitioned state's callable for the MoE experts' pairs too.

    ``precond(name, t)`` is the callable of :func:`snip_ds.engine.adam_state.layer_preconditioner` built with
    the experts' 3-D Parameters among its weights, under their parameter names
    (:func:`snip_ds.experts.model.expert_parameters`). The returned callable answers a pair's name (in ``points``)
    by placing its ``[out, in]`` tensor at the expert's flat range ``[e·out·in, (e+1)·out·in)`` of an otherwise
    zero tensor shaped like the Parameter, in the Parameter's storage order, and asking ``precond`` about that
    Parameter: the zeros add nothing, so this rank's sum covers exactly the elements of the expert's slice
    whose optimizer state it owns (ZeRO 0-3 alike). It costs one Parameter-sized FP32 tensor per call. Any
    other name goes to ``precond`` unchanged.
    """
    def fn(fqn: str, t: torch.Tensor) -> torch.Tensor:
        point = points.get(fqn)
        if point is None:
            return precond(fqn, t)
        full = t.new_zeros(full_shape(point.parameter), dtype=torch.float32)
        full[point.expert] = point.to_storage(t.float())
        return precond(point.parameter_name, full)
    return fn
