"""Helpers for tests that run launch/train.py: tiny configs, the deepspeed launcher, TensorBoard read-back."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "launch" / "train.py"
LAUNCH_RANKS = REPO / "tests" / "launch_ranks.py"

TINY_MODEL = {"model_type": "llama", "vocab_size": 264, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "tie_word_embeddings": False}
# Other families' tiny configs of the same widths (fused projections: Phi-3's qkv_proj and gate_up_proj,
# GPT-NeoX's query_key_value); token ids inside the byte tokenizer's vocabulary.
TINY_PHI3 = {**TINY_MODEL, "model_type": "phi3", "bos_token_id": 1, "eos_token_id": 256, "pad_token_id": 256}
TINY_GPT_NEOX = {"model_type": "gpt_neox", "vocab_size": 264, "hidden_size": 64, "intermediate_size": 128,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
                 "tie_word_embeddings": False}

# Mixture-of-Experts families of the same widths: 4 experts, top-2
_TOKENS = {"bos_token_id": 1, "eos_token_id": 256, "pad_token_id": 256}
TINY_MIXTRAL = {**TINY_MODEL, **_TOKENS, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
TINY_QWEN2_MOE = {**TINY_MODEL, **_TOKENS, "model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64}
TINY_DEEPSEEK_V3 = {**TINY_MODEL, **_TOKENS, "model_type": "deepseek_v3", "moe_intermediate_size": 32,
                    "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1}


def write_configs(tmp: Path, stage: int = 3, plan: str = "fp8", model: Optional[dict] = None, **train) -> Path:
    """A DeepSpeed JSON for a tiny, fast run (fp32, small corpus) of ``model`` (a model config; default
    :data:`TINY_MODEL`); returns its path."""
    (tmp / "model.json").write_text(json.dumps(TINY_MODEL if model is None else model))
    base = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    base["zero_optimization"] = {"stage": stage} if stage < 3 else dict(base["zero_optimization"])
    base["train_micro_batch_size_per_gpu"] = 2
    base["snip"]["plan"] = plan
    base["snip"]["train"] = {"model_config": str(tmp / "model.json"), "block_size": 64, "max_steps": 6,
                             "eval_steps": 3, "eval_batches": 2, "save_steps": 3, "seed": 0,
                             "max_corpus_bytes": 200_000, "output_dir": str(tmp / "out"), **train}
    path = tmp / f"ds_stage{stage}_{plan.replace('/', '_')}.json"
    path.write_text(json.dumps(base, indent=1))
    return path


def env() -> Dict[str, str]:
    e = dict(os.environ)
    e.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    e.pop("SNIP_DS_SINGLE_PROCESS", None)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(key, None)
    return e


def launcher_head(launcher: str = "ranks") -> List[str]:
    """The command that starts ranks on this machine, before its ``--num_gpus N --master_port P SCRIPT ARGS``:
    ``"deepspeed"`` is DeepSpeed's launcher as ``deepspeed --num_gpus N`` runs it; ``"ranks"`` is
    tests/launch_ranks.py, which gives each rank the same command and environment without importing torch and
    DeepSpeed twice first (about 10 s a launch here). Tests whose subject is how users start a run use
    ``"deepspeed"``; the others ``"ranks"``."""
    if launcher == "deepspeed":
        return [sys.executable, "-m", "deepspeed.launcher.runner"]
    if launcher == "ranks":
        return [sys.executable, str(LAUNCH_RANKS)]
    raise ValueError(f"launcher: unknown value {launcher!r}; valid: ranks, deepspeed")


def ranks_cmd(script, args=(), num_ranks: int = 2, port: Optional[int] = None,
              launcher: str = "ranks") -> List[str]:
    """The command line that starts ``SCRIPT ARGS`` on N ranks of this machine: :func:`launcher_head`'s, then
    ``--num_gpus N --master_port P`` (``port``, else a free one drawn now: build the command anew for a retry)."""
    from snip_ds.engine.core import _free_port

    port = str(port or _free_port())
    return [*launcher_head(launcher), "--num_gpus", str(num_ranks), "--master_port", port, str(script),
            *map(str, args)]


def launch_cmd(args: List[str], num_ranks: int = 1, port: Optional[int] = None,
               launcher: str = "ranks") -> List[str]:
    """The command line that starts ``launch/train.py ARGS`` on N ranks: ``launcher`` is one of
    :func:`launcher_head`'s or ``"torchrun"`` (``torchrun --nproc_per_node N``)."""
    if launcher != "torchrun":
        return ranks_cmd(TRAIN, [*args, "--no_progress"], num_ranks, port, launcher)
    from snip_ds.engine.core import _free_port

    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(num_ranks), "--master_port",
            str(port or _free_port()), str(TRAIN), *args, "--no_progress"]


def launch(args: List[str], num_ranks: int = 1, timeout: int = 600, port: Optional[int] = None,
           cwd: Optional[Path] = None, launcher: str = "ranks") -> subprocess.CompletedProcess:
    """Runs :func:`launch_cmd`'s command and returns the finished process."""
    cmd = launch_cmd(args, num_ranks, port, launcher)
    proc = subprocess.run(cmd, cwd=cwd or REPO, env=env(), capture_output=True, text=True, timeout=timeout)
    assert_no_shm_left(cmd)
    return proc


def launch_all(arg_lists: List[List[str]], num_ranks: int = 1, timeout: int = 600) -> List[subprocess.CompletedProcess]:
    """:func:`launch` of independent runs (none reads what another writes), as many at once as the machine has
    cores for their ranks (each rank runs one thread: :func:`env`); returns the finished processes in order.
    Their master ports are chosen up front, all held open together, so two runs cannot draw the same one."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    socks = [socket.socket() for _ in arg_lists]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        ports = [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    at_once = max(1, (os.cpu_count() or 1) // num_ranks)
    with ThreadPoolExecutor(max_workers=at_once) as pool:
        return list(pool.map(lambda a: launch(a[0], num_ranks, timeout, port=a[1]), zip(arg_lists, ports)))


def assert_no_shm_left(cmd: List[str]) -> None:
    """Every launched run must leave none of DeepSpeed's shared-memory all-reduce buffers in /dev/shm."""
    if "--master_port" not in cmd:  # not a launcher command (the runner's own tests use stand-ins)
        return
    port = cmd[cmd.index("--master_port") + 1]
    left = sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))
    for path in left:  # do not let one failure fill the machine's RAM for the rest of the suite
        path.unlink(missing_ok=True)
    assert not left, f"the run left {[p.name for p in left]} in /dev/shm"


_RANK_KILLED = re.compile(r"exits with return code = -\d+")


def run_ranks(make_cmd: Callable[[], List[str]], timeout: int) -> subprocess.CompletedProcess:
    """Runs a multi-rank launcher command of a probe script whose only output is a file it rewrites.

    ``make_cmd()`` builds the command with a fresh master port. One retry when a rank was killed by a signal
    (the launcher logs "exits with return code = -N"): on the 2-core CI machine a rank of a 2-rank ZeRO-3
    probe once aborted with C++'s "terminate called without an active exception", which 16 local runs did
    not reproduce. A second such death, or any other failure, is returned as it is.
    """
    for attempt in range(2):
        cmd = make_cmd()
        proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0:
            assert_no_shm_left(cmd)
        if proc.returncode == 0 or attempt == 1 or not _RANK_KILLED.search(proc.stdout + proc.stderr):
            return proc
    return proc


def scalars(log_dir: Path) -> Dict[str, Dict[int, float]]:
    """Every scalar series in a TensorBoard directory, read back with tensorboard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def written_twice(log_dir: Path) -> Dict[str, List[int]]:
    """The scalar tags a TensorBoard directory holds more than one value of at one step, with those steps
    (:func:`scalars` keeps the last of them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    twice = {}
    for tag in acc.Tags()["scalars"]:
        steps = [e.step for e in acc.Scalars(tag)]
        repeated = sorted({s for s in steps if steps.count(s) > 1})
        if repeated:
            twice[tag] = repeated
    return twice


def images(log_dir: Path) -> List[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"images": 0})
    acc.Reload()
    return acc.Tags()["images"]


def ranks_directly(args: List[str], num_ranks: int = 2, timeout: int = 300,
                   preexec: Optional[Dict[int, Callable[[], None]]] = None) -> list:
    """Starts ``launch/train.py ARGS`` once per rank with the variables a launcher sets (``preexec[r]`` runs in
    rank r's child before it starts); returns each rank's (exit code, stdout, stderr)."""
    from snip_ds.engine.core import _free_port

    port = str(_free_port())
    procs = []
    for r in range(num_ranks):
        e = env()
        e.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(num_ranks), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, str(TRAIN), *args, "--no_progress"], cwd=REPO, env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      preexec_fn=(preexec or {}).get(r)))
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert_no_shm_left(["--master_port", port])
    return results


@pytest.fixture
def restore_environ():
    """For tests that run ``main()`` in process, which sets RANK/WORLD_SIZE/MASTER_PORT...: later tests must not
    inherit them. A module opts in with ``pytestmark = pytest.mark.usefixtures("restore_environ")`` after
    importing it."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def copy_of_run(run: dict, into: Path) -> dict:
    """A module's own copy of a shared finished run (``run``: its ``cfg`` and ``out``): ``into/out`` holds a copy
    of its output directory and ``into/<cfg name>`` its config with ``output_dir`` pointing there, so a module
    that writes beside the run or resumes it cannot change what another module reads."""
    import shutil

    shutil.copytree(run["out"], into / "out")
    shutil.copy(run["cfg"].parent / "model.json", into / "model.json")  # write_configs' model config
    data = json.loads(run["cfg"].read_text())
    data["snip"]["train"].update(output_dir=str(into / "out"), model_config=str(into / "model.json"))
    cfg = into / run["cfg"].name
    cfg.write_text(json.dumps(data, indent=1))
    return {"tmp": into, "cfg": cfg, "out": into / "out"}

