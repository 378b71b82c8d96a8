"""Per-family config overrides for the families survey, where the general rules of
:mod:`snip_ds.families.shrink` do not give a model that builds.

Each entry of :data:`OVERRIDES` names the model type, the fields it sets (a dotted path reaches into a
sub-config: ``"text_config.vocab_size"``) and one line saying why. transformers' own model tests keep such
per-model tiny configs too. This table belongs to the survey only: snip_ds recognises models by their
structure, never by a list of names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict


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


def apply_override(model_type: str, d: dict) -> None:
    """Sets ``model_type``'s override values in the shrunk config dictionary ``d`` (none: unchanged)."""
    entry = OVERRIDES.get(model_type)
    if entry is None:
        return

    for path, value in entry.values.items():
        *parents, key = path.split(".")
        target = d
        for p in parents:
            target = target[p]
        target[key] = value
