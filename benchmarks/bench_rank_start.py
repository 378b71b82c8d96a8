"""What loading DeepSpeed's (already built) fused_adam op costs a rank at start: py-cpuinfo asked at every load, or
its answer kept per CPU (snip_ds.runtime.cpuinfo_cache).

    python benchmarks/bench_rank_start.py [--repeats 5] [--output_dir DIR]

Each measurement is a fresh Python process (as a rank is: nothing cached in memory) that imports DeepSpeed, then
times ``FusedAdamBuilder().load()`` -- the load every rank of a CPU run does when DeepSpeed builds its optimizer
-- against the environment's build folder (the op is built already: ``launch/warm_ops.py``). ``deepspeed``:
DeepSpeed as it is, py-cpuinfo answering from a new process at each question. ``kept``: after
``snip_ds.runtime.cpuinfo_cache.install`` with this CPU's answer kept (written by one process before the measurements).
The two alternate, ``--repeats`` times each, in one run; the table gives each one's median and the ratio.

Writes ``bench_rank_start.json`` and ``.md`` into ``--output_dir`` (default: print only), naming the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from snip_ds.runtime import jit_builds  # noqa: E402  (standard library only: no torch, no DeepSpeed)

CHILD = """
import json, sys, time
from pathlib import Path
from deepspeed.ops.op_builder.cpu import FusedAdamBuilder
if sys.argv[1] == "kept":
    from snip_ds.runtime import cpuinfo_cache
    cpuinfo_cache.install(Path(sys.argv[2]))
t = time.perf_counter()
FusedAdamBuilder().load(verbose=False)
print(json.dumps({"load_s": time.perf_counter() - t}))
"""


def _one(mode: str, root: Path) -> float:
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(root), PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, str(root)], env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(proc.stdout.splitlines()[-1])["load_s"]


def measure(repeats: int) -> dict:
    root = jit_builds.build_root()
    _one("kept", root)  # builds fused_adam if it is missing, and keeps this CPU's answer
    times = {"deepspeed": [], "kept": []}
    for _ in range(repeats):
        for mode in times:
            times[mode].append(_one(mode, root))
    median = {mode: statistics.median(ts) for mode, ts in times.items()}
    return {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "python": sys.version.split()[0], "repeats": repeats, "times_s": times, "median_s": median,
            "saved_s": median["deepspeed"] - median["kept"], "ratio": median["deepspeed"] / median["kept"]}


def markdown(res: dict) -> str:
    m = res["median_s"]
    return "\n".join([
        "# Loading DeepSpeed's built fused_adam op at a rank's start",
        "",
        f"{res['machine']}, Python {res['python']}; each a fresh process, {res['repeats']} alternating repeats "
        "(`python benchmarks/bench_rank_start.py`).",
        "",
        "| py-cpuinfo | median load (s) |",
        "|---|---|",
        f"| asked at every load (DeepSpeed as it is) | {m['deepspeed']:.2f} |",
        f"| kept per CPU (snip_ds.runtime.cpuinfo_cache) | {m['kept']:.2f} |",
        "",
        f"Saved per rank start: {res['saved_s']:.2f} s ({res['ratio']:.1f}x faster load).",
        ""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output_dir", type=Path)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats: must be at least 1, got {args.repeats}")
    res = measure(args.repeats)
    text = markdown(res)
    print(text)
    if args.output_dir is not None:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        (args.output_dir / "bench_rank_start.json").write_text(json.dumps(res, indent=1) + "\n")
        (args.output_dir / "bench_rank_start.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
