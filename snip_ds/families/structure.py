"""Whether a model holds Mixture-of-Experts experts, decided from its structure alone (no class or attribute
names), for the survey's "MoE" column.

An experts module sits beside a router and is one of:

* **stacked**: a module (not a convolution) holding 3-D Parameters ``[E, out, in]`` with a leading size
  ``E >= 2`` (``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``; some families hold up to ``2E`` rows
  for identity experts in one of them);
* **flattened**: a module holding two or more 2-D Parameters of one shape ``[E * I, H]`` (DBRX);
* **listed**: an ``nn.ModuleList`` of ``E >= 2`` children of one class, each made of linear layers only
  (every Parameter belongs to an ``nn.Linear`` or a transposed linear such as GPT-2's ``Conv1D``).

A router is a 2-D Parameter near the experts (below their parent, or their grandparent where the parent only
wraps them; outside the experts) that gives one logit per expert, or up to twice as many where identity
("zero") experts are routed beside them, from a wider input: ``gate.weight [E, H]``, a top-k router's own
``weight``, the last layer of a router MLP. Decoder blocks are never "listed" experts (they hold norms), a
convolution's 3-D weight is not stacked experts, and per-head weights ``[heads, d, d]`` with no router beside
them (RecurrentGemma's RG-LRU, Zamba's Mamba) are not experts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

from torch import nn


@dataclass(frozen=True)
class ExpertsFound:
    """One experts module of a model."""

    path: str
    layout: str  # "stacked", "flattened" or "listed"
    experts: int


def _near(ancestor: nn.Module, depth: int = 2):
    """``ancestor`` and the modules at most ``depth`` child steps below it."""
    level = [ancestor]
    for _ in range(depth + 1):
        yield from level
        level = [c for m in level for c in m.children()]


def _routes(count: int, ancestors: List[nn.Module], experts: nn.Module, exact: bool = False) -> bool:
    """Whether a router for ``count`` experts sits near them: a 2-D Parameter (of the experts' parent or a
    module at most three steps below it; where the parent only wraps the experts, of the grandparent or a module
    at most two steps below that; outside the experts) that gives one logit per expert, or up to as many again
    where identity ("zero") experts are routed beside them (LongCat-Flash, ZAYA), from a wider input."""
    inside = {id(p) for p in experts.parameters()}
    for ancestor, depth in zip(ancestors, (3, 2)):
        for module in _near(ancestor, depth):
            for p in module.parameters(recurse=False):
                if id(p) in inside or p.dim() != 2:
                    continue
                small, large = sorted(int(d) for d in p.shape)
                if (small == count if exact else count <= small <= 2 * count) and large > 2 * small:
                    return True
    return False


def _linear_only(module: nn.Module) -> bool:
    """Every Parameter of ``module`` belongs to a linear layer (``nn.Linear``, or a 2-D ``weight`` with an
    optional 1-D ``bias`` as GPT-2's ``Conv1D`` holds them), and it has at least one."""
    found = False
    for sub in module.modules():
        own = dict(sub.named_parameters(recurse=False))
        if not own:
            continue
        linear = isinstance(sub, nn.Linear) or ("weight" in own and set(own) <= {"weight", "bias"}
                                                 and own["weight"].dim() == 2
                                                 and ("bias" not in own or own["bias"].dim() == 1))
        if not linear:
            return False
        found = True
    return found


_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def find_experts(model: nn.Module) -> List[ExpertsFound]:
    """Every experts module of ``model`` (module order)."""
    parents: Dict[int, nn.Module] = {}
    for _, module in model.named_modules():
        for child in module.children():
            parents.setdefault(id(child), module)
    found: List[ExpertsFound] = []
    for path, module in model.named_modules():
        parent = parents.get(id(module))
        if parent is None or isinstance(module, _CONVOLUTIONS):
            continue
        ancestors = [parent]
        if id(parent) in parents and {id(p) for p in parent.parameters()} <= {id(p) for p in module.parameters()}:
            ancestors.append(parents[id(parent)])  # the parent only wraps the experts (DBRX): look one level up
        own = list(module.parameters(recurse=False))
        stacked = [p for p in own if p.dim() == 3 and p.shape[0] >= 2]
        if stacked:  # [E, out, in] each (some families hold identity experts' rows too: up to 2E)
            count = min(int(p.shape[0]) for p in stacked)
            if all(p.shape[0] <= 2 * count for p in stacked) and _routes(count, ancestors, module):
                found.append(ExpertsFound(path, "stacked", count))
                continue
        shapes = {tuple(p.shape) for p in own}
        if len(own) >= 2 and len(shapes) == 1 and len(next(iter(shapes))) == 2:  # [E * I, H] each (DBRX)
            rows, width = next(iter(shapes))
            counts = [c for c in range(2, rows // 2 + 1) if rows % c == 0 and rows >= 2 * width
                      and _routes(c, ancestors, module, exact=True)]
            if counts:
                found.append(ExpertsFound(path, "flattened", max(counts)))
                continue
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            kinds = {type(c) for c in module}
            if len(kinds) == 1 and all(_linear_only(c) for c in module) and _routes(len(module), ancestors, module):
                found.append(ExpertsFound(path, "listed", len(module)))
    return found


__all__ = ["ExpertsFound", "find_experts"]
