"""Adam's second moments per layer, read from DeepSpeed's real optimizer state (the preconditioner of BWD, docs/method.md).

The backward divergence needs ``‖ΔG_W ⊙ P‖²`` with ``P = 1/(sqrt(v̂) + eps)``, ``v̂ = exp_avg_sq/(1-β₂ᵗ)``.
Where the state lives depends on the ZeRO stage:

* stage 0 (or a plain torch optimizer): one full ``exp_avg_sq`` per parameter;
* stages 1 and 2: one flat FP32 partition per parameter group and rank; parameter ``p`` occupies
  ``[offset, offset + numel)`` of its group's flat buffer (found from the storage pointers DeepSpeed set up,
  so alignment padding is accounted for), and this rank owns ``[r*size, (r+1)*size)`` of it;
* stage 3: each parameter is cut into equal partitions (``p.ds_tensor``, ``partition_numel`` elements:
  rank ``r`` owns elements ``[r*pn, (r+1)*pn)`` of the flattened parameter), packed into per-sub-group flat
  buffers whose FP32 copies carry the optimizer state.

:func:`layer_preconditioner` returns one callable ``precond(fqn, t) -> Σ_owned (t ⊙ P)²`` over the elements
this rank owns: the collection sums it over ranks, so every element is counted exactly once and nothing
weight-sized is communicated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch


@dataclass(frozen=True)
class _Slice:
    """This rank's owned elements of one weight: ``flat_weight[start:stop]`` <-> ``state[s_start:s_start+n]``."""

    start: int
    stop: int
    state_key: int  # index into the list of (exp_avg_sq, step) sources
    state_start: int


def torch_optimizer(ds_optimizer):
    """The torch optimizer holding Adam's state: DeepSpeed's ZeRO and bf16 optimizers wrap it as ``.optimizer``;
    a torch optimizer is its own."""
    return getattr(ds_optimizer, "optimizer", ds_optimizer)


def adam_hyperparameters(ds_optimizer) -> Tuple[float, float]:
    """Adam's ``(β₂, eps)`` of the optimizer's first parameter group (what the preconditioner divides by).

    Raises:
        ValueError: the optimizer is not Adam or AdamW.
    """
    group = torch_optimizer(ds_optimizer).param_groups[0]
    if "betas" not in group or "eps" not in group:
        raise ValueError("optimizer: expected Adam or AdamW (param groups need 'betas' and 'eps') for the "
                         "backward divergence")
    return float(group["betas"][1]), float(group["eps"])


def _rank_world(group=None) -> Tuple[int, int]:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _slices_stage3(opt, weights: Mapping[str, torch.nn.Parameter]) -> Tuple[Dict[str, _Slice], List[torch.Tensor]]:
    by_id = {id(p): fqn for fqn, p in weights.items()}
    slices, sources = {}, []
    rank, _ = _rank_world(getattr(opt, "dp_process_group", None))
    for i, params in enumerate(opt.fp16_groups):
        flat16 = opt.fp16_partitioned_groups_flat[i]
        sources.append(opt.fp32_partitioned_groups_flat[i])
        for p in params:
            fqn = by_id.get(id(p))
            if fqn is None:
                continue
            pn = p.ds_tensor.ds_numel
            off = (p.ds_tensor.data_ptr() - flat16.data_ptr()) // flat16.element_size()
            start = min(rank * pn, p.ds_numel)
            stop = min(start + pn, p.ds_numel)
            slices[fqn] = _Slice(start, stop, i, off)
    return slices, sources


def _slices_stage12(opt, weights: Mapping[str, torch.nn.Parameter]) -> Tuple[Dict[str, _Slice], List[torch.Tensor]]:
    by_id = {id(p): fqn for fqn, p in weights.items()}
    slices, sources = {}, []
    rank, _ = _rank_world(getattr(opt, "dp_process_group", None))
    for i, params in enumerate(opt.bit16_groups):
        flat = opt.bit16_groups_flat[i]
        part = opt.parallel_partitioned_bit16_groups[i][rank]
        part_lo = (part.data_ptr() - flat.data_ptr()) // flat.element_size()
        part_hi = part_lo + part.numel()
        sources.append(opt.single_partition_of_fp32_groups[i])
        for p in params:
            fqn = by_id.get(id(p))
            if fqn is None:
                continue
            off = (p.data.data_ptr() - flat.data_ptr()) // flat.element_size()
            lo, hi = max(off, part_lo), min(off + p.numel(), part_hi)
            if lo >= hi:
                slices[fqn] = _Slice(0, 0, i, 0)
            else:
                slices[fqn] = _Slice(lo - off, hi - off, i, lo - part_lo)
    return slices, sources


def zero_state(ds_optimizer, params: Mapping[str, torch.nn.Parameter], what: str = "layer weight(s)"):
    """Where each named Parameter's Adam ``exp_avg_sq`` lives in a ZeRO optimizer's partitioned state.

    Returns:
        None at stage 0 (the optimizer holds each Parameter's full state); else ``(slices, states, source)``:
        ``{name: _Slice}`` (the part of the Parameter's flat range this rank owns, and where in its group's
        state), the groups' ``exp_avg_sq`` tensors (None before the optimizer has state) and ``"zero1"`` to
        ``"zero3"``.

    Raises:
        ValueError: a Parameter is in none of the optimizer's groups (``what`` names them in the message).
    """
    if hasattr(ds_optimizer, "fp32_partitioned_groups_flat"):
        slices, sources = _slices_stage3(ds_optimizer, params)
        source = "zero3"
    elif hasattr(ds_optimizer, "single_partition_of_fp32_groups"):
        slices, sources = _slices_stage12(ds_optimizer, params)
        source = f"zero{getattr(ds_optimizer, 'partition_gradients', False) and 2 or 1}"
    else:
        return None
    inner = torch_optimizer(ds_optimizer)
    states: Optional[list] = []
    for flat in sources:
        state = inner.state.get(flat, {})
        if "exp_avg_sq" not in state:
            states = None
            break
        states.append(state["exp_avg_sq"])
    missing = sorted(set(params) - set(slices))
    if states is not None and missing:
        raise ValueError(f"optimizer: no partition found for {len(missing)} {what}, e.g. {missing[:3]}")
    return slices, states, source


def layer_preconditioner(ds_optimizer, weights: Mapping[str, torch.nn.Parameter], step: int,
                         ) -> Tuple[Optional[Callable[[str, torch.Tensor], torch.Tensor]], str]:
    """The per-layer ``Σ_owned (t ⊙ P)²`` callable for DeepSpeed's optimizer, or None before it has state.

    Args:
        ds_optimizer: ``engine.optimizer`` (a ZeRO optimizer, or the torch/DeepSpeed Adam itself at stage 0).
        weights: ``{fqn: weight Parameter}`` of the layers.
        step: optimizer steps taken so far (for the bias correction ``1-β₂ᵗ``).

    Returns:
        ``(precond, source)``; ``source`` names where the state came from (logged with the statistics).
    """
    beta2, eps = adam_hyperparameters(ds_optimizer)
    inner = torch_optimizer(ds_optimizer)
    if step < 1:
        return None, "none (no optimizer step yet)"
    partitioned_state = zero_state(ds_optimizer, weights)
    if partitioned_state is None:  # stage 0: the optimizer holds full per-parameter state
        states = {}
        for fqn, p in weights.items():
            state = inner.state.get(p, {})
            if "exp_avg_sq" not in state:
                return None, "none (optimizer has no exp_avg_sq yet)"
            states[fqn] = state["exp_avg_sq"]
        correction = 1.0 - beta2 ** step

        def full(fqn: str, t: torch.Tensor) -> torch.Tensor:
            p = 1.0 / ((states[fqn].float() / correction).sqrt() + eps)
            return (t * p.to(t.device)).pow(2).sum()
        return full, "adam"
    slices, states, source = partitioned_state
    if states is None:
        return None, "none (optimizer has no exp_avg_sq yet)"
    correction = 1.0 - beta2 ** step

    def partitioned(fqn: str, t: torch.Tensor) -> torch.Tensor:
        s = slices[fqn]
        n = s.stop - s.start
        if n <= 0:
            return t.new_zeros(())
        v = states[s.state_key].narrow(0, s.state_start, n).float().to(t.device)
        p = 1.0 / ((v / correction).sqrt() + eps)
        return (t.reshape(-1)[s.start:s.stop].float() * p).pow(2).sum()
    return partitioned, source
