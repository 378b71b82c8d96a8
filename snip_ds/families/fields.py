"""What a field of a model family's config dictionary holds, as :mod:`snip_ds.families.shrink` and
:mod:`snip_ds.families.depth` tell them apart: integers (not booleans), lists of them, token ids by their names, and
values made hashable to compare layers by.
"""
from __future__ import annotations

import re
from typing import List

# fields naming special token ids (a number, or a list of them)
TOKEN_FIELD = re.compile(r"(_token_id|_token_index|token_id$|^(unk|mask|pad|bos|eos)_index$|^decoder_start_token_id$)")


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_int_list(v) -> bool:
    return isinstance(v, (list, tuple)) and all(is_int(x) for x in v)


def ints_of(v) -> List[int]:
    return [v] if is_int(v) else [x for x in v if is_int(x)]


def hashable(v):
    """``v`` with its lists and dictionaries turned into (sorted) tuples."""
    if isinstance(v, (list, tuple)):
        return tuple(hashable(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, hashable(x)) for k, x in v.items()))
    return v
