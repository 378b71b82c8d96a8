"""Swapping a model's decoder linears for :class:`~snip_ds.linear.SnipLinear`.

Every ``nn.Linear`` of every decoder block (:mod:`snip_ds.decoder`: q, k, v, o, gate, up, down in a Llama; fused
projections such as Phi-3's ``qkv_proj`` as one layer) is swapped, except MoE routers and what ``snip.exclude``
names; ``lm_head``, embeddings, norms and attention's own matmuls stay as they are.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from snip_ds.quant_config import QuantConfig
from snip_ds.linear import SnipLinear
from snip_ds.decoder import decoder_linears
from snip_ds.types import LayerPrecision, block_index, layer_kind



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
    module order (:func:`snip_ds.decoder.decoder_linears`: every ``nn.Linear`` of a block but MoE routers and
    the names matching a glob of ``exclude``).

    Raises:
        ValueError: the model has no quantizable linear, or MoE experts (named), or an ``exclude`` pattern
            matches no layer.
    """
    return decoder_linears(model, exclude)


def _layer_seed(seed: int, fqn: str, rank: int) -> int:
    digest = hashlib.sha256(f"{seed}:{rank}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def swap_linears(model: nn.Module, precision: LayerPrecision = "fp8",
                 quant_config: Optional[QuantConfig] = None, *, seed: int = 0,
                 rank: int = 0, exclude: Sequence[str] = ()) -> Dict[str, LayerInfo]:
    """Replaces the linears of every decoder block (:func:`find_decoder_linears`) by :class:`SnipLinear`, in place.

    The Parameters are reused, so this works before ``deepspeed.initialize`` on ordinary and on
    ``zero.Init``-partitioned models. Each layer gets its own stochastic-rounding generator seeded from
    ``(seed, rank, fqn)``.

    Args:
        model: a Hugging Face causal LM whose decoder blocks are named ``...layers.<i>``.
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
        new = old if isinstance(old, SnipLinear) else SnipLinear.from_linear(old, precision, quant_config)
        new.precision, new.quant_config, new.fqn = precision, quant_config, fqn
        device = old.weight.device if old.weight.device.type != "meta" else torch.device("cpu")
        new.generator = torch.Generator(device=device).manual_seed(_layer_seed(seed, fqn, rank))
        setattr(parent, child, new)
        infos[fqn] = LayerInfo(fqn, block_index(fqn), layer_kind(fqn), old.in_features, old.out_features)
    return infos


def snip_layers(model: nn.Module) -> Dict[str, SnipLinear]:
    """The model's :class:`SnipLinear` layers by fully qualified name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, SnipLinear)}


def check_still_swapped(model: nn.Module, fqns, when: str) -> None:
    """Raises RuntimeError unless every layer in ``fqns`` is still a :class:`SnipLinear` of ``model``: something
    (``when``, e.g. ``deepspeed.initialize`` injecting its own layers) replaced it, and it would train
    unquantized under a plan that says otherwise. The message names the first such layer and what it became."""
    modules = dict(model.named_modules())
    for fqn in fqns:
        found = modules.get(fqn)
        if not isinstance(found, SnipLinear):
            what = "removed" if found is None else f"replaced by {type(found).__module__}.{type(found).__name__}"
            raise RuntimeError(f"layer {fqn}: {when} {what} snip_ds's quantized layer, which would train "
                               f"unquantized; snip_ds cannot run this configuration")
