"""One console line before a one-time JIT build, and snip_ds's CPU quantizer built before training starts.

The first run in a new environment compiles DeepSpeed's ops (``deepspeed_shm_comm``, ``fused_adam``,
``cpu_adam``) and snip_ds's CPU quantization kernels; without a word that is a minute or more of silence.
:func:`announce` prints one line when such a build starts (what, how long it usually takes, and that later runs
load it); :mod:`snip_ds.engine.op_builds` calls it for DeepSpeed's ops, :func:`load_cpu_quantizer` for ours.

:func:`load_cpu_quantizer` loads (building if needed) the CPU kernels before the first step, so that their build
is never counted in the first statistics collection's time (SNIP's own time): the kernels otherwise build on
their first use, inside it. No DeepSpeed import here.
"""
from __future__ import annotations

import os
from pathlib import Path

from snip_ds.runtime import distributed as sdist
from snip_ds.runtime.console import say

# How long each build usually takes (2 CPU cores; nvcc on a GPU machine builds fused_adam in 1-3 minutes).
TYPICAL = {
    "snip_ds_cpu_quant": "10-20 s",
    "deepspeed_shm_comm": "20-30 s",
    "fused_adam": "30-60 s on a CPU, 1-3 min with nvcc",
    "cpu_adam": "30-60 s",
}


def announce(name: str, what: str) -> None:
    """Says (on the local rank 0 of each machine, where builds happen first) that ``what`` (op ``name``) is being
    compiled for this environment now, how long that usually takes, and that later runs only load it."""
    if int(os.environ.get("LOCAL_RANK", sdist.rank()) or 0) != 0:
        return
    say(f"snip_ds: building {what} for this environment (once; usually {TYPICAL.get(name, 'under a minute')}; "
        f"later runs load it, `python launch/warm_ops.py` builds every op ahead)")


def cpu_quantizer_built() -> bool:
    """Whether snip_ds's CPU kernels are compiled already in this environment's build folder."""
    from snip_ds.backend import cpu as cpu_kernels

    return (Path(cpu_kernels.build_directory()) / f"{cpu_kernels.EXTENSION_NAME}.so").is_file()


def load_cpu_quantizer(device) -> None:
    """On a CPU (``device``, a ``torch.device``): loads snip_ds's CPU quantization kernels now, saying first if they
    must be compiled. Where they cannot build, their loader warns once and plain torch ops quantize instead."""
    if getattr(device, "type", str(device)) != "cpu":
        return
    from snip_ds.backend import cpu as cpu_kernels

    if cpu_kernels.load_seconds() is None and cpu_kernels.unavailable_reason() is None and not cpu_quantizer_built():
        announce(cpu_kernels.EXTENSION_NAME, "snip_ds's CPU quantization kernels")
    cpu_kernels.load()
