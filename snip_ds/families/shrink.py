"""A model family's default config, shrunk to a model that trains a step on a CPU in well under a second.

:func:`tiny_config` takes ``CONFIG_MAPPING[model_type]()`` (the family's own defaults: its layer kinds, MoE,
attention variants), shrinks the plain dictionary of it (``to_dict()``, sub-configs such as ``text_config``
included, recursively) by general rules, applies the family's entry of :data:`snip_ds.families.overrides.
OVERRIDES` if it has one, and builds the config class again from the result, so that the class derives what
it derives from the smaller values. The rules, by field:

* sizes: the hidden size to :data:`HIDDEN`, any other size-like field that equals the old hidden size with it;
  intermediate sizes to :data:`INTERMEDIATE` (:data:`EXPERT_INTERMEDIATE` for MoE and shared-expert ones);
* attention: heads to :data:`HEADS`, key-value heads to 1 where there was one, to half the heads where there
  were fewer than the heads (GQA), else to the heads; every head-dimension-like field (``head_dim``, MLA's
  ``qk_rope_head_dim``/``qk_nope_head_dim``/``v_head_dim``/``qk_head_dim``, ``rotary_dim``, ``kv_channels``,
  the latent ranks ...) scaled by one factor, the one that takes the config's head dimension to
  :data:`HEAD_DIM`, so that sums and equalities among them hold; state-space heads kept at
  ``hidden * expand / head_dim`` where they were;
* vocabulary to :data:`VOCAB`, positions to :data:`POSITIONS`, sliding windows and chunks to :data:`WINDOW`;
* experts to :data:`EXPERTS` (also where the defaults have a single one) with top-:data:`TOP_K` routing at most,
  one shared expert, one expert group;
* special token ids at or above the new vocabulary mapped to distinct ids at its top (the same old id to
  the same new id everywhere in the config), so that :func:`TinyConfig.token_range` can draw the inputs
  below all of them;
* depth (:mod:`snip_ds.families.depth`): the first layer of each distinct kind is kept (its values in the
  per-layer lists, index lists and "first / last k layers" counts), topped up to :data:`MIN_DEPTH`, and every
  per-layer field cut to the kept layers, so every distinct layer kind stays; periodic layer patterns get a
  period of at most 2.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from snip_ds.families.depth import MIN_DEPTH, cut_depth, is_depth_field, shorten_periods
from snip_ds.families.fields import TOKEN_FIELD, ints_of, is_int, is_int_list

HIDDEN = 64
HEADS = 4
HEAD_DIM = 16
INTERMEDIATE = 128
EXPERT_INTERMEDIATE = 32
VOCAB = 256
POSITIONS = 512
WINDOW = 8
EXPERTS = 4
TOP_K = 2
STATE = 16  # state-space model state size

# dictionaries of a config that are data, not sub-configs
_NOT_SUBCONFIGS = {"id2label", "label2id", "rope_parameters", "rope_scaling", "per_layer_config",
                   "quantization_config", "task_specific_params", "auto_map"}

_HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "emb_dim", "model_dim", "dim",
                "embedding_dim", "hidden_dim")
_HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads", "encoder_attention_heads",
              "decoder_attention_heads", "index_n_heads", "swa_num_attention_heads", "num_encoder_attention_heads",
              "num_decoder_attention_heads", "conf_num_attention_heads", "linear_num_heads")
_KV_HEAD_KEYS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "kv_n_heads", "multi_query_group_num",
                 "num_query_groups", "swa_num_key_value_heads")

_RE = lambda *alts: re.compile("|".join(f"(?:{a})" for a in alts))  # noqa: E731
_HEAD_DIM_RE = _RE(r"head_dim$", r"head_size$", r"^d_head$", r"^dim_head$", r"^kv_channels$", r"^d_kv$",
                   r"^rotary_dim$", r"^rotary_emb_dim$", r"lora_rank$", r"^d_rel$", r"^attention_head_dim$",
                   r"headdim$", r"^mamba_d_head$", r"^qk_head_dim$")
_INTERMEDIATE_RE = _RE(r"intermediate_size", r"ffn_dim$", r"^n_inner$", r"^d_ff$", r"^dff$", r"^dim_ff$",
                       r"^d_inner$", r"^mlp_dim$", r"feed_forward_size$", r"ffn_hidden_size$")
_EXPERT_RE = re.compile(r"moe|expert|shared")
_VOCAB_RE = re.compile(r"vocab_size$|^vocab_size|_vocab$|ngram_vocab_size_base$")
_POSITION_RE = _RE(r"^max_position_embeddings$", r"^n_positions$", r"^n_ctx$", r"^max_seq_len$", r"^context_length$",
                   r"^max_target_positions$", r"^max_source_positions$", r"^model_max_length$",
                   r"^max_sequence_length$", r"^original_max_position_embeddings$")
_WINDOW_RE = _RE(r"^sliding_window$", r"^sliding_window_size$", r"^attention_window_size$", r"^window_size$",
                 r"^attention_chunk_size$", r"^local_attention_window_len$", r"^chunk_size$", r"^mamba_chunk_size$",
                 r"^local_attention$", r"^rel_extent$", r"^index_topk$", r"attn_chunk_length$",
                 r"^max_inference_chunksize$", r"^keep_window_size$")
_EXPERTS_RE = _RE(r"^num_experts$", r"^num_local_experts$", r"^n_routed_experts$", r"^moe_num_experts$",
                  r"^num_experts_total$", r"^zero_expert_num$")
_TOP_K_RE = _RE(r"^num_experts_per_tok$", r"^num_experts_per_token$", r"^moe_top_k$", r"^moe_topk$",
                r"^top_k_experts$", r"^moe_k$", r"^experts_per_token$")
_SHARED_RE = _RE(r"^n_shared_experts$", r"^num_shared_experts$", r"^moe_num_shared_experts$")
_GROUP_RE = _RE(r"^n_group$", r"^num_expert_group$", r"^topk_group$")
_STATE_RE = _RE(r"^mamba_d_state$", r"^state_size$", r"^ssm_state_size$", r"^d_state$", r"^mamba_d_ssm$")
_MAMBA_HEADS_RE = _RE(r"^mamba_n_heads$", r"^mamba_num_heads$", r"^n_mamba_heads$", r"^num_heads$")
_SIZE_WORD_RE = re.compile(r"size|dim|width|embd|embed|hidden|channels")


@dataclass
class TinyConfig:
    """A shrunk config and what its inputs must avoid.

    Attributes:
        config: the config object, built by its own class from the shrunk values.
        special_ids: every token id the config names (after mapping), which random inputs leave out.
        vocab_size: the smallest vocabulary of the config tree (inputs are drawn below it).
        kept_layers: ``{config path: original layer indices kept}`` where a depth was cut.
    """

    config: Any
    special_ids: Set[int] = field(default_factory=set)
    vocab_size: int = VOCAB
    kept_layers: Dict[str, List[int]] = field(default_factory=dict)

    def token_range(self) -> List[int]:
        """The token ids random inputs may use: below the vocabulary, no special id."""
        return [i for i in range(self.vocab_size) if i not in self.special_ids]


class _Shrinker:
    """One pass over a config tree (dictionaries), recording token ids and kept layers as it goes."""

    def __init__(self, hiddens: Set[int] = frozenset()) -> None:
        self.hiddens = set(hiddens)  # every config's hidden size in the tree: widths one part names of another
        self.vocabs: List[int] = []
        self.token_fields: List[Tuple[dict, str]] = []
        self.kept: Dict[str, List[int]] = {}

    # ---------------------------------------------------------------------------------------- one config
    def shrink(self, d: dict, obj: Any, path: str = "") -> None:
        from transformers import PretrainedConfig

        for key, value in list(d.items()):  # sub-configs first, each by the same rules
            sub = vars(obj).get(key) if obj is not None else None  # (getattr refuses per-layer attributes)
            if isinstance(value, dict) and key not in _NOT_SUBCONFIGS and (
                    isinstance(sub, PretrainedConfig) or "model_type" in value):
                self.shrink(value, sub if isinstance(sub, PretrainedConfig) else None, f"{path}{key}.")
        ints = {k: v for k, v in d.items() if is_int(v)}
        hidden0 = next((ints[k] for k in _HIDDEN_KEYS if k in ints), None)
        heads0 = next((ints[k] for k in _HEAD_KEYS if k in ints), None)
        head_dim0 = ints.get("head_dim") or (hidden0 // heads0 if hidden0 and heads0 and hidden0 % heads0 == 0
                                             else None)
        if head_dim0 is None:  # heads that do not divide the width: the smallest head dimension named
            head_dim0 = min((v for k, v in ints.items() if k.endswith("head_dim") and v > 0), default=None)
        scale = HEAD_DIM / head_dim0 if head_dim0 else None
        kept = cut_depth(d)
        if kept is not None:
            self.kept[path or "."] = kept
        new: Dict[str, Any] = {}
        for key, value in ints.items():
            got = self._rule(key, value, hidden0, heads0, scale, ints)
            if got is not None:
                new[key] = got
        d.update(new)
        self._state_space_heads(d, ints, hidden0)
        self._fill_unset(d, heads0)
        shorten_periods(d)
        for key, value in list(d.items()):
            if isinstance(value, list) and value and all(is_int(v) for v in value) and \
                    _INTERMEDIATE_RE.search(key) and key not in new:
                d[key] = [_intermediate(key) for _ in value]  # per-layer intermediate sizes (Gemma-3n)
        self._per_layer_config(d, ints, hidden0, heads0, scale)
        for key, value in d.items():
            if TOKEN_FIELD.search(key) and (is_int(value) or is_int_list(value)):
                self.token_fields.append((d, key))
        if is_int(d.get("vocab_size")):
            self.vocabs.append(d["vocab_size"])

    def _rule(self, key: str, v: int, hidden0, heads0, scale, ints) -> Optional[int]:
        """The new value of the integer field ``key`` (None: left as it is)."""
        if is_depth_field(key):
            return None  # snip_ds.families.depth's
        if TOKEN_FIELD.search(key):
            return None  # after the vocabulary is known
        if key in _HIDDEN_KEYS:
            return HIDDEN if v > HIDDEN else None
        if key in _HEAD_KEYS:
            return HEADS if v > HEADS else None
        if key in _KV_HEAD_KEYS:
            if heads0 is None or v <= 1:
                return None
            return HEADS // 2 if v < heads0 else HEADS
        if key == "linear_num_key_heads":
            return 2
        if key == "linear_num_value_heads":
            ratio = max(1, v // max(1, ints.get("linear_num_key_heads", v)))
            return 2 * ratio
        if _MAMBA_HEADS_RE.search(key):
            return HEADS if v > HEADS else None  # _state_space_heads keeps heads * head_dim = expand * hidden
        if _HEAD_DIM_RE.search(key):
            if scale is None or v <= 0:
                return None
            return max(4, 2 * round(v * scale / 2))
        if _INTERMEDIATE_RE.search(key):
            return _intermediate(key) if v > 0 else None
        if _VOCAB_RE.search(key):
            return VOCAB if v > VOCAB else None
        if _POSITION_RE.search(key):
            return POSITIONS if v > POSITIONS else None
        if _WINDOW_RE.search(key):
            return WINDOW if v > WINDOW else None
        if _EXPERTS_RE.search(key):  # a single routed expert (HunYuan-MoE's defaults) routes nothing: four
            return EXPERTS if v > EXPERTS or (v == 1 and key != "zero_expert_num") else None
        if _TOP_K_RE.search(key):
            return TOP_K if v > TOP_K else None
        if _SHARED_RE.search(key):
            return 1 if v > 1 else None
        if _GROUP_RE.search(key):
            return 1 if v > 1 else None
        if _STATE_RE.search(key):
            return STATE if v > STATE else None
        if key in ("time_step_rank", "mamba_dt_rank"):
            return 8 if v > 8 else None
        if key.endswith("_rank") or key.endswith("rank"):
            return 8 if v > 8 else None
        if (v == hidden0 or v in self.hiddens) and _SIZE_WORD_RE.search(key):
            return HIDDEN
        if hidden0 and v > hidden0 and v % hidden0 == 0 and _SIZE_WORD_RE.search(key):
            return HIDDEN * (v // hidden0)
        return None

    def _state_space_heads(self, d: dict, ints: dict, hidden0) -> None:
        """State-space heads: ``heads * head_dim == expand * hidden`` where it held (Mamba-2 and its hybrids)."""
        expand = next((ints[k] for k in ("mamba_expand", "expand") if k in ints), None)
        if expand is None or not hidden0:
            return
        for heads_key, dim_key in (("mamba_n_heads", "mamba_d_head"), ("mamba_num_heads", "mamba_head_dim"),
                                   ("num_heads", "head_dim"), ("n_mamba_heads", "mamba_headdim")):
            if heads_key in ints and dim_key in ints and ints[heads_key] * ints[dim_key] == expand * hidden0:
                d[heads_key] = max(1, expand * HIDDEN // d[dim_key])
            elif heads_key in ints and dim_key in ints and dim_key == "mamba_headdim":
                # heads given, head dim derived: keep expand * hidden divisible
                d[heads_key] = min(ints[heads_key], 4)
                d[dim_key] = expand * HIDDEN // d[heads_key]

    def _fill_unset(self, d: dict, heads0) -> None:
        """Fields a family's defaults leave None that its model code divides or indexes by (a checkpoint's
        config sets them): head dims and key-value heads of an attention with heads, expert counts, top-k,
        expert groups and expert sizes of a config with experts."""
        if heads0 is not None:
            for key in ("head_dim",) + _KV_HEAD_KEYS:
                if key in d and d[key] is None:
                    d[key] = HEAD_DIM if key == "head_dim" else HEADS
        if any(_EXPERTS_RE.search(k) or _TOP_K_RE.search(k) for k in d):
            for key in list(d):
                if d[key] is None:
                    if _EXPERTS_RE.search(key):
                        d[key] = EXPERTS
                    elif _SHARED_RE.search(key):
                        d[key] = 1
                    elif _TOP_K_RE.search(key):
                        d[key] = TOP_K
                    elif _GROUP_RE.search(key):
                        d[key] = 1
                    elif _INTERMEDIATE_RE.search(key) and _EXPERT_RE.search(key):
                        d[key] = EXPERT_INTERMEDIATE

    def _per_layer_config(self, d: dict, ints0: dict, hidden0, heads0, scale) -> None:
        """Per-layer overrides shrink in proportion to the global value they override."""
        plc = d.get("per_layer_config")
        if not isinstance(plc, dict) or not plc:
            return
        for entry in plc.values():
            for key, value in list(entry.items()):
                if not is_int(value):
                    continue
                old, now = ints0.get(key), d.get(key)
                if is_int(old) and is_int(now) and old > 0:
                    got = max(1, round(value * now / old))
                    if _HEAD_DIM_RE.search(key) and got % 2:
                        got += 1
                    entry[key] = got
                else:
                    got = self._rule(key, value, hidden0, heads0, scale, ints0)
                    if got is not None:
                        entry[key] = got

    # ---------------------------------------------------------------------------------------- token ids
    def map_token_ids(self) -> Tuple[Set[int], int]:
        vocab = min(self.vocabs) if self.vocabs else VOCAB
        ids = sorted({i for d, k in self.token_fields for i in ints_of(d[k]) if i >= 0})
        high = [i for i in ids if i >= vocab]
        mapping = {old: vocab - 1 - j for j, old in enumerate(sorted(high))}
        taken = {i for i in ids if i < vocab}
        for old in sorted(high):  # distinct from the ids already below the vocabulary
            while mapping[old] in taken:
                mapping[old] -= 1
            taken.add(mapping[old])
        for d, k in self.token_fields:
            v = d[k]
            d[k] = [mapping.get(i, i) for i in v] if isinstance(v, list) else mapping.get(v, v)
        return taken, vocab


def _intermediate(key: str) -> int:
    return EXPERT_INTERMEDIATE if _EXPERT_RE.search(key) else INTERMEDIATE


def _hidden_sizes(d: dict) -> Set[int]:
    """The hidden sizes of a config dictionary and of every dictionary inside it."""
    found = {d[k] for k in _HIDDEN_KEYS[:1] if is_int(d.get(k)) and d[k] > HIDDEN}
    for key, value in d.items():
        if isinstance(value, dict) and key not in _NOT_SUBCONFIGS:
            found |= _hidden_sizes(value)
    return found


def tiny_config(model_type: str) -> TinyConfig:
    """The tiny config of ``model_type`` (a key of transformers' ``CONFIG_MAPPING``, or one of
    :data:`snip_ds.families.overrides.VARIANTS`).

    Raises:
        KeyError: ``model_type`` is not a config transformers knows.
        Exception: whatever the config class raises on its defaults or on the shrunk values (the caller
            records it as the family's reason for not being buildable).
    """
    from transformers import CONFIG_MAPPING

    from snip_ds.families.overrides import apply_override, base_type, config_init

    config_class = CONFIG_MAPPING[base_type(model_type)]
    base = config_class(**config_init(model_type))
    d = base.to_dict()
    shrinker = _Shrinker(_hidden_sizes(d))
    shrinker.shrink(d, base)
    special, vocab = shrinker.map_token_ids()
    apply_override(model_type, d)
    config = config_class(**d)
    return TinyConfig(config, special, vocab, shrinker.kept)


__all__ = ["TinyConfig", "tiny_config", "HIDDEN", "HEADS", "HEAD_DIM", "VOCAB", "EXPERTS", "TOP_K", "MIN_DEPTH"]
