"""launch/ab.py: the same short training under several plans, one table; bad flags stop before any run."""
import json
import math
import subprocess
import sys

import pytest

from snip_ds.run.ab import ABError, parse, table
from train_utils import REPO, env, write_configs


@pytest.mark.parametrize("argv, flag", [
    (["--plans", "fp8,fp9"], "--plans"), (["--plans", "fp8,fp8"], "--plans"), (["--max_steps", "0"], "--max_steps"),
    (["--precision", "fp4"], "--precision"), (["--plan", "p.json"], "--plan"), (["--max_step", "3"], "--max_step"),
    (["--resume_from_checkpoint", "x"], "--resume_from_checkpoint")])
def test_bad_flags_are_named_before_any_run(tmp_path, argv, flag):
    cfg = write_configs(tmp_path)
    with pytest.raises(ABError, match=flag):
        parse(["--deepspeed", str(cfg), *argv])


def test_train_flags_are_checked_by_launch_train(tmp_path, capsys):
    with pytest.raises(ABError):
        parse(["--deepspeed", str(write_configs(tmp_path)), "--no_such_flag"])
    assert "--no_such_flag" in capsys.readouterr().err
    with pytest.raises(ABError, match="missing.json"):
        parse(["--deepspeed", str(tmp_path / "missing.json")])


def test_table_compares_each_plan_with_bf16_and_says_what_is_emulated():
    row = {"steps": 30, "train_loss_steps": 10, "peak_memory_kind": "resident memory (RSS)", "fp4_share": 0.0,
           "snip_share": None, "emulation": None, "train_loss": 3.0, "validation_loss": 2.9}
    rows = [{**row, "plan": "bf16", "tokens_per_s": 1000.0, "peak_memory_bytes": 2**30},
            {**row, "plan": "adaptive", "tokens_per_s": 1500.0, "peak_memory_bytes": 2**29, "fp4_share": 0.75,
             "snip_share": 0.1, "emulation": "FP8 and FP4 are emulated on a CPU", "validation_loss": math.nan}]
    text = table(rows)
    adaptive = next(line for line in text.splitlines() if line.startswith("| adaptive"))
    cells = [c.strip() for c in adaptive.strip("|").split("|")]
    assert cells == ["adaptive", "1,500", "1.50x", "0.50 GiB", "3.0000", "n/a", "0.75", "10%"]
    assert "emulated on a CPU" in text and "30 steps" in text


@pytest.mark.slow
def test_ab_trains_each_plan_and_writes_the_table(tmp_path):
    cfg = write_configs(tmp_path, stage=0, plan="fp8")
    out = tmp_path / "ab"
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "ab.py"), "--deepspeed", str(cfg), "--plans",
                           "fp8,adaptive", "--max_steps", "2", "--output_dir", str(out)], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "ab.json").read_text())
    assert [r["plan"] for r in result["rows"]] == ["fp8", "adaptive"] and result["max_steps"] == 2
    for r in result["rows"]:
        assert r["steps"] == 2 and r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0
        assert math.isfinite(r["train_loss"]) and math.isfinite(r["validation_loss"])
        assert (out / r["plan"] / "summary.json").is_file() and (out / r["plan"] / "console.log").is_file()
    fp8, adaptive = result["rows"]
    assert fp8["fp4_share"] == 0.0 and 0.5 <= adaptive["fp4_share"] <= 1.0 and adaptive["snip_share"] > 0
    assert "emulated" in proc.stdout  # a CPU: said before the runs and under the table
    rows = [line.split("|")[1].strip() for line in (out / "ab.md").read_text().splitlines() if line.startswith("| ")]
    assert rows == ["plan", "fp8", "adaptive"]  # the header, then one row per plan
