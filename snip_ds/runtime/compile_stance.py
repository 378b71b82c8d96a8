"""SNIP's own passes run eagerly inside a ``torch.compile``'d model.

A user may compile the model (``torch.compile(model)``, DeepSpeed's ``engine.compile()``, the Trainer's
``torch_compile``); training steps then run the compiled graphs. SNIP's statistics collection and its measuring
forwards call the same model with every layer at another precision, observers on the layers' backward and
hooks on their inputs: compiled, each would be a graph of its own (compiled on first use, again after every
re-plan, counted against dynamo's recompilation limit) and would trace callbacks dynamo cannot follow.
:func:`eager` runs them as plain eager code (``torch.compiler.set_stance("force_eager")``, torch >= 2.6),
which computes exactly what the uncompiled model computes.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch


def eager() -> ContextManager[None]:
    """A context in which every ``torch.compile``'d function runs its eager code (no compile, no recompile)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()
