"""The plan study (launch/plan_study.py): pairing at an equal FP4 share, per-cell random plans, the clustered
standard error against a hand-computed case, the verdicts, resume with a fake cell runner, and the one Spearman."""
from __future__ import annotations

import importlib.util
import json
import math
import types
from pathlib import Path

import pytest

from snip_ds.experiments import paired, plan_study, scores
from snip_ds.experiments.plan_study import FIXED, random_plan, random_seed, run_study, solve_arms
from snip_ds.experiments.study_stats import analyse, classify, clustered_mean, paired_by_cell

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"q_proj": 4.0, "k_proj": 2.0, "v_proj": 2.0, "o_proj": 4.0, "gate_proj": 10.0, "up_proj": 10.0,
          "down_proj": 10.0}


def _stats(blocks: int) -> dict:
    """Statistics of a Llama-like model: equal blocks of four layer shapes, distinct costs per layer."""
    layers = {}
    for b in range(blocks):
        for i, (name, flops) in enumerate(SHAPES.items()):
            part = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            k = b * len(SHAPES) + i + 1
            rec = {"flops": flops * 1e9, "nonfinite": False}
            for field, mult in (("fld", 7919), ("bwd", 104729), ("quant_err", 31), ("rel_quant_err", 577)):
                rec[field] = {"fp8": 1e-6 * k, "fp4": ((k * mult) % 101 + 1) * 1e-3}  # a ranking of its own
            layers[f"model.layers.{b}.{part}.{name}"] = rec
    return {"format": "snip_ds.stats/1", "step": 100, "lambda": 2.0, "layers": layers}


# --------------------------------------------------------------------------------------------------------
# Pairing at an equal share
# --------------------------------------------------------------------------------------------------------
def test_arms_are_solved_at_one_share_and_a_rule_is_paired_where_it_landed():
    arms = plan_study.ARMS
    # 8 blocks: the last 2 blocks in FP8 reach 0.75 exactly, so last_k_fp8 is paired with SNIP itself
    eight = solve_arms(_stats(8), arms, 0.75, 2.0)
    assert eight["share"] == pytest.approx(0.75)
    for arm, plan in eight["plans"].items():
        if not arm.startswith("uniform_"):
            assert plan.fp4_share == pytest.approx(eight["share"], abs=1e-9), arm
    assert eight["pair_with"]["last_k_fp8"] == "snip" and eight["plans"]["last_k_fp8"].meta["k"] == 2
    assert eight["pair_with"]["random"] == "snip" and "random" not in eight["plans"]
    assert not eight["skipped"] and eight["plans"]["snip_gemm"].assignment != eight["plans"]["snip"].assignment
    # 3 blocks: last_k lands on 2/3, not the solved share; SNIP is solved again there and paired with it, and
    # first_last_fp8's pins (2 of 3 blocks in FP8) cannot reach 0.75: skipped with its reason
    with pytest.warns(RuntimeWarning, match="last_k_fp8: the FP4 share reached, 0.6667"):
        three = solve_arms(_stats(3), arms, 0.75, 2.0)
    assert three["share"] >= 0.75 and three["plans"]["last_k_fp8"].fp4_share == pytest.approx(2 / 3)
    ref = three["pair_with"]["last_k_fp8"]
    assert ref == "snip@0.6667" and three["plans"][ref].fp4_share == pytest.approx(2 / 3, abs=1e-9)
    assert three["plans"][ref].method == "best"
    assert [s["arm"] for s in three["skipped"]] == ["first_last_fp8"]


def test_a_plan_off_the_share_is_refused(monkeypatch):
    real = plan_study._solve

    def off(method, stats, share, lam, per_gemm=False, seed=0):
        plan = real(method, stats, share, lam, per_gemm, seed)
        if method != "quant_err":
            return plan
        return real("best", stats, 0.5, lam)  # a solver that missed the share

    monkeypatch.setattr(plan_study, "_solve", off)
    with pytest.raises(ValueError, match="quant_err: solved at FP4 share 0.5.*refusing to pair"):
        solve_arms(_stats(8), ("uniform_fp8", "snip", "quant_err"), 0.75, 2.0)


def _row(ms, ds, arm, loss, share=0.75, **kw):
    return dict(model_seed=ms, data_seed=ds, arm=arm, rho=0.75, fp4_share=share, val_loss=loss,
                plan_hash=f"{arm}-{ms}-{ds}", **kw)


def test_pairing_refuses_unequal_shares_and_follows_pair_with():
    rows = [_row(0, 0, "snip", 2.0), _row(0, 0, "quant_err", 2.001), _row(0, 1, "snip", 3.0),
            _row(0, 1, "quant_err", 3.003)]
    assert paired_by_cell(rows, "snip", "quant_err") == {0: [pytest.approx(-0.001), pytest.approx(-0.003)]}
    bad = rows + [_row(1, 0, "snip", 2.0), _row(1, 0, "quant_err", 2.0, share=0.7)]
    with pytest.raises(ValueError, match=r"cell \(model seed 1, data seed 0\).*refusing to pair"):
        paired_by_cell(bad, "snip", "quant_err")
    # a rule at another share is compared with SNIP at that share (its pair_with), never with SNIP at 0.75
    rows = [_row(0, d, a, 2.0 + d + x, share=s, **kw) for d in (0, 1) for a, x, s, kw in (
        ("uniform_fp8", 0.0, 0.0, {}), ("uniform_fp4", 0.005, 1.0, {}), ("snip", 0.001, 0.75, {}),
        ("snip@0.6667", 0.0005, 2 / 3, {}), ("last_k_fp8", 0.002, 2 / 3, dict(pair_with="snip@0.6667")))]
    [c] = analyse(rows)["comparisons"]
    assert c["arm"] == "last_k_fp8" and c["reference"] == "snip@0.6667"
    assert c["diff"].mean == pytest.approx(-0.0015)
    wrong = [dict(r, pair_with="snip") if r["arm"] == "last_k_fp8" else r for r in rows]
    with pytest.raises(ValueError, match="refusing to pair"):
        analyse(wrong)


# --------------------------------------------------------------------------------------------------------
# Random plans per cell
# --------------------------------------------------------------------------------------------------------
def test_random_plans_are_drawn_per_cell_and_reproducible():
    stats = _stats(8)
    share = solve_arms(stats, ("uniform_fp8", "snip"), 0.75, 2.0)["share"]
    cells = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 5)]
    seeds = [random_seed(*c) for c in cells]
    assert len(set(seeds)) == len(cells)
    plans = [random_plan(stats, share, *c) for c in cells]
    assert len({p.digest() for p in plans}) == len(cells)  # a fresh plan in every cell
    assert all(p.fp4_share == pytest.approx(share, abs=1e-9) for p in plans)
    assert random_plan(stats, share, 1, 0).digest() == plans[2].digest()  # the same cell: the same plan
    assert random_seed(1, 0) == seeds[2]


# --------------------------------------------------------------------------------------------------------
# Standard errors and verdicts
# --------------------------------------------------------------------------------------------------------
def test_clustered_se_by_hand():
    # clusters A = [1, 3], B = [2, 6]: mean 3; e_A = -2 + 0, e_B = -1 + 3; CR1 = sqrt(2/1 · (4 + 4) / 4²) = 1
    m = clustered_mean({"A": [1.0, 3.0], "B": [2.0, 6.0]})
    assert (m.mean, m.n, m.clusters) == (3.0, 4, 2)
    assert m.se_cluster == pytest.approx(1.0)
    assert m.se_pooled == pytest.approx(math.sqrt((4 + 0 + 1 + 9) / 3 / 4))  # sample SD / √n
    assert m.between_sd == pytest.approx(math.sqrt(2.0))  # seed means 2 and 4
    assert m.se == pytest.approx(m.se_pooled)  # the larger of the two decides
    # cells alike within a model seed: CR1 sees that they are one observation each, the pooled SE does not
    c = clustered_mean({0: [1.0] * 3, 1: [3.0] * 3, 2: [2.0] * 3})
    # e = (-3, 3, 0), CR1 = sqrt(3/2 · 18 / 81) = 1/√3; pooled = sqrt(6/8 / 9)
    assert c.se_cluster == pytest.approx(1 / math.sqrt(3)) and c.se_pooled == pytest.approx(math.sqrt(0.75 / 9))
    assert c.se == c.se_cluster and c.se_kind.startswith("max(CR1")
    one = clustered_mean({0: [1.0, 2.0, 4.0]})
    assert math.isnan(one.se_cluster) and one.se == one.se_pooled and one.se_kind.startswith("pooled")


def test_verdicts_win_loss_tie_unresolved():
    def diff(mean, se):
        return clustered_mean({0: [mean - se, mean + se]})  # one model seed: the pooled SE, sample SD / √2 = se

    cost = 5e-3  # bound ± 0.5e-3
    assert classify(diff(-1e-3, 0.4e-3), cost)["verdict"] == "win"  # 2.5 SE below
    assert classify(diff(1e-3, 0.4e-3), cost)["verdict"] == "loss"
    assert classify(diff(0.1e-3, 0.2e-3), cost)["verdict"] == "tie"  # 90 % CI [-0.23, 0.43] inside ± 0.5
    assert classify(diff(0.3e-3, 0.2e-3), cost)["verdict"] == "unresolved"  # CI reaches 0.63: not a tie
    assert classify(diff(-0.7e-3, 0.4e-3), cost)["verdict"] == "unresolved"  # below, but only 1.75 SE
    assert classify(diff(0.1e-3, 0.2e-3), -1e-3)["verdict"] == "unresolved"  # no FP4 cost: no tie
    r = classify(diff(0.0, 0.1e-3), cost)
    assert r["bound"] == pytest.approx(0.5e-3) and r["ci90"][1] == pytest.approx(0.16449e-3, rel=1e-4)


# --------------------------------------------------------------------------------------------------------
# Resume, with a fake cell runner
# --------------------------------------------------------------------------------------------------------
class FakeWorker:
    """Runs nothing: a cell's loss is a formula of the seeds and the arm; every call is logged."""

    calls: list = []

    def __init__(self, args):
        self.args = args

    def prepare(self, ms):
        return dict(share=0.75, skipped=[], pair_with={}, plans={})

    def cell(self, ms, ds, done):
        rows = []
        for i, arm in enumerate(self.args.arms):
            row = _row(ms, ds, arm, 2.0 + 0.01 * ms + 1e-3 * ds * (i % 3) + 1e-4 * i,
                       share={"uniform_fp8": 0.0, "uniform_fp4": 1.0}.get(arm, 0.75))
            if plan_study.row_key(row) not in done:
                FakeWorker.calls.append((ms, ds, arm))
                rows.append(row)
        return rows


def _args(out, **kw):
    a = dict(regime="main", model_config="m.json", blocks=None, dataset=None, warmup_steps=10, steps=2, rho=0.75, lam=2.0,
             batch_size=2, block_size=8, eval_batches=1, stat_batches=1, lr=1e-3, lr_warmup_steps=0,
             fp4_recipe="nvfp4", stochastic_rounding=True, model_seeds=[0, 1], data_seeds=[0, 1, 2], workers=1,
             silent=True, output_dir=str(out), arms=("uniform_fp8", "uniform_fp4", "snip", "quant_err"),
             max_minutes=0.0, device="cpu")
    assert set(FIXED) <= set(a)
    a.update(kw)
    return types.SimpleNamespace(**a)


def test_resume_skips_finished_cells_and_refuses_other_settings(tmp_path):
    FakeWorker.calls = []
    run_study(_args(tmp_path), factory=FakeWorker)
    assert len(FakeWorker.calls) == 2 * 3 * 4
    data = json.loads((tmp_path / "cells.json").read_text())
    assert len(data["rows"]) == 24 and {r["arm"] for r in data["rows"]} == {"uniform_fp8", "uniform_fp4", "snip",
                                                                              "quant_err"}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["cells"]["snip"] == 6 and summary["fp4_cost"]["clusters"] == 2
    # a finished study: nothing runs again
    FakeWorker.calls = []
    run_study(_args(tmp_path), factory=FakeWorker)
    assert FakeWorker.calls == []
    # a study stopped part-way (two runs of one cell lost): only those run, the rest are kept as they were
    data["rows"] = [r for r in data["rows"] if not (r["model_seed"] == 1 and r["data_seed"] == 2
                                                    and r["arm"] in ("snip", "quant_err"))]
    (tmp_path / "cells.json").write_text(json.dumps(data))
    run_study(_args(tmp_path), factory=FakeWorker)
    assert sorted(FakeWorker.calls) == [(1, 2, "quant_err"), (1, 2, "snip")]
    assert len(json.loads((tmp_path / "cells.json").read_text())["rows"]) == 24
    # more data seeds into the same folder: only the new cells run
    FakeWorker.calls = []
    run_study(_args(tmp_path, data_seeds=[0, 1, 2, 3]), factory=FakeWorker)
    assert {c[:2] for c in FakeWorker.calls} == {(0, 3), (1, 3)}
    with pytest.raises(ValueError, match="other settings .*--steps 2.*another --output_dir"):
        run_study(_args(tmp_path, steps=3), factory=FakeWorker)
    # a time limit already spent: one cell, then a stop that keeps it; the same command finishes the rest
    FakeWorker.calls = []
    fresh = tmp_path / "limited"
    out = run_study(_args(fresh, max_minutes=1e-9), factory=FakeWorker)
    assert out["cells_left"] == 5 and len(FakeWorker.calls) == 4
    assert len(json.loads((fresh / "cells.json").read_text())["rows"]) == 4
    out = run_study(_args(fresh), factory=FakeWorker)
    assert out["cells_left"] == 0 and len(FakeWorker.calls) == 24


def test_a_cell_reruns_only_what_its_checkpoint_did_not_train(monkeypatch):
    """The real Worker.cell with training faked: finished rows of this checkpoint are skipped, rows of another
    checkpoint rerun, a plan two arms share runs once, and the cell's random plan is its own."""
    from snip_ds.experiments import runs
    stats = _stats(8)
    solved = solve_arms(stats, ("uniform_fp8", "snip", "quant_err", "random"), 0.75, 2.0)
    solved["plans"]["rel_quant_err"] = solved["plans"]["snip"]  # the same plan under another arm
    trained = []

    def fake_run_plan(model, ckpt, plan, *a, **kw):
        trained.append(plan.digest())
        return dict(val_loss=2.0 + len(trained) * 1e-3, seconds=1.0, train_losses=[3.0])

    monkeypatch.setattr(runs, "run_plan", fake_run_plan)
    w = plan_study.Worker.__new__(plan_study.Worker)  # no __init__: it would set this process's torch threads
    w.args = _args("unused", arms=("uniform_fp8", "snip", "quant_err", "rel_quant_err", "random"))
    w.built = (None, None, None)
    w.ready = {0: dict(ckpt=Path("unused"), stats=stats, record={}, digest="ckpt-new", **solved)}
    w.settings = lambda: runs.TrainSettings()
    rows = w.cell(0, 3, {})
    assert [r["arm"] for r in rows] == ["uniform_fp8", "snip", "quant_err", "rel_quant_err", "random"]
    assert len(trained) == 4 and rows[3]["shared_with"] == "snip" and rows[3]["val_loss"] == rows[1]["val_loss"]
    assert rows[4]["plan_hash"] == random_plan(stats, solved["share"], 0, 3).digest()[:16]
    assert all(r["checkpoint"] == "ckpt-new" and r["run_seed"] == 3 for r in rows)
    done = {plan_study.row_key(r): r for r in rows}
    trained.clear()
    assert w.cell(0, 3, done) == [] and trained == []
    stale = {k: dict(r, checkpoint="ckpt-old") if r["arm"] == "quant_err" else r for k, r in done.items()}
    again = w.cell(0, 3, stale)
    assert [r["arm"] for r in again] == ["quant_err"] and len(trained) == 1


def test_launcher_names_a_bad_flag(capsys):
    spec = importlib.util.spec_from_file_location("plan_study_launch", ROOT / "launch" / "plan_study.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for argv, want in ((["--arms", "snip,best"], "--arms: unknown best"),
                       (["--model_seeds", "0,x"], "--model_seeds: expected comma-separated integers"),
                       (["--data_seeds", "1,1"], "--data_seeds: expected distinct integers"),
                       (["--rho", "1.0"], "--rho must lie strictly between 0 and 1"),
                       (["--workers", "0"], "--workers must be >= 1"),
                       (["--max_minutes", "-1"], "--max_minutes must be a finite number >= 0"),
                       (["--blocks", "0"], "--blocks must be >= 1"),
                       (["--model_config", "nope.json"], "--model_config nope.json: no such file")):
        with pytest.raises(SystemExit) as exc:
            script.parse_args(argv)
        assert exc.value.code == 2 and want in capsys.readouterr().err, argv
    a = script.parse_args(["--regime", "stress", "--arms", "random"])
    assert a.fp4_recipe == "mxfp4" and a.arms == ("uniform_fp8", "snip", "random")
    assert a.output_dir.endswith("plan_study/stress") and len(a.model_seeds) == 2
    a = script.parse_args([])
    assert (len(a.model_seeds), len(a.data_seeds), a.lam, a.fp4_recipe) == (4, 12, 2.0, "nvfp4")


def test_a_study_recorded_before_the_device_setting_resumes_as_a_cpu_study(tmp_path):
    run_study(_args(tmp_path, data_seeds=[0]), factory=FakeWorker)
    data = json.loads((tmp_path / "cells.json").read_text())
    assert data["settings"]["device"] == "cpu"
    del data["settings"]["device"]  # as the first CPU study wrote it
    (tmp_path / "cells.json").write_text(json.dumps(data))
    FakeWorker.calls = []
    run_study(_args(tmp_path, data_seeds=[0]), factory=FakeWorker)
    assert FakeWorker.calls == []
    with pytest.raises(ValueError, match="other settings .*--device 'cpu'"):
        run_study(_args(tmp_path, data_seeds=[0], device="cuda"), factory=FakeWorker)


def test_gpu_regime_flags(capsys, monkeypatch):
    import torch
    spec = importlib.util.spec_from_file_location("plan_study_launch", ROOT / "launch" / "plan_study.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        script.parse_args(["--regime", "gpu"])
    assert "--device cuda: torch sees no CUDA GPU" in capsys.readouterr().err
    a = script.parse_args(["--regime", "gpu", "--device", "cpu", "--model_seeds", "1"])  # its dry run
    assert (a.device, a.workers, a.model_seeds) == ("cpu", 2, [1])
    assert a.model_config.endswith("llama_12x256.json") and Path(a.model_config_path).is_file()
    assert a.output_dir.endswith("plan_study/gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert script.parse_args(["--regime", "gpu"]).workers == 1
    with pytest.raises(SystemExit):
        script.parse_args(["--regime", "gpu", "--workers", "2"])
    assert "--workers must be 1 with --device cuda" in capsys.readouterr().err
    main = script.parse_args([])
    assert (main.device, main.workers, main.model_config) == ("cpu", 2, "benchmarks/configs/llama_8x96.json")


def test_next_gpu_study_seed_is_the_first_unfinished(tmp_path):
    spec = importlib.util.spec_from_file_location("next_study_seed", ROOT / "gpu" / "next_study_seed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.next_seed(tmp_path) == 0  # nothing yet
    rows = [dict(model_seed=ms, data_seed=ds, arm=arm) for ms in (0, 1) for ds in range(12)
            for arm in ("uniform_fp8", "snip")]
    rows = [r for r in rows if not (r["model_seed"] == 1 and r["data_seed"] == 7 and r["arm"] == "snip")]
    (tmp_path / "cells.json").write_text(json.dumps(dict(rows=rows)))
    assert mod.next_seed(tmp_path) == 1  # seed 0 done; seed 1 lacks one cell's SNIP run
    rows += [dict(model_seed=1, data_seed=7, arm="snip")] + [
        dict(model_seed=ms, data_seed=ds, arm=arm) for ms in (2, 3) for ds in range(12) for arm in ("uniform_fp8", "snip")]
    (tmp_path / "cells.json").write_text(json.dumps(dict(rows=rows)))
    assert mod.next_seed(tmp_path) is None and mod.main([str(tmp_path)]) == 1


# --------------------------------------------------------------------------------------------------------
# One Spearman in the package
# --------------------------------------------------------------------------------------------------------
def test_one_spearman_nan_on_constant_input():
    assert scores.spearman is paired.spearman  # validate_metrics scores with the same function
    assert math.isnan(scores.split_half({"a": [1.0, 1.0], "b": [1.0, 1.0], "c": [1.0, 1.0]}))
    assert scores.split_half({"a": [1.0, 1.1], "b": [2.0, 2.2], "c": [3.0, 3.5]}) == pytest.approx(1.0)
    assert paired.finite_mean([0.5, float("nan"), 1.0]) == (0.75, 1)
    mean, skipped = paired.finite_mean([float("nan")])
    assert math.isnan(mean) and skipped == 1
