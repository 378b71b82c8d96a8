"""benchmarks/soak.py end to end with a tiny step count: 2 ranks through the deepspeed launcher, a sample of
every rank after each re-plan and at the end, the targets evaluated and written as JSON and Markdown."""
import json
import subprocess
import sys

import pytest

from train_utils import REPO, env

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


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
    for k in range(2):  # the flatness figures are those of the samples after the warm-up (step >= 2)
        series = [r["rss"][k] for r in records[1:]]
        assert summary["rss"][k]["first_after_warmup"] == series[0]
        assert summary["rss"][k]["max_growth"] == pytest.approx((max(series) - series[0]) / series[0])
        assert summary["rss"][k]["ok"] == (max(series) <= series[0] * 1.05)
    assert summary["passed"] == all(summary["targets"].values())
    assert ("soak: PASSED" if summary["passed"] else "soak: FAILED") in proc.stdout
    md = (tmp_path / "soak.md").read_text()
    assert md.startswith("# soak: 2 ranks, 20 steps, re-plan every 5 steps") and "| 4 of 4 |" in md
