"""benchmarks/soak.py: its verdict on hand-made samples, and end to end with a tiny step count (2 ranks through
the deepspeed launcher, a sample of every rank after each re-plan and at the end, the targets evaluated and
written as JSON and Markdown)."""
import argparse
import importlib.util
import json
import subprocess
import sys

import pytest

from train_utils import REPO, env


def _soak():
    spec = importlib.util.spec_from_file_location("soak", REPO / "benchmarks" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(step, rss, fds, replanned=True, agree=True):
    return {"step": step, "rss": rss, "fds": fds, "replanned": replanned, "agree": agree, "shm_files": []}


def test_summary_verdict_on_hand_made_samples():
    """Growth is measured from the first sample at or after the warm-up (step 6 here, warm-up 2 steps), and a
    series passes while its maximum stays within 5 % of that sample; the run passes only if every target does."""
    soak = _soak()
    args = argparse.Namespace(steps=20, warmup=2, replan_every=5, save_every=10)
    records = [_record(1, [500, 500], [5, 5]),  # the warm-up sample: left out
               _record(6, [100, 200], [20, 20]),
               _record(11, [104, 211], [20, 20], agree=False),
               _record(16, [103, 205], [20, 20]),
               _record(20, [102, 200], [21, 20], replanned=False)]
    s = soak.summarize(records, args, [], 0, 1.0)
    rss0, rss1, fds0 = s["rss"][0], s["rss"][1], s["fds"][0]
    assert (rss0["first_after_warmup"], rss0["max_after_warmup"], rss0["min_after_warmup"], rss0["last"]) == \
        (100, 104, 100, 102)
    assert rss0["max_growth"] == pytest.approx(0.04) and rss0["last_growth"] == pytest.approx(0.02) and rss0["ok"]
    assert rss1["max_growth"] == pytest.approx(0.055) and not rss1["ok"]  # 211 > 200 + 5 %
    assert fds0["max_growth"] == pytest.approx(0.05) and fds0["ok"]  # 21 = 20 + 5 %: within
    assert (s["replans"], s["replans_agreed"]) == (4, 3)
    assert s["targets"] == {"finished": True, "rss_flat": False, "fds_flat": True, "shm_empty_at_exit": True,
                            "shm_run_files_during": True, "replans_agreed": False}
    assert s["passed"] is False
    records[2] = _record(11, [104, 210], [20, 20])  # 210 = 200 + 5 %, and the digests agree
    s = soak.summarize(records, args, [], 0, 1.0)
    assert s["passed"] is True and all(s["targets"].values())
    for leftover, code, last_step, target in ((["/dev/shm/x"], 0, 20, "shm_empty_at_exit"),
                                             ([], 1, 20, "finished"), ([], 0, 16, "finished")):
        cut = records if last_step == 20 else records[:4]
        s = soak.summarize(cut, args, leftover, code, 1.0)
        assert s["targets"][target] is False and s["passed"] is False, target


@pytest.mark.slow
@pytest.mark.distributed
def test_soak_samples_every_replan_and_checks_its_targets(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "soak.py"), "--steps", "20", "--replan_every",
                           "5", "--save_every", "10", "--results_dir", str(tmp_path)],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "soak.json").read_text())
    # 20 steps are too few to judge memory growth: only the exit code's agreement with the verdict is checked
    assert proc.returncode == (0 if summary["passed"] else 1)
    assert summary["targets"]["finished"] and summary["targets"]["replans_agreed"], summary["targets"]
    records = summary["records"]
    # re-plans before steps 1, 6, 11, 16 (sampled after those steps), and the end of the run
    assert [r["step"] for r in records] == [1, 6, 11, 16, 20]
    assert [r["replanned"] for r in records] == [True] * 4 + [False]
    assert [r["replan_at"] for r in records] == [0, 5, 10, 15, 15]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("soak: step")]
    assert len(lines) == 5 and all("digests agree" in line for line in lines)
    for r in records:
        assert len(r["rss"]) == len(r["fds"]) == len(r["digests"]) == 2
        assert r["agree"] == (r["digests"][0] == r["digests"][1]) and r["agree"]
        assert all(rss > 50 * 2 ** 20 for rss in r["rss"])  # a Python process with torch loaded
        assert all(fds > 3 for fds in r["fds"])  # stdin, stdout, stderr and more
        assert r["shm_files"] == []  # DeepSpeed's buffers are unlinked once every rank has mapped them
    assert summary["replans"] == summary["replans_agreed"] == 4
    assert summary["shm_left_at_exit"] == [] and summary["launcher_returncode"] == 0
    for k in range(2):  # growth is measured from the first sample after the warm-up (10 %: step >= 2)
        assert summary["rss"][k]["first_after_warmup"] == records[1]["rss"][k]
        assert summary["fds"][k]["first_after_warmup"] == records[1]["fds"][k]
    assert ("soak: PASSED" if summary["passed"] else "soak: FAILED") in proc.stdout
    md = (tmp_path / "soak.md").read_text()
    assert md.startswith("# soak: 2 ranks, 20 steps, re-plan every 5 steps") and "| 4 of 4 |" in md
