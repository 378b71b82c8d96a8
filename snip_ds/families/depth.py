"""The depth rule of :mod:`snip_ds.families.shrink`: a config's layer stack cut to the first layer of each
distinct kind (:func:`cut_depth`), and periodic layer patterns to a period of at most 2 (:func:`shorten_periods`).

Every original layer gets a signature (its value in each per-layer list such as ``layer_types``,
``mlp_layer_types`` or ``no_rope_layers``, its membership of each layer-index list such as ``mlp_only_layers``,
its ``per_layer_config`` entry, and the side of each "first k layers" / "last k layers" count it falls on, e.g.
``first_k_dense_replace``, ``num_kv_shared_layers``); the first layer of each distinct signature is kept, in
order, topped up to :data:`MIN_DEPTH`, and every per-layer list, index list, ``per_layer_config`` and count is
cut to the kept layers. Repeating patterns shorter than the depth (``block_types``) raise the depth to their
length (up to :data:`MAX_PATTERN`).
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional

from snip_ds.families.fields import TOKEN_FIELD, hashable, is_int, is_int_list

MIN_DEPTH = 2
MAX_PATTERN = 8  # a repeating layer pattern longer than this is not kept whole
MAX_KINDS = 6  # a per-layer list with more distinct values is a schedule (sizes, factors), not layer kinds

DEPTH_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "num_decoder_layers")
# counts of layers at the start / end of the stack that differ from the rest
FROM_START = ("first_k_dense_replace", "num_dense_layers", "max_window_layers", "moe_layer_start_index",
              "n_input_layers")
FROM_END = ("num_kv_shared_layers", "n_output_layers")
# the layers between the first and last counts: {count: (start count, end count)}
BETWEEN = {"n_recurrent_layers": ("n_input_layers", "n_output_layers")}
PERIODS = ("decoder_sparse_step", "attn_layer_period", "expert_layer_period", "interleave_moe_layer_step",
           "moe_layer_interval", "sliding_window_pattern", "_sliding_window_pattern", "global_attn_every_n_layers",
           "no_rope_layer_interval", "n_layers_per_attn_res_block", "layer_group_size", "moe_layer_freq",
           "prefix_dense_sliding_window_pattern", "rescale_every")
OFFSETS = {"attn_layer_offset": "attn_layer_period", "expert_layer_offset": "expert_layer_period"}


def is_depth_field(key: str) -> bool:
    """Whether integer field ``key`` is a layer count, a period or an offset (this module's to change)."""
    return key in DEPTH_KEYS or key in FROM_START or key in FROM_END or key in BETWEEN or key in PERIODS \
        or key in OFFSETS


def cut_depth(d: dict) -> Optional[List[int]]:
    """Cuts the layer stack of the config dictionary ``d`` in place (module docstring); returns the original
    indices of the layers kept, None where nothing was cut. Other layer counts of ``d`` (an encoder's) go to
    :data:`MIN_DEPTH`."""
    depth_key = next((k for k in DEPTH_KEYS if is_int(d.get(k))), None)
    for k in DEPTH_KEYS:  # other layer counts of the same config (an encoder's)
        if k != depth_key and is_int(d.get(k)) and d[k] > MIN_DEPTH:
            d[k] = MIN_DEPTH
    for k in ("encoder_layers", "num_encoder_layers", "depth", "num_blocks", "conf_num_hidden_layers",
              "num_layers_per_stack"):
        if k != depth_key and is_int(d.get(k)) and d[k] > MIN_DEPTH:
            d[k] = MIN_DEPTH
    if depth_key is None:
        return None
    n = d[depth_key]
    per_layer = [k for k, v in d.items() if _per_layer(k, v, n)]
    index_lists = [k for k, v in d.items() if k not in per_layer and _index_list(k, v, n)]
    per_layer_config = _per_layer_config_of(d)
    starts = {k: d[k] for k in FROM_START if is_int(d.get(k)) and 0 < d[k] < n}
    ends = {k: d[k] for k in FROM_END if is_int(d.get(k)) and 0 < d[k] < n}

    kinds = [k for k in per_layer if len({hashable(v) for v in d[k]}) <= MAX_KINDS]  # not a schedule

    def signature(i: int) -> tuple:
        return (tuple(hashable(d[k][i]) for k in kinds)
                + tuple(i in d[k] for k in index_lists)
                + (tuple(sorted(per_layer_config.get(i, {}))),)  # which fields a layer overrides
                + tuple(i < c for c in starts.values()) + tuple(i >= n - c for c in ends.values()))

    kept: List[int] = []
    seen = set()
    for i in range(n):
        s = signature(i)
        if s not in seen:
            seen.add(s)
            kept.append(i)
    patterns = [len(v) for k, v in d.items() if isinstance(v, list) and 1 < len(v) < n and k not in index_lists
                and all(isinstance(x, str) for x in v)]
    want = max([MIN_DEPTH] + [p for p in patterns if p <= MAX_PATTERN])
    for i in range(n):
        if len(kept) >= want:
            break
        if i not in kept:
            kept.append(i)
    kept = sorted(kept)
    if len(kept) >= n:
        return None
    d[depth_key] = len(kept)
    for k in per_layer:
        value = d[k]
        picked = [value[i] for i in kept]
        d[k] = "".join(picked) if isinstance(value, str) else type(value)(picked)
    for k in index_lists:
        d[k] = [j for j, i in enumerate(kept) if i in d[k]]
    for k, c in starts.items():
        d[k] = sum(1 for i in kept if i < c)
    for k, c in ends.items():
        d[k] = sum(1 for i in kept if i >= n - c)
    for k in FROM_START + FROM_END:  # "all layers" stays all layers
        if is_int(d.get(k)) and d[k] == n:
            d[k] = len(kept)
    for k, (start, end) in BETWEEN.items():
        if is_int(d.get(k)) and start in starts and end in ends:
            d[k] = len(kept) - d[start] - d[end]
    if per_layer_config:
        d["per_layer_config"] = {str(j): dict(per_layer_config[i]) for j, i in enumerate(kept)
                                 if i in per_layer_config}
    return kept


def shorten_periods(d: dict) -> None:
    """Periodic layer patterns (``decoder_sparse_step``, ``attn_layer_period`` ...) to a period of at most 2, their
    offsets inside it."""
    for key in PERIODS:
        if is_int(d.get(key)) and d[key] > 2:
            d[key] = 2
    for key, period in OFFSETS.items():
        if is_int(d.get(key)) and is_int(d.get(period)):
            d[key] = min(d[key], d[period] - 1)


def _per_layer(key: str, value, n: int) -> bool:
    """A list (or pattern string) with one entry per layer."""
    if isinstance(value, str):
        return len(value) == n and "pattern" in key
    if not isinstance(value, (list, tuple)) or len(value) != n or TOKEN_FIELD.search(key):
        return False
    return not _index_list(key, value, n) or len(set(value)) < len(value)


def _index_list(key: str, value, n: int) -> bool:
    """A strictly increasing list of layer indices (``mlp_only_layers``, ``cross_attention_layers``)."""
    if not isinstance(value, (list, tuple)) or not is_int_list(value) or TOKEN_FIELD.search(key):
        return False
    if not re.search(r"layer|idx|index|ids", key):
        return False
    return all(0 <= x < n for x in value) and all(a < b for a, b in zip(value, value[1:]))


def _per_layer_config_of(d: dict) -> Dict[int, dict]:
    plc = d.get("per_layer_config")
    if not isinstance(plc, dict):
        return {}
    return {int(k): dict(v) for k, v in plc.items() if isinstance(v, dict)}
