"""Per-family config overrides for the families survey, where the general rules of
:mod:`snip_ds.families.shrink` do not give a model that builds, and the variants the survey adds.

Each entry of :data:`OVERRIDES` names the model type, the fields it sets (a dotted path reaches into a
sub-config: ``"text_config.vocab_size"``) and one line saying why. transformers' own model tests keep such
per-model tiny configs too. :data:`VARIANTS` adds rows ``<model type>:<variant>`` for what a family's defaults
switch off (its Mixture-of-Experts layers), built from the family's config with the variant's fields set on
top. These tables belong to the survey only: snip_ds recognises models by their structure, never by a list
of names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List


@dataclass(frozen=True)
class Override:
    """What one family needs beyond the general rules, and why.

    Attributes:
        reason: one line: why the general rules do not do.
        values: fields set on the shrunk config dictionary (dotted paths reach into sub-configs).
        init: keyword arguments of the config class for the defaults themselves (where its no-argument
            defaults do not validate).
        config_path: the sub-config the causal LM class is built from (where transformers maps the
            composite config to a class that takes one of its parts).
        after_build: ``{method: args}`` called on the built model (what a user must call before training).
    """

    reason: str
    values: Dict[str, Any] = field(default_factory=dict)
    init: Dict[str, Any] = field(default_factory=dict)
    config_path: str = ""
    after_build: Dict[str, tuple] = field(default_factory=dict)


_QSA = {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
        "indexer_compress_ratio": 4}

OVERRIDES: Dict[str, Override] = {
    "blt": Override("the local encoder and decoder name the global transformer's width (hidden_size_global), "
                    "which the global config's own hidden size must match",
                    {"encoder_config.hidden_size_global": 64, "decoder_config.hidden_size_global": 64}),
    "cohere_compass_text": Override("the defaults leave the per-layer-type RoPE map empty (NoPE), and the rotary "
                                    "embedding indexes it by layer type",
                                    {"rope_parameters": {"full_attention": None}}),
    "dbrx": Override("transformers' DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig no "
                     "longer defines, and clamps with clip_qkv, which torch refuses as None (checkpoints set 8)",
                     {"attn_config.rope_theta": 10000.0, "attn_config.clip_qkv": 8.0}),
    "dory": Override("its config lists every layer as an attention block and an mlp block (counts doubled), which "
                     "the general per-layer cut would split: one layer per section instead",
                     {"num_hidden_layers": 6, "n_input_layers": 2, "n_recurrent_layers": 2, "n_output_layers": 2,
                      "layer_types": ["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention",
                                      "mlp"]}),
    "gemma4_assistant": Override("the assistant's defaults do not validate: its text config must have no per-layer "
                                 "inputs and share the KV cache in every layer",
                                 init={"text_config": {"hidden_size_per_layer_input": 0,
                                                       "vocab_size_per_layer_input": 0}}),
    "lfm2_moe": Override("the defaults leave layer_types unset, and every decoder layer indexes it "
                         "(conv or attention)",
                         {"num_hidden_layers": 4, "num_dense_layers": 2,
                          "layer_types": ["conv", "full_attention", "conv", "full_attention"]}),
    "musicgen": Override("MusicgenForCausalLM takes the decoder sub-config, which transformers' causal-LM "
                         "mapping pairs with the composite config (its inputs are audio codebooks: ids "
                         "(batch x codebooks, seq), labels (batch, seq, codebooks))", config_path="decoder"),
    "musicgen_melody": Override("MusicgenMelodyForCausalLM takes the decoder sub-config, which transformers' "
                                "causal-LM mapping pairs with the composite config (its inputs are audio "
                                "codebooks: ids (batch x codebooks, seq), labels (batch, seq, codebooks))",
                                config_path="decoder"),
    "qwen4_exp": Override("the defaults leave the sparse-attention indexer sizes unset, and its layers divide by "
                          "them", {f"text_config.{k}": v for k, v in _QSA.items()}),
    "qwen4_exp_text": Override("the defaults leave the sparse-attention indexer sizes unset, and its layers divide "
                               "by them", dict(_QSA)),
    "reformer": Override("the causal LM needs is_decoder, and its axial position shape must multiply to the "
                         "training sequence length (32) with dims summing to the hidden size",
                         {"is_decoder": True, "axial_pos_shape": [4, 8], "axial_pos_embds_dim": [16, 48]}),
    "xmod": Override("X-MOD routes every token through a language adapter and refuses to guess the language",
                     after_build={"set_default_language": ("en_XX",)}),
    "zamba": Override("the shared attention block is tied across hybrid layers, and transformers' tie check "
                      "needs two or more of them",
                      {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]}),
}


VARIANTS: Dict[str, Override] = {
    "doge:moe": Override("Doge's mixture of experts (is_moe), off in its defaults", {"is_moe": True}),
    "gemma4_text:moe": Override("Gemma-4's MoE block beside its MLP (enable_moe_block, the 26B-A4B layout), off in "
                                "its defaults", {"enable_moe_block": True}),
}


def base_type(name: str) -> str:
    """The model type of a survey name (``"gemma4_text:moe"`` -> ``"gemma4_text"``)."""
    return name.partition(":")[0]


def entries(name: str) -> List[Override]:
    """The overrides of a survey name: its model type's, then its variant's."""
    found = [OVERRIDES[base_type(name)]] if base_type(name) in OVERRIDES else []
    return found + ([VARIANTS[name]] if name in VARIANTS else [])


def config_init(name: str) -> Dict[str, Any]:
    """Keyword arguments of the config class for the defaults (see :attr:`Override.init`)."""
    return {k: v for entry in entries(name) for k, v in entry.init.items()}


def config_path(name: str) -> str:
    """The sub-config the causal LM is built from (see :attr:`Override.config_path`); "" for the whole."""
    return next((e.config_path for e in entries(name) if e.config_path), "")


def after_build(name: str) -> Dict[str, tuple]:
    """``{method: args}`` to call on the built model (see :attr:`Override.after_build`)."""
    return {k: v for entry in entries(name) for k, v in entry.after_build.items()}


def reasons(name: str) -> str:
    """Why the survey name needs more than the general rules (empty if it does not)."""
    return "; ".join(e.reason for e in entries(name))


def apply_override(name: str, d: dict) -> None:
    """Sets the override (and variant) values of ``name`` in the shrunk config dictionary ``d``."""
    for entry in entries(name):
        for path, value in entry.values.items():
            *parents, key = path.split(".")
            target = d
            for p in parents:
                target = target[p]
            target[key] = value


__all__ = ["OVERRIDES", "Override", "VARIANTS", "after_build", "apply_override", "base_type", "config_init",
           "config_path", "entries", "reasons"]
