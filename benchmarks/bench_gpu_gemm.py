"""On a CUDA GPU: what SnipLinear's FP8/FP4 GEMMs cost next to BF16, per backend and recipe.

    python benchmarks/bench_gpu_gemm.py [--tokens 8192] [--repeats 20] [--output_dir benchmarks/results]
    python benchmarks/bench_gpu_gemm.py --device cpu --tokens 64 --repeats 1   # plumbing check, no files

For each Llama-7B-like shape (tokens T, in k, out n), side by side in one run, the median time of one linear
layer's forward and of its forward+backward (fprop, dgrad, wgrad), each divided by BF16's, and the peak
memory of the forward+backward over BF16's. Two times per forward+backward (``benchmarks/timing.py``):

* the **latency** of one step: CUDA events around it, the GPU idle before it (every repeat is synchronised).
  The events count from the moment the host records the first, so this includes any time the GPU waits for
  the host to issue the step's kernels: a host-bound step and one with slow kernels read alike here;
* the **pipelined** time: ``--repeats`` steps queued back to back between two events, one synchronisation,
  divided by the steps -- what training's steady state sees -- beside the host's wall time to issue one
  step in that loop. Pipelined about equal to issue: the host is the bottleneck (more GPU work per launch,
  fewer launches, less Python would help); pipelined above issue: the kernels are.

Variants:

* ``bf16``: ``nn.Linear`` on BF16 tensors (tensor cores, FP32 accumulation);
* ``fp8_tensor_core``: a bare FP8 GEMM (``torch._scaled_mm``) with per-tensor current scaling, casts
  included (forward only): the floor a per-tensor FP8 forward can reach;
* ``torch_<recipe>``: SnipLinear in BF16 on the ``torch`` backend for ``fp8_hybrid`` (``_scaled_mm``),
  ``mxfp8``, ``nvfp4`` and ``mxfp4`` (exact grid values in BF16 GEMMs); targets: fp8 <= 0.8x, mxfp8 <= 1.2x,
  nvfp4 / mxfp4 <= 1.3x BF16's forward+backward, peak memory <= 1.1x;
* ``te_<recipe>``: SnipLinear in BF16 on the ``te`` backend (Transformer Engine) for ``fp8_hybrid``, ``mxfp8``
  and ``nvfp4`` where it can run them here; the report names each one it could not run and why;
* ``emulated_fp8`` / ``emulated_fp4``: the emulated backend in FP32 (quantize->dequantize, FP32 GEMM), the
  numerical reference.

Writes ``bench_gpu_gemm.json`` and ``bench_gpu_gemm.md``. Without CUDA it exits with status 2 and a message,
unless ``--device cpu`` asks for a run of the same code on the CPU at small shapes, which checks that every
variant runs and prints its ratios but writes no files: CPU times are not GPU figures.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from snip_ds.quant_config import QuantConfig  # noqa: E402
from snip_ds.linear import SnipLinear  # noqa: E402
from snip_ds.backend import BackendError, resolve  # noqa: E402
from bench_layer_gpu import commit  # noqa: E402
from timing import median_ms, pipelined_ms  # noqa: E402

SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096)]  # (in k, out n): attention, MLP up/gate, MLP down
CPU_SHAPES = [(256, 256), (256, 704), (704, 256)]  # the same aspect ratios, small: --device cpu
TORCH_RECIPES = {  # variant: (precision, QuantConfig)
    "torch_fp8_hybrid": ("fp8", QuantConfig(backend="torch")),
    "torch_mxfp8": ("fp8", QuantConfig(backend="torch", fp8_recipe="mxfp8")),
    "torch_nvfp4": ("fp4", QuantConfig(backend="torch")),
    "torch_mxfp4": ("fp4", QuantConfig(backend="torch", fp4_recipe="mxfp4")),
}
TE_RECIPES = {  # the te backend where it can run the recipe here (Transformer Engine installed, the GPU has it)
    "te_fp8_hybrid": ("fp8", QuantConfig(backend="te")),
    "te_mxfp8": ("fp8", QuantConfig(backend="te", fp8_recipe="mxfp8")),
    "te_nvfp4": ("fp4", QuantConfig(backend="te")),
}
TARGETS = {"torch_fp8_hybrid": 0.8, "torch_mxfp8": 1.2, "torch_nvfp4": 1.3, "torch_mxfp4": 1.3}


def _fp8_forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    fmax = torch.finfo(torch.float8_e4m3fn).max
    sx, sw = x.abs().amax().float() / fmax, w.abs().amax().float() / fmax
    qx, qw = (x.float() / sx).to(torch.float8_e4m3fn), (w.float() / sw).to(torch.float8_e4m3fn)
    return torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)


def _peak_mib(fn, device: str) -> float:
    """Peak CUDA memory of ``fn()`` above what was allocated before it, in MiB (NaN on the CPU)."""
    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2 ** 20


def bench_shape(tokens: int, k: int, n: int, repeats: int, device: str = "cuda") -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    x32 = torch.randn(tokens, k, device=device, generator=gen)
    g32 = torch.randn(tokens, n, device=device, generator=gen) * 1e-3
    layer32 = torch.nn.Linear(k, n, bias=False, device=device)
    layer16 = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    x16, g16 = x32.bfloat16(), g32.bfloat16()
    row = dict(tokens=tokens, k=k, n=n, forward_ms={}, step_ms={}, pipelined_ms={}, issue_ms={}, peak_mib={})

    def time(fn):
        return median_ms(fn, repeats, device)

    def step(layer, x, g):
        x = x.detach().requires_grad_(True)
        layer(x).backward(g)
        layer.weight.grad = None

    def measure(name, layer, x, g):
        with torch.no_grad():
            row["forward_ms"][name] = time(lambda: layer(x))
        row["step_ms"][name] = time(lambda: step(layer, x, g))
        row["pipelined_ms"][name], row["issue_ms"][name] = pipelined_ms(lambda: step(layer, x, g), repeats, device)
        row["peak_mib"][name] = _peak_mib(lambda: step(layer, x, g), device)

    measure("bf16", layer16, x16, g16)
    if device == "cuda":
        row["forward_ms"]["fp8_tensor_core"] = time(lambda: _fp8_forward(x16, layer16.weight))
    for variant, (precision, cfg) in TORCH_RECIPES.items():
        snip = SnipLinear.from_linear(layer16, precision, cfg)
        snip.generator = torch.Generator(device=device).manual_seed(0)
        measure(variant, snip, x16, g16)
    for variant, (precision, cfg) in TE_RECIPES.items():
        try:
            resolve("te", precision, cfg, device)
        except BackendError as err:  # no Transformer Engine, or not this recipe on this GPU: named in the report
            row.setdefault("not_run", {})[variant] = str(err)
            continue
        snip = SnipLinear.from_linear(layer16, precision, cfg)
        snip.generator = torch.Generator(device=device).manual_seed(0)
        measure(variant, snip, x16, g16)
    for precision in ("fp8", "fp4"):
        snip = SnipLinear.from_linear(layer32, precision, QuantConfig(backend="emulated"))
        snip.generator = torch.Generator(device=device).manual_seed(0)
        measure(f"emulated_{precision}", snip, x32, g32)
    for kind in ("forward_ms", "step_ms", "pipelined_ms", "peak_mib"):
        base = row[kind]["bf16"]
        row[kind.replace("_ms", "_vs_bf16").replace("_mib", "_vs_bf16")] = {v: t / base for v, t in row[kind].items()}
    return row


def write_markdown(result: dict, path: Path) -> None:
    variants = [v for v in result["rows"][0]["step_ms"] if v != "bf16"]
    lines = ["# bench_gpu_gemm: SnipLinear's FP8/FP4 GEMMs per backend and recipe against BF16", "",
             f"Device: {result['device']}; torch {result['torch']}; commit {result.get('commit', 'unknown')}; "
             f"{result['tokens']} tokens; median of "
             f"{result['repeats']} (CUDA events around each step, the GPU idle before it: a step's latency, the "
             "GPU's waits for the host included). × = ratio to BF16 `nn.Linear` in the same run; torch_* run "
             "in BF16, emulated_* in FP32.", "",
             "## Forward+backward (time ×, peak memory ×)", "",
             "| k | n | bf16 ms | " + " | ".join(variants) + " |", "|---|---|---|" + "---|" * len(variants)]
    for r in result["rows"]:
        sr, mr = r["step_vs_bf16"], r["peak_vs_bf16"]
        lines.append(f"| {r['k']} | {r['n']} | {r['step_ms']['bf16']:.3f} | "
                     + " | ".join(f"{sr[v]:.2f}× / {mr[v]:.2f}×" for v in variants) + " |")
    lines += ["", "Targets (forward+backward): " + ", ".join(f"{v} ≤ {t}×" for v, t in TARGETS.items())
              + "; peak memory ≤ 1.1×.", "",
              "## Forward+backward pipelined (time ×; ms per step queued, ms the host takes to issue one)", "",
              f"{result['repeats']} steps queued between two CUDA events, one synchronisation. Where the pipelined "
              "time is about the issue time, the host is the bottleneck; above it, the kernels are.", "",
              "| k | n | bf16 ms (issue ms) | " + " | ".join(variants) + " |", "|---|---|---|" + "---|" * len(variants)]
    for r in result["rows"]:
        pr, pm, im = r["pipelined_vs_bf16"], r["pipelined_ms"], r["issue_ms"]
        lines.append(f"| {r['k']} | {r['n']} | {pm['bf16']:.3f} ({im['bf16']:.3f}) | "
                     + " | ".join(f"{pr[v]:.2f}× ({pm[v]:.3f} / {im[v]:.3f})" for v in variants) + " |")
    lines += ["", "## Forward only (time ×)", "",
              "| k | n | bf16 ms | fp8 tensor core | " + " | ".join(variants) + " |",
              "|---|---|---|---|" + "---|" * len(variants)]
    for r in result["rows"]:
        fr = r["forward_vs_bf16"]
        lines.append(f"| {r['k']} | {r['n']} | {r['forward_ms']['bf16']:.3f} | {fr.get('fp8_tensor_core', float('nan')):.2f}× | "
                     + " | ".join(f"{fr[v]:.2f}×" for v in variants) + " |")
    not_run = {v: why for r in result["rows"] for v, why in r.get("not_run", {}).items()}
    if not_run:
        lines += ["", "Not run here:", ""] + [f"- {v}: {why}" for v, why in sorted(not_run.items())]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--output_dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: run every variant at small shapes to check the code; prints, writes nothing")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu_gemm: error: needs a CUDA GPU (none is visible); --device cpu checks the code only",
              file=sys.stderr)
        return 2
    if args.tokens < 16 or args.tokens % 16 or args.repeats < 1:
        ap.error("--tokens must be a positive multiple of 16 and --repeats >= 1")
    if args.device == "cpu":
        rows = [bench_shape(args.tokens, k, n, args.repeats, "cpu") for k, n in CPU_SHAPES]
        print(json.dumps({f"{r['k']}x{r['n']}": r["step_vs_bf16"] for r in rows}))
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False  # the emulated GEMMs are true FP32, as on the CPU
    rows = [bench_shape(args.tokens, k, n, args.repeats) for k, n in SHAPES]
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, commit=commit(), tokens=args.tokens,
                  repeats=args.repeats, rows=rows)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_gpu_gemm.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    write_markdown(result, out / "bench_gpu_gemm.md")
    print(json.dumps({f"{r['k']}x{r['n']}": r["step_vs_bf16"] for r in rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
