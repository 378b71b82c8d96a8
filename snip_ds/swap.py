"""Swapping a model's decoder linears for :class:`~snip_ds.linear.SnipLinear` and its MoE experts for
:class:`~snip_ds.experts.module.SnipExperts`.

Every linear GEMM of every decoder block (:mod:`snip_ds.decoder`: q, k, v, o, gate, up, down in a Llama; fused
projections such as Phi-3's ``qkv_proj`` as one layer; GPT-2's ``Conv1D`` with its weight stored transposed) is
swapped, except MoE routers and what ``snip.exclude`` names; ``lm_head``, embeddings, norms and attention's own matmuls stay as they are. :func:`swap_model` also
replaces every MoE experts module, each (expert, projection) pair becoming a layer of its own
(``<experts path>.<expert>.<projection>``), which ``snip.exclude`` cannot leave out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from snip_ds.quant_config import QuantConfig
from snip_ds.linear import SnipLinear
from snip_ds.decoder import decoder_linears
from snip_ds.experts.model import expert_points, find_experts_modules, swap_experts
from snip_ds.experts.module import SnipExperts
from snip_ds.experts.points import ExpertLayerInfo, ExpertPoint
from snip_ds.layouts.linears import TRANSPOSED, gemm_shape, linear_form
from snip_ds.types import LayerPrecision, block_index, layer_kind, layer_seed

if TYPE_CHECKING:
    from snip_ds.plan import Plan



@dataclass(frozen=True)
class LayerInfo:
    """What the planner needs to know about one swapped layer."""

    fqn: str
    block: int
    kind: str  # the path inside the block: self_attn.q_proj, mlp.dense_h_to_4h
    in_features: int
    out_features: int

    def flops(self, tokens_per_step: int) -> float:
        """FLOPs per step of fprop + dgrad + wgrad: ``6 * T * k * n``."""
        return 6.0 * tokens_per_step * self.in_features * self.out_features


def find_decoder_linears(model: nn.Module, exclude: Sequence[str] = ()) -> List[str]:
    """Fully qualified names of the quantizable linears of the decoder blocks, in block order and each block's
    module order (:func:`snip_ds.decoder.decoder_linears`: every linear GEMM of a block but MoE routers and
    the names matching a glob of ``exclude``).

    Raises:
        ValueError: the model has no quantizable linear, or MoE experts (named), or an ``exclude`` pattern
            matches no layer.
    """
    return decoder_linears(model, exclude)


def swap_linears(model: nn.Module, precision: LayerPrecision = "fp8",
                 quant_config: Optional[QuantConfig] = None, *, seed: int = 0,
                 rank: int = 0, exclude: Sequence[str] = ()) -> Dict[str, LayerInfo]:
    """Replaces the linears of every decoder block (:func:`find_decoder_linears`) by :class:`SnipLinear`, in place.

    The Parameters are reused, so this works before ``deepspeed.initialize`` on ordinary and on
    ``zero.Init``-partitioned models. Each layer gets its own stochastic-rounding generator seeded from
    ``(seed, rank, fqn)``.

    Args:
        model: a Hugging Face causal LM (decoder blocks found by :mod:`snip_ds.layouts.blocks`).
        precision: initial precision of every swapped layer.
        quant_config: recipes shared by all layers.
        seed: seed of the per-layer stochastic-rounding generators.
        rank: data-parallel rank, mixed into the seed so ranks draw independent rounding noise.
        exclude: globs of fully qualified names left unswapped (``snip.exclude``).

    Returns:
        ``{fqn: LayerInfo}`` in model order; ``LayerInfo.flops(T)`` gives ``6*T*k*n``.
    """
    quant_config = quant_config or QuantConfig()
    infos: Dict[str, LayerInfo] = {}
    for fqn in find_decoder_linears(model, exclude):
        parent_name, child = fqn.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        new = old if isinstance(old, SnipLinear) else SnipLinear.from_linear(
            old, precision, quant_config, transposed=linear_form(old) == TRANSPOSED)
        new.precision, new.quant_config, new.fqn = precision, quant_config, fqn
        device = old.weight.device if old.weight.device.type != "meta" else torch.device("cpu")
        new.generator = torch.Generator(device=device).manual_seed(layer_seed(seed, fqn, rank))
        setattr(parent, child, new)
        infos[fqn] = LayerInfo(fqn, block_index(fqn), layer_kind(fqn), new.in_features, new.out_features)
    return infos


AnyLayerInfo = Union[LayerInfo, "ExpertLayerInfo"]


def swap_model(model: nn.Module, precision: LayerPrecision = "fp8",
               quant_config: Optional[QuantConfig] = None, *, seed: int = 0,
               rank: int = 0, exclude: Sequence[str] = ()) -> Dict[str, AnyLayerInfo]:
    """:func:`swap_linears`, then every MoE experts module replaced by a :class:`~snip_ds.experts.module.SnipExperts`
    (:func:`snip_ds.experts.model.swap_experts`, the same precision, recipes and seeding).

    Returns:
        ``{layer name: LayerInfo or ExpertLayerInfo}`` of every planned layer in model order (a block's MoE
        pairs where its experts module sits); both have ``flops(tokens_per_step)``, an expert pair's for the
        even share of the tokens its router sends it (``top_k / experts``).

    Raises:
        ValueError: as :func:`find_decoder_linears` (an experts module of an unknown layout is named there,
            before anything is replaced).
    """
    quant_config = quant_config or QuantConfig()
    swap_linears(model, precision, quant_config, seed=seed, rank=rank, exclude=exclude)
    swap_experts(model, precision, quant_config, seed=seed, rank=rank)
    return layer_infos(model, exclude)


def layer_infos(model: nn.Module, exclude: Sequence[str] = ()) -> Dict[str, AnyLayerInfo]:
    """What :func:`swap_model` would return for ``model``, without changing it (to check a plan against a model
    before anything is swapped).

    Raises:
        ValueError: as :func:`swap_model`.
    """
    linears = set(find_decoder_linears(model, exclude))
    experts = find_experts_modules(model)
    infos: Dict[str, AnyLayerInfo] = {}
    for name, module in model.named_modules():
        if name in linears:
            infos[name] = LayerInfo(name, block_index(name), layer_kind(name),
                                    *gemm_shape(module, linear_form(module)))
        elif name in experts:
            wrapped = module if isinstance(module, SnipExperts) else SnipExperts.from_family(module, name, seed=None)
            infos.update(wrapped.layers())
    return infos


def model_layers(model: nn.Module) -> Dict[str, Union[SnipLinear, ExpertPoint]]:
    """Every planned layer of ``model`` by name, in model order: its :class:`SnipLinear` modules and its
    experts' (expert, projection) :class:`~snip_ds.experts.points.ExpertPoint` (each with ``precision``,
    ``generator``, ``weight``)."""
    points = expert_points(model)
    out: Dict[str, Union[SnipLinear, ExpertPoint]] = {}
    for name, module in model.named_modules():
        if isinstance(module, SnipLinear):
            out[name] = module
        elif isinstance(module, SnipExperts):
            out.update((n, points[n]) for n in module.points())
    return out


def snip_layers(model: nn.Module) -> Dict[str, SnipLinear]:
    """The model's :class:`SnipLinear` layers by fully qualified name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, SnipLinear)}


def check_still_swapped(model: nn.Module, fqns, when: str) -> None:
    """Raises RuntimeError unless every layer in ``fqns`` is still a :class:`SnipLinear` of ``model``: something
    (``when``, e.g. ``deepspeed.initialize`` injecting its own layers) replaced it, and it would train
    unquantized under a plan that says otherwise. The message names the first such layer and what it became."""
    modules = dict(model.named_modules())
    for fqn in fqns:
        if isinstance(fqns, dict) and isinstance(fqns[fqn], ExpertLayerInfo):  # its experts module must be ours
            path = fqn.rsplit(".", 2)[0]
            owner = modules.get(path)
            if isinstance(owner, SnipExperts) and owner.pair_of(fqn) is not None:
                continue
            what = "removed" if owner is None else f"replaced by {type(owner).__module__}.{type(owner).__name__}"
            raise RuntimeError(f"experts module {path}: {when} {what} snip_ds's quantized experts, which would "
                               f"train unquantized; snip_ds cannot run this configuration")
        found = modules.get(fqn)
        if not isinstance(found, SnipLinear):
            what = "removed" if found is None else f"replaced by {type(found).__module__}.{type(found).__name__}"
            raise RuntimeError(f"layer {fqn}: {when} {what} snip_ds's quantized layer, which would train "
                               f"unquantized; snip_ds cannot run this configuration")


def apply_plan(model: nn.Module, plan: "Plan") -> None:
    """Sets every planned layer's precision from ``plan`` (per-layer or per-GEMM): each SnipLinear, and each MoE
    (expert, projection) pair of a :class:`~snip_ds.experts.module.SnipExperts`.

    Raises:
        ValueError: The plan and the model's planned layers are not the same set of names.
    """
    layers = model_layers(model)
    plan.check_layers(layers, source=f"plan ({plan.method})")
    for fqn, layer in layers.items():
        value = plan.assignment[fqn]
        layer.precision = value if isinstance(value, str) else dict(value)
