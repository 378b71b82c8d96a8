"""What a run leaves a user with: plan.json and stats.json beside the checkpoints (and `snip-ds` reading them,
or a checkpoint directory), console messages on lines of their own above the progress bar, and a resume with
another --max_steps that keeps the checkpoint's learning-rate schedule unless --reset_lr_schedule."""
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
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "plan.json", "stats.json", "tensorboard"]
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
    assert main(["show", str(out / "stats.json")]) == 2
    assert "is a snip_ds statistics file, not a plan" in capsys.readouterr().err

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


def test_console_messages_stay_off_the_progress_bar(adaptive):
    _, _, output = adaptive
    visible = [line.rsplit("\r", 1)[-1] for line in output.split("\n")]  # what a terminal shows of each line
    messages = [line for line in visible if "snip_ds: step " in line or "snip_ds: checkpoint saved" in line]
    # evaluation at steps 3 and 6, checkpoints at 3 and 6, re-plans before steps 1 and 5
    assert len(messages) == 6, output[-4000:]
    assert [m.split(":")[1] for m in messages if ": plan " in m] == [" step 0", " step 4"], messages
    assert all(line.startswith("snip_ds: ") for line in messages), messages
    assert any(re.match(r"train: +\d+%\|", line) for line in visible)  # the bar was drawn


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
