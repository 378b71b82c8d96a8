"""launch/train.py under every shipped DeepSpeed JSON and launcher: ds_configs/zero1, zero2 and zero3_offload
unchanged on one rank, torchrun with 2 ranks, and SIGTERM to a running 2-rank job (checkpoint, clean exit,
resume). Also: ``--help`` answers without importing torch."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from train_utils import REPO, TINY_MODEL, TRAIN, env, launch, launch_cmd, scalars, write_configs

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# A tiny model and a 2-step run; everything else comes from the shipped JSON, unchanged.
SHORT = ["--block_size", "64", "--max_steps", "2", "--eval_steps", "2", "--eval_batches", "1", "--save_steps", "0",
         "--per_device_train_batch_size", "2", "--precision", "fp8"]


def _ok(proc, out=None):
    text = (out if out is not None else proc.stdout + proc.stderr)
    assert proc.returncode == 0, text[-6000:]
    assert "Traceback" not in text, text[-6000:]
    return text


def test_help_lists_the_flags_without_importing_torch():
    proc = subprocess.run([sys.executable, str(TRAIN), "--help"], cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--deepspeed", "--model_name_or_path", "--model_config", "--dataset", "--max_steps",
                 "--precision", "--plan", "--resume_from_checkpoint", "--output_dir", "--learning_rate",
                 "--per_device_train_batch_size", "--gradient_accumulation_steps", "--no_progress"):
        assert flag in proc.stdout, flag
    # --help must not pay for torch / transformers / DeepSpeed (several seconds on a CPU box).
    probe = subprocess.run([sys.executable, "-c", "import sys; from snip_ds.config.train_args import build_parser; "
                            "build_parser().format_help(); "
                            "print([m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules])"],
                           cwd=REPO, env=env(), capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "[]", probe.stdout + probe.stderr


@pytest.mark.rounding
def test_shipped_zero_configs_run_unchanged_on_one_rank(tmp_path):
    """zero1, zero2 and zero3_offload (cpu_adam) as shipped, each a plain 1-rank ``python launch/train.py``
    (the launchers are exercised below), all at once. On one rank ZeRO only moves state around, so the
    three loss curves agree to float32 reduction order."""
    (tmp_path / "model.json").write_text(json.dumps(TINY_MODEL))
    procs = {}
    for name in ("zero1", "zero2", "zero3_offload"):
        args = ["--deepspeed", str(REPO / "ds_configs" / f"{name}.json"), "--model_config",
                str(tmp_path / "model.json"), "--output_dir", str(tmp_path / name), *SHORT]
        procs[name] = subprocess.Popen([sys.executable, str(TRAIN), *args, "--no_progress"], cwd=REPO, env=env(),
                                       text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    losses = {}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=600)
        _ok(proc, out)
        assert "1 rank(s)" in out
        losses[name] = scalars(tmp_path / name / "tensorboard")["train/loss"]
        meta = json.loads((tmp_path / name / "checkpoints" / "step_2" / "snip_meta.json").read_text())
        assert meta["step"] == 2 and meta["world_size"] == 1
    assert sorted(losses["zero1"]) == [1, 2]
    # measured: bitwise equal (AVX-512 and AVX2); 1e-5 leaves room for cpu_adam's SIMD vs torch's Adam
    # arithmetic, a few ulps (2^-24 ≈ 6e-8) per step in the weights, far below 1e-5 in a loss near 5
    for name in ("zero2", "zero3_offload"):
        for step, value in losses["zero1"].items():
            assert losses[name][step] == pytest.approx(value, rel=1e-5), (name, step)


def _wait_until_training(proc) -> list:
    """Reads ``proc``'s output until training is under way (its start-up line), then lets a step or two run;
    returns the lines read."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("snip_ds:") and "parameters" in line:
            break
    time.sleep(1.0)
    return lines


def test_sigterm_to_the_launcher_saves_and_torchrun_resumes(tmp_path):
    """SIGTERM to the ``deepspeed`` runner alone (it forwards nothing on one node; the ranks notice it exited):
    both ranks stop at the same step boundary, save a complete checkpoint and exit 0. torchrun with 2 ranks
    then resumes from it."""
    cfg = write_configs(tmp_path, stage=3, plan="fp8", max_steps=100_000, eval_steps=100_000, save_steps=0)
    proc = subprocess.Popen(launch_cmd(["--deepspeed", str(cfg)], num_ranks=2, launcher="deepspeed"), cwd=REPO,
                            env=env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        lines = _wait_until_training(proc)
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=300)  # EOF only once the ranks and deepspeed.launcher.launch exited
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # only left-overs of a failed test are still there
        except ProcessLookupError:
            pass
    out = "".join(lines) + rest
    assert proc.returncode == -signal.SIGTERM
    assert "Traceback" not in out, out[-6000:]
    assert out.count("exits successfully") == 2, out[-6000:]  # deepspeed.launcher.launch saw both ranks exit 0
    ckpts = tmp_path / "out" / "checkpoints"
    tag = (ckpts / "latest").read_text()
    step = int(tag.split("_")[1])
    # the ranks notice the runner's exit, or (when the runner's own handler passes the signal on first) SIGTERM
    assert re.search(rf"stopped by (the exit of launcher process \d+|SIGTERM) at step {step};", out), out[-6000:]
    assert 1 <= step < 100_000
    meta = json.loads((ckpts / tag / "snip_meta.json").read_text())
    assert meta["step"] == step and meta["world_size"] == 2
    assert (ckpts / tag / "snip_rng_rank1.safetensors").is_file() and (ckpts / tag / "snip_state.json").is_file()

    resumed = launch(["--deepspeed", str(cfg), "--resume_from_checkpoint", str(ckpts), "--max_steps",
                      str(step + 2), "--output_dir", str(tmp_path / "resumed")], num_ranks=2, launcher="torchrun")
    text = _ok(resumed)
    assert f"resumed from {ckpts} at step {step}" in text and "2 rank(s)" in text
    assert sorted(scalars(tmp_path / "resumed" / "tensorboard")["train/loss"]) == [step + 1, step + 2]
    assert (tmp_path / "resumed" / "checkpoints" / "latest").read_text() == f"step_{step + 2}"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_to_the_training_process_saves_and_exits_cleanly(tmp_path, signum):
    """Ctrl-C (SIGINT) or SIGTERM delivered to a plain ``python launch/train.py`` process: its handler stops the
    loop at the next step boundary, a complete checkpoint is saved, and the process exits 0 with a line
    saying where to resume from."""
    cfg = write_configs(tmp_path, stage=3, plan="fp8", max_steps=100_000, eval_steps=100_000, save_steps=0)
    proc = subprocess.Popen([sys.executable, str(TRAIN), "--deepspeed", str(cfg), "--no_progress"], cwd=REPO,
                            env=env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        lines = _wait_until_training(proc)
        proc.send_signal(signum)
        rest, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines) + rest
    assert proc.returncode == 0, out[-6000:]
    assert "Traceback" not in out, out[-6000:]
    ckpts = tmp_path / "out" / "checkpoints"
    tag = (ckpts / "latest").read_text()
    step = int(tag.split("_")[1])
    assert 1 <= step < 100_000
    assert f"stopped by {signal.Signals(signum).name} at step {step}" in out
    assert f"--resume_from_checkpoint {ckpts}" in out
    meta = json.loads((ckpts / tag / "snip_meta.json").read_text())
    state = json.loads((ckpts / tag / "snip_state.json").read_text())  # SNIP's own state: the plan in force
    assert meta["step"] == state["step"] == step and state["plan"]["assignment"]
