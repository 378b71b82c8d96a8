"""DeepSpeed's fused Adam: built under a TORCH_CUDA_ARCH_LIST DeepSpeed can read, and replaced by torch's AdamW,
with a warning, where it cannot be built (snip_ds.engine.optimizer, snip_ds.runtime.jit_builds.deepspeed_arch_list).

The failing build is real: a fresh extensions root in which ``fused_adam`` (the folder torch builds the op in)
is a plain file, so torch's builder cannot create it. The other ops (DeepSpeed's shared-memory all-reduce,
snip_ds's CPU kernels) are copied from this environment's finished builds, mtimes kept, so nothing recompiles.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from snip_ds.runtime import jit_builds
from train_utils import REPO, TINY_MODEL, env, launch_cmd, write_configs


def test_arch_lists_deepspeed_cannot_read_are_rewritten():
    assert jit_builds.deepspeed_arch_list("9.0a") == "9.0"
    assert jit_builds.deepspeed_arch_list("8.0;9.0a;10.0a+PTX") == "8.0;9.0;10.0+PTX"
    assert jit_builds.deepspeed_arch_list("9.0 10.0f 12.0") == "9.0;10.0;12.0"
    assert jit_builds.deepspeed_arch_list("Ampere;Hopper") == "8.0;8.6+PTX;9.0+PTX"
    assert jit_builds.deepspeed_arch_list("9.0;9.0a") == "9.0"
    assert jit_builds.deepspeed_arch_list("7.5;8.0;8.6+PTX") == "7.5;8.0;8.6+PTX"  # already readable: as given


def test_the_rewritten_list_holds_only_while_deepspeed_builds(monkeypatch):
    monkeypatch.setenv(jit_builds.ARCH_VAR, "9.0a")
    with jit_builds.deepspeed_arch_list_set():
        assert os.environ[jit_builds.ARCH_VAR] == "9.0"
    assert os.environ[jit_builds.ARCH_VAR] == "9.0a"
    monkeypatch.delenv(jit_builds.ARCH_VAR)
    with jit_builds.deepspeed_arch_list_set():
        assert jit_builds.ARCH_VAR not in os.environ
    assert jit_builds.ARCH_VAR not in os.environ


def _blocked_root(tmp_path: Path) -> Path:
    """An extensions root holding this environment's finished builds, except that ``fused_adam`` cannot be
    built there."""
    built = jit_builds.build_root()
    root = tmp_path / "ext"
    if built.is_dir():
        shutil.copytree(built, root, ignore=shutil.ignore_patterns("fused_adam", "lock"))
    root.mkdir(exist_ok=True)
    (root / "fused_adam").write_text("not a folder\n")
    return root


CONFIG_CHECK = """
import json, sys
from snip_ds.engine.optimizer import working_adam_config
for cfg in json.loads(sys.argv[1]):
    print("RESULT", json.dumps(working_adam_config(cfg)))
"""


@pytest.mark.slow
def test_configs_get_torch_adam_only_where_fused_adam_is_asked_for_and_cannot_build(tmp_path):
    adam = {"type": "AdamW", "params": {"lr": 1e-3}}
    configs = [
        {"optimizer": adam},
        {"optimizer": {"type": "Adam"}},
        {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}},
        {"optimizer": adam, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
        {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
        {},
    ]
    proc = subprocess.run([sys.executable, "-c", CONFIG_CHECK, json.dumps(configs)], cwd=REPO,
                          env={**env(), "TORCH_EXTENSIONS_DIR": str(_blocked_root(tmp_path))},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert got[0] == {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    assert got[1] == {"optimizer": {"type": "Adam", "params": {"torch_adam": True}}}
    assert got[2:] == configs[2:]  # torch's Adam already, DeepSpeed's CPU Adam, another optimizer, none
    assert proc.stderr.count("DeepSpeed's FusedAdam could not be built") == 2
    assert "training with torch.optim.AdamW instead" in proc.stderr
    assert "training with torch.optim.Adam instead" in proc.stderr
    assert "fused_adam" in proc.stderr  # the reason names what failed


@pytest.mark.slow
def test_training_runs_on_torch_adamw_when_fused_adam_cannot_build(tmp_path):
    """launch/train.py through the launcher (tests/launch_ranks.py), ZeRO-3, adaptive: a warning, then the run
    completes."""
    cfg = write_configs(tmp_path, stage=3, plan="adaptive", max_steps=3, eval_steps=3, save_steps=3)
    proc = subprocess.run(launch_cmd(["--deepspeed", str(cfg)]), cwd=REPO,
                          env={**env(), "TORCH_EXTENSIONS_DIR": str(_blocked_root(tmp_path))},
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "DeepSpeed's FusedAdam could not be built" in out and "torch.optim.AdamW instead" in out
    assert "step 3 train loss" in out
    assert (tmp_path / "out" / "checkpoints" / "step_3").is_dir()


@pytest.mark.slow
def test_trainer_runs_on_torch_adamw_when_fused_adam_cannot_build(tmp_path):
    """launch/train_hf.py (the Trainer with SnipCallback) through the launcher (tests/launch_ranks.py) on ZeRO-3."""
    (tmp_path / "model.json").write_text(json.dumps(TINY_MODEL))
    cfg = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    cfg["snip"].update(replan_every=2)
    cfg["snip"]["train"] = {"model_config": str(tmp_path / "model.json"), "block_size": 64,
                            "max_corpus_bytes": 200_000, "eval_batches": 1}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    cmd = launch_cmd([], 1)[:-2] + [str(REPO / "launch" / "train_hf.py"), "--deepspeed", str(path),
                                    "--output_dir", str(tmp_path / "out"), "--max_steps", "3"]
    proc = subprocess.run(cmd, cwd=REPO, env={**env(), "TORCH_EXTENSIONS_DIR": str(_blocked_root(tmp_path))},
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "DeepSpeed's FusedAdam could not be built" in out and "torch.optim.AdamW instead" in out
    assert "'train_loss'" in out or "train_loss" in out
