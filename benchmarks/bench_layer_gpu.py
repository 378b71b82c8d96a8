"""One linear layer's forward+backward on a GPU: snip_ds's recipes and torchao's float8 against BF16, eager and compiled.

    python benchmarks/bench_layer_gpu.py [--tokens 4096 16384] [--repeats 10] [--deadline_s 420] [--output_dir DIR]
    python benchmarks/bench_layer_gpu.py --device cpu      # plumbing check on tiny shapes, nothing written

For each layer shape (in k, out n) -- 4096 x 4096 (and so 4096^3 at 4096 tokens), Llama-7B's 4096 -> 11008 and
11008 -> 4096, Llama-70B's 8192 -> 8192, 8192 -> 28672 and 28672 -> 8192 -- at each token count, and for each
variant, in this one process, BF16 activations and weights:

* ``bf16``: ``nn.Linear``; ``fp8_hybrid``, ``mxfp8``, ``nvfp4``, ``mxfp4``: SnipLinear on the ``torch`` backend
  (``backend: auto`` on CUDA); ``torchao_fp8``: torchao's float8 training (``convert_to_float8_training``,
  the tensorwise recipe: dynamic per-tensor scaling, cuBLAS's FP8 GEMM), the peer -- where torchao imports;
* each ``eager`` and ``compiled`` (``torch.compile``, inductor, static shapes: one compile per configuration,
  its time in ``warmup_s``).

Per configuration: the median wall time of a step over ``--repeats`` steps with CUDA events (the GPU's clock,
host gaps included: what training sees); from ``torch.profiler`` over 3 steps, at the same commit, the sum of
the kernels' device times per step (no host gaps), the kernel launches per step and the shares of GEMM,
quantization and other kernels; the host time to issue one step (wall time from the call to its return, the
GPU idle before it: where this exceeds the kernel time, the host is the bottleneck); the step's peak memory
above what was allocated before it. Every figure also as a ratio to ``bf16`` eager of the same shape.

Configurations run in order of value -- every variant at 4096 tokens shape by shape, then 16384 tokens -- and
none starts after ``--deadline_s`` (the results written so far stay; the JSON says what was not reached). A
variant that fails (torchao not installed, a compile error) is recorded with its error and the rest go on.
Results: ``bench_layer_gpu.json`` and ``.md`` in ``--output_dir``, rewritten after every shape.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_gpu_gemm import kernel_table  # noqa: E402
from snip_ds.runtime.fileio import atomic_write_text  # noqa: E402
from snip_ds.linear import SnipLinear  # noqa: E402
from snip_ds.quant_config import QuantConfig  # noqa: E402

SHAPES = {"4096x4096": (4096, 4096), "7b_up": (4096, 11008), "7b_down": (11008, 4096),
          "70b_attn": (8192, 8192), "70b_up": (8192, 28672), "70b_down": (28672, 8192)}
CPU_SHAPES = {"64x64": (64, 64), "up": (64, 176), "down": (176, 64)}
SNIP = {"fp8_hybrid": ("fp8", QuantConfig(backend="auto")),
        "mxfp8": ("fp8", QuantConfig(backend="auto", fp8_recipe="mxfp8")),
        "nvfp4": ("fp4", QuantConfig(backend="auto")),
        "mxfp4": ("fp4", QuantConfig(backend="auto", fp4_recipe="mxfp4"))}
VARIANTS = ("bf16", *SNIP, "torchao_fp8")
MODES = ("eager", "compiled")
TARGETS = {"fp8_hybrid": 0.80, "mxfp8": 1.15, "nvfp4": 1.15, "mxfp4": 1.15}  # time, against bf16 eager


def make_layer(variant: str, k: int, n: int, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    linear = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    if variant == "bf16":
        return linear
    if variant in SNIP:
        layer = SnipLinear.from_linear(linear, *SNIP[variant])
        layer.generator = torch.Generator(device=device).manual_seed(0)
        return layer
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    holder = torch.nn.Sequential(linear)
    convert_to_float8_training(holder, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    return holder


def measure(variant: str, mode: str, tokens: int, k: int, n: int, repeats: int, device: str,
            compile_backend: str) -> dict:
    layer = make_layer(variant, k, n, device)
    fn = layer
    if mode == "compiled":
        torch._dynamo.reset()  # (every SnipLinear's forward is one code object: its recompilation count too)
        fn = torch.compile(layer, backend=compile_backend)
    x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
    g = torch.randn(tokens, n, device=device, dtype=torch.bfloat16) * 1e-3
    params = [p for p in layer.parameters()]
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step():
        xi = x.detach().requires_grad_(True)
        fn(xi).backward(g)
        for p in params:
            p.grad = None

    begin = time.perf_counter()
    for _ in range(3):  # warm-up: compiles (inductor, Triton), cuBLAS's choices
        step()
    sync()
    warmup_s = time.perf_counter() - begin
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e6)
    host = []
    for _ in range(max(3, repeats // 2)):
        sync()
        t0 = time.perf_counter()
        step()  # returns once the host has issued it (the GPU may still run it)
        host.append((time.perf_counter() - t0) * 1e6)
    sync()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(3):
            step()
        sync()
    table = kernel_table(prof, device, 3, top_n=8)
    peak = float("nan")
    if cuda:
        sync()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        sync()
        peak = torch.cuda.max_memory_allocated() - before
    return {"wall_us": statistics.median(times), "kernel_us": table["step_us"],
            "launches": table["launches_per_step"], "share": table["share"], "top": table["top"],
            "host_issue_us": statistics.median(host), "peak_bytes": peak, "warmup_s": warmup_s}


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or os.environ.get("SNIP_DEVICE_COMMIT", "unknown")[:12]


def peer_version() -> str:
    try:
        import torchao
        return torchao.__version__
    except Exception as err:  # not installed, or it does not import with this torch
        return f"not available ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"


def run(args) -> dict:
    device = args.device
    shapes = CPU_SHAPES if device == "cpu" else SHAPES
    tokens_list = [32] if device == "cpu" else args.tokens
    backend = "aot_eager" if device == "cpu" else "inductor"
    res = {"benchmark": "bench_layer_gpu", "commit": commit(), "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if device == "cuda" else "CPU (plumbing check)",
           "torchao": peer_version(), "compile_backend": backend, "repeats": args.repeats,
           "variants": list(args.variants), "modes": list(args.modes), "rows": [], "not_reached": []}
    start = time.perf_counter()
    order = [(t, name) for t in tokens_list for name in shapes]
    for tokens, name in order:
        k, n = shapes[name]
        for mode in args.modes:
            for variant in args.variants:
                key = {"shape": name, "tokens": tokens, "k": k, "n": n, "mode": mode, "variant": variant}
                if time.perf_counter() - start > args.deadline_s:
                    res["not_reached"].append(key)
                    continue
                try:
                    row = {**key, **measure(variant, mode, tokens, k, n, args.repeats, device, backend)}
                except Exception as err:  # a variant that cannot run here must not stop the others
                    row = {**key, "error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
                finally:
                    if device == "cuda":
                        torch.cuda.empty_cache()
                res["rows"].append(row)
                print(_line(row), flush=True)
        _ratios(res)
        if args.output_dir is not None and device == "cuda":
            write(res, args.output_dir)
    res["wall_s"] = time.perf_counter() - start
    return res


def _line(r: dict) -> str:
    head = f"{r['shape']:>9} T={r['tokens']:<5} {r['mode']:>8} {r['variant']:>12}:"
    if "error" in r:
        return f"{head} error {r['error'][:160]}"
    return (f"{head} {r['wall_us']:9.0f} us wall, {r['kernel_us']:9.0f} us kernels, {r['launches']:4.0f} launches, "
            f"host {r['host_issue_us']:7.0f} us, peak {r['peak_bytes'] / 2 ** 20:8.0f} MiB")


def _ratios(res: dict) -> None:
    """Each row's wall time, kernel time and peak memory over bf16 eager's at the same shape and tokens."""
    base = {(r["shape"], r["tokens"]): r for r in res["rows"]
            if r["variant"] == "bf16" and r["mode"] == "eager" and "error" not in r}
    for r in res["rows"]:
        b = base.get((r["shape"], r["tokens"]))
        if b is None or "error" in r:
            continue
        r["wall_vs_bf16"] = r["wall_us"] / b["wall_us"]
        r["kernel_vs_bf16"] = r["kernel_us"] / b["kernel_us"] if b["kernel_us"] else float("nan")
        r["peak_vs_bf16"] = r["peak_bytes"] / b["peak_bytes"] if b["peak_bytes"] else float("nan")


def markdown(res: dict) -> str:
    lines = [f"# bench_layer_gpu: one linear layer's forward+backward ({res['device']})", "",
             f"Commit {res['commit']}, torch {res['torch']}, torchao {res['torchao']}; BF16; compiled: "
             f"torch.compile ({res['compile_backend']}). Ratios against bf16 eager at the same shape and tokens. "
             "wall: CUDA events around each step (median); kernels: the sum of kernel times per step "
             "(torch.profiler); host: time to issue one step; peak: the step's peak memory above what was "
             "allocated before it. Targets (time, fp8_hybrid / the others): <= 0.80x / <= 1.15x.", "",
             "| shape | tokens | mode | variant | wall µs | × bf16 | kernels µs | × bf16 | launches | host µs | "
             "peak MiB | × bf16 |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['tokens']} | {r['mode']} | {r['variant']} | error: "
                         f"{r['error'][:120]} | | | | | | | |")
            continue
        lines.append(f"| {r['shape']} | {r['tokens']} | {r['mode']} | {r['variant']} | {r['wall_us']:.0f} | "
                     f"{r.get('wall_vs_bf16', float('nan')):.2f} | {r['kernel_us']:.0f} | "
                     f"{r.get('kernel_vs_bf16', float('nan')):.2f} | {r['launches']:.0f} | "
                     f"{r['host_issue_us']:.0f} | {r['peak_bytes'] / 2 ** 20:.0f} | "
                     f"{r.get('peak_vs_bf16', float('nan')):.2f} |")
    if res["not_reached"]:
        lines += ["", f"Not reached before the deadline: {len(res['not_reached'])} configurations (see the JSON)."]
    return "\n".join(lines) + "\n"


def write(res: dict, output_dir: Path) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output_dir / "bench_layer_gpu.json", json.dumps(res, indent=1) + "\n")
    atomic_write_text(output_dir / "bench_layer_gpu.md", markdown(res))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--deadline_s", type=float, default=420.0,
                   help="no configuration starts after this many seconds (default 420)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--output_dir", type=Path)
    args = p.parse_args(argv)
    if args.repeats < 1 or any(t < 1 for t in args.tokens) or args.deadline_s <= 0:
        p.error("--repeats, --tokens and --deadline_s must be positive")
    if args.variants[0] != "bf16":
        p.error("--variants: bf16 first (the ratios are against it)")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_layer_gpu: needs a CUDA GPU (none is visible); --device cpu checks the script", file=sys.stderr)
        return 2
    if args.device == "cpu":
        args.repeats = min(args.repeats, 2)
    res = run(args)
    if args.output_dir is not None and args.device == "cuda":
        write(res, args.output_dir)
    errors = [r for r in res["rows"] if "error" in r]
    print(f"bench_layer_gpu: {len(res['rows']) - len(errors)} configurations measured, {len(errors)} failed, "
          f"{len(res['not_reached'])} not reached ({res['wall_s']:.0f} s)")
    return 1 if errors and len(errors) == len(res["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
