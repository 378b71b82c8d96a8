"""Builds the JIT-compiled ops once, so later runs (and tests) do not each pay for the compile.

Usage: ``python launch/warm_ops.py``. snip_ds's own fused CPU quantization kernels (``snip_ds_cpu_quant``,
used by the torch backend on CPU, the default there) are built first. On a CPU machine DeepSpeed compiles its
shared-memory collectives (``deepspeed_shm_comm``), ``fused_adam`` (used when a JSON names an Adam optimizer)
and ``cpu_adam`` (used by ZeRO-Offload); on a GPU machine the accelerator's own builders are used. Compiled ops
are cached under ``$TORCH_EXTENSIONS_DIR``, which snip_ds sets, when it is unset, to a folder of this environment's
own under ``~/.cache/torch_extensions`` (``snip_ds.runtime.jit_builds``, printed here), so run this once in each virtual
environment. A ``lock`` left there by a build killed more than 30 minutes ago is removed, with a warning.
"""
import logging
import sys
import time

from deepspeed.accelerator import get_accelerator

from snip_ds.runtime import jit_builds
from snip_ds.backend import cpu as cpu_kernels


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    print(f"warm_ops: ops build under {jit_builds.prepare()}", flush=True)
    if cpu_kernels.load():
        print(f"warm_ops: {cpu_kernels.EXTENSION_NAME} ready in {cpu_kernels.load_seconds():.1f} s "
              f"({cpu_kernels.build_directory()})", flush=True)
    else:
        print(f"warm_ops: {cpu_kernels.EXTENSION_NAME} did not build ({cpu_kernels.unavailable_reason()}); the "
              f"torch backend quantizes with plain torch ops on CPU", flush=True)
    accel = get_accelerator()
    names = ["FusedAdamBuilder", "CPUAdamBuilder"]
    if accel.device_name() == "cpu":
        names.insert(0, "ShareMemCommBuilder")
    for name in names:
        start = time.time()
        builder = accel.create_op_builder(name)
        if builder is None or not builder.is_compatible():
            print(f"warm_ops: {name} is not available on {accel.device_name()}; skipped", flush=True)
            continue
        builder.load(verbose=False)
        print(f"warm_ops: {name} ready in {time.time() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
