"""The README's figures for the default job: validation loss at steps 40 / 80 / 120 and the run time.

    python benchmarks/readme_losses.py --run native --run avx2   # runs the job twice (a few minutes each)
    python benchmarks/readme_losses.py DIR[=LABEL] ...          # reads finished runs' output directories
                                                                 # (LABEL avx2: a run made under the AVX2 limit)

``--run LABEL`` runs the README's job, ``deepspeed launch/train.py --deepspeed ds_configs/zero3.json``, into a
fresh directory and times it end to end (start-up and DeepSpeed's JIT builds included). LABEL ``avx2`` runs
it with ``MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2`` (GEMMs and convolutions limited to AVX2,
as on a CPU without AVX-512 or AMX); any other label runs with the environment as it is. Every run's
TensorBoard events give ``eval/loss`` at each step and the training time: from the first step's event to the
last event's (wall clock of the event records, start-up not included). Results go to
``benchmarks/results/readme_losses.{json,md}`` (``--out`` for another stem).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
STEPS = (40, 80, 120)
AVX2_ENV = {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def read_run(out_dir: Path) -> Dict[str, object]:
    """``eval/loss`` per step and the training time span from ``out_dir/tensorboard``'s event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = out_dir / "tensorboard"
    if not log_dir.is_dir():
        raise ValueError(f"{out_dir}: no tensorboard directory (not a finished launch/train.py output_dir?)")
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    if "eval/loss" not in tags or "train/loss" not in tags:
        raise ValueError(f"{log_dir}: no eval/loss or train/loss scalars")
    evals = {e.step: e.value for e in acc.Scalars("eval/loss")}
    events = [e for tag in tags for e in acc.Scalars(tag)]
    first = min(e.wall_time for e in acc.Scalars("train/loss"))
    return {"eval_loss": {str(s): round(v, 4) for s, v in sorted(evals.items())},
            "train_s": round(max(e.wall_time for e in events) - first, 1),
            "last_step": max(e.step for e in acc.Scalars("train/loss"))}


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(label: str, out_dir: Path) -> float:
    """Runs the README's job into ``out_dir``; returns its end-to-end wall time in seconds."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(AVX2_ENV if label == "avx2" else {}))
    # a free master port, so that another DeepSpeed job on the machine cannot collide with this one
    cmd = ["deepspeed", "--master_port", str(_free_port()), "launch/train.py", "--deepspeed", "ds_configs/zero3.json",
           "--output_dir", str(out_dir), "--no_progress"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return wall


def cpu() -> str:
    """The CPU's model name and which of AVX-512 / AMX / AVX2 it has (Linux), else the machine type."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                platform.machine())
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    return f"{name} ({', '.join(f for f in ('avx512f', 'amx_tile', 'avx2') if f in flags) or 'no AVX2'})"


def markdown(rows: List[Dict[str, object]]) -> str:
    head = ("| run | ISA limit | " + " | ".join(f"val. loss @{s}" for s in STEPS)
            + " | training (s) | end to end (s) |")
    lines = ["# The default job's validation loss (README figures)", "",
             f"`deepspeed launch/train.py --deepspeed ds_configs/zero3.json`, 1 rank. "
             f"{cpu()}, {os.cpu_count()} cores; load average "
             f"{os.getloadavg()[0]:.1f} at the end (the times depend on it).",
             "", head, "|" + "---|" * (len(STEPS) + 4)]
    for r in rows:
        losses = " | ".join(f"{r['eval_loss'].get(str(s), float('nan')):.4f}" for s in STEPS)
        e2e = f"{r['end_to_end_s']:.0f}" if r.get("end_to_end_s") is not None else "-"
        lines.append(f"| {r['label']} | {r['isa']} | {losses} | {r['train_s']:.0f} | {e2e} |")
    vals = {s: [r["eval_loss"][str(s)] for r in rows if str(s) in r["eval_loss"]] for s in STEPS}
    spread = ", ".join(f"@{s}: {max(v) - min(v):.4f}" for s, v in vals.items() if v)
    lines += ["", f"Spread (max - min) across the runs: {spread}."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="*", help="finished output directories, DIR or DIR=LABEL")
    p.add_argument("--run", action="append", default=[], metavar="LABEL",
                   help="run the job (LABEL avx2: under the AVX2 limit); may be repeated")
    p.add_argument("--out", default=str(RESULTS / "readme_losses"), help="results stem (.json and .md)")
    args = p.parse_args(argv)
    if not args.dirs and not args.run:
        p.error("give finished output directories or --run LABEL")
    rows = []
    try:
        for item in args.dirs:
            path, _, label = item.partition("=")
            label = label or Path(path).name
            rows.append({"label": label, "isa": "AVX2" if label == "avx2" else "native",
                         "end_to_end_s": None, **read_run(Path(path))})
        for label in args.run:
            out_dir = Path(tempfile.mkdtemp(prefix=f"readme_losses_{label}_"))
            wall = run_job(label, out_dir)
            rows.append({"label": label, "isa": "AVX2" if label == "avx2" else "native",
                         "end_to_end_s": round(wall, 1), "output_dir": str(out_dir), **read_run(out_dir)})
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for r in rows:
        print(json.dumps(r))
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"command": "deepspeed launch/train.py --deepspeed "
                                                    "ds_configs/zero3.json", "cpu": cpu(), "cores": os.cpu_count(),
                                                    "load_average_at_end": round(os.getloadavg()[0], 1),
                                                    "runs": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(rows))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
