"""benchmarks/bench_gpu_gemm.py runs every variant (the torch backend for each recipe in BF16, the emulated
backend in FP32) through the same code the GPU run uses, here on the CPU at small shapes, and its report
has a row per shape and a column per variant. Its times are not checked: CPU figures say nothing of a GPU."""
import importlib.util
import math

import pytest

from train_utils import REPO

pytestmark = pytest.mark.slow


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gpu_gemm", REPO / "benchmarks" / "bench_gpu_gemm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_variant_runs_and_the_report_has_them(tmp_path):
    bench = _bench()
    rows = [bench.bench_shape(32, k, n, repeats=1, device="cpu") for k, n in ((64, 32), (32, 64))]
    variants = ["bf16", *bench.TORCH_RECIPES, "emulated_fp8", "emulated_fp4"]
    for row in rows:
        assert list(row["step_ms"]) == variants and row["step_vs_bf16"]["bf16"] == 1.0
        assert all(t > 0 and math.isfinite(t) for t in row["step_ms"].values())
        assert list(row["pipelined_ms"]) == list(row["issue_ms"]) == variants  # beside each step's latency
        assert all(t > 0 and math.isfinite(t) for t in row["pipelined_ms"].values())
    bench.write_markdown(dict(device="cpu", torch="x", tokens=32, repeats=1, rows=rows), tmp_path / "r.md")
    text = (tmp_path / "r.md").read_text()
    assert text.count("| 64 | 32 |") == 3 and text.count("| 32 | 64 |") == 3  # latency, pipelined, forward
    assert "## Forward+backward pipelined" in text
    for variant in variants[1:]:
        assert variant in text
    for variant in bench.TE_RECIPES:  # the te backend cannot run on a CPU: each is named, with the reason
        assert all("CUDA devices only" in row["not_run"][variant] for row in rows)
        assert f"- {variant}: backend 'te' cannot run" in text


def test_without_cuda_it_says_so(capsys):
    bench = _bench()
    if bench.torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert bench.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
