"""``snip_ds.initialize`` runs SNIP inside a user's own loop: real 2-rank ZeRO-3 runs of
tests/dist_scripts/own_loop.py through the deepspeed launcher."""
import json
import subprocess
import sys

import pytest

from train_utils import REPO, env

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
SCRIPT = REPO / "tests" / "dist_scripts" / "own_loop.py"


def _run(case: str, tmp_path) -> list:
    from snip_ds.engine.core import _free_port

    out = tmp_path / case
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(_free_port()),
           str(SCRIPT), "--case", case, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads((tmp_path / f"{case}.{r}").read_text()) for r in (0, 1)]


def test_adaptive_replans_on_schedule_with_the_same_plan_on_every_rank(tmp_path):
    ranks = _run("replan", tmp_path)
    for r in ranks:
        assert [h["step"] for h in r["history"]] == [0, 2, 4]
        assert all(h["status"] != "failed" for h in r["history"])
        assert r["method"] == "best"  # SNIP's own plan replaced the fp8 placeholder before step 1
        assert all(s >= 0.5 - 1e-9 for s in r["shares"])  # the efficiency target holds at every step
    assert ranks[0]["digests"] == ranks[1]["digests"]


def test_an_unsolvable_first_plan_stops_every_rank_with_the_reason(tmp_path):
    ranks = _run("first_unsolvable", tmp_path)
    for r in ranks:
        assert "first adaptive plan cannot be solved" in r["error"], r
    assert ranks[0]["error"] == ranks[1]["error"]


def test_a_failed_replan_keeps_the_plan_in_force_on_every_rank(tmp_path):
    ranks = _run("replan_fails", tmp_path)
    for r in ranks:
        assert [(h["step"], h["status"] == "failed") for h in r["history"]] == [(0, False), (2, True), (4, False)]
        assert r["digests"][1] == r["digests"][2]  # steps 2-3 ran on the plan solved at step 0
    assert ranks[0]["digests"] == ranks[1]["digests"]
