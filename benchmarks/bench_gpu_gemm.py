"""On a CUDA GPU: what the emulated FP8/FP4 GEMMs cost next to BF16 and to the hardware's FP8 GEMM.

    python benchmarks/bench_gpu_gemm.py [--tokens 8192] [--repeats 20] [--output_dir benchmarks/results]

For each Llama-7B-like shape (tokens T, in k, out n), side by side in one run, the median time (CUDA events)
of one linear layer's forward GEMM and of its forward+backward (fprop, dgrad, wgrad), each divided by BF16's:

* ``bf16``: ``torch.nn.functional.linear`` on BF16 tensors (tensor cores, FP32 accumulation);
* ``fp8_tensor_core``: the GPU's FP8 GEMM (``torch._scaled_mm``) with per-tensor current scaling, the casts
  included: what a hardware backend (Transformer Engine) would run for SNIP's ``fp8`` (forward only);
* ``emulated_fp8`` / ``emulated_fp4``: snip_ds's emulated backend (quantize->dequantize, FP32 GEMM), the
  numerical reference that every CPU run uses.

Writes ``bench_gpu_gemm.json`` and ``bench_gpu_gemm.md``. Exits with status 2 and a message without CUDA.
No target: the numbers say how far the emulation is from hardware speed, i.e. what a hardware backend buys.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from snip_ds.linear import SnipLinear  # noqa: E402

SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096)]  # (in k, out n): attention, MLP up/gate, MLP down


def _time(fn, repeats: int) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` (after 3 warm-ups)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _fp8_forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    fmax = torch.finfo(torch.float8_e4m3fn).max
    sx, sw = x.abs().amax().float() / fmax, w.abs().amax().float() / fmax
    qx, qw = (x.float() / sx).to(torch.float8_e4m3fn), (w.float() / sw).to(torch.float8_e4m3fn)
    return torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)


def bench_shape(tokens: int, k: int, n: int, repeats: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x32 = torch.randn(tokens, k, device="cuda", generator=gen)
    g32 = torch.randn(tokens, n, device="cuda", generator=gen) * 1e-3
    layer32 = torch.nn.Linear(k, n, bias=False, device="cuda")
    layer16 = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x16, g16 = x32.bfloat16(), g32.bfloat16()
    row = dict(tokens=tokens, k=k, n=n, forward_ms={}, step_ms={})
    row["forward_ms"]["bf16"] = _time(lambda: torch.nn.functional.linear(x16, layer16.weight), repeats)
    row["forward_ms"]["fp8_tensor_core"] = _time(lambda: _fp8_forward(x16, layer16.weight), repeats)

    def step(layer, x, g):
        x = x.detach().requires_grad_(True)
        layer(x).backward(g)
        layer.weight.grad = None

    row["step_ms"]["bf16"] = _time(lambda: step(layer16, x16, g16), repeats)
    for precision in ("fp8", "fp4"):
        snip = SnipLinear.from_linear(layer32, precision)
        snip.generator = torch.Generator(device="cuda").manual_seed(0)
        with torch.no_grad():
            row["forward_ms"][f"emulated_{precision}"] = _time(lambda: snip(x32), repeats)
        row["step_ms"][f"emulated_{precision}"] = _time(lambda: step(snip, x32, g32), repeats)
    for kind in ("forward_ms", "step_ms"):
        base = row[kind]["bf16"]
        row[kind.replace("_ms", "_vs_bf16")] = {v: t / base for v, t in row[kind].items()}
    return row


def write_markdown(result: dict, path: Path) -> None:
    lines = ["# bench_gpu_gemm: emulated FP8/FP4 GEMMs against BF16 and the GPU's FP8 GEMM", "",
             f"Device: {result['device']}; torch {result['torch']}; {result['tokens']} tokens; median of "
             f"{result['repeats']} (CUDA events). Times in ms; × = ratio to BF16 in the same run.", "",
             "| k | n | bf16 fwd | fp8 tensor-core fwd | emulated fp8 fwd | emulated fp4 fwd | bf16 fwd+bwd | "
             "emulated fp8 fwd+bwd | emulated fp4 fwd+bwd |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        f, fr, s, sr = r["forward_ms"], r["forward_vs_bf16"], r["step_ms"], r["step_vs_bf16"]
        lines.append(f"| {r['k']} | {r['n']} | {f['bf16']:.3f} | {f['fp8_tensor_core']:.3f} "
                     f"({fr['fp8_tensor_core']:.2f}×) | {f['emulated_fp8']:.3f} ({fr['emulated_fp8']:.1f}×) | "
                     f"{f['emulated_fp4']:.3f} ({fr['emulated_fp4']:.1f}×) | {s['bf16']:.3f} | "
                     f"{s['emulated_fp8']:.3f} ({sr['emulated_fp8']:.1f}×) | "
                     f"{s['emulated_fp4']:.3f} ({sr['emulated_fp4']:.1f}×) |")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--output_dir", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu_gemm: error: needs a CUDA GPU (none is visible)", file=sys.stderr)
        return 2
    if args.tokens < 16 or args.tokens % 16 or args.repeats < 1:
        ap.error("--tokens must be a positive multiple of 16 and --repeats >= 1")
    torch.backends.cuda.matmul.allow_tf32 = False  # the emulated GEMMs are true FP32, as on the CPU
    rows = [bench_shape(args.tokens, k, n, args.repeats) for k, n in SHAPES]
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, tokens=args.tokens,
                  repeats=args.repeats, rows=rows)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_gpu_gemm.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    write_markdown(result, out / "bench_gpu_gemm.md")
    print(json.dumps({r["n"]: r["step_vs_bf16"] for r in rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
