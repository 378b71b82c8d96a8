"""Builds the JIT-compiled ops once, so later runs (and tests) do not each pay for the compile.

Usage: ``python launch/warm_ops.py``. snip_ds's own fused CPU quantization kernels (``snip_ds_cpu_quant``,
used by the torch backend on CPU, the default there) are built first. On a CPU machine DeepSpeed compiles its
shared-memory collectives (``deepspeed_shm_comm``), ``fused_adam`` (used when a JSON names an Adam optimizer)
and ``cpu_adam`` (used by ZeRO-Offload); on a GPU machine the accelerator's own builders are used. Compiled ops
are cached under ``~/.cache/torch_extensions`` (or ``$TORCH_EXTENSIONS_DIR``); snip_ds's kernels in a folder of
their own per environment (``snip_ds.backend.cpu.build_directory()``, printed here), so run this once in each
virtual environment.
"""
import sys
import time

from deepspeed.accelerator import get_accelerator

from snip_ds.backend import cpu as cpu_kernels


def main() -> int:
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
