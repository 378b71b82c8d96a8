"""The DeepSpeed side of snip_ds: the only package that imports DeepSpeed (besides ``launch/``).

:func:`initialize` wraps ``deepspeed.initialize``: it swaps the model's decoder linears for
:class:`~snip_ds.linear.SnipLinear`, builds the DeepSpeed engine, and returns a :class:`SnipEngine` that owns
the current precision plan, switches it at optimizer-step boundaries and saves it with checkpoints.
"""
from snip_ds.engine.checkpoint import CheckpointError
from snip_ds.engine.core import NonFiniteError, SnipEngine, init_distributed, initialize

__all__ = ["SnipEngine", "initialize", "init_distributed", "CheckpointError", "NonFiniteError"]
