"""tests/launch_ranks.py, which most multi-rank tests start their ranks with, gives each rank what DeepSpeed's own
launcher (``deepspeed --num_gpus N``) gives it and ends the same way: both run the same probe here, side by side."""
import json
import os
import subprocess
import sys

import pytest

from train_utils import REPO, env, launcher_head

pytestmark = pytest.mark.slow

# Each rank writes its command line (interpreter flags included) and environment; RANK 1 then exits with the code in PROBE_EXIT (if set) and rank 0
# waits for it, writing its pid first so the test can see it was stopped.
PROBE = """
import json, os, sys, time
out = os.environ["PROBE_OUT"]
rank = os.environ["RANK"]
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"argv": sys.orig_argv, "env": dict(os.environ)}, f)
code = int(os.environ.get("PROBE_EXIT", "0"))
if code and rank == "1":
    print("rank 1 stops", flush=True)
    sys.exit(code)
if code:
    time.sleep(300)
"""


def _run(launcher, tmp_path, ranks=2, exit_code=0):
    out = tmp_path / launcher
    out.mkdir()
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    from snip_ds.engine.core import _free_port  # (its import sets TORCH_EXTENSIONS_DIR: before env())

    e = {**env(), "PROBE_OUT": str(out)}
    if exit_code:
        e["PROBE_EXIT"] = str(exit_code)
    port = str(_free_port())
    cmd = [*launcher_head(launcher), "--num_gpus", str(ranks), "--master_port", port, str(probe), "--a", "1"]
    proc = subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=120)
    seen = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    for s in seen.values():  # the two values that differ between the two runs by construction, checked here
        assert s["env"].pop("MASTER_PORT") == port and s["env"].pop("PROBE_OUT") == str(out)
    return proc, seen


def test_each_rank_gets_the_same_command_and_environment_as_under_deepspeeds_launcher(tmp_path):
    ds, ds_seen = _run("deepspeed", tmp_path)
    ours, our_seen = _run("ranks", tmp_path)
    assert ds.returncode == 0 and ours.returncode == 0, (ds.stdout[-2000:], ours.stderr[-2000:])
    assert sorted(ds_seen) == sorted(our_seen) == [0, 1]
    for rank in (0, 1):
        ours_env, ds_env = our_seen[rank]["env"], ds_seen[rank]["env"]
        assert ours_env == ds_env, {k: (ours_env.get(k), ds_env.get(k)) for k in set(ours_env) ^ set(ds_env)
                                    | {k for k in ours_env.keys() & ds_env.keys() if ours_env[k] != ds_env[k]}}
        assert our_seen[rank]["argv"] == ds_seen[rank]["argv"]
        assert our_seen[rank]["argv"][:2] == [sys.executable, "-u"]
        assert our_seen[rank]["argv"][3:] == [f"--local_rank={rank}", "--a", "1"]
        assert our_seen[rank]["env"]["RANK"] == our_seen[rank]["env"]["LOCAL_RANK"] == str(rank)


def test_a_failing_rank_stops_the_others_and_its_code_is_the_launchers(tmp_path):
    for launcher in ("deepspeed", "ranks"):
        proc, seen = _run(launcher, tmp_path, exit_code=3)
        assert proc.returncode == 3, (launcher, proc.stdout[-2000:], proc.stderr[-2000:])
        assert "exits with return code = 3" in proc.stdout + proc.stderr, launcher
        assert "rank 1 stops" in proc.stdout, launcher  # a rank's output is the launcher's
        assert sorted(seen) == [0, 1]
    # rank 0 was waiting 300 s; both launchers returned long before (timeout=120), so it was stopped: no probe
    # process is left behind
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "probe.py")], capture_output=True, text=True).stdout
    assert left.strip() == "", left
