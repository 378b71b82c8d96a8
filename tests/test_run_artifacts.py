"""What a run leaves a user with: plan.json, stats.json and summary.json beside the checkpoints (and `snip-ds`
reading them, or a checkpoint directory), a console of plain lines in a log (each re-plan, the end summary, no
progress-bar fragments), and a resume with another --max_steps that keeps the checkpoint's learning-rate schedule
unless --reset_lr_schedule."""
import json
import re
import subprocess

import pytest

from snip_ds.cli import main
from snip_ds.plan import Plan
from train_utils import REPO, assert_no_shm_left, env, launch, launch_cmd, scalars, write_configs

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LR = 0.002  # ds_configs/zero3.json's optimizer.params.lr, which write_configs keeps


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def adaptive(tmp_path_factory):
    """A 6-step adaptive run (re-plans before steps 1 and 5, checkpoints at 3 and 6) with its progress bar on,
    stdout and stderr in one stream as a terminal shows them; its statistics record one study-field group."""
    tmp = tmp_path_factory.mktemp("adaptive")
    cfg = write_configs(tmp, stage=0, plan="adaptive")
    data = json.loads(cfg.read_text())
    data["snip"].update(replan_every=4, efficiency_saving=0.5)
    data["snip"].setdefault("research", {})["study_fields"] = ["quant_err"]
    cfg.write_text(json.dumps(data))
    cmd = [a for a in launch_cmd(["--deepspeed", str(cfg)]) if a != "--no_progress"]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    assert_no_shm_left(cmd)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return tmp, cfg, proc.stdout


def test_run_writes_the_plan_and_the_last_statistics(adaptive, tmp_path):
    tmp, _, _ = adaptive
    out = tmp / "out"
    meta = json.loads((out / "checkpoints" / "step_6" / "snip_state.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    stats = json.loads((out / "stats.json").read_text())
    assert plan == meta["plan"] and plan["format"] == "snip_ds.plan/1"  # the plan in force at the end
    assert stats == meta["planner"]["last_stats"] and stats["format"] == "snip_ds.stats/1"
    assert stats["step"] == 4  # the last collection: before step 5
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "plan.json", "stats.json", "summary.json",
                                                     "tensorboard"]
    reference = tmp_path / "plain"
    reference.write_text("")  # an ordinary open(): the permissions the user's umask gives
    for name in ("plan.json", "stats.json"):
        assert (out / name).stat().st_mode & 0o777 == reference.stat().st_mode & 0o777, name


def test_cli_reads_checkpoint_and_output_directories(adaptive, tmp_path, capsys):
    tmp, _, _ = adaptive
    out, ckpt = tmp / "out", tmp / "out" / "checkpoints" / "step_6"
    assert main(["show", str(ckpt)]) == 0
    from_ckpt = capsys.readouterr().out.splitlines()
    assert main(["show", str(out / "plan.json")]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == from_ckpt[1:]  # the same map, another title
    assert main(["show", str(tmp / "out" / "checkpoints")]) == 0  # its 'latest': step_6
    assert capsys.readouterr().out.splitlines()[1:] == from_ckpt[1:]

    assert main(["show", str(ckpt / "snip_meta.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a snip_ds checkpoint metadata file, not a plan; pass its directory" in err
    assert main(["show", str(out / "stats.json")]) == 0  # a statistics file: its per-layer table
    table = capsys.readouterr().out
    assert all(fqn in table for fqn in json.loads((out / "stats.json").read_text())["layers"])

    # statistics from the checkpoint's planner state and from stats.json: the same plan
    for i, source in enumerate((ckpt, out, out / "stats.json")):
        assert main(["plan", str(source), "--efficiency-saving", "0.5", "-o", str(tmp_path / f"p{i}.json")]) == 0
    capsys.readouterr()
    plans = [Plan.load(tmp_path / f"p{i}.json") for i in range(3)]
    assert plans[0].assignment == plans[1].assignment == plans[2].assignment
    assert main(["diff", str(tmp / "out" / "checkpoints" / "step_3"), str(out)]) == 0
    assert "common layers differ" in capsys.readouterr().out


def test_statistics_hold_the_plan_fields_and_the_study_fields_asked_for(adaptive, tmp_path, capsys):
    tmp, _, _ = adaptive
    out = tmp / "out"
    stats = json.loads((out / "stats.json").read_text())
    assert stats["study_fields"] == ["quant_err"]
    for rec in stats["layers"].values():
        assert {"flops", "fld", "bwd", "nonfinite", "quant_err", "rel_quant_err_g"} <= set(rec)
        assert not {"first_order", "fld_channel", "bwd_bias", "bwd_drift"} & set(rec)
    # the baseline the asked-for group serves solves from the run's statistics; one it lacks says why
    assert main(["plan", str(out), "--efficiency-saving", "0.5", "--method", "quant_err", "--per-gemm",
                 "-o", str(tmp_path / "q.json")]) == 0
    capsys.readouterr()
    assert main(["plan", str(out), "--efficiency-saving", "0.5", "--bwd-estimate", "systematic",
                 "-o", str(tmp_path / "s.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lack field 'bwd_bias'" in err and "snip.research.study_fields" in err


def test_a_log_gets_plain_lines_what_snip_did_and_an_end_summary(adaptive):
    """stdout is a pipe here, not a terminal: plain lines, no progress-bar fragments; each re-plan says what it
    moved and where to look; the run ends with its summary (also in summary.json)."""
    tmp, _, output = adaptive
    out = tmp / "out"
    assert "\r" not in output and not re.search(r"train: +\d+%\|", output)
    lines = [line for line in output.splitlines() if line.startswith("snip_ds: ")]
    replans = [line for line in lines if re.match(r"snip_ds: (first plan|re-plan) at step \d+: ", line)]
    assert [int(re.search(r"at step (\d+)", r).group(1)) for r in replans] == [0, 4], output[-4000:]
    for line in replans:  # moves both ways, share and target, both divergences (measured right after), the map
        assert re.search(r"\d+ layers FP8->FP4, \d+ FP4->FP8|plan unchanged", line), line
        assert re.search(r"FP4 share 0\.\d+ \(target 0\.5\)", line) and f"snip-ds show {out}" in line, line
        assert re.search(r"predicted \d\S*, measured \d\S* nats/token", line), line
    assert sum(" validation loss " in line for line in lines) == 2  # steps 3 and 6
    progress = [line for line in lines if line.startswith("snip_ds: progress: ")]
    assert len(progress) == 1 and "step 6/6" in progress[0]  # a line every 10 steps and at the last
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["replans"] == 2 and summary["snip_seconds"] > 0
    assert summary["checkpoint"] == str(out / "checkpoints" / "step_6")
    assert summary["plan"] == json.loads((out / "plan.json").read_text())
    assert summary["tokens_per_s"] > 0 and min(summary["peak_memory_bytes"]) > 0
    end = lines[-5:]  # done, SNIP's time, final plan, where to look, the CPU's emulation
    assert "6 steps" in end[0] and "tokens/s" in end[0] and "SNIP's own time" in end[1]
    assert end[2].startswith("snip_ds: final plan: ") and f"FP4 share {summary['fp4_share']:.3f}" in end[2]
    assert str(out / "checkpoints" / "step_6") in end[3] and str(out / "tensorboard") in end[3]
    assert "emulated" in end[4]


def _ds_lrs(total_steps: int, steps: int):
    """The lr after each of ``steps`` optimizer steps under DeepSpeed's own WarmupCosineLR (the scheduler in
    ds_configs/zero3.json, its "auto" fields as the run resolves them: warm-up max(1, total // 10) = 1)."""
    import torch
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    sched = WarmupCosineLR(opt, total_num_steps=total_steps, warmup_num_steps=max(1, total_steps // 10),
                           warmup_min_ratio=0.0, cos_min_ratio=0.1)
    lrs = {}
    for step in range(1, steps + 1):
        sched.step()
        lrs[step] = opt.param_groups[0]["lr"]
    return lrs


def _assert_lrs(logged, expected, steps):
    # train/lr is stored as float32 by TensorBoard: relative rounding <= 2^-24 ~ 6e-8
    for step in steps:
        assert logged[step] == pytest.approx(expected[step], rel=1e-7, abs=1e-12), (step, logged, expected)


def test_resume_with_more_steps_keeps_the_checkpoints_lr_schedule_unless_reset(adaptive):
    tmp, cfg, _ = adaptive
    original = scalars(tmp / "out" / "tensorboard")["train/lr"]
    _assert_lrs(original, _ds_lrs(6, 6), range(1, 7))  # the alignment of train/lr with DeepSpeed's steps
    step_3 = str(tmp / "out" / "checkpoints" / "step_3")
    kept = _ok(launch(["--deepspeed", str(cfg), "--resume_from_checkpoint", step_3, "--max_steps", "8",
                       "--output_dir", str(tmp / "kept")]))
    lines = [line for line in kept.stdout.splitlines() if "lr schedule" in line]
    assert len(lines) == 1 and lines[0].startswith("snip_ds: lr schedule: the checkpoint's")
    assert "total_num_steps=6" in lines[0] and "--reset_lr_schedule" in lines[0]
    logged = scalars(tmp / "kept" / "tensorboard")["train/lr"]
    assert sorted(logged) == [4, 5, 6, 7, 8]
    _assert_lrs(logged, _ds_lrs(6, 8), range(4, 9))  # the old schedule, past its end at its floor

    reset = _ok(launch(["--deepspeed", str(cfg), "--resume_from_checkpoint", step_3, "--max_steps", "8",
                        "--output_dir", str(tmp / "reset"), "--reset_lr_schedule"]))
    lines = [line for line in reset.stdout.splitlines() if "lr schedule" in line]
    assert len(lines) == 1 and lines[0].startswith("snip_ds: lr schedule: this run's")
    assert "total_num_steps=8" in lines[0]
    _assert_lrs(scalars(tmp / "reset" / "tensorboard")["train/lr"], _ds_lrs(8, 8), range(4, 9))
    # the kept run's own checkpoints carry the schedule it followed on
    meta = json.loads((tmp / "kept" / "checkpoints" / "step_8" / "snip_meta.json").read_text())
    assert meta["lr_schedule"]["params"]["total_num_steps"] == 6


def test_fixed_plan_run_writes_its_plan_and_no_statistics(tmp_path, capsys):
    cfg = write_configs(tmp_path, stage=0, plan="fp4", max_steps=2, eval_steps=2, save_steps=0)
    _ok(launch(["--deepspeed", str(cfg)]))
    out = tmp_path / "out"
    plan = Plan.load(out / "plan.json")
    assert set(plan.assignment.values()) == {"fp4"} and len(plan.assignment) == 14  # 2 blocks x 7 linears
    assert not (out / "stats.json").exists()
    assert main(["plan", str(out / "checkpoints" / "step_2"), "--efficiency-saving", "0.5",
                 "-o", str(tmp_path / "p.json")]) == 2
    assert "the checkpoint holds no statistics" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()
