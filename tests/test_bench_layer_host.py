"""benchmarks/bench_layer_host.py, a short run (bf16 and fp8_hybrid, eager, both scopes, 3 timed steps) on the CUDA
code path on CPU tensors: every row has the report's fields, and the figures that do not depend on timing are
what the code does -- three GEMMs per linear, no host read, X kept as FP8 codes. Times are not checked.

And benchmarks/triton_launch_path.py, the driver that times Triton's own launch path without a GPU: a launch
goes through ``JITFunction.run`` and reaches the driver's launch call with the arguments the kernel was called
with; each kernel specialization is compiled once, not per launch; where Triton cannot compile, the columns say
why ("not measured"), never a figure."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from train_utils import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import triton_launch_path  # noqa: E402  (imports no triton: the driver's module is loaded in the subprocess)

FIELDS = ("scope", "variant", "mode", "launches", "host_us", "host_ratio_vs_bf16", "syncs",
          "saved_bytes_ratio_vs_bf16", "peak_bytes_ratio_vs_bf16")


def test_a_short_run_writes_every_row_with_its_fields(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_layer_host.py"), "--steps", "3",
                           "--variants", "fp8_hybrid", "--modes", "eager", "--no_python_profile",
                           "--launch_repeats", "3", "--output_dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads((tmp_path / "bench_layer_host.json").read_text())
    assert res["commit"] and res["cuda_path_gemms"]
    rows = {(r["scope"], r["variant"]): r for r in res["rows"]}
    assert set(rows) == {(s, v) for s in ("layer", "block") for v in ("bf16", "fp8_hybrid")} | {
        ("layer", "fp8_gemms_only")}  # (beside fp8_hybrid's eager layer row: its three GEMMs alone)
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
    # the floor: the same three FP8 GEMMs and the same bytes kept, nothing quantized in the step
    floor = rows["layer", "fp8_gemms_only"]
    assert floor["by_op"] == {"aten::_scaled_mm": 3} and floor["saved_bytes"] == fp8["saved_bytes"]
    assert set(floor["arithmetic_by_op"]) == {"aten::_scaled_mm"} and floor["triton_launch_us"] == 0.0
    # the arithmetic subtracted from each step: its own GEMMs (and the block's attention), replayed after it
    assert set(rows["layer", "bf16"]["arithmetic_by_op"]) == {"aten::mm"}
    assert set(fp8["arithmetic_by_op"]) == {"aten::_scaled_mm"}
    assert {"aten::_scaled_mm", "aten::_scaled_dot_product_flash_attention_for_cpu"} <= set(
        rows["block", "fp8_hybrid"]["arithmetic_by_op"])
    # where the bytes are: the block's linears keep fewer under fp8_hybrid, and what the rest keeps is unchanged
    block_bf16, block_fp8 = rows["block", "bf16"], rows["block", "fp8_hybrid"]
    assert 0 < block_fp8["saved_linear_only_bytes"] < block_bf16["saved_linear_only_bytes"]
    assert (block_fp8["saved_bytes"] - block_fp8["saved_linear_only_bytes"]
            == block_bf16["saved_bytes"] - block_bf16["saved_linear_only_bytes"] > 0)
    # two measures of an eager step's peak agree: the live tensors' bytes (dispatch), and the CPU allocator's
    # bytes that outlive the operator call that allocated them
    for r in rows.values():
        assert r["peak_alloc_outliving_bytes"] == r["peak_bytes"] <= r["peak_alloc_bytes"]
        assert r["peak_op"]["phase"] in ("forward", "backward") and sum(e[0] for e in r["peak_held"]) == r["peak_bytes"]
    text = (tmp_path / "bench_layer_host.md").read_text()
    assert res["commit"] in text and "| block | eager | fp8_hybrid |" in text and "## Where the bytes are" in text
    # Triton's own launch path: measured in a process of its own for the rows that launch snip_ds's kernels
    assert "not_measured" not in res["triton_launch_path"], res["triton_launch_path"]
    for r in rows.values():
        assert r["host_with_triton_us"] == r["host_us"] + r["triton_launch_us"]
        assert r["host_with_triton_ratio_vs_bf16"] is not None
    assert rows["layer", "bf16"]["triton_launch_us"] == 0.0 and "triton_launch" not in rows["layer", "bf16"]
    for scope in ("layer", "block"):
        launch = rows[scope, "fp8_hybrid"]["triton_launch"]
        triton_ops = {op[len("triton::"):]: c for op, c in rows[scope, "fp8_hybrid"]["by_op"].items()
                      if op.startswith("triton::")}
        assert launch["launches"] == launch["driver_launches"] == sum(triton_ops.values())
        assert {one["kernel"] for one in launch["per_launch"]} == set(triton_ops)
        assert all(one["args"] == one["params"] and {"us", "without_wrap_triton_us", "compiled_kernel_us"} <= set(one)
                   for one in launch["per_launch"])  # (times are not checked)
        assert launch["compiles_timed"] == 0
    # every specialization compiled in a row's warm-up (the block's: those the layer's did not)
    assert rows["layer", "fp8_hybrid"]["triton_launch"]["compiles_warmup"] > 0
    assert len(res["triton_launch_path"]["compiles"]) == sum(
        rows[s, "fp8_hybrid"]["triton_launch"]["compiles_warmup"] for s in ("layer", "block"))
    assert "| Triton launch µs | host + Triton µs |" in text and "## Triton's own launch path (eager)" in text


def _run_without_interpreter(script: str, tmp_path) -> str:
    """``script`` in a process where Triton is not in interpreter mode, benchmarks/ on its path; its stdout, or a
    skip where Triton's CUDA backend is not installed."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache"),
           "TRITON_DEFAULT_FP_FUSION": "1", "PYTHONPATH": os.pathsep.join([str(REPO / "benchmarks"), str(REPO)])}
    path = tmp_path / "launch_script.py"  # (Triton reads a kernel's source from its file)
    path.write_text(textwrap.dedent(script))
    proc = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if proc.stdout.startswith("skip:"):
        pytest.skip(proc.stdout.strip())
    return proc.stdout


LAUNCH_SCRIPT = """
    import json
    from contextlib import ExitStack
    try:
        import triton.backends.nvidia.driver  # noqa: F401
    except ImportError as err:
        print(f"skip: Triton's CUDA backend is not installed ({err})")
        raise SystemExit(0)
    import torch
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction
    import triton_launch_path as tlp

    @triton.jit
    def double_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)

    runs = []
    real_run = JITFunction.run

    def spied(self, *args, **kwargs):
        runs.append(self.fn.__name__)
        return real_run(self, *args, **kwargs)

    JITFunction.run = spied
    out = {}
    with ExitStack() as stack:
        drv, compiles = tlp.install(stack)
        drv.utils.recorded = []
        x, y = torch.randn(4096), torch.empty(4096)
        for _ in range(3):
            double_kernel[(4,)](x, y, 4096, BLOCK=1024)
        out["after_three"] = len(compiles)
        double_kernel[(8,)](x[:2048], y, 2048, BLOCK=256)  # another BLOCK: another specialization
        out["compiles"] = [c.kernel for c in compiles]
        out["runs"] = runs
        out["launches"] = drv.utils.launches
        out["recorded"] = [[list(grid), [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]]
                           for grid, args in drv.utils.recorded]
        out["called"] = [[[4, 1, 1], [x.data_ptr(), y.data_ptr(), 4096, 1024]]] * 3 + [
            [[8, 1, 1], [x.data_ptr(), y.data_ptr(), 2048, 256]]]
        out["target"] = str(drv.get_current_target())
        out["active"] = triton.runtime.driver.active is drv
    print(json.dumps(out))
"""


def test_the_launch_path_reaches_the_driver_with_the_call_arguments_compiling_once(tmp_path):
    out = json.loads(_run_without_interpreter(LAUNCH_SCRIPT, tmp_path).strip().splitlines()[-1])
    assert out["runs"] == ["double_kernel"] * 4  # every launch through JITFunction.run
    assert out["launches"] == 4 and out["recorded"] == out["called"]  # the driver's launch, the call's arguments
    assert out["after_three"] == 1 and out["compiles"] == ["double_kernel"] * 2  # once per specialization
    assert out["active"] and "90" in out["target"] and "cuda" in out["target"]


def test_a_kernel_that_cannot_compile_is_not_measured_and_says_why(monkeypatch):
    monkeypatch.setenv("PTXAS_OPTIONS", "--no-such-option")  # ptxas refuses: what a missing ptxas looks like
    res = triton_launch_path.measure_in_subprocess(["layer:fp8_hybrid"], 32, 64, 64, 1, 1, timeout_s=120)
    # no rows, no figures: why, and where it ran (commit, machine, torch)
    assert set(res) == {"not_measured", "commit", "machine", "torch"} and "ptxas" in res["not_measured"].lower(), res


def test_the_stand_in_for_triton_3_6_s_launcher_refuses_what_its_c_parse_refuses():
    """benchmarks/no_gpu_driver.NoGpuLauncher checks a recorded launch's arguments as 3.6's C module parses them:
    one per parameter, constexprs included; a pointer None, an int or a tensor; an integer kind an int in range;
    a float kind a number. Each wrong argument is a TypeError naming its position."""
    from types import SimpleNamespace

    import torch
    from no_gpu_driver import NoGpuLauncher

    pytest.importorskip("triton")
    src = SimpleNamespace(signature={"x_ptr": "*fp32", "n": "i32", "scale": "fp32", "flag": "u1",
                                     "BLOCK": "constexpr"})
    metadata = SimpleNamespace(global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0,
                               profile_scratch_align=1, launch_cooperative_grid=False, launch_pdl=False)
    launcher = NoGpuLauncher(src, metadata)
    x = torch.zeros(4)
    launcher.check((x, 2 ** 31 - 1, 0.5, True, object()))  # (a constexpr slot takes anything)
    launcher.check((None, -2 ** 31, 1, 0, 64))
    for index, wrong in ((0, "a string"), (1, 2 ** 31), (1, 1.0), (2, "1"), (3, -1)):
        args = [x, 1, 0.5, True, 64]
        args[index] = wrong
        with pytest.raises(TypeError, match=f"argument {index} "):
            launcher.check(tuple(args))
    with pytest.raises(TypeError, match="4 kernel arguments for a signature of 5"):
        launcher.check((x, 1, 0.5, True))
