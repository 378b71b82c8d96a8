"""benchmarks/bench_layer_host.py, a short run (bf16 and fp8_hybrid, eager, both scopes, 3 timed steps) on the CUDA
code path on CPU tensors: every row has the report's fields, and the figures that do not depend on timing are
what the code does -- three GEMMs per linear, no host read, X kept as FP8 codes. Times are not checked."""
import json
import os
import subprocess
import sys

from train_utils import REPO

FIELDS = ("scope", "variant", "mode", "launches", "host_us", "host_ratio_vs_bf16", "syncs",
          "saved_bytes_ratio_vs_bf16", "peak_bytes_ratio_vs_bf16")


def test_a_short_run_writes_every_row_with_its_fields(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_layer_host.py"), "--steps", "3",
                           "--variants", "fp8_hybrid", "--modes", "eager", "--no_python_profile",
                           "--output_dir", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads((tmp_path / "bench_layer_host.json").read_text())
    assert res["commit"] and res["cuda_path_gemms"]
    rows = {(r["scope"], r["variant"]): r for r in res["rows"]}
    assert set(rows) == {(s, v) for s in ("layer", "block") for v in ("bf16", "fp8_hybrid")}
    for r in rows.values():
        assert "error" not in r, r
        assert all(field in r for field in FIELDS) and r["mode"] == "eager"
        assert r["syncs"] == 0 and r["host_us"] > 0
    assert rows["layer", "bf16"]["by_op"] == {"aten::mm": 3}
    assert rows["layer", "bf16"]["host_ratio_vs_bf16"] == rows["block", "bf16"]["saved_bytes_ratio_vs_bf16"] == 1.0
    assert rows["block", "bf16"]["by_op"]["aten::mm"] == 21  # seven linears, three GEMMs each
    fp8 = rows["layer", "fp8_hybrid"]
    assert fp8["by_op"]["aten::_scaled_mm"] == 3 and "aten::mm" not in fp8["by_op"]
    assert any(op.startswith("triton::") for op in fp8["by_op"])
    # X's E4M3 codes (one byte an element) and two scales kept instead of X in BF16
    assert fp8["saved_bytes_ratio_vs_bf16"] < 0.6
    assert rows["block", "fp8_hybrid"]["by_op"]["aten::_scaled_mm"] == 21
    # the arithmetic subtracted from each step: its own GEMMs (and the block's attention), replayed after it
    assert set(rows["layer", "bf16"]["arithmetic_by_op"]) == {"aten::mm"}
    assert set(fp8["arithmetic_by_op"]) == {"aten::_scaled_mm"}
    assert {"aten::_scaled_mm", "aten::_scaled_dot_product_flash_attention_for_cpu"} <= set(
        rows["block", "fp8_hybrid"]["arithmetic_by_op"])
    text = (tmp_path / "bench_layer_host.md").read_text()
    assert res["commit"] in text and "| block | eager | fp8_hybrid |" in text
