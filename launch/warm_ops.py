"""Builds DeepSpeed's JIT-compiled ops once, so later runs (and tests) do not each pay for the compile.

Usage: ``python launch/warm_ops.py``. On a CPU machine DeepSpeed compiles its shared-memory collectives
(``deepspeed_shm_comm``), ``fused_adam`` (used when a JSON names an Adam optimizer) and ``cpu_adam`` (used by
ZeRO-Offload); on a GPU machine the accelerator's own builders are used. Compiled ops are cached under
``~/.cache/torch_extensions`` (or ``$TORCH_EXTENSIONS_DIR``).
"""
import sys
import time

from deepspeed.accelerator import get_accelerator


def main() -> int:
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
