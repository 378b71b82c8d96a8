"""BWD's preconditioner for MoE experts from DeepSpeed's (possibly partitioned) Adam state.

An (expert, projection) pair's weight is expert ``e`` of a 3-D Parameter ``[E, a, b]``: the contiguous range
``[e·a·b, (e+1)·a·b)`` of the flattened Parameter, in the Parameter's storage order (``[E, out, in]``, or
``[E, in, out]`` for the families that store it transposed). :func:`expert_preconditioner` finds, with the
partition mapping of :mod:`snip_ds.engine.adam_state`, which elements of that range this rank's optimizer state
holds (ZeRO 1-2: the rank's part of the flat bit16 group; ZeRO 3: the rank's part of each Parameter; stage 0:
all of it) and sums ``(t ⊙ P)²`` over them only, without forming anything Parameter-sized.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional, Tuple

import torch

from snip_ds.engine.adam_state import adam_hyperparameters, torch_optimizer, zero_state
from snip_ds.experts.points import ExpertPoint

PrecondFn = Callable[[str, torch.Tensor], torch.Tensor]


def expert_preconditioner(ds_optimizer, points: Mapping[str, ExpertPoint], step: int,
                          dense: Optional[PrecondFn] = None) -> Tuple[Optional[PrecondFn], str]:
    """The ``Σ_owned (t ⊙ P)²`` callable of the pairs in ``points`` (``{layer name: ExpertPoint}``, e.g.
    :func:`snip_ds.experts.model.expert_points`), as :func:`snip_ds.engine.adam_state.layer_preconditioner` gives it
    for linear layers; names not in ``points`` go to ``dense`` (that function's callable).

    Args:
        ds_optimizer: ``engine.optimizer`` (a ZeRO optimizer, or the torch/DeepSpeed Adam itself at stage 0).
        points: the pairs; ``t`` is a pair's ``[out, in]`` FP32 tensor.
        step: optimizer steps taken so far (for the bias correction ``1-β₂ᵗ``).
        dense: the callable of the other layers, or None (then only pairs may be asked about).

    Returns:
        ``(precond, source)`` as ``layer_preconditioner`` returns them; precond None before the optimizer has
        state.
    """
    beta2, eps = adam_hyperparameters(ds_optimizer)
    inner = torch_optimizer(ds_optimizer)
    if step < 1:
        return None, "none (no optimizer step yet)"
    params = {p.parameter_name: p.parameter for p in points.values()}
    correction = 1.0 - beta2 ** step
    partitioned_state = zero_state(ds_optimizer, params, what="experts Parameter(s)")
    if partitioned_state is None:  # stage 0: the optimizer holds each Parameter's full state
        states = {}
        for name, p in params.items():
            state = inner.state.get(p, {})
            if "exp_avg_sq" not in state:
                return None, "none (optimizer has no exp_avg_sq yet)"
            states[name] = state["exp_avg_sq"]

        def full(fqn: str, t: torch.Tensor) -> torch.Tensor:
            point = points.get(fqn)
            if point is None:
                return dense(fqn, t)
            v = point.slice(states[point.parameter_name]).float().to(t.device)
            return (t.float() * (1.0 / ((v / correction).sqrt() + eps))).pow(2).sum()
        return full, "adam"
    slices, states, source = partitioned_state
    if states is None:
        return None, "none (optimizer has no exp_avg_sq yet)"

    def partitioned(fqn: str, t: torch.Tensor) -> torch.Tensor:
        point = points.get(fqn)
        if point is None:
            return dense(fqn, t)
        s = slices[point.parameter_name]
        size = point.in_features * point.out_features
        first = point.expert * size  # the expert's range [first, first + size) of the flat Parameter
        lo, hi = max(s.start, first), min(s.stop, first + size)
        if lo >= hi:  # this rank owns none of it
            return t.new_zeros((), dtype=torch.float32)
        v = states[s.state_key].narrow(0, s.state_start + lo - s.start, hi - lo).float().to(t.device)
        owned = point.to_storage(t.float()).reshape(-1)[lo - first:hi - first]
        return (owned * (1.0 / ((v / correction).sqrt() + eps))).pow(2).sum()
    return partitioned, source
