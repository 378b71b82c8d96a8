"""Device check: may the CUDA GEMMs of block-scaled recipes (MXFP8, MXFP4, NVFP4 on Hopper) write BF16 directly?

On CUDA the torch backend multiplies the operands' exact grid values in a BF16 GEMM that returns FP32
(``torch.mm(a, b, out_dtype=torch.float32)``) and rounds to BF16 after (MX: a cast; NVFP4: the tensor scales'
multiply). A BF16-output GEMM would save that cast, a launch per GEMM, if its result is the FP32 GEMM's rounded
once to BF16, bit for bit. That holds only if cuBLAS sums the same way for both outputs; with
``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction`` on (torch's default) it may reduce split-K
partial sums in BF16. This check answers it on the GPU it runs on, over the layer shapes the benchmarks use and a
few odd ones, both settings, operands of random BF16 values (a superset of the grid values: every grid value is a
BF16 value), B column-major as the step passes W.

    python gpu/mx_gemm_check.py --output mx_gemm_check.json

Writes, per setting and shape, how many of the M x N results differ (0: bit for bit). Without CUDA it says so and
exits 0 (the dry run).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

SHAPES = [(32, 64, 64), (64, 96, 80), (33, 70, 45), (128, 4096, 4096), (4096, 4096, 4096), (16, 16384, 64),
          (64, 64, 16384), (8, 8192, 8192), (2048, 11008, 4096), (1, 4096, 4096), (8192, 2048, 5632),
          (8192, 5632, 2048)]  # (M, K, N); the last two: the 1B Llama's MLP at 8 x 1024 tokens


def differing(m: int, k: int, n: int) -> int:
    """How many of ``A B``'s elements differ between a BF16-output GEMM and the FP32-output GEMM rounded to BF16."""
    gen = torch.Generator(device="cuda").manual_seed(m * 1_000_003 + k * 1_009 + n)
    a = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    b = torch.randn(n, k, device="cuda", generator=gen).bfloat16().t()  # column-major, as the step's W
    y16 = torch.mm(a, b)
    y32 = torch.mm(a, b, out_dtype=torch.float32)
    return int((y16.view(torch.int16) != y32.bfloat16().view(torch.int16)).sum())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", type=Path, required=True, help="the JSON file to write")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("mx_gemm_check: needs a CUDA GPU; nothing checked")
        return 0
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_bf16_reduced_precision_reduction
    rows = []
    try:
        for reduced in (False, True):
            matmul.allow_bf16_reduced_precision_reduction = reduced
            for m, k, n in SHAPES:
                bad = differing(m, k, n)
                rows.append(dict(reduced_precision_reduction=reduced, m=m, k=k, n=n, differ=bad, of=m * n))
                print(f"reduced_precision_reduction={reduced} {m}x{k}x{n}: {bad} of {m * n} differ")
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before
    verdict = {str(r): all(row["differ"] == 0 for row in rows if row["reduced_precision_reduction"] == r)
               for r in (False, True)}
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows,
               bit_for_bit_by_reduced_precision_reduction=verdict)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(res, indent=1) + "\n")
    print("bit for bit:", verdict)
    return 0


if __name__ == "__main__":
    sys.exit(main())
