"""benchmarks/bench_train.py --device cuda: its error without a GPU, and the pure pieces of its GPU path (the
run's config, the model's size, the figures read back from a run's TensorBoard). The GPU runs themselves need
a GPU; their figures are not checked here."""
import importlib.util
import json

import pytest
import torch

from train_utils import REPO, TINY_MODEL


def _bench():
    spec = importlib.util.spec_from_file_location("bench_train", REPO / "benchmarks" / "bench_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cuda_without_a_gpu_is_one_error_line_and_exit_2(monkeypatch, capsys):
    bench = _bench()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--device", "cuda"]) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "--device cuda" in errors[0] and "no CUDA device" in errors[0], captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_a_cuda_run_cut_short_keeps_the_plans_it_finished(monkeypatch, tmp_path, capsys):
    """The results are rewritten after every plan's run: when a later run fails (or the job is killed), the
    JSON and Markdown hold the finished plans, say which were not measured, and are marked incomplete."""
    bench = _bench()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Test GPU")
    step_time = {"bf16": 0.5, "fp8": 1.0}

    def launch(plan, steps, replan_every, *sizes):
        if plan not in step_time:
            raise RuntimeError(f"plan {plan}: launch/train.py failed (1)")
        return {"perf/step_time_s": {s: step_time[plan] for s in range(1, steps + 1)}}

    monkeypatch.setattr(bench, "_in_process_run", launch)
    with pytest.raises(RuntimeError, match="plan fp4"):
        bench.main(["--device", "cuda", "--steps", "6", "--output_dir", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_train_cuda.json").read_text())
    assert list(saved["rows"]) == ["bf16", "fp8"] and saved["meta"]["complete"] is False
    assert saved["rows"]["fp8"]["tokens_per_s_ratio_vs_bf16"] == pytest.approx(0.5)
    md = (tmp_path / "bench_train_cuda.md").read_text()
    assert "| fp8 | 1.000 | 8192 | 0.50x |" in md
    assert "| fp4 | not measured" in md and "| adaptive | not measured" in md
    assert not list(tmp_path.glob("*.tmp"))


def test_cuda_plans_must_start_with_bf16(capsys):
    bench = _bench()
    for plans in (["fp8", "bf16"], ["bf16", "fp8", "fp8"]):
        with pytest.raises(SystemExit) as exit_:
            bench.main(["--device", "cuda", "--plans", *plans])
        assert exit_.value.code == 2
        assert "--plans: with --device cuda only, bf16 first" in capsys.readouterr().err


def test_llama_parameters_counts_what_build_model_builds():
    from snip_ds.run.model import build_model, count_parameters

    bench = _bench()
    assert bench.llama_parameters(TINY_MODEL) == count_parameters(build_model(model_config=TINY_MODEL))
    assert 0.9e9 < bench.llama_parameters(bench.GPU_MODEL) < 1.1e9  # the "~1B" model


def test_gpu_run_config_is_the_shipped_zero3_with_the_benchmark_s_changes(tmp_path):
    from snip_ds.config.deepspeed_config import resolve_ds_config
    from snip_ds.config.settings import parse_snip_section

    bench = _bench()
    shipped = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    for plan in bench.GPU_PLANS:
        cfg = bench.gpu_run_config(plan, tmp_path / "model.json", tmp_path / "out", steps=12, replan_every=4)
        settings = parse_snip_section(cfg["snip"], "bench")
        assert settings.plan == plan and settings.replan_every == 4 and settings.quant.backend == "auto"
        t = settings.train
        assert (t.model_config, t.block_size, t.max_steps, t.eval_steps, t.output_dir) == (
            str(tmp_path / "model.json"), bench.GPU_BLOCK, 12, 12, str(tmp_path / "out"))
        deepspeed_part = {k: v for k, v in cfg.items() if k != "snip"}  # as load_ds_config splits it
        ds = resolve_ds_config(deepspeed_part, max_steps=12, on_gpu=True, source="bench")
        assert ds["bf16"] == {"enabled": True} and ds["zero_optimization"] == shipped["zero_optimization"]
        assert ds["train_micro_batch_size_per_gpu"] == bench.GPU_MICRO_BATCH
        assert ds["optimizer"]["type"] == shipped["optimizer"]["type"]
        untouched = {k for k in shipped["snip"] if k not in ("plan", "replan_every", "quant", "train")}
        assert {k: cfg["snip"][k] for k in untouched} == {k: shipped["snip"][k] for k in untouched}


def test_a_compiled_gpu_run_is_zero1_with_torch_compile_into_its_own_files(monkeypatch, tmp_path, capsys):
    """--torch_compile: each run is the shipped zero1.json, compiled by launch/train.py (which refuses ZeRO-3),
    its results beside the eager runs' (not over them); and it is an error for the CPU benchmark."""
    from snip_ds.config.settings import parse_snip_section

    bench = _bench()
    cfg = bench.gpu_run_config("fp8", tmp_path / "model.json", tmp_path / "out", steps=12, replan_every=4,
                               compiled=True)
    assert cfg["zero_optimization"] == json.loads((REPO / "ds_configs" / "zero1.json").read_text())[
        "zero_optimization"] and parse_snip_section(cfg["snip"], "bench").train.compiles
    assert not parse_snip_section(bench.gpu_run_config("fp8", tmp_path / "m", tmp_path / "o")["snip"],
                                  "bench").train.compiles
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Test GPU")
    seen = []

    def run(plan, steps, replan_every, model_cfg, micro_batch, block, compiled):
        seen.append(compiled)
        return {"perf/step_time_s": {s: 0.5 for s in range(1, steps + 1)}}

    monkeypatch.setattr(bench, "_in_process_run", run)
    assert bench.main(["--device", "cuda", "--steps", "6", "--plans", "bf16", "--torch_compile",
                       "--output_dir", str(tmp_path)]) == 0
    assert seen == [True] and sorted(f.name for f in tmp_path.glob("bench_train_cuda*")) == [
        "bench_train_cuda_compiled.json", "bench_train_cuda_compiled.md"]
    assert "ZeRO-1, torch.compile" in (tmp_path / "bench_train_cuda_compiled.md").read_text()
    with pytest.raises(SystemExit):
        bench.main(["--torch_compile"])
    assert "--torch_compile: with --device cuda or --plumbing only" in capsys.readouterr().err


def test_summarize_run_reads_step_time_and_snip_overhead():
    bench = _bench()
    # steps 1..12: warm-up 1, 2 left out; steps 5 and 10 carry the BF16 measuring forward (+0.5 s)
    steps = {s: (9.0 if s <= 2 else 2.0 + (0.5 if s % 5 == 0 else 0.0) + 0.01 * (s % 2)) for s in range(1, 13)}
    series = {"perf/step_time_s": steps, "snip/collect_time_s": {0: 6.0, 4: 6.0, 8: 7.0},
              "snip/solve_time_s": {0: 1.0, 4: 1.0, 8: 1.0}}
    row = bench.summarize_run(series, tokens_per_step=1000, measure_every=5, shipped_replan_every=100)
    plain = sorted(2.0 + 0.01 * (s % 2) for s in range(3, 13) if s % 5)  # 8 steps: 4 x 2.00, 4 x 2.01
    assert row["steps_timed"] == 8 and row["step_time_s"] == pytest.approx((plain[3] + plain[4]) / 2)
    assert row["tokens_per_s"] == pytest.approx(1000 / row["step_time_s"])
    assert row["collect_s"] == 6.0 and row["solve_s"] == 1.0 and row["collections"] == 3
    measured = (2.51 + 2.5) / 2  # steps 5 and 10
    assert row["bf16_measure_forward_s"] == pytest.approx(measured - row["step_time_s"])
    overhead = 6.0 + 1.0 + 100 / 5 * row["bf16_measure_forward_s"]
    assert row["snip_overhead_share"] == pytest.approx(overhead / (100 * row["step_time_s"] + overhead))
    assert row["tokens_per_s_with_snip"] == pytest.approx(100 * 1000 / (100 * row["step_time_s"] + overhead))
    uniform = bench.summarize_run({"perf/step_time_s": steps}, 1000, 5, 100)
    assert "snip_overhead_share" not in uniform and uniform["step_time_s"] == row["step_time_s"]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_gpu_run_s_path_on_the_cpu_at_a_tiny_size(monkeypatch):
    """The --device cuda path (the generated config through the deepspeed launcher, launch/train.py, its
    TensorBoard read back) on the CPU with the tiny model: an adaptive run yields step times and collections."""
    bench = _bench()
    monkeypatch.setattr(bench, "GPU_MODEL", TINY_MODEL)
    monkeypatch.setattr(bench, "GPU_BLOCK", 64)
    monkeypatch.setattr(bench, "GPU_MICRO_BATCH", 2)
    series = bench._launch_run("adaptive", steps=8, replan_every=4)
    assert sorted(series["perf/step_time_s"]) == list(range(1, 9))
    assert sorted(series["snip/collect_time_s"]) == sorted(series["snip/solve_time_s"]) and \
        len(series["snip/collect_time_s"]) == 2  # steps 0 and 4
    row = bench.summarize_run(series, 2 * 64, measure_every=10, shipped_replan_every=200)
    assert row["tokens_per_s"] > 0 and 0 < row["snip_overhead_share"] < 1


@pytest.mark.slow
def test_the_gpu_plans_run_one_after_another_in_one_process():
    """--plumbing: the --device cuda code path with every plan trained in this process (snip_ds.run.trainer.main in
    turn, the process group kept between runs) on a 2-block Llama on the CPU: each plan yields its row, the
    adaptive one its collections, and the process group is gone at the end."""
    import torch.distributed as dist

    bench = _bench()
    res = bench.bench_cuda(6, 3, plumbing=True)
    assert list(res["rows"]) == list(bench.GPU_PLANS) and res["runs"] == "in one process"
    assert all(r["tokens_per_s"] > 0 for r in res["rows"].values())
    assert res["rows"]["adaptive"]["collections"] == 2 and not dist.is_initialized()
