"""Tests for the snip-ds command line (called through main([...]))."""
import json
import random

import pytest

from snip_ds.cli import main, render_plan
from snip_ds.plan import Plan, fp4_share
from snip_ds.planner import SolverSettings, costs_from_stats, solve_plan
from snip_ds.types import block_index

NAMES = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
         ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def _stats(n_blocks=4, seed=0):
    rng = random.Random(seed)
    layers = {}
    for b in range(n_blocks):
        for part, name in NAMES:
            layers[f"model.layers.{b}.{part}.{name}"] = {
                "flops": rng.uniform(1e9, 4e9), "nonfinite": False,
                **{k: {"fp8": rng.random() * 1e-3, "fp4": rng.random()}
                   for k in ("fld", "bwd", "quant_err", "rel_quant_err")}}
    return {"format": "snip_ds.stats/1", "step": 200, "lr": 1e-3, "world_size": 1, "estimator": "mc_fisher",
            "lambda": 100.0, "layers": layers}


@pytest.fixture
def stats_file(tmp_path):
    path = tmp_path / "stats.json"
    path.write_text(json.dumps(_stats()))
    return path


def test_plan_best_writes_the_ilp_plan(stats_file, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", str(stats_file), "--efficiency-saving", "0.4", "-o", str(out)]) == 0
    plan = Plan.load(out)
    stats = _stats()
    sc = costs_from_stats(stats, 100.0)
    assert plan.digest() == solve_plan(sc.costs, sc.flops, 0.4).digest()
    assert plan.fp4_share >= 0.4 and plan.meta["rho"] == 0.4 and plan.meta["step"] == 200
    assert str(out) in capsys.readouterr().out


def test_plan_lambda_pin_and_methods(stats_file, tmp_path):
    out = tmp_path / "p.json"
    pin = "model.layers.1.mlp.down_proj"
    assert main(["plan", str(stats_file), "--efficiency-saving", "0.3", "--lambda", "0", "--pin", f"{pin}=fp4",
                 "--method", "best", "-o", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.assignment[pin] == "fp4" and plan.meta["lambda"] == 0.0
    stats = _stats()
    sc = costs_from_stats(stats, 0.0)
    assert plan.digest() == solve_plan(sc.costs, sc.flops, 0.3, SolverSettings(pinned={pin: "fp4"})).digest()
    assert main(["plan", str(stats_file), "--efficiency-saving", "0.3", "--method", "first_last_fp8",
                 "-o", str(out)]) == 0
    fl = Plan.load(out)
    assert all(p == "fp8" for f, p in fl.assignment.items() if block_index(f) in (0, 3))


def test_plan_random_writes_one_file_per_seed(stats_file, tmp_path):
    out = tmp_path / "rand.json"
    assert main(["plan", str(stats_file), "--efficiency-saving", "0.5", "--method", "random", "--seed", "7",
                 "--num-random", "3", "-o", str(out)]) == 0
    plans = [Plan.load(tmp_path / f"rand.seed{s}.json") for s in (7, 8, 9)]
    assert [p.meta["seed"] for p in plans] == [7, 8, 9]
    assert len({p.digest() for p in plans}) == 3


def test_plan_per_gemm_and_three_precisions(stats_file, tmp_path):
    out = tmp_path / "g.json"
    assert main(["plan", str(stats_file), "--efficiency-saving", "0.5", "--per-gemm", "--allowed",
                 "bf16,fp8,fp4", "--max-share", "0.55", "-o", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.per_gemm and 0.5 - 1e-9 <= plan.fp4_share <= 0.55 + 1e-9


def test_plan_three_precisions_under_a_compute_budget(stats_file, tmp_path):
    """With bf16 allowed, a GEMM-cost budget (relative to all-BF16; fp8 1/2, fp4 1/4) decides which layers
    stay in bf16; checked against the stats file's own FLOPs."""
    out = tmp_path / "b.json"
    assert main(["plan", str(stats_file), "--efficiency-saving", "0.5", "--allowed", "bf16,fp8,fp4",
                 "--compute-budget", "0.4", "-o", str(out)]) == 0
    plan = Plan.load(out)
    flops = {f: rec["flops"] for f, rec in json.loads(stats_file.read_text())["layers"].items()}
    cost = {"bf16": 1.0, "fp8": 0.5, "fp4": 0.25}
    relative = sum(flops[f] * cost[p] for f, p in plan.assignment.items()) / sum(flops.values())
    assert relative <= 0.4 + 1e-9
    assert fp4_share(plan.assignment, flops) >= 0.5 - 1e-9
    assert {"bf16", "fp4"} <= set(plan.assignment.values())  # bf16 (zero cost) wherever the budget allows
    # without a budget nothing is gained by fp8 over bf16 (bf16 has no divergence): no fp8 at all
    free = tmp_path / "free.json"
    assert main(["plan", str(stats_file), "--efficiency-saving", "0.5", "--allowed", "bf16,fp8,fp4",
                 "-o", str(free)]) == 0
    assert "fp8" not in set(Plan.load(free).assignment.values())


@pytest.mark.parametrize("argv_tail, match", [
    (["--efficiency-saving", "1.5"], r"--efficiency-saving: must lie in \[0, 1\], got 1.5"),
    (["--rho", "-0.5"], r"--rho: must lie in \[0, 1\], got -0.5"),  # the flag as typed, not the setting's name
    (["--rho=1.5"], r"--rho: must lie in \[0, 1\], got 1.5"),
    (["--lambda", "-1"], "--lambda: must not be negative, got -1.0"),
    (["--compute-budget", "0"], r"--compute-budget: must lie in \(0, 1\]"),
    (["--time-limit", "0"], "--time-limit: must be positive, got 0.0"),
    (["--dgrad-calibration", "0"], "--dgrad-calibration: must be a finite number > 0"),
    (["--flip-penalty", "-1"], "--flip-penalty: must not be negative"),
    (["--rho", "0.5", "--max-share", "0.4"], r"--max-share: must lie in \[--efficiency-saving, 1\] = \[0.5, 1\]"),
    (["--num-random", "0"], "--num-random: must be at least 1, got 0"),
    (["--dgrad-cost", "upstream"], "--dgrad-cost upstream: .* needs --per-gemm"),
    (["--allowed", ","], "--allowed: must name at least one of bf16, fp8, fp4"),
    (["--efficiency-saving", "0.5", "--pin", "nofield"], "expected FQN=PRECISION"),
    (["--efficiency-saving", "0.5", "--pin", "model.layers.0.mlp.up_proj=fp16"], "unknown precision 'fp16'"),
    (["--efficiency-saving", "0.5", "--pin", "model.layers.99.mlp.up_proj=fp8"], "not in the cost table"),
    (["--efficiency-saving", "0.9", "--method", "first_last_fp8"], "unreachable"),
    (["--efficiency-saving", "0.5", "--allowed", "fp8,int4"], "--allowed: unknown value 'int4'; valid: bf16, fp8, fp4"),
])
def test_plan_user_errors_exit_2_with_one_line(stats_file, tmp_path, capsys, argv_tail, match):
    out = tmp_path / "never.json"
    assert main(["plan", str(stats_file), *argv_tail, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("snip-ds: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert pytest.importorskip("re").search(match, err)
    assert not out.exists()


def test_bad_stats_files_exit_2(tmp_path, capsys):
    missing = tmp_path / "missing.json"
    assert main(["plan", str(missing), "--efficiency-saving", "0.5", "-o", str(tmp_path / "o.json")]) == 2
    assert str(missing) in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    assert main(["plan", str(bad), "--efficiency-saving", "0.5", "-o", str(tmp_path / "o.json")]) == 2
    assert f"{bad}: not valid JSON" in capsys.readouterr().err
    stats = _stats()
    del stats["layers"]["model.layers.0.mlp.up_proj"]["bwd"]
    bad.write_text(json.dumps(stats))
    assert main(["plan", str(bad), "--efficiency-saving", "0.5", "-o", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "lacks field 'bwd'" in err and err.count("\n") == 1


def test_nonfinite_warning_goes_to_stderr(tmp_path, capsys):
    stats = _stats()
    stats["layers"]["model.layers.2.mlp.up_proj"]["nonfinite"] = True
    path = tmp_path / "s.json"
    path.write_text(json.dumps(stats))
    out = tmp_path / "p.json"
    assert main(["plan", str(path), "--efficiency-saving", "0.3", "-o", str(out)]) == 0
    assert "warning: 1 layer(s) have non-finite statistics" in capsys.readouterr().err
    assert Plan.load(out).assignment["model.layers.2.mlp.up_proj"] == "fp8"


def test_show_renders_block_map(tmp_path, capsys):
    fqns = [f"model.layers.{b}.{part}.{name}" for b in range(2) for part, name in NAMES]
    assignment = {f: ("fp4" if "mlp" in f else "fp8") for f in fqns}
    assignment["model.layers.1.self_attn.q_proj"] = "bf16"
    flops = {f: 1.0 for f in fqns}
    path = tmp_path / "p.json"
    Plan.fixed(assignment, flops).save(path)
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["block", "q", "k", "v", "o", "gate", "up", "down"]
    assert out[2].split() == ["0", "8", "8", "8", "8", "4", "4", "4"]
    assert out[3].split() == ["1", "B", "8", "8", "8", "4", "4", "4"]
    assert "FP4 share 0.4286" in out[0]  # 6 of 14 equal-FLOP layers
    assert any(line.startswith("legend: ") and "4 = fp4" in line and "B = bf16" in line for line in out)


def test_show_per_gemm_and_bare_file(tmp_path, capsys):
    path = tmp_path / "user.json"
    path.write_text(json.dumps({"model.layers.0.self_attn.q_proj": {"fprop": "fp4", "dgrad": "fp8",
                                                                      "wgrad": "fp8"},
                                "model.layers.0.mlp.down_proj": "fp8"}))
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "FP4 share unknown" in out
    lines = out.splitlines()
    assert lines[1].split() == ["block", "q", "down"]  # only the columns the plan has
    assert lines[2].split() == ["0", "488", "888"]      # fprop/dgrad/wgrad per cell
    text = render_plan(Plan.load(path), "x")
    assert "fprop/dgrad/wgrad" in text


def test_show_errors(tmp_path, capsys):
    assert main(["show", str(tmp_path / "none.json")]) == 2
    assert "none.json" in capsys.readouterr().err
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps({"model.layers.0.mlp.up_proj": "fp5"}))
    assert main(["show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "'fp5'" in err and "valid precisions are bf16, fp8, fp4" in err


def test_diff(tmp_path, capsys):
    fqns = [f"model.layers.0.{part}.{name}" for part, name in NAMES]
    flops = {f: 1.0 for f in fqns}
    a = {f: "fp8" for f in fqns}
    b = dict(a)
    b[fqns[0]] = b[fqns[1]] = "fp4"
    b[fqns[2]] = "bf16"
    Plan.fixed(a, flops).save(tmp_path / "a.json")
    Plan.fixed(b, flops).save(tmp_path / "b.json")
    assert main(["diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "3 of 7 common layers differ: fp8 -> bf16: 1, fp8 -> fp4: 2" in out
    assert f"FP4 share {fp4_share(b, flops):.4f}" in out and "FP4 share 0.0000" in out
    assert f"{fqns[0]}  fp8 -> fp4" in out and f"{fqns[2]}  fp8 -> bf16" in out
    assert main(["diff", str(tmp_path / "a.json"), str(tmp_path / "zzz.json")]) == 2


def test_plan_dgrad_upstream_prices_dgrad_from_the_statistics(tmp_path, capsys):
    stats = _stats(n_blocks=2)
    for rec in stats["layers"].values():
        rec["bwd_dgrad"] = {"fp8": 0.0, "fp4": 1e-9}  # nearly free: at a share of 1/3, dgrad is what moves
    path, out = tmp_path / "s.json", tmp_path / "p.json"
    path.write_text(json.dumps(stats))
    assert main(["plan", str(path), "--rho", "0.3333", "--per-gemm", "--dgrad-cost", "upstream",
                 "--dgrad-calibration", "10", "-o", str(out)]) == 0
    plan = Plan.load(out)
    assert all(a["dgrad"] == "fp4" and a["fprop"] == a["wgrad"] == "fp8" for a in plan.assignment.values())
    assert plan.meta["dgrad_calibration"] == 10.0
    assert main(["plan", str(path), "--rho", "0.3", "--dgrad-cost", "upstream", "-o", str(out)]) == 2
    assert "--dgrad-cost upstream: prices the dgrad GEMM on its own, so it needs --per-gemm" in capsys.readouterr().err
    del stats["layers"]["model.layers.0.mlp.up_proj"]["bwd_dgrad"]
    path.write_text(json.dumps(stats))
    assert main(["plan", str(path), "--rho", "0.3", "--per-gemm", "--dgrad-cost", "upstream", "-o", str(out)]) == 2
    assert "lack field 'bwd_dgrad'" in capsys.readouterr().err


def test_plan_bwd_estimate_systematic_uses_the_persistent_part(tmp_path, capsys):
    stats = _stats(n_blocks=2)
    for i, rec in enumerate(stats["layers"].values()):
        rec["bwd_bias"] = {"fp8": 0.0, "fp4": 0.0}
    path, out = tmp_path / "s.json", tmp_path / "p.json"
    path.write_text(json.dumps(stats))
    assert main(["plan", str(path), "--rho", "0.5", "--bwd-estimate", "systematic", "--lambda", "1e6",
                 "-o", str(out)]) == 0
    assert Plan.load(out).meta["bwd_key"] == "bwd_bias"
    del stats["layers"]["model.layers.0.mlp.up_proj"]["bwd_bias"]
    path.write_text(json.dumps(stats))
    assert main(["plan", str(path), "--rho", "0.5", "--bwd-estimate", "systematic", "-o", str(out)]) == 2
    assert "lack field 'bwd_bias'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ --version, help
def test_version_answers_without_a_command(capsys):
    from snip_ds import __version__
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"snip-ds {__version__}"


def test_plan_help_states_defaults_in_the_flags_own_words(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse's line wrapping undone
    assert "(default 0.75)" in out and "(default best)" in out and "(default fp8,fp4)" in out
    assert "--pin model.layers.0.mlp.down_proj=fp8" in out and '{"' not in out  # FQN=PRECISION, not JSON
    assert "None: none" not in out and "Default: no bound" in out


def test_plan_efficiency_saving_defaults_to_the_sections(stats_file, tmp_path):
    out = tmp_path / "p.json"
    assert main(["plan", str(stats_file), "-o", str(out)]) == 0
    assert Plan.load(out).meta["rho"] == 0.75


# ------------------------------------------------------------------------------------------------ show: units
def test_show_labels_the_flop_share_the_gemm_count_and_the_objectives_unit(stats_file, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["plan", str(stats_file), "--rho", "0.5", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    text = capsys.readouterr().out
    plan = Plan.load(out)
    assert f"FP4 share {plan.fp4_share:.4f} of the linear FLOPs" in text
    assert f"objective {plan.objective:.6g} (nats, Σ FLD + λ·BWD: the predicted loss increase)" in text
    fp4_gemms = 3 * sum(p == "fp4" for p in plan.assignment.values())
    assert f"GEMMs counted (fprop, dgrad and wgrad of each layer, not weighted by FLOPs): " in text
    assert f"fp4 {fp4_gemms}/{3 * len(plan.assignment)}" in text


# ------------------------------------------------------------------------------------------------ show: statistics
def _stats_rows(text: str) -> list:
    """The layer rows of ``snip-ds show STATS``: [name, FLOPs %, FLD fp8, FLD fp4, BWD fp8, BWD fp4, cost, (plan)]."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("layer "))
    return [line.split() for line in lines[start + 1:]]


def test_show_statistics_prints_fld_bwd_and_the_plans_precision_per_layer(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    stats = _stats(n_blocks=2)
    (run / "stats.json").write_text(json.dumps(stats))
    sc = costs_from_stats(stats, 100.0)
    plan = solve_plan(sc.costs, sc.flops, 0.5)
    plan.save(run / "plan.json")
    assert main(["show", str(run / "stats.json")]) == 0
    text = capsys.readouterr().out
    assert "statistics at step 200" in text and "λ 100" in text and f"precisions from {run / 'plan.json'}" in text
    rows = _stats_rows(text)
    assert [r[0] for r in rows] == list(stats["layers"])  # the model's order
    for row in rows:
        rec = stats["layers"][row[0]]
        assert float(row[3]) == pytest.approx(rec["fld"]["fp4"], rel=1e-3)
        assert float(row[5]) == pytest.approx(rec["bwd"]["fp4"], rel=1e-3)
        assert float(row[6]) == pytest.approx(rec["fld"]["fp4"] + 100.0 * rec["bwd"]["fp4"], rel=1e-3)
        assert row[7] == plan.assignment[row[0]]
    total = sum(r["flops"] for r in stats["layers"].values())
    assert sum(float(r[1]) for r in rows) == pytest.approx(100.0, abs=0.01 * len(rows))
    assert float(rows[0][1]) == pytest.approx(100 * stats["layers"][rows[0][0]]["flops"] / total, abs=0.006)


@pytest.mark.parametrize("sort, field", [("fld", "fld"), ("bwd", "bwd")])
def test_show_statistics_sorts_by_a_column_largest_first(stats_file, capsys, sort, field):
    assert main(["show", str(stats_file), "--sort", sort]) == 0
    text = capsys.readouterr().out
    names = [r[0] for r in _stats_rows(text)]
    layers = _stats()["layers"]
    assert names == sorted(layers, key=lambda f: -layers[f][field]["fp4"])
    assert "no plan.json beside it" in text  # and no plan column
    assert all(len(r) == 7 for r in _stats_rows(text))


def test_show_statistics_takes_a_plan_from_plan_flag(stats_file, tmp_path, capsys):
    plan_path = tmp_path / "elsewhere.json"
    Plan.uniform(list(_stats()["layers"]), "fp8").save(plan_path)
    assert main(["show", str(stats_file), "--plan", str(plan_path), "--sort", "cost"]) == 0
    assert {r[7] for r in _stats_rows(capsys.readouterr().out)} == {"fp8"}


@pytest.mark.parametrize("case, match", [
    ("missing", "statistics file .* does not exist|does not exist"),
    ("broken", "not a snip_ds statistics|lacks field 'bwd'"),
    ("plan_missing", "plan file .*nothing.json.* does not exist"),
    ("plan_with_plan", "--plan: only with a statistics file"),
])
def test_show_statistics_errors_are_one_line(stats_file, tmp_path, capsys, case, match):
    import re
    argv = {"missing": ["show", str(tmp_path / "none" / "stats.json")],
            "plan_missing": ["show", str(stats_file), "--plan", str(tmp_path / "nothing.json")]}.get(case)
    if case == "broken":
        stats = _stats()
        del stats["layers"]["model.layers.0.mlp.up_proj"]["bwd"]
        stats_file.write_text(json.dumps(stats))
        argv = ["show", str(stats_file)]
    if case == "plan_with_plan":
        plan_path = tmp_path / "p.json"
        Plan.uniform(list(_stats()["layers"]), "fp8").save(plan_path)
        argv = ["show", str(plan_path), "--plan", str(plan_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("snip-ds: error: ") and err.count("\n") == 1 and re.search(match, err), err


# ------------------------------------------------------------------------------------------------ families
def test_families_needs_an_output_named_by_the_user(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["families", "--only", "llama"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("snip-ds: error: --output: name the directory") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []  # nothing written, no docs/ made


# ------------------------------------------------------------------------------------------------ launch/train.py
@pytest.mark.parametrize("argv, message", [
    (["--max_steps", "0"], "--max_steps: must be at least 1, got 0"),
    (["--seed", "-1"], "--seed: must lie in [0, 2**63), got -1"),
    (["--block_size", "0"], "--block_size: must be at least 1, got 0"),
    (["--plan", "plan.txt"], "--plan: 'plan.txt' is neither one of"),
])
def test_train_flag_errors_name_the_flag(argv, message):
    from pathlib import Path

    from snip_ds.config.settings import ConfigError
    from snip_ds.config.train_args import build_parser, settings_from_args

    config = Path(__file__).resolve().parents[1] / "ds_configs" / "zero3.json"
    args = build_parser().parse_args(["--deepspeed", str(config), *argv])
    with pytest.raises(ConfigError) as err:
        settings_from_args(args)
    assert str(err.value).startswith(message)


def test_train_help_states_each_flags_default():
    from snip_ds.options import OPTIONS
    from snip_ds.config.settings import TrainSettings
    from snip_ds.config.train_args import build_parser

    text = " ".join(build_parser().format_help().split())
    assert f"tokens per training sequence (default: the JSON's snip.train.block_size, else " \
           f"{TrainSettings.block_size})" in text
    assert f"(default: the JSON's snip.train.max_steps, else {TrainSettings.max_steps})" in text
    assert "(default: the JSON's optimizer.params.lr; when that is \"auto\", 0.002)" in text
    assert f"default: the JSON's snip.plan, else {OPTIONS['plan'].default}" in text
