"""Faults injected into real runs: a full disk during a checkpoint save, non-finite losses and gradients, a
re-plan the solver cannot solve. Each run is a real process (2 ranks through the launcher
(tests/launch_ranks.py), or one plain process); the fault comes from an input a user can reach (a file-size
limit, a config, a model).

docs/reliability.md lists what each run did.
"""
import json
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest

from train_utils import REPO, assert_no_shm_left, env, launch, launch_cmd, ranks_directly, scalars, write_configs


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _file_size_limit(limit: int):
    """A ``preexec_fn``: writes past ``limit`` bytes of any one file fail with EFBIG in this process and its
    children (RLIMIT_FSIZE is inherited), as a full disk makes writes fail with ENOSPC. SIGXFSZ, which the
    kernel sends on such a write, is ignored (Python ignores it already; the launcher's children inherit
    the disposition), so that the write raises instead of killing the process."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def _error_lines(text: str) -> list:
    return [line for line in text.splitlines() if line.startswith("error: ")]


# ------------------------------------------------------------------------------------- a full disk (unit)
@pytest.mark.slow
def test_plan_and_stats_writes_fail_whole_under_a_file_size_limit(tmp_path):
    """plan.json / stats.json are written atomically: a write that fails part-way (EFBIG here, ENOSPC on a
    full disk) leaves the previous file as it was and no temporary behind, and the run's writer stops with
    one line naming the file and the cause."""
    (tmp_path / "stats.json").write_text('{"previous": true}\n')
    code = f"""
import json, sys
sys.path.insert(0, {str(REPO)!r})
from snip_ds.plan import Plan
from snip_ds.config.train_args import RunFault
from snip_ds.run.trainer import _write_artifacts
plan = Plan.uniform(["model.layers.0.mlp.up_proj"], "fp8", {{"model.layers.0.mlp.up_proj": 1.0}})
stats = {{"format": "snip_ds.stats/1", "padding": "x" * 200000}}
try:
    _write_artifacts(__import__("pathlib").Path({str(tmp_path)!r}), plan, stats)
except RunFault as err:
    print("FAULT", err.code, err)
"""
    proc = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=120,
                          preexec_fn=_file_size_limit(100_000))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith(f"FAULT 1 {tmp_path / 'stats.json'}: cannot be written (File too large [errno 27])"), line
    assert (tmp_path / "stats.json").read_text() == '{"previous": true}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats.json"]  # no temporary, no plan.json yet


# ---------------------------------------------------------------------------- a full disk (2-rank runs)
@pytest.fixture(scope="module")
def extensions(tmp_path_factory):
    """A private TORCH_EXTENSIONS_DIR for this module's runs. It starts as a copy of this environment's builds
    (``launch/warm_ops.py``'s, when they exist: building them again would cost minutes); the reference run (no
    file-size limit) JIT-builds there whatever op the runs load that is missing (DeepSpeed's and snip_ds's), so
    a run under RLIMIT_FSIZE only loads them: a compiler under the limit would die. No other environment on the
    machine builds into it, so the limited runs do not depend on the state of the machine's shared cache."""
    from snip_ds.runtime.jit_builds import build_root

    path = tmp_path_factory.mktemp("torch_extensions")
    shared = build_root()
    if shared.is_dir():
        shutil.copytree(shared, path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("lock"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_EXTENSIONS_DIR", str(path))  # env() copies os.environ
        yield path


def _build_state(folder) -> dict:
    """Every file under a JIT build folder with its modification time (torch's transient 'lock' files left out)."""
    return {str(p): p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "lock"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, extensions):
    """An uninterrupted 2-rank ZeRO-3 fp8 run of 4 steps, checkpoints at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("faults_ref")
    cfg = write_configs(tmp, stage=3, plan="fp8", max_steps=4, save_steps=2, eval_steps=4)
    _ok(launch(["--deepspeed", str(cfg)], num_ranks=2))
    assert any(extensions.rglob("*.so")), "no JIT op in the private folder after the reference run"
    return {"tmp": tmp, "cfg": cfg, "out": tmp / "out", "loss": scalars(tmp / "out" / "tensorboard")["train/loss"]}


@pytest.mark.slow
@pytest.mark.distributed
def test_disk_full_during_a_save_stops_the_run_and_keeps_the_previous_checkpoint(reference, extensions, tmp_path):
    """The save of step 4 fails on both ranks: one error line each, the partial step_4 removed (by every rank
    that wrote it), step_2 and 'latest' untouched, and resuming the run continues from step_2 bit for bit."""
    from snip_ds.engine.checkpoint_layout import CheckpointError, resolve

    ref_ckpts = reference["out"] / "checkpoints"
    run = tmp_path / "run"  # the state of a run that has saved step_2: its checkpoint and 'latest'
    shutil.copytree(ref_ckpts / "step_2", run / "checkpoints" / "step_2")
    (run / "checkpoints" / "latest").write_text("step_2")
    shards = sorted((ref_ckpts / "step_2").glob("*_optim_states.pt"))
    largest = max(p.stat().st_size for p in shards)
    others = [p for p in (ref_ckpts / "step_2").iterdir() if p not in shards]
    limit = largest // 2  # the optimizer shards no longer fit; every other file of the run does
    assert all(p.stat().st_size < limit for p in others)
    assert all(p.stat().st_size < limit for p in (reference["out"] / "tensorboard").iterdir())

    cmd = launch_cmd(["--deepspeed", str(reference["cfg"]), "--resume_from_checkpoint", str(run),
                      "--output_dir", str(run)], num_ranks=2)
    step2_files = {p.name: p.read_bytes() for p in (run / "checkpoints" / "step_2").iterdir()}
    built = _build_state(extensions)
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600,
                          preexec_fn=_file_size_limit(limit))
    elapsed = time.monotonic() - start
    assert _build_state(extensions) == built  # the limited run compiled nothing
    assert_no_shm_left(cmd)
    print(f"disk-full run: exit {proc.returncode} after {elapsed:.1f} s:", _error_lines(proc.stderr)[:1])
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-5000:]
    lines = _error_lines(proc.stderr)
    assert len(lines) == 2 and lines[0] == lines[1], proc.stderr[-3000:]  # the same line from both ranks
    step4 = run / "checkpoints" / "step_4"
    assert lines[0].startswith(f"error: checkpoint {step4} not saved: {step4}/"), lines[0]
    assert "_optim_states.pt: cannot be written (File too large [errno 27])" in lines[0]
    assert lines[0].endswith("'latest' still names step_2 (the partial step_4 was removed)"), lines[0]

    assert (run / "checkpoints" / "latest").read_text() == "step_2"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_2"]  # step_4 is gone
    assert {p.name: p.read_bytes() for p in (run / "checkpoints" / "step_2").iterdir()} == step2_files
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve(step4)
    assert resolve(run) == run / "checkpoints" / "step_2"  # the run directory resumes from step_2

    # Resuming the run directory continues from step 2 and reproduces the uninterrupted losses bit for bit.
    _ok(launch(["--deepspeed", str(reference["cfg"]), "--resume_from_checkpoint", str(run),
                "--output_dir", str(tmp_path / "resumed")], num_ranks=2))
    again = scalars(tmp_path / "resumed" / "tensorboard")["train/loss"]
    assert sorted(again) == [3, 4]
    for step in (3, 4):
        assert again[step] == reference["loss"][step], (step, again[step], reference["loss"][step])


# ------------------------------------------------------------------------------- non-finite numbers
@pytest.mark.slow
@pytest.mark.distributed
def test_a_diverging_run_stops_at_the_first_nonfinite_step_and_saves_nothing_from_it(tmp_path):
    """--learning_rate 1e30 makes a 2-rank ZeRO-3 run diverge after the warm-up's first step (at lr 0): the
    first step whose loss or gradient is NaN/Inf stops both ranks with the same line (exit 1), before its
    update; every earlier step's checkpoint is complete and none exists from that step on."""
    import re

    cfg = write_configs(tmp_path, stage=3, plan="fp8", max_steps=8, save_steps=1, eval_steps=8)
    cmd = launch_cmd(["--deepspeed", str(cfg), "--learning_rate", "1e30"], num_ranks=2)
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    elapsed = time.monotonic() - start
    assert_no_shm_left(cmd)
    lines = _error_lines(proc.stderr)
    print(f"diverging run: exit {proc.returncode} after {elapsed:.1f} s:", lines[:1])
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-5000:]
    assert len(lines) == 2 and lines[0] == lines[1], proc.stderr[-3000:]
    match = re.match(r"error: non-finite (loss|gradient) .* at step (\d+), micro-batch 1 of 1 on rank [01]; ",
                     lines[0])
    assert match, lines[0]
    bad = int(match.group(2))
    assert 2 <= bad <= 8
    assert f"the step's update was not applied and no checkpoint was saved after step {bad - 1}" in lines[0]
    ckpts = tmp_path / "out" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == sorted(f"step_{s}" for s in range(1, bad))
    assert (ckpts / "latest").read_text() == f"step_{bad - 1}"
    assert all((ckpts / f"step_{s}" / "snip_meta.json").is_file() for s in range(1, bad))


@pytest.mark.slow
def test_a_layer_with_nonfinite_statistics_stays_fp8_with_a_warning_naming_it():
    """Statistics collected from a real model, whose Adam second moment (the BWD preconditioner) of one layer
    overflowed to Inf: that layer's record is flagged non-finite, and the plan keeps it at fp8 (the safer of
    the planned precisions) while meeting the FP4 target with the others; the warning names the layer."""
    import warnings

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from snip_ds.stats import CollectSettings, collect_statistics
    from snip_ds.planner import solve_baseline
    from snip_ds.swap import snip_layers, swap_linears

    layer = "model.layers.1.mlp.down_proj"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         use_cache=False))
    swap_linears(model, "fp8", seed=3)
    precond = {f: torch.ones(m.weight.shape) for f, m in snip_layers(model).items()}
    precond[layer] = torch.full_like(precond[layer], float("inf"))
    batch = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(1))
    stats = collect_statistics(model, [batch], CollectSettings(lam=2.0), lr=1e-3, precond=precond)
    assert stats["layers"][layer]["nonfinite"] is True
    assert not any(r["nonfinite"] for f, r in stats["layers"].items() if f != layer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (plan,) = solve_baseline("best", stats, 0.75)
    assert plan.assignment[layer] == "fp8" and plan.fp4_share >= 0.75 - 1e-9  # FP64 share round-off
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("non-finite statistics" in m and layer in m for m in messages), messages


# ------------------------------------------------------------------------------ a re-plan that fails
@pytest.mark.slow
@pytest.mark.distributed
def test_a_replan_the_solver_cannot_solve_keeps_the_plan_in_force_on_every_rank(tmp_path):
    """A 2-rank adaptive run is resumed with a config that pins every layer to fp8, so that rank 0's solver
    (a real solve of the statistics collected at step 2) finds no plan meeting efficiency_saving 0.75: both
    ranks keep the checkpoint's plan and train on to step 4; the failure and its reason are said and logged."""
    cfg = write_configs(tmp_path, stage=3, plan="adaptive", max_steps=2, save_steps=2, eval_steps=2)
    data = json.loads(cfg.read_text())
    data["snip"].update(replan_every=2, additional_bf16_fwd_every_n_steps=0)
    cfg.write_text(json.dumps(data))
    _ok(launch(["--deepspeed", str(cfg)], num_ranks=2))
    first = json.loads((tmp_path / "out" / "checkpoints" / "step_2" / "snip_state.json").read_text())
    assert first["plan"]["method"] == "best" and first["planner"]["planned_at"] == 0

    linears = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
    data["snip"]["pinned"] = {f"model.layers.{i}.{m}": "fp8" for i in range(2) for m in linears}
    pinned = tmp_path / "pinned.json"
    pinned.write_text(json.dumps(data))
    out = tmp_path / "resumed"
    proc = _ok(launch(["--deepspeed", str(pinned), "--resume_from_checkpoint", str(tmp_path / "out"),
                       "--max_steps", "4", "--output_dir", str(out)], num_ranks=2))
    assert ("snip_ds: warning: re-plan at step 2 could not be solved (target FP4 share 0.7500 is unreachable"
            in proc.stdout), proc.stdout[-3000:]
    assert proc.stdout.count("could not be solved") == 1 and "keeping the plan in force" in proc.stdout

    last = json.loads((out / "checkpoints" / "step_4" / "snip_state.json").read_text())
    assert last["plan"] == first["plan"]  # steps 3-4 trained on the plan solved at step 0
    assert [(h["step"], h["status"]) for h in last["planner"]["history"]][-1] == (2, "failed")
    assert json.loads((out / "plan.json").read_text())["assignment"] == first["plan"]["assignment"]
    logged = scalars(out / "tensorboard")
    assert logged["snip/replan_failed"] == {2: 1.0}
    assert sorted(logged["train/loss"]) == [3, 4] and all(v == v for v in logged["train/loss"].values())


@pytest.mark.slow
@pytest.mark.distributed
def test_a_save_failing_on_one_rank_stops_both_with_its_line(reference, tmp_path):
    """Only rank 1's disk is full (the ranks started as separate processes, the file-size limit on rank 1's
    alone, as on a node-local disk): rank 0 wrote all its files, yet learns of rank 1's failure before
    marking the checkpoint complete, and both stop with rank 1's line instead of waiting on each other; the
    partial step_4, rank 0's complete shards included, is removed."""
    run = tmp_path / "run"
    shutil.copytree(reference["out"] / "checkpoints" / "step_2", run / "checkpoints" / "step_2")
    (run / "checkpoints" / "latest").write_text("step_2")
    limit = max(p.stat().st_size for p in (run / "checkpoints" / "step_2").glob("*_optim_states.pt")) // 2
    results = ranks_directly(["--deepspeed", str(reference["cfg"]), "--resume_from_checkpoint", str(run),
                              "--output_dir", str(run)], timeout=600, preexec={1: _file_size_limit(limit)})
    lines = []
    for rank, (code, out, err) in enumerate(results):
        assert code == 1, (rank, out[-2000:], err[-3000:])
        assert "Traceback" not in out + err, (rank, err[-3000:])
        assert len(_error_lines(err)) == 1, (rank, err[-3000:])
        lines.append(_error_lines(err)[0])
    assert lines[0] == lines[1]
    step4 = run / "checkpoints" / "step_4"
    assert f"{step4}/zero_pp_rank_1_mp_rank_00_optim_states.pt: cannot be written (File too large" in lines[0]
    assert lines[0].endswith("(the partial step_4 was removed)"), lines[0]
    assert not step4.exists() and (run / "checkpoints" / "latest").read_text() == "step_2"
