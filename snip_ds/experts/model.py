"""A model's MoE experts as a whole: swapping them, their planned layers, routed tokens and precisions."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, Optional

from torch import nn

from snip_ds.experts.module import SnipExperts
from snip_ds.experts.points import ExpertLayerInfo, ExpertPoint
from snip_ds.layouts.experts import experts_candidates, recognize
from snip_ds.quant_config import QuantConfig
from snip_ds.types import GemmPrecision, LayerPrecision


def find_experts_modules(model: nn.Module) -> Dict[str, nn.Module]:
    """``{path: module}`` of the model's experts modules that :func:`swap_experts` would replace, in model
    order (already replaced ones included), each one's layout proved (:mod:`snip_ds.layouts.experts`).

    Raises:
        snip_ds.layouts.experts.ExpertsLayoutError: an experts module whose layout is not proved, naming its
            path, its class and what did not match.
    """
    found = {}
    for fqn, module in experts_candidates(model):
        if not isinstance(module, SnipExperts):
            recognize(module, fqn, SnipExperts.unquantized)
        found[fqn] = module
    return found


def swap_experts(model: nn.Module, precision: LayerPrecision = "fp8",
                 quant_config: Optional[QuantConfig] = None, *, seed: int = 0,
                 rank: int = 0) -> Dict[str, nn.Module]:
    """Replaces every experts module of ``model`` by a :class:`SnipExperts`, in place.

    Every module is checked first, so a model with one unknown experts module is left unchanged. Parameters
    are reused (this works before ``deepspeed.initialize``, on ordinary and ``zero.Init``-partitioned models);
    each (expert, projection) pair gets its own generator seeded from ``(seed, rank, layer name)``. A module
    that is already a :class:`SnipExperts` is given ``precision``, ``quant_config`` and new generators.

    Returns:
        ``{path: the module that was there before}`` in model order.

    Raises:
        ValueError: an experts module whose layout is unknown (nothing is replaced).
    """
    quant_config = quant_config or QuantConfig()
    replaced = {}
    for fqn, old in find_experts_modules(model).items():
        if isinstance(old, SnipExperts):
            new = old
            new.set_precision(precision)
            new.quant_config, new.fqn = quant_config, fqn
            new._points = None  # named after the old path
            new.seed_generators(seed, rank)
        else:
            new = SnipExperts.from_family(old, fqn, precision, quant_config, seed=seed, rank=rank)
        if not fqn:
            raise ValueError(f"model: the model itself is an experts module ({type(old).__name__}); wrap it "
                             f"with SnipExperts.from_family instead")
        parent_name, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
        replaced[fqn] = old
    return replaced


def experts_modules(model: nn.Module) -> Dict[str, SnipExperts]:
    """The model's :class:`SnipExperts` modules by path."""
    return {name: m for name, m in model.named_modules() if isinstance(m, SnipExperts)}


# ------------------------------------------------------------------------------------------------------
# all of a model's experts at once
# ------------------------------------------------------------------------------------------------------

def expert_layers(model: nn.Module) -> Dict[str, ExpertLayerInfo]:
    """``{layer name: ExpertLayerInfo}`` of every (expert, projection) pair of the model, in model order."""
    return {name: info for m in experts_modules(model).values() for name, info in m.layers().items()}


def expert_parameters(model: nn.Module) -> Dict[str, nn.Parameter]:
    """``{parameter name: 3-D Parameter}`` of every projection of the model's experts (the names
    ``model.named_parameters()`` gives them): what an optimizer-state mapping is asked about."""
    return {p.parameter_name: p.parameter for m in experts_modules(model).values()
            for p in (m.points()[m.layer_name(0, j)] for j in range(len(m.layout.projections)))}


def expert_points(model: nn.Module) -> Dict[str, ExpertPoint]:
    """``{layer name: ExpertPoint}`` of every (expert, projection) pair of the model, in model order: what
    :func:`snip_ds.stats.collect_statistics` measures besides the :class:`~snip_ds.linear.SnipLinear` layers."""
    return {name: p for m in experts_modules(model).values() for name, p in m.points().items()}


@contextmanager
def routed_tokens_kept(model: nn.Module) -> Iterator[None]:
    """Forwards inside leave every experts module's routed token count as it was (a statistics collection's
    passes are not training steps)."""
    saved = {m: m._routed_tokens for m in experts_modules(model).values()}
    try:
        yield
    finally:
        for m, counts in saved.items():
            m._routed_tokens = counts


def take_routed_tokens(model: nn.Module) -> Dict[str, int]:
    """``{layer name: routed tokens}`` of every (expert, projection) pair since the last call (both of an
    expert's projections see its tokens), resetting every module's count."""
    out = {}
    for module in experts_modules(model).values():
        counts = module.take_routed_tokens().tolist()
        out.update({module.layer_name(e, j): counts[e] for e in range(module.num_experts)
                    for j in range(len(module.layout.projections))})
    return out


def set_expert_precisions(model: nn.Module, assignment: Dict[str, LayerPrecision]) -> Dict[str, LayerPrecision]:
    """Sets the precision of every (expert, projection) pair named in ``assignment`` (``{layer name:
    precision}``, e.g. a plan's, which may also name other layers); returns the entries that name no pair of
    ``model``'s experts, for the caller to apply elsewhere. Nothing is set if an entry that names a pair is
    invalid (ValueError naming it)."""
    modules = experts_modules(model)
    per_module: Dict[str, Dict[str, LayerPrecision]] = {}
    rest = {}
    for name, precision in assignment.items():
        path = name.rsplit(".", 2)[0]
        if path in modules and modules[path].pair_of(name) is not None:
            per_module.setdefault(path, {})[name] = precision
        else:
            rest[name] = precision
    checked = {path: {name: GemmPrecision.of(value, field=name) for name, value in entries.items()}
               for path, entries in per_module.items()}
    for path, entries in checked.items():
        modules[path].set_precisions(entries)
    return rest
