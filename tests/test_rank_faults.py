"""A rank that dies or hangs, and two nodes on one machine: real launcher processes, gloo on CPU, no mocks.

* ``--dist_timeout``: a hung rank (paused by ``SNIP_DS_PAUSE_AT``) makes its peer's collective time out after
  the set time; the peer exits 1 with one ``error:`` line, the launcher exits non-zero.
* A rank SIGKILLed mid-step, during a statistics collection and during a checkpoint save, in a 2-node run
  (two ``torchrun`` agents on this machine, one rank each): both agents exit non-zero, the survivor with one
  ``error:`` line and its TensorBoard file holding every loss it logged before the stop; ``latest`` names the
  last complete checkpoint, and resuming from the run's directory reproduces the uninterrupted run's losses
  bit for bit (CPU is deterministic).
* Two nodes with node-local output directories: each file is written once, by its owner (TensorBoard, plan,
  statistics, ``snip_meta.json`` and ``latest`` by global rank 0 only; node 1's local rank 0, global rank 1,
  writes only its own shards).
* DeepSpeed's own launcher with a two-entry hostfile (``--no_ssh``, one runner per node) trains and saves.
* SIGTERM to both agents of a 2-node run: every rank saves and stops cleanly.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train_utils import REPO, TRAIN, assert_no_shm_left, env, launch_cmd, restore_environ, scalars, write_configs  # noqa: F401

from snip_ds.runtime import faults

LOST = "a collective failed, another rank died or stopped answering"


# ---------------------------------------------------------------------------------------------- unit tests
def test_pause_spec_is_parsed_and_a_bad_one_names_the_variable(monkeypatch):
    assert faults.parse("save:4:1") == ("save", 4, 1, faults.DEFAULT_PAUSE_S)
    assert faults.parse("collect:0:0:2.5") == ("collect", 0, 0, 2.5)
    for text, words in (("save:4", "expected POINT:STEP:RANK"), ("nap:1:0", "unknown point 'nap'"),
                        ("step:x:0", "must be integers"), ("step:1:-1", "non-negative")):
        with pytest.raises(ValueError, match=re.escape(words)) as info:
            faults.parse(text)
        assert str(info.value).startswith("SNIP_DS_PAUSE_AT: ")
    monkeypatch.setenv(faults.ENV, "step:3:1")
    assert faults.spec() == ("step", 3, 1, faults.DEFAULT_PAUSE_S)
    faults.pause_point("step", 2, 1)  # another step: returns at once
    faults.pause_point("step", 3, 0)  # another rank
    monkeypatch.setenv(faults.ENV, "")
    assert faults.spec() is None


def test_init_distributed_refuses_a_timeout_that_is_not_a_positive_number():
    import torch.distributed as dist

    from snip_ds.engine import init_distributed

    assert not dist.is_initialized()
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="init_distributed: timeout_s must be a positive number of seconds"):
            init_distributed(bad)
    assert not dist.is_initialized()


def test_a_second_process_group_in_one_process_gets_deepspeed_groups_of_its_own(monkeypatch, restore_environ):  # noqa: F811
    """Two trainings in one process (a notebook, bench_train's plans, in-process tests): the second's
    ``deepspeed.initialize`` broadcasts from DeepSpeed's clone of the world group, which must belong to the
    second process group. Torch's own teardown alone left DeepSpeed's clone of the first, destroyed, group in
    place ("Group ... is not registered")."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    from snip_ds.engine import destroy_distributed, init_distributed

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SNIP_DS_SINGLE_PROCESS"):
        monkeypatch.delenv(key, raising=False)
    clones = []
    for _ in range(2):
        init_distributed(60)
        try:
            clones.append(groups._clone_world_group())
            assert dist.get_global_rank(clones[-1], 0) == 0  # raises for a group of a destroyed process group
        finally:
            destroy_distributed()
        assert not dist.is_initialized()
    assert clones[0] is not clones[1]
    destroy_distributed()  # nothing up: a no-op


@pytest.mark.parametrize("flag, words", [
    (["--dist_timeout", "0"], "--dist_timeout: must be a positive number of seconds, got 0.0"),
    (["--dist_timeout", "nan"], "--dist_timeout: must be a positive number of seconds, got nan"),
])
def test_a_bad_timeout_or_pause_spec_is_one_error_line(tmp_path, capsys, monkeypatch, flag, words):
    from snip_ds.run.trainer import main

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SNIP_DS_SINGLE_PROCESS"):
        monkeypatch.delenv(key, raising=False)
    cfg = write_configs(tmp_path, stage=3, plan="fp8")
    assert main(["--deepspeed", str(cfg), *flag, "--no_progress"]) == 2
    assert capsys.readouterr().err == f"error: {words}\n"
    monkeypatch.setenv(faults.ENV, "save:one:1")
    assert main(["--deepspeed", str(cfg), "--no_progress"]) == 2
    assert capsys.readouterr().err.startswith("error: SNIP_DS_PAUSE_AT: STEP and RANK must be integers")
    monkeypatch.delenv(faults.ENV)
    monkeypatch.setenv("SNIP_DS_TRITON_DIRECT", "yes")
    assert main(["--deepspeed", str(cfg), "--no_progress"]) == 2
    assert capsys.readouterr().err.startswith("error: SNIP_DS_TRITON_DIRECT='yes': expected 0")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------ real runs: helpers
def _free_port() -> str:
    from snip_ds.engine.core import _free_port as free
    return str(free())


def _start(cmds, logs, extra_env=None):
    """Starts each command with its output (stdout and stderr) in its log file; returns the processes."""
    e = env()
    e.update(extra_env or {})
    procs = []
    for cmd, log in zip(cmds, logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=e, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    return procs


def _torchrun_nodes(tmp: Path, name: str, args, nodes: int = 2, nproc: int = 1, extra_env=None, node_args=None):
    """``nodes`` torchrun agents on this machine (static rendezvous on 127.0.0.1): node ``n`` gets global
    ranks ``n*nproc .. n*nproc+nproc-1``. Returns (processes, log paths)."""
    port = _free_port()
    cmds, logs = [], []
    for n in range(nodes):
        cmds.append([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node_rank", str(n),
                     "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port", port,
                     str(TRAIN), *args, *(node_args[n] if node_args else []), "--no_progress"])
        logs.append(tmp / f"{name}.node{n}.log")
    return _start(cmds, logs, extra_env), logs


def _wait(procs, timeout: float = 400):
    """Exit codes, waiting at most ``timeout`` seconds in all; kills what is left (and fails) after that."""
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(deadline - time.monotonic(), 1)) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


_PAUSED = re.compile(r"snip_ds: fault injection: rank (\d+) pid (\d+) paused at (\w+) of step (\d+)")


def _wait_for_pause(procs, logs, timeout: float = 300) -> int:
    """The pid of the rank that printed the fault-injection line (fails if a process exits first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for log in logs:
            m = _PAUSED.search(Path(log).read_text(errors="replace"))
            if m:
                return int(m.group(2))
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    _wait(procs, 1)
    raise AssertionError("no rank paused: " + "\n".join(Path(log).read_text()[-3000:] for log in logs))


def _read(log) -> str:
    return Path(log).read_text(errors="replace")


def _adaptive_config(tmp: Path, **train) -> Path:
    """The tiny 2-rank ZeRO-3 run, adaptive, re-planned every 2 steps, saved every 2 steps, 4 steps."""
    cfg = write_configs(tmp, stage=3, plan="adaptive", **{"max_steps": 4, "save_steps": 2, "eval_steps": 2, **train})
    data = json.loads(cfg.read_text())
    data["snip"].update(replan_every=2, additional_bf16_fwd_every_n_steps=0)
    cfg.write_text(json.dumps(data, indent=1))
    return cfg


def _ok(codes, logs):
    assert codes == [0] * len(codes), "\n".join(_read(log)[-4000:] for log in logs)


# ------------------------------------------------------------------------------- the collective timeout
@pytest.mark.slow
@pytest.mark.distributed
def test_a_hung_rank_stops_its_peer_after_the_dist_timeout(tmp_path):
    """Rank 1 hangs inside step 2 (paused, alive): rank 0's collective times out after --dist_timeout (10 s;
    the gloo message carries the timeout in ms), rank 0 exits 1 with one error line, and the launcher
    stops rank 1 and exits non-zero. /dev/shm is left clean."""
    cfg = write_configs(tmp_path, stage=3, plan="fp8", max_steps=4, save_steps=2)
    cmd = launch_cmd(["--deepspeed", str(cfg), "--dist_timeout", "10"], num_ranks=2)
    log = tmp_path / "hung.log"
    procs = _start([cmd], [log], {faults.ENV: "step:1:1"})
    _wait_for_pause(procs, [log])
    (code,) = _wait(procs, 300)
    text = _read(log)
    assert code != 0, text[-4000:]
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: rank 0: {LOST}"), text[-4000:]
    assert "Timed out waiting 10000ms" in errors[0]
    assert not (tmp_path / "out" / "checkpoints").exists()  # stopped before the first save (step 2)
    assert_no_shm_left(cmd)


# -------------------------------------------------------------------------------- a rank is SIGKILLed
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 2-node run (2 torchrun agents, one rank each): re-plans before steps 1 and 3,
    checkpoints at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("faults")
    cfg = _adaptive_config(tmp)
    procs, logs = _torchrun_nodes(tmp, "reference", ["--deepspeed", str(cfg)])
    _ok(_wait(procs), logs)
    out = tmp / "out"
    assert (out / "checkpoints" / "latest").read_text() == "step_4"
    loss = scalars(out / "tensorboard")["train/loss"]
    assert sorted(loss) == [1, 2, 3, 4]
    history = json.loads((out / "checkpoints" / "step_4" / "snip_state.json").read_text())["planner"]["history"]
    assert [h["step"] for h in history] == [0, 2]  # two adaptive plans, agreed on by both ranks (set_plan checks)
    return {"tmp": tmp, "cfg": cfg, "loss": loss}


# point -> (SNIP_DS_PAUSE_AT on rank 1, the checkpoint that must be the last complete one, the last step whose
# loss rank 0 logged to TensorBoard before it stopped)
KILLS = {"step": ("step:2:1", "step_2", 2),        # inside step 3, after its backward
         "collect": ("collect:2:1", "step_2", 2),  # the re-plan before step 3
         "save": ("save:4:1", "step_2", 4)}        # step 4's checkpoint, after DeepSpeed's shards


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("point", sorted(KILLS))
def test_a_killed_rank_stops_the_job_and_a_resume_reproduces_the_losses(reference, point):
    tmp, cfg = reference["tmp"], reference["cfg"]
    spec, last, logged = KILLS[point]
    out = tmp / f"killed_{point}"
    procs, logs = _torchrun_nodes(tmp, f"killed_{point}", ["--deepspeed", str(cfg), "--output_dir", str(out),
                                                          "--dist_timeout", "120"], extra_env={faults.ENV: spec})
    pid = _wait_for_pause(procs, logs)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    codes = _wait(procs, 300)
    print(f"{point}: agents exited {codes}, {time.monotonic() - killed_at:.1f} s after the kill")
    assert codes[0] != 0 and codes[1] != 0, [_read(log)[-3000:] for log in logs]
    survivor = _read(logs[0])
    errors = [line for line in survivor.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: rank 0: {LOST}"), survivor[-4000:]
    assert "Timed out" not in errors[0]  # noticed at once (the connection closed), not by the timeout
    # the surviving logging rank flushed its TensorBoard file before it stopped: every loss it logged is there
    assert scalars(out / "tensorboard")["train/loss"] == {s: reference["loss"][s] for s in range(1, logged + 1)}
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text() == last
    if point == "save":  # the interrupted checkpoint has DeepSpeed's files but no completion marker
        assert (ckpts / "step_4" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file()
        assert not (ckpts / "step_4" / "snip_meta.json").exists()

    resumed = tmp / f"resumed_{point}"
    procs, logs = _torchrun_nodes(tmp, f"resumed_{point}", ["--deepspeed", str(cfg), "--resume_from_checkpoint",
                                                           str(out), "--output_dir", str(resumed)])
    _ok(_wait(procs), logs)
    assert f"at step {last.split('_')[1]}" in _read(logs[0])
    again = scalars(resumed / "tensorboard")["train/loss"]
    assert sorted(again) == [3, 4]
    for step in (3, 4):  # bit for bit: the same data, RNG states and plans on the same topology
        assert again[step] == reference["loss"][step], (step, again[step], reference["loss"][step])


# ------------------------------------------------------------------------------------ who writes what
def _files(root: Path) -> set:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def _shards(ranks) -> set:
    return {f"checkpoints/step_2/{name}" for r in ranks for name in (
        f"snip_rng_rank{r}.safetensors", f"zero_pp_rank_{r}_mp_rank_00_model_states.pt",
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [1, 2])
def test_two_nodes_with_node_local_output_write_each_file_once_from_its_owner(tmp_path, nproc):
    """Node 1's local rank 0 is global rank ``nproc`` (1 or 2): in its own (node-local) output directory node 1
    writes only its ranks' DeepSpeed shards and RNG files; everything global comes from global rank 0."""
    cfg = _adaptive_config(tmp_path, max_steps=2)
    dirs = [tmp_path / "node0_out", tmp_path / "node1_out"]
    procs, logs = _torchrun_nodes(tmp_path, "local", ["--deepspeed", str(cfg)], nproc=nproc,
                                  node_args=[["--output_dir", str(d)] for d in dirs])
    _ok(_wait(procs), logs)
    tb = {f for f in _files(dirs[0]) if f.startswith("tensorboard/")}
    assert len(tb) == 1
    assert _files(dirs[1]) == _shards(range(nproc, 2 * nproc))
    assert _files(dirs[0]) == tb | _shards(range(nproc)) | {
        "plan.json", "stats.json", "summary.json", "checkpoints/latest", "checkpoints/zero_to_fp32.py",
        "checkpoints/zero_to_torch.py", "checkpoints/step_2/snip_state.json", "checkpoints/step_2/snip_meta.json"}
    # rank 0's record covers both nodes' shards (each rank hashed the files it sees) and its snip_state.json
    meta = json.loads((dirs[0] / "checkpoints" / "step_2" / "snip_meta.json").read_text())
    assert meta["world_size"] == 2 * nproc
    assert sorted(meta["files"]) == sorted([f.split("/", 2)[2] for f in _shards(range(2 * nproc))]
                                           + ["snip_state.json"])
    assert f"{2 * nproc} rank(s)" in _read(logs[0]) and "rank(s)" not in _read(logs[1])  # rank 0 alone prints


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_to_both_nodes_saves_and_stops_every_rank(tmp_path):
    """As a scheduler stops a job: SIGTERM to both torchrun agents while rank 0 is inside step 2 (paused 3 s);
    the agents pass it to their ranks, which finish the step, save step_2 and exit 0."""
    cfg = write_configs(tmp_path, stage=3, plan="fp8", max_steps=6, save_steps=0, eval_steps=6)
    procs, logs = _torchrun_nodes(tmp_path, "sigterm", ["--deepspeed", str(cfg)],
                                  extra_env={faults.ENV: "step:1:0:3"})
    _wait_for_pause(procs, logs)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    codes = _wait(procs, 300)
    text = _read(logs[0])
    assert "snip_ds: stopped by SIGTERM at step 2" in text, text[-4000:]
    assert (tmp_path / "out" / "checkpoints" / "latest").read_text() == "step_2"
    assert "error:" not in text + _read(logs[1])
    print(f"SIGTERM: agents exited {codes}")


@pytest.mark.slow
@pytest.mark.distributed
def test_deepspeed_launcher_with_a_two_node_hostfile(tmp_path):
    """DeepSpeed's own launcher, a hostfile of two entries, one runner per node started without ssh
    (``--no_ssh --node_rank N``): the ranks follow the hostfile's order and the run trains and saves."""
    cfg = write_configs(tmp_path, stage=3, plan="fp8", max_steps=2, save_steps=2, eval_steps=2)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    port = _free_port()
    cmds = [[sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh",
             "--node_rank", str(n), "--master_addr", "127.0.0.1", "--master_port", port, str(TRAIN),
             "--deepspeed", str(cfg), "--no_progress"] for n in range(2)]
    logs = [tmp_path / f"ds.node{n}.log" for n in range(2)]
    _ok(_wait(_start(cmds, logs)), logs)
    assert "global_rank_mapping=defaultdict(<class 'list'>, {'node0': [0], 'node1': [1]})" in _read(logs[0])
    assert "2 rank(s)" in _read(logs[0])
    ckpts = tmp_path / "out" / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_2"
    meta = json.loads((ckpts / "step_2" / "snip_meta.json").read_text())
    assert meta["world_size"] == 2 and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in meta["files"]
    assert_no_shm_left(["--master_port", port])  # one rank per node: no shared-memory all-reduce
