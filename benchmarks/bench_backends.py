"""Forward+backward time of one SnipLinear per GEMM backend and recipe against nn.Linear, side by side.

    python benchmarks/bench_backends.py [--size 2048] [--repeats 3] [--dtypes float32 bfloat16] [--tag NAME]
                                        [--threads N] [--clock wall|cpu] [--stat median|min]

One layer of T = k = n = ``size`` (no bias). Every variant (nn.Linear, and each backend x recipe) runs
round-robin, so machine load hits them alike; the median time of each is divided by nn.Linear's in the
same dtype. The ``auto`` column is the backend ``backend: auto`` picks for the recipe here (its ratio, from the
same runs). The torch backend quantizes on CPU with snip_ds's fused C++ kernels (snip_ds/backend/cpu): their
build (compile, or load from the cache) is timed first and reported, with the instruction-set variant they
run. Also timed once: the bare GEMM kernels the backends are built on (FP32 mm, BF16 mm, torch._scaled_mm on
FP8). Results go to benchmarks/results/bench_backends[_TAG].{json,md}.

``--clock cpu`` times the process's CPU time instead of the wall clock; with ``--threads 1`` (which it
requires: idle threads would count their spinning) that is the work itself, whatever else loads the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from snip_ds.quant_config import QuantConfig  # noqa: E402
from snip_ds.linear import SnipLinear  # noqa: E402
from snip_ds.backend import cpu as cpu_kernels, resolve  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
RECIPES = {  # name -> (precision, QuantConfig fields)
    "fp8_hybrid": ("fp8", {"fp8_recipe": "fp8_hybrid"}),
    "mxfp8": ("fp8", {"fp8_recipe": "mxfp8"}),
    "nvfp4": ("fp4", {"fp4_recipe": "nvfp4"}),  # 2-D weight blocks, stochastic rounding of G_Y (defaults)
    "mxfp4": ("fp4", {"fp4_recipe": "mxfp4"}),
}
BACKENDS = ("emulated", "torch")


_CLOCK = time.perf_counter
_STAT = statistics.median


def _time(fn) -> float:
    start = _CLOCK()
    fn()
    return _CLOCK() - start


def kernel_times(size: int, repeats: int) -> dict:
    """Seconds of one size^3 product: FP32 mm, BF16 mm, and torch._scaled_mm (E4M3, tensorwise scales)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen)
    a16, a8 = a.to(torch.bfloat16), a.to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    fns = {"mm_fp32": lambda: torch.mm(a, a), "mm_bf16": lambda: torch.mm(a16, a16),
           "scaled_mm_fp8": lambda: torch._scaled_mm(a8, a8.t(), scale_a=one, scale_b=one,
                                                     out_dtype=torch.bfloat16)}
    out = {}
    for name, fn in fns.items():
        try:
            fn()
            out[name] = min(_time(fn) for _ in range(repeats))
        except RuntimeError as err:
            out[name] = f"does not run: {str(err).splitlines()[0]}"
    return out


def bench(size: int, dtype: torch.dtype, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    base = nn.Linear(size, size, bias=False, dtype=dtype)
    x = torch.randn(size, size, generator=gen).to(dtype).requires_grad_(True)
    g = torch.randn(size, size, generator=gen).to(dtype)
    layers = {"nn.Linear": base}
    for backend in BACKENDS:
        for recipe, (precision, fields) in RECIPES.items():
            layer = SnipLinear.from_linear(base, precision, QuantConfig(backend=backend, **fields))
            layer.generator = torch.Generator().manual_seed(1)
            layers[f"{backend}/{recipe}"] = layer

    def step(layer):
        x.grad = None
        base.weight.grad = None
        layer(x).backward(g)

    for layer in layers.values():  # warm-up
        step(layer)
    times = {name: [] for name in layers}
    for _ in range(repeats):
        for name, layer in layers.items():
            times[name].append(_time(lambda: step(layer)))
    med = {name: _STAT(ts) for name, ts in times.items()}
    auto = {recipe: resolve("auto", precision, QuantConfig(**fields), "cpu").name
            for recipe, (precision, fields) in RECIPES.items()}
    return {"dtype": str(dtype).replace("torch.", ""), "size": size, "time_s": med,
            "ratio": {name: med[name] / med["nn.Linear"] for name in med}, "auto": auto}


def kernel_build() -> dict:
    """Builds (or loads from the cache) the fused CPU quantization kernels; what it took."""
    build_dir = cpu_kernels.build_directory()
    cached = os.path.exists(os.path.join(build_dir, f"{cpu_kernels.EXTENSION_NAME}.so"))
    ok = cpu_kernels.load()
    return {"available": ok, "seconds": cpu_kernels.load_seconds(), "cached": cached,
            "isa_variant": {2: "AVX-512", 1: "AVX2", 0: "baseline"}[cpu_kernels.isa_level()] if ok else None,
            "error": cpu_kernels.unavailable_reason()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=2048, help="T = k = n")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--kernel_size", type=int, default=512, help="size of the bare-kernel products")
    p.add_argument("--tag", default="", help="suffix of the result files (e.g. avx2)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall clock, or the process's CPU time (needs --threads 1)")
    p.add_argument("--stat", choices=["median", "min"], default="median",
                   help="per variant, the median of the repeats or the fastest (least disturbed by other load)")
    args = p.parse_args(argv)
    if args.threads < 0:
        p.error(f"--threads: expected a number >= 0, got {args.threads}")
    if args.clock == "cpu" and args.threads != 1:
        p.error("--clock cpu: needs --threads 1 (with more threads, CPU time counts idle threads spinning)")
    if args.threads:
        torch.set_num_threads(args.threads)
    global _CLOCK
    _CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    global _STAT
    _STAT = min if args.stat == "min" else statistics.median
    load_start = os.getloadavg()
    build = kernel_build()
    kernels = kernel_times(args.kernel_size, args.repeats)
    rows = [bench(args.size, getattr(torch, d), args.repeats) for d in args.dtypes]
    env = {k: os.environ[k] for k in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
           if k in os.environ}
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cores": os.cpu_count(),
            "cpu": platform.processor() or platform.machine(), "isa_env": env, "repeats": args.repeats,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "clock": args.clock, "stat": args.stat,
            "load_average_start": load_start, "load_average": os.getloadavg()}
    name = "bench_backends" + (f"_{args.tag}" if args.tag else "")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"meta": meta, "cpu_quant_kernels": build,
                                                      "kernels_s": kernels, "rows": rows}, indent=2) + "\n")
    lines = [f"# {name}: SnipLinear per backend vs nn.Linear, forward+backward on CPU", "",
             f"torch {meta['torch']}, {meta['threads']} threads, {meta['cores']} cores, capability "
             f"{meta['cpu_capability']}{', env ' + str(env) if env else ''}; T = k = n = {args.size}, "
             f"{'CPU time' if args.clock == 'cpu' else 'wall clock'}, {args.stat} "
             f"of {args.repeats} round-robin repeats; ratios to nn.Linear in the same dtype; machine load average "
             f"(1 min) {load_start[0]:.2f} at the start, {meta['load_average'][0]:.2f} at the end.", "",
             "Fused CPU quantization kernels: " + (
                 f"{'loaded from the cache' if build['cached'] else 'compiled'} in {build['seconds']:.1f} s, "
                 f"{build['isa_variant']} variant" if build["available"] else f"unavailable ({build['error']})")
             + ".", "",
             "| dtype | nn.Linear (s) | recipe | emulated | torch | auto |", "|---|---|---|---|---|---|"]
    for r in rows:
        for recipe in RECIPES:
            chosen = r["auto"][recipe]
            lines.append(f"| {r['dtype']} | {r['time_s']['nn.Linear']:.3f} | {recipe} | "
                         + " | ".join(f"{r['ratio'][f'{b}/{recipe}']:.2f}x" for b in BACKENDS)
                         + f" | {chosen}: {r['ratio'][f'{chosen}/{recipe}']:.2f}x |")
    lines += ["", f"Bare kernels, one {args.kernel_size}^3 product (best of {args.repeats}):", "",
              "| kernel | seconds |", "|---|---|"]
    lines += [f"| {k} | {v if isinstance(v, str) else f'{v:.4f}'} |" for k, v in kernels.items()]
    text = "\n".join(lines) + "\n"
    (RESULTS / f"{name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
