"""tests/launch_ranks.py, which most multi-rank tests start their ranks with, gives each rank what DeepSpeed's own
launcher (``deepspeed --num_gpus N``) gives it and ends the same way: both run the same probe here, side by side;
a SIGTERM to it stops every rank and leaves none of their DeepSpeed shared-memory buffers in /dev/shm."""
import json
import signal
import subprocess
import sys
import time

import pytest

from train_utils import REPO, assert_no_shm_left, env, ranks_cmd

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
    cmd = ranks_cmd(probe, ["--a", "1"], ranks, port, launcher)
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


# Each rank initialises torch.distributed as snip_ds does (DeepSpeed's CPU shared-memory all-reduce maps one
# /dev/shm buffer per rank), records whether its buffer was there before snip_ds released it, says it is ready
# (pid) and then all-reduces through DeepSpeed until it is stopped.
SHM_PROBE = """
import json, os, time
import snip_ds.engine.core as core
import deepspeed.comm as ds_comm
import torch

rank = int(os.environ["RANK"])
release, made = core.release_shm_buffer, {}


def recorded():
    made["buffer"] = core.shm_buffer_path(rank).exists()
    release()


core.release_shm_buffer = recorded
core.init_distributed()
t = torch.ones(64)
ds_comm.all_reduce(t)
path = os.path.join(os.environ["PROBE_OUT"], f"rank{rank}.json")
with open(path + ".tmp", "w") as f:
    json.dump({"pid": os.getpid(), "sum": t[0].item(), **made}, f)
os.replace(path + ".tmp", path)
while True:
    ds_comm.all_reduce(t)
    time.sleep(0.05)
"""


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.distributed
def test_sigterm_stops_every_rank_and_leaves_nothing_in_dev_shm(tmp_path):
    """SIGTERM to the launcher while its ranks all-reduce through DeepSpeed's shared memory: the launcher stops
    every rank and exits 1, and none of the ranks' /dev/shm buffers (which they did map) is left."""
    out = tmp_path / "out"
    out.mkdir()
    probe = tmp_path / "shm_probe.py"
    probe.write_text(SHM_PROBE)
    cmd = ranks_cmd(probe, [], 2)
    log = tmp_path / "launcher.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**env(), "PROBE_OUT": str(out)}, stdout=f,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120  # a guard against a hang, not a timing check
        while len(list(out.glob("rank*.json"))) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
        assert proc.poll() is None and sorted(ranks) == [0, 1], log.read_text()[-3000:]
        assert all(r["buffer"] and r["sum"] == 2.0 for r in ranks.values()), ranks  # shared memory in use
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:  # let the launcher stop its ranks before it is killed
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    output = log.read_text()
    assert code == 1, output[-3000:]
    assert [r["pid"] for r in ranks.values() if _running(r["pid"])] == [], output[-3000:]
    assert_no_shm_left(cmd)  # (and removes what a failure left)
