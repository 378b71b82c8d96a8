"""Shared test set-up: the tests directory is importable (for reference_quant), runs are single-threaded-safe,
no test leaves subnormals flushed for the next, and Triton's mode is settled before any test module imports it."""
import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton fixes interpreted vs compiled when it is first imported, and torch._dynamo imports it as a side effect of
# many test modules' imports (transformers, DeepSpeed): were that first, the kernel tests would skip in a
# whole-suite run. So triton and the kernels are imported here first, in the mode tests/triton_mode.py chooses
# (compiled on a CUDA GPU, Triton's interpreter elsewhere).
if importlib.util.find_spec("triton") is not None:
    import triton_mode  # noqa: E402,F401


@pytest.fixture(autouse=True)
def _subnormals_kept():
    """``snip_ds.run.trainer.main`` flushes subnormals for its whole process (as launch/train.py wants); a test that
    calls it in-process must not leave later tests' FP32 subnormals flushed to zero."""
    yield
    torch.set_flush_denormal(False)


@pytest.fixture(scope="session")
def zero3_fp8_run(tmp_path_factory):
    """One finished 2-rank ZeRO-3 fp8 run of 2 steps through DeepSpeed's launcher, for the modules that check
    what is done with a finished run's checkpoints (tests/test_checkpoint_integrity.py, test_train_errors.py):
    ``out/checkpoints`` holds step_1, step_2 and latest, ``out/tensorboard`` the event file. Read it through
    :func:`train_utils.copy_of_run`, never in place."""
    from train_utils import launch, write_configs

    tmp = tmp_path_factory.mktemp("zero3_fp8_run")
    cfg = write_configs(tmp, stage=3, plan="fp8", max_steps=2, save_steps=1, eval_steps=2)
    proc = launch(["--deepspeed", str(cfg)], num_ranks=2, launcher="deepspeed")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp / "out"
    assert (out / "checkpoints" / "latest").read_text() == "step_2"
    assert list((out / "tensorboard").iterdir())
    return {"cfg": cfg, "out": out}
