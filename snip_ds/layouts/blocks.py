"""The decoder blocks of a model, found by structure.

A causal LM repeats one block (attention and MLP, or a mixer) ``N`` times and keeps the copies in a container:
``model.layers`` (Llama), ``transformer.h`` (GPT-2), ``gpt_neox.layers``, ``model.decoder.layers`` (OPT), a
language model's ``model.language_model.layers`` beside a vision tower's ``...encoder.layers``. The blocks are
the numbered entries of such containers that hold a linear GEMM; a layer's name is therefore
``<container>.<i>.<path in the block>`` and :func:`snip_ds.types.block_index` reads ``i`` from it whatever the
container is called. Where containers nest (a stage of blocks), the level is the one the model declares as its
repeated block (transformers' ``_no_split_modules``, the modules it never splits across devices), else the
outermost one. A model may have several block lists (text and vision towers): each list's entries are blocks;
layers that never run in training are dropped later, from what a step really calls.
"""
from __future__ import annotations

from typing import Callable, List, Tuple

from torch import nn


def _numbered(name: str) -> bool:
    return bool(name) and name.rsplit(".", 1)[-1].isdigit()


def _inside(name: str, prefixes) -> bool:
    return any(name.startswith(p + ".") for p in prefixes)


def decoder_blocks(model: nn.Module, holds_gemm: Callable[[nn.Module], bool]) -> List[Tuple[str, nn.Module]]:
    """``(fqn, module)`` of the model's decoder blocks in model order: numbered container entries (not leaf
    modules) for which ``holds_gemm`` is true, at the declared level (module docstring) or else the outermost."""
    declared = set(getattr(model, "_no_split_modules", None) or ())
    entries = [(n, m) for n, m in model.named_modules()
               if _numbered(n) and next(m.children(), None) is not None and holds_gemm(m)]
    chosen = [(n, m) for n, m in entries if type(m).__name__ in declared]
    chosen = [(n, m) for n, m in chosen if not _inside(n, [c for c, _ in chosen])]
    taken = [c for c, _ in chosen]
    for name, module in entries:  # containers the declaration does not cover: their outermost entries
        if name in taken or _inside(name, taken) or any(c.startswith(name + ".") for c, _ in chosen):
            continue
        chosen.append((name, module))
        taken.append(name)
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(chosen, key=lambda item: order[item[0]])
