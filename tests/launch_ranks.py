"""Starts a script's ranks on this machine as ``deepspeed --num_gpus N`` does, without its two Python processes.

``python -m deepspeed.launcher.runner --num_gpus N --master_port P SCRIPT ARGS`` imports torch and DeepSpeed
twice (the runner, then ``deepspeed.launcher.launch``) before the first rank starts: about 10 s of a 2-core
machine per launch, most of the slow tier's time across its launches. This launcher takes the same leading
options and gives each rank what DeepSpeed's gives it on one node (tests/test_launch_ranks.py compares the two
rank by rank):

- the environment: the caller's plus ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT``, ``CROSS_RANK``, ``CROSS_SIZE``, ``CUDA_VISIBLE_DEVICES`` and the
  ``PYTORCH_NVML_BASED_CUDA_CHECK`` that importing DeepSpeed sets in the launcher;
- the command ``python -u SCRIPT --local_rank=R ARGS``, its stdout and stderr the launcher's own;
- the same end: when a rank exits non-zero, every rank's process tree is terminated (killed after 30 s), the
  line ``CMD exits with return code = C`` is logged and the launcher exits with C; SIGINT/SIGTERM terminate
  the ranks and exit 1; it exits 0 once every rank has.

Standard library and psutil (a DeepSpeed dependency) only, so it starts in milliseconds. Tests whose subject is
DeepSpeed's launcher itself keep running it.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import List

import psutil


def _parse(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_gpus", type=int, required=True, help="ranks on this machine")
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument("--master_addr", default="127.0.0.1")
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.num_gpus < 1:
        parser.error(f"--num_gpus: {args.num_gpus} ranks; give 1 or more")
    return args


def _terminate_tree(pid: int) -> None:
    try:
        procs = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=30)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def main(argv: List[str]) -> int:
    args = _parse(argv)
    n = args.num_gpus
    base = dict(os.environ)
    base.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    base.update(CUDA_VISIBLE_DEVICES=",".join(str(r) for r in range(n)), MASTER_ADDR=args.master_addr,
                MASTER_PORT=str(args.master_port), WORLD_SIZE=str(n), CROSS_RANK="0", CROSS_SIZE="1",
                LOCAL_SIZE=str(n))
    procs, cmd = [], []
    for rank in range(n):
        cmd = [sys.executable, "-u", args.script, f"--local_rank={rank}", *args.script_args]
        procs.append(subprocess.Popen(cmd, env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}))

    def stop(code: int) -> int:
        for p in procs:
            _terminate_tree(p.pid)
        if code:
            print(f"{cmd} exits with return code = {code}", file=sys.stderr, flush=True)
        return code

    def on_signal(signum, frame):
        stop(0)
        sys.exit(1)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    alive = list(procs)
    while alive:
        for p in list(alive):
            code = p.poll()
            if code is None:
                continue
            if code != 0:
                return stop(code)
            alive.remove(p)
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
