"""ZeRO-3 leaf modules and SNIP's statistics passes.

DeepSpeed marks some modules as ZeRO-3 *leaf modules*: by default the MoE blocks of Mixtral, Qwen2-MoE and
Qwen3-MoE (``zero_optimization.leaf_module``), so that all of their experts' Parameters are gathered at once.
It reduces a leaf module's gradients from a full backward hook on the module, which fires for any backward
through it and hands every Parameter of the module (a zero gradient where it has none) to the reduction
buckets. A statistics collection back-propagates to its own leaf (the embeddings' output) only, never to the
Parameters; through a leaf module, that hook would still queue the experts' Parameters, and the next training
step's backward would queue them a second time (DeepSpeed's ``len(set(ds_id)) == len(params_in_bucket)``
assertion). :func:`leaf_backward_hooks_suspended` takes the hooks off the leaf modules for the collection and
puts them back, in their order, afterwards.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import nn


@contextmanager
def leaf_backward_hooks_suspended(model: nn.Module) -> Iterator[None]:
    """Inside, ZeRO-3 leaf modules of ``model`` have no backward hooks (forwards run inside set up none);
    restored on exit, also after an exception. A no-op for models without leaf modules."""
    from deepspeed.utils import z3_leaf_module

    saved = []
    for module in model.modules():
        if z3_leaf_module(module) and module._backward_hooks:
            saved.append((module, dict(module._backward_hooks)))
            module._backward_hooks.clear()
    try:
        yield
    finally:
        for module, hooks in saved:
            module._backward_hooks.update(hooks)
