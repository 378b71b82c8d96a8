"""On a CUDA GPU: how close the fused Triton quantization kernels come to the GPU's copy bandwidth.

    python benchmarks/bench_quant_kernels.py [--repeats 50] [--output_dir benchmarks/results]

For Llama-7B-like GEMM operands (BF16 in, as the GEMMs get them) and every recipe, side by side in one run,
the median time (CUDA events) of

* ``amax``: the tensor-amax pass (reads the operand once; recipes with a tensor-level scale);
* ``fused``: the quantize pass with the amax given (reads the operand, writes the values: BF16, in the
  operand's layout or transposed, the block axis along the rows' contiguous dimension or across it);
* ``total``: both, as :func:`snip_ds.backend.kernels.quantize_parts` runs them without a ``tensor_amax``;

each as bytes moved per second over the GPU's copy bandwidth, measured in the same run as
``torch.Tensor.copy_`` of the operand (read + write of the same bytes). A share near 1 means the kernel is
memory-bound at the copy's speed. The emulated reference (:func:`snip_ds.quant.quantize_parts`, torch ops) is
timed too, and every configuration is first checked bit for bit against it.

Writes ``bench_quant_kernels.json`` and ``.md``. Without CUDA it prints that it needs a GPU and exits 0.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from snip_ds import quant  # noqa: E402
from timing import median_ms  # noqa: E402

SHAPES = [(8192, 4096), (4096, 11008)]  # activations (tokens x k), an MLP weight (k x n)
CASES = [  # (block axis, transpose the output)
    (1, False),  # blocks along the contiguous dimension (X, W along k for fprop)
    (0, False),  # blocks across it (W along n for dgrad)
    (1, True),  # transposed output (an operand the GEMM wants the other way round)
]


def _time(fn, repeats: int) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` (CUDA events, after 3 warm-ups, which also compile)."""
    return median_ms(fn, repeats, "cuda")


def _check(kq, x: torch.Tensor, recipe: str, axis: int, transpose: bool) -> None:
    got = kq.quantize_parts(x, recipe, axis, out_dtype=torch.bfloat16, transpose=transpose)
    ref = quant.quantize_parts(x, recipe, axis)
    want = ref.values.to(torch.bfloat16)
    want = want.t().contiguous() if transpose else want
    if not (torch.equal(got.values.view(torch.int16), want.view(torch.int16))
            and torch.equal(got.tensor_scale, ref.tensor_scale)):
        raise SystemExit(f"bench_quant_kernels: error: {recipe} axis {axis} transpose {transpose}: the kernel "
                         f"does not match snip_ds.quant.quantize_parts bit for bit")


def bench_shape(kq, rows: int, cols: int, repeats: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, cols, device="cuda", generator=gen).bfloat16()
    n = x.numel()
    dst = torch.empty_like(x)
    copy_ms = _time(lambda: dst.copy_(x), repeats)
    copy_gbps = 2 * n * x.element_size() / copy_ms / 1e6
    out = dict(rows=rows, cols=cols, copy_ms=copy_ms, copy_gbps=copy_gbps, results=[])
    amax = x.abs().amax().float()
    for recipe in quant.RECIPES:
        has_amax = quant.get_recipe(recipe).scale != "e8m0"
        for axis, transpose in CASES:
            _check(kq, x, recipe, axis, transpose)
            fused_ms = _time(lambda: kq.quantize_parts(x, recipe, axis, tensor_amax=amax if has_amax else None,
                                                       out_dtype=torch.bfloat16, transpose=transpose), repeats)
            total_ms = _time(lambda: kq.quantize_parts(x, recipe, axis, out_dtype=torch.bfloat16,
                                                       transpose=transpose), repeats)
            ref_ms = _time(lambda: quant.quantize_parts(x, recipe, axis), repeats)
            moved_fused = n * (x.element_size() + 2)  # read the operand, write BF16 values
            moved_amax = n * x.element_size() if has_amax else 0
            r = dict(recipe=recipe, axis=axis, transpose=transpose, fused_ms=fused_ms, total_ms=total_ms,
                     reference_ms=ref_ms,
                     fused_share=moved_fused / fused_ms / 1e6 / copy_gbps,
                     total_share=(moved_fused + moved_amax) / total_ms / 1e6 / copy_gbps,
                     speedup_vs_reference=ref_ms / total_ms)
            if has_amax:
                amax_ms = _time(lambda: kq.tensor_amax(x), repeats)
                r.update(amax_ms=amax_ms, amax_share=moved_amax / amax_ms / 1e6 / copy_gbps)
            out["results"].append(r)
    return out


def write_markdown(result: dict, path: Path) -> None:
    lines = ["# bench_quant_kernels: fused Triton quantization against the GPU's copy bandwidth", "",
             f"Device: {result['device']}; torch {result['torch']}, triton {result['triton']}; BF16 operands, "
             f"BF16 values; median of {result['repeats']} (CUDA events). share = bytes moved per second / "
             "copy_ bandwidth of the same operand in the same run.", ""]
    for s in result["shapes"]:
        lines += [f"## {s['rows']} x {s['cols']}: copy {s['copy_ms']:.3f} ms, {s['copy_gbps']:.0f} GB/s", "",
                  "| recipe | axis | transposed | amax share | fused share | total ms | total share | "
                  "reference ms | speed-up |", "|---|---|---|---|---|---|---|---|---|"]
        for r in s["results"]:
            amax = f"{r['amax_share']:.2f}" if "amax_share" in r else "-"
            lines.append(f"| {r['recipe']} | {r['axis']} | {'yes' if r['transpose'] else 'no'} | {amax} | "
                         f"{r['fused_share']:.2f} | {r['total_ms']:.3f} | {r['total_share']:.2f} | "
                         f"{r['reference_ms']:.3f} | {r['speedup_vs_reference']:.1f}× |")
        lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--output_dir", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if not torch.cuda.is_available():
        print("bench_quant_kernels: needs a CUDA GPU (none is visible); nothing measured")
        return 0
    import triton
    from snip_ds.backend.kernels import quantize as kq
    if kq.INTERPRETED:
        ap.error("TRITON_INTERPRET is set: unset it to time the compiled kernels")
    shapes = [bench_shape(kq, rows, cols, args.repeats) for rows, cols in SHAPES]
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  repeats=args.repeats, shapes=shapes)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_quant_kernels.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    write_markdown(result, out / "bench_quant_kernels.md")
    print(json.dumps({f"{s['rows']}x{s['cols']}": {f"{r['recipe']}/{r['axis']}/{int(r['transpose'])}":
                                                   round(r["total_share"], 2) for r in s["results"]}
                      for s in shapes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
