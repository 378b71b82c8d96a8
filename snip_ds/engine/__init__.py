"""The DeepSpeed side of snip_ds: the only package that imports DeepSpeed (besides ``launch/``).

:func:`initialize` wraps ``deepspeed.initialize``: it swaps the model's decoder linears for
:class:`~snip_ds.linear.SnipLinear`, builds the DeepSpeed engine, and returns a :class:`SnipEngine`, the thin
driver of SNIP's state (:class:`snip_ds.engine.state.SnipState`: the plan, the planner, the streams) in a loop of
one's own: it switches plans at optimizer-step boundaries and saves the state with checkpoints.

Importing it first settles where DeepSpeed's JIT ops build (:func:`snip_ds.runtime.jit_builds.prepare`), and drops the
third-party messages a user cannot act on (:mod:`snip_ds.runtime.deprecations`: torch's deprecation warnings for the
collectives DeepSpeed calls, DeepSpeed's accelerator guess).

May import: report/, config/, planner/, stats/, backend/, experts/, layouts/, the numerics core in snip_ds/ and
runtime/; never run/, hf/, export/ or above. It also holds what both loops share: :mod:`.state` (SnipState),
:mod:`.schedule` (when to re-plan), :mod:`.nonfinite`, :mod:`.builds`.
"""
from snip_ds.runtime import jit_builds
from snip_ds.runtime.deprecations import quiet_third_party

jit_builds.prepare()  # before DeepSpeed can build an op
quiet_third_party()  # before DeepSpeed is imported: its accelerator guess, torch's warnings for its collectives

from snip_ds.engine.checkpoint_layout import CheckpointError  # noqa: E402
from snip_ds.engine.core import (NonFiniteError, SnipEngine, destroy_distributed, init_distributed,  # noqa: E402
                                 initialize)

__all__ = ["SnipEngine", "initialize", "init_distributed", "destroy_distributed", "CheckpointError", "NonFiniteError"]
