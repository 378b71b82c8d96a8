"""Where the torch backend's time goes in one SnipLinear forward+backward: torch.profiler, kernel by kernel.

    python benchmarks/profile_gpu_gemm.py [--tokens 4096] [--k 4096] [--n 4096] [--output_dir DIR]
    python benchmarks/profile_gpu_gemm.py --device cpu --tokens 64 --k 256 --n 256   # plumbing check

For BF16 ``nn.Linear`` and SnipLinear on the ``torch`` backend (``fp8_hybrid``, ``mxfp8``, ``nvfp4``,
``mxfp4``, BF16 tensors), after warm-up, ``--steps`` forward+backward steps are profiled (CUDA kernels and
CPU operators). For each variant the report gives the device time per step, the number of kernel launches
per step, the share of the time in GEMM kernels, in snip_ds's Triton quantization kernels and in everything
else, and the ten most expensive kernels: the figures that say whether a missed speed target is the GEMMs, the
quantizers, or the glue between them (casts, copies, transposes, small launches).

Writes ``profile_gpu_gemm.json`` and ``.md`` into ``--output_dir`` (default: print only). On the CPU it runs
the same code with the CPU's operators (their self time) in place of kernels (a check of the script, not a
measurement).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from snip_ds.linear import SnipLinear  # noqa: E402
from snip_ds.quant_config import QuantConfig  # noqa: E402

VARIANTS = {  # name: (precision, config); None: BF16 nn.Linear
    "bf16": None,
    "torch_fp8_hybrid": ("fp8", QuantConfig(backend="torch")),
    "torch_mxfp8": ("fp8", QuantConfig(backend="torch", fp8_recipe="mxfp8")),
    "torch_nvfp4": ("fp4", QuantConfig(backend="torch")),
    "torch_mxfp4": ("fp4", QuantConfig(backend="torch", fp4_recipe="mxfp4")),
}
GEMM_MARKERS = ("gemm", "cutlass", "sm90", "xmma", "scaled_mm", "nvjet", "cublas", "aten::mm", "aten::addmm",
                "aten::_scaled_mm")
QUANT_MARKERS = ("_quantize_kernel", "_amax_kernel")


def classify(name: str) -> str:
    low = name.lower()
    if any(m in name for m in QUANT_MARKERS):
        return "quantize"
    if any(m in low for m in GEMM_MARKERS):
        return "gemm"
    return "other"


def profile_variant(name: str, tokens: int, k: int, n: int, steps: int, device: str) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, k, device=device, generator=gen).bfloat16()
    g = (torch.randn(tokens, n, device=device, generator=gen) * 1e-3).bfloat16()
    layer = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    spec = VARIANTS[name]
    if spec is not None:
        layer = SnipLinear.from_linear(layer, spec[0], spec[1])
        layer.generator = torch.Generator(device=device).manual_seed(0)

    def step():
        xi = x.detach().requires_grad_(True)
        layer(xi).backward(g)
        layer.weight.grad = None

    for _ in range(3):  # warm-up: Triton compiles, cuBLAS picks its kernels
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
    return kernel_table(prof, device, steps)


def kernel_table(prof, device: str, steps: int, top_n: int = 10) -> dict:
    """A finished profile's device time per step (or per call of whatever ran ``steps`` times), kernel
    launches per step, the shares of GEMM, quantization and other kernels, and the ``top_n`` most expensive
    kernels. On the CPU, each aten operator's self time (without the operators it called) stands for kernels."""
    kernels = {}
    for ev in prof.events():
        if device == "cuda":
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = ev.device_time
        else:  # each aten operator's own time, without the operators it called
            if not ev.name.startswith("aten::"):
                continue
            us = ev.self_cpu_time_total
        entry = kernels.setdefault(ev.name, {"us": 0.0, "calls": 0})
        entry["us"] += us
        entry["calls"] += 1
    total = sum(v["us"] for v in kernels.values())
    by_class = {"gemm": 0.0, "quantize": 0.0, "other": 0.0}
    for kname, v in kernels.items():
        by_class[classify(kname)] += v["us"]
    top = sorted(kernels.items(), key=lambda kv: -kv[1]["us"])[:top_n]
    return {"step_us": total / steps, "launches_per_step": sum(v["calls"] for v in kernels.values()) / steps,
            "share": {c: (t / total if total else 0.0) for c, t in by_class.items()},
            "top": [{"kernel": kname[:160], "us_per_step": v["us"] / steps, "calls_per_step": v["calls"] / steps,
                     "class": classify(kname)} for kname, v in top]}


def write_markdown(result: dict, path: Path) -> None:
    lines = [f"# profile_gpu_gemm: one SnipLinear forward+backward, kernel by kernel ({result['device_name']})", "",
             f"torch {result['torch']}; {result['tokens']} tokens, k = {result['k']}, n = {result['n']}, BF16; "
             f"{result['steps']} profiled steps after 3 warm-up steps. Times are device time per step.", "",
             "| variant | µs / step | × bf16 | launches / step | GEMM | quantize | other |",
             "|---|---|---|---|---|---|---|"]
    base = result["variants"]["bf16"]["step_us"]
    for name, r in result["variants"].items():
        s = r["share"]
        lines.append(f"| {name} | {r['step_us']:.1f} | {r['step_us'] / base:.2f} | {r['launches_per_step']:.0f} | "
                     f"{s['gemm']:.0%} | {s['quantize']:.0%} | {s['other']:.0%} |")
    for name, r in result["variants"].items():
        lines += ["", f"## {name}", "", "| kernel | class | µs / step | calls / step |", "|---|---|---|---|"]
        lines += [f"| `{t['kernel']}` | {t['class']} | {t['us_per_step']:.1f} | {t['calls_per_step']:.0f} |"
                  for t in r["top"]]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--output_dir", type=Path)
    args = p.parse_args(argv)
    for field in ("tokens", "k", "n", "steps"):
        if getattr(args, field) < 1:
            p.error(f"--{field} must be at least 1, got {getattr(args, field)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("profile_gpu_gemm: needs a CUDA GPU (none is visible); --device cpu checks the script", file=sys.stderr)
        return 2
    result = {"device_name": torch.cuda.get_device_name() if args.device == "cuda" else "CPU (script check)",
              "torch": torch.__version__, "tokens": args.tokens, "k": args.k, "n": args.n, "steps": args.steps,
              "variants": {name: profile_variant(name, args.tokens, args.k, args.n, args.steps, args.device)
                           for name in VARIANTS}}
    for name, r in result["variants"].items():
        s = r["share"]
        print(f"{name}: {r['step_us']:.1f} us/step, {r['launches_per_step']:.0f} launches, gemm {s['gemm']:.0%}, "
              f"quantize {s['quantize']:.0%}, other {s['other']:.0%}", flush=True)
    if args.output_dir is not None and args.device == "cuda":
        args.output_dir.mkdir(parents=True, exist_ok=True)
        (args.output_dir / "profile_gpu_gemm.json").write_text(json.dumps(result, indent=1))
        write_markdown(result, args.output_dir / "profile_gpu_gemm.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
