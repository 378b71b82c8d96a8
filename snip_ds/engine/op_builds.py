"""DeepSpeed's JIT-compiled ops as the console shows them: one line before an op is built for the first time in
this environment (:func:`announce_unbuilt`, through :func:`snip_ds.engine.builds.announce`), and nothing when an op built
earlier is only loaded (:func:`quiet_shm_comm` drops the "DeepSpeed ... built successfully" that DeepSpeed prints
at every start of its shared-memory collectives, built or loaded)."""
from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from pathlib import Path
from typing import Iterator, Mapping

from snip_ds.engine import builds

_WHAT = {"ShareMemCommBuilder": "DeepSpeed's shared-memory collectives", "FusedAdamBuilder": "DeepSpeed's FusedAdam",
         "CPUAdamBuilder": "DeepSpeed's CPU Adam (ZeRO-Offload)"}
_SHM_LOADED = re.compile(r"^DeepSpeed \S*shm_comm\S* built successfully$")


def _needs_build(builder) -> bool:
    """Whether loading ``builder``'s op compiles it: not loaded in this process, not installed with DeepSpeed,
    and no library in its JIT folder under ``$TORCH_EXTENSIONS_DIR`` (set by :func:`snip_ds.runtime.jit_builds.prepare`)."""
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder.builder import OpBuilder

    name = builder.name
    if name in OpBuilder._loaded_ops or installed_ops.get(name, False):
        return False
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return not (root and (Path(root) / name / f"{name}.so").is_file())


def announce_unbuilt(builder_name: str) -> None:
    """One line (:func:`snip_ds.engine.builds.announce`) when DeepSpeed's ``builder_name`` op (``"FusedAdamBuilder"``, ...)
    is about to be compiled here; nothing when it is built already or not available on this accelerator."""
    try:
        from deepspeed.accelerator import get_accelerator

        import deepspeed.ops

        builder = get_accelerator().create_op_builder(builder_name)
        if (builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False)
                and _needs_build(builder)):
            builds.announce(builder.name, _WHAT.get(builder_name, f"DeepSpeed's {builder.name} op"))
    except Exception:  # only a console line: DeepSpeed's own load reports any real problem
        return


def announce_optimizer_build(config: Mapping) -> None:
    """Before ``deepspeed.initialize``: announces the CPU Adam build of a config that offloads its Adam optimizer
    (the fused Adam is announced where :mod:`snip_ds.engine.optimizer` builds it)."""
    opt = config.get("optimizer")
    zero = config.get("zero_optimization") or {}
    offload = zero.get("offload_optimizer") if isinstance(zero, Mapping) else None
    if (isinstance(opt, Mapping) and str(opt.get("type", "")).lower() in ("adam", "adamw")
            and isinstance(offload, Mapping) and str(offload.get("device", "none")).lower() in ("cpu", "nvme")):
        announce_unbuilt("CPUAdamBuilder")


@contextlib.contextmanager
def quiet_shm_comm() -> Iterator[None]:
    """Around ``deepspeed.init_distributed``: announces the shared-memory collectives' build on a CPU when it is
    due, and drops DeepSpeed's "DeepSpeed ... shm_comm ... built successfully" line (printed at every start, also
    when the op is only loaded); anything else printed meanwhile is passed on."""
    announce_unbuilt("ShareMemCommBuilder")
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        kept = [line for line in buffer.getvalue().splitlines(keepends=True) if not _SHM_LOADED.match(line.strip())]
        if kept:
            sys.stdout.write("".join(kept))
            sys.stdout.flush()
