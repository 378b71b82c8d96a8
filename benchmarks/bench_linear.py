"""Forward+backward time and peak memory of SnipLinear (bf16/fp8/fp4) against nn.Linear, side by side.

    python benchmarks/bench_linear.py [--tokens 2048] [--repeats 5] [--quick]

For each Llama-like shape, the four variants run round-robin (so machine load hits them alike) and the
median time of each is divided by nn.Linear's. Peak memory is what one forward+backward adds to resident
memory at its high-water mark (input, weight and incoming gradient exist before; Linux VmHWM, see
peak_bytes), divided by nn.Linear's. Results go to benchmarks/results/bench_linear.{json,md}.
Targets on a CPU in FP32: fp4 time <= 1.5x and peak memory <= 1.2x of nn.Linear.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from snip_ds.linear import SnipLinear  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = [(2048, 2048), (2048, 5632), (5632, 2048)]  # (in k, out n): attention q/o, MLP up, MLP down


def _status_bytes(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+) kB", text).group(1)) * 1024


def _memory_child(variant: str, tokens: int, k: int, n: int) -> int:
    """In a fresh process: bytes the step adds to resident memory at its peak (VmHWM - VmRSS at start)."""
    layer, x, g = _setup(variant, tokens, k, n)
    step, clear = step_fn(layer, x, g)
    clear()
    step()  # warm-up: first-touch costs and lazily created state are not the step's
    clear()
    start = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    step()
    return _status_bytes("VmHWM") - start


def peak_bytes(variant: str, tokens: int, k: int, n: int) -> int:
    """Peak extra resident memory of one forward+backward, measured in a fresh process.

    glibc's mmap threshold is pinned at 128 KiB there, so every large tensor is its own mapping and is
    returned to the OS when freed: resident memory then follows the live tensors (temporaries included).
    That setting slows allocation down, so times are measured here, not there.
    """
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    out = subprocess.run([sys.executable, __file__, "--_memory", variant, str(tokens), str(k), str(n)],
                         env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def _setup(variant: str, tokens: int, k: int, n: int):
    gen = torch.Generator().manual_seed(0)
    base = nn.Linear(k, n, bias=False)
    x = torch.randn(tokens, k, generator=gen).requires_grad_(True)
    g = torch.randn(tokens, n, generator=gen)
    if variant == "nn.Linear":
        return base, x, g
    layer = SnipLinear.from_linear(base, variant)
    layer.generator = torch.Generator().manual_seed(1)
    return layer, x, g


def step_fn(layer: nn.Module, x: torch.Tensor, g: torch.Tensor):
    """One forward+backward; gradients are cleared *before* it runs, so it allocates them afresh."""
    def step():
        layer(x).backward(g)

    def clear():
        x.grad = None
        layer.weight.grad = None
    return step, clear


def timed(step, clear) -> float:
    clear()
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


VARIANTS = ("nn.Linear", "bf16", "fp8", "fp4")


def bench_shape(tokens: int, k: int, n: int, repeats: int) -> dict:
    base, x, g = _setup("nn.Linear", tokens, k, n)
    variants = {"nn.Linear": base}
    for precision in VARIANTS[1:]:
        layer = SnipLinear.from_linear(base, precision)
        layer.generator = torch.Generator().manual_seed(1)
        variants[precision] = layer
    fns = {name: step_fn(layer, x, g) for name, layer in variants.items()}
    for fn in fns.values():  # warm-up
        timed(*fn)
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(timed(*fn))
    peaks = {name: peak_bytes(name, tokens, k, n) for name in VARIANTS}
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "tokens": tokens, "in_features": k, "out_features": n,
        "time_s": med, "peak_bytes": peaks,
        "time_ratio": {name: med[name] / med["nn.Linear"] for name in med},
        "memory_ratio": {name: peaks[name] / peaks["nn.Linear"] for name in peaks},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="small shapes, 2 repeats, results not written")
    p.add_argument("--_memory", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._memory:
        variant, tokens, k, n = args._memory
        print(_memory_child(variant, int(tokens), int(k), int(n)))
        return 0
    shapes = [(256, 256)] if args.quick else SHAPES
    tokens = 256 if args.quick else args.tokens
    repeats = 2 if args.quick else args.repeats
    rows = [bench_shape(tokens, k, n, repeats) for k, n in shapes]
    header = f"{'shape (T, k, n)':>22} | " + " | ".join(f"{v:>14}" for v in ("bf16", "fp8", "fp4"))
    print("time ratio vs nn.Linear (median of round-robin repeats) / peak-memory ratio")
    print(header)
    for r in rows:
        cells = " | ".join(f"{r['time_ratio'][v]:5.2f}x / {r['memory_ratio'][v]:4.2f}x" for v in ("bf16", "fp8", "fp4"))
        print(f"{str((r['tokens'], r['in_features'], r['out_features'])):>22} | {cells}")
    if args.quick:
        return 0
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor() or
            platform.machine(), "cores": os.cpu_count(), "dtype": "float32", "repeats": repeats}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_linear.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = ["# bench_linear: SnipLinear vs nn.Linear, forward+backward, FP32 on CPU", "",
             f"torch {meta['torch']}, {meta['threads']} threads, {meta['cores']} cores; median of {repeats} "
             "round-robin repeats. Ratios to nn.Linear: time / peak memory the step adds (VmHWM in a fresh "
             "process, glibc mmap threshold pinned so freed tensors leave resident memory).", "",
             "| T | k | n | nn.Linear time (s) | bf16 | fp8 | fp4 |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = " | ".join(f"{r['time_ratio'][v]:.2f}x / {r['memory_ratio'][v]:.2f}x" for v in ("bf16", "fp8", "fp4"))
        lines.append(f"| {r['tokens']} | {r['in_features']} | {r['out_features']} | "
                     f"{r['time_s']['nn.Linear']:.3f} | {cells} |")
    (RESULTS / "bench_linear.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS / 'bench_linear.json'} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
