"""launch/compare_plans.py --quick end to end, and the pieces of snip_ds.experiments against hand-computed
references."""
from __future__ import annotations

import importlib.util
import json
import math
import struct
from pathlib import Path

import pytest
import torch
from torch import nn

from snip_ds.experiments.grid import KIND_PLANS, parse_phases
from snip_ds.experiments.paired import MeanSE, mean_se, paired_differences, paired_verdict, spearman
from snip_ds.experiments.plans import apply_plan, attainable_share, bf16_forward, predicted_divergence
from snip_ds.experiments.report import _target_cell, _target_misses
from snip_ds.experiments.results import merge_results, versus_data
from snip_ds.experiments.runs import run_settings
from snip_ds.experiments.summary import kind_calibration, objective_ranking, summarize, target_checks, versus_rows
from snip_ds.experiments.training import (TrainSettings, evaluate, load_checkpoint, make_optimizer, save_checkpoint,
                                          train_steps)
from snip_ds.plan import Plan
from snip_ds.swap import snip_layers, swap_linears

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("method", "rho", "phase", "seed", "val_loss", "val_loss_bf16_forward", "gap_to_fp8",
            "gap_to_fp8_bf16_forward", "fp4_share", "train_losses")
PNGS = ("compare_plans_gap.png", "compare_plans_curves.png", "compare_plans_maps.png")


def _script():
    spec = importlib.util.spec_from_file_location("compare_plans", ROOT / "launch" / "compare_plans.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _png_size(path: Path) -> tuple:
    """Width and height from a PNG's IHDR chunk, after checking the signature."""
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    assert raw[12:16] == b"IHDR"
    return struct.unpack(">II", raw[16:24])


# --------------------------------------------------------------------------------------------------------
# End to end
# --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    rc = _script().main(["--quick", "--output_dir", str(out), "--silent"])
    assert rc == 0
    return out


def test_quick_records(quick_run):
    data = json.loads((quick_run / "compare_plans.json").read_text())
    records = data["records"]
    for r in records:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, f"{r['label']} lacks {missing}"
        assert math.isfinite(r["val_loss"]) and math.isfinite(r["val_loss_bf16_forward"])
    labels = {r["label"] for r in records}
    # every method once: uniform ones, SNIP at each λ, the random plan, both quant-error baselines, first/last
    assert labels == {"bf16", "uniform_fp8", "uniform_fp4", "best λ=1", "best λ=2", "best λ=1000", "random#0",
                      "quant_err", "rel_quant_err", "first_last_fp8"}
    assert not data["skipped"]
    fp8 = next(r for r in records if r["method"] == "uniform_fp8")
    for r in records:  # the gap is the paired difference to uniform FP8 of the same cell
        assert r["gap_to_fp8"] == pytest.approx(r["val_loss"] - fp8["val_loss"], abs=1e-12)
        assert len(r["train_losses"]) == data["settings"]["steps"]
        if r["rho"] is not None:
            assert r["fp4_share"] == pytest.approx(0.5)
            assert r["phase"] == "early" and r["seed"] == 0
        if r["method"] == "best":
            assert r["lambda"] in (1.0, 2.0, 1000.0)
    assert fp8["gap_to_fp8"] == 0.0
    bf16 = next(r for r in records if r["method"] == "bf16")
    assert bf16["val_loss"] == bf16["val_loss_bf16_forward"]  # BF16 plan: both forwards are the same one
    assert bf16["measured_fld_at_ckpt"] == 0.0
    # first/last pinned: blocks 0 and 3 stay FP8 in the stored plan
    fl = next(p for p in data["plans"]["early"] if p["label"] == "first_last_fp8")
    for fqn, prec in fl["assignment"].items():
        if ".layers.0." in fqn or ".layers.3." in fqn:
            assert prec == "fp8"


def test_quick_markdown(quick_run):
    md = (quick_run / "compare_plans.md").read_text()
    for heading in ("## Targets", "## Gaps per phase and ρ", "## λ sweep", "## Does the planner's objective rank"):
        assert heading in md
    gaps = md.split("## Gaps per phase and ρ")[1].split("Fixed plans (ρ-independent")[0]
    rows = [line for line in gaps.splitlines() if line.startswith("| early | 0.5 |")]
    # one gaps row per non-random label plus the pooled random row, and one target row
    assert sum("| best λ=2 |" in line for line in rows) == 1
    assert any("| random |" in line for line in rows)
    targets = md.split("## Targets")[1].split("## Gaps per phase and ρ")[0]
    target = [line for line in targets.splitlines() if line.startswith("| early | 0.5 | ")]
    assert len(target) == 1
    # with one seed there is no standard error: it must say so instead of inventing one, and no verdict on
    # a comparison needs one
    assert "n/a" in target[0] and "resolved loss" not in target[0] and "tie" not in target[0]


def test_quick_pngs(quick_run):
    for name in PNGS:
        w, h = _png_size(quick_run / name)
        assert w > 100 and h > 100
    import matplotlib.image as mpimg
    img = mpimg.imread(str(quick_run / "compare_plans_maps.png"))
    assert img.ndim == 3 and img.std() > 0  # decodes, and is not blank


def test_report_only_rewrites_from_json(quick_run, tmp_path):
    mod = _script()
    assert mod.main(["--report_only", "--merge", str(quick_run), "--output_dir", str(tmp_path), "--silent",
                     "--note", "rerendered"]) == 0
    assert "**rerendered**" in (tmp_path / "compare_plans.md").read_text()
    for name in PNGS:
        _png_size(tmp_path / name)


def test_fp4_recipe_flags_reach_the_runs(quick_run, tmp_path):
    """--fp4_recipe / --no_stochastic_rounding: recorded, reported, and used by the runs (uniform FP4 trains
    differently from the default recipe's run on the same cell)."""
    mod = _script()
    out = tmp_path / "mx"
    assert mod.main(["--quick", "--methods", "uniform_fp4", "--fp4_recipe", "mxfp4", "--no_stochastic_rounding",
                     "--output_dir", str(out), "--silent"]) == 0
    data = json.loads((out / "compare_plans.json").read_text())
    assert data["settings"]["fp4_recipe"] == "mxfp4" and data["settings"]["stochastic_rounding"] is False
    assert "FP4 mxfp4, gradients rounded to nearest" in (out / "compare_plans.md").read_text()
    default = json.loads((quick_run / "compare_plans.json").read_text())
    assert default["settings"]["fp4_recipe"] == "nvfp4" and default["settings"]["stochastic_rounding"] is True

    def fp4(d, key):
        return next(r[key] for r in d["records"] if r["method"] == "uniform_fp4")
    assert fp4(data, "val_loss") != fp4(default, "val_loss")
    fp8 = [next(r["val_loss"] for r in d["records"] if r["method"] == "uniform_fp8") for d in (data, default)]
    assert fp8[0] == fp8[1]  # FP8 runs do not depend on the FP4 recipe
    with pytest.raises(SystemExit):
        mod.parse_args(["--fp4_recipe", "int4"])


def test_lr_decay_reaches_the_runs_and_blocks_merging(quick_run, tmp_path):
    """--lr_decay none: recorded, reported, used (FP8 trains differently), and not mergeable with a decayed run."""
    mod = _script()
    out = tmp_path / "const"
    assert mod.main(["--quick", "--methods", "uniform_fp8", "--lr_decay", "none", "--output_dir", str(out),
                     "--silent"]) == 0
    data = json.loads((out / "compare_plans.json").read_text())
    default = json.loads((quick_run / "compare_plans.json").read_text())
    assert data["settings"]["lr_decay"] == "none" and default["settings"]["lr_decay"] == "linear"
    assert "decaying linearly to 0 over each run" in (quick_run / "compare_plans.md").read_text()
    assert "decaying linearly" not in (out / "compare_plans.md").read_text()

    def fp8(d):
        return next(r for r in d["records"] if r["method"] == "uniform_fp8")
    assert fp8(data)["train_losses"][0] == fp8(default)["train_losses"][0]  # same first step (lr not decayed yet)
    assert fp8(data)["val_loss"] != fp8(default)["val_loss"]
    with pytest.raises(ValueError, match="lr_decay"):
        merge_results([str(quick_run), str(out)])
    with pytest.raises(ValueError, match="lr_decay"):
        merge_results([str(out), str(quick_run)])


@pytest.mark.slow
def test_per_gemm_plans_reach_the_runs(quick_run, tmp_path):
    """--per_gemm: every solved plan is per GEMM and on one FP4 share, recorded and reported; the uniform runs
    are those of the per-layer grid, bit for bit; a per-layer grid cannot be merged with it."""
    mod = _script()
    out = tmp_path / "pg"
    assert mod.main(["--quick", "--per_gemm", "--methods", "best,quant_err,rel_quant_err", "--output_dir", str(out),
                     "--silent"]) == 0
    data = json.loads((out / "compare_plans.json").read_text())
    assert data["settings"]["per_gemm"] is True
    assert "plans solved per GEMM" in (out / "compare_plans.md").read_text()
    assert "plans solved per layer" in (quick_run / "compare_plans.md").read_text()
    solved = [p for p in data["plans"]["early"] if p["rho"] is not None]
    assert {p["label"] for p in solved} == {"best λ=1", "best λ=2", "best λ=1000", "quant_err", "rel_quant_err"}
    for p in solved:
        assert all(set(v) == {"fprop", "dgrad", "wgrad"} for v in p["assignment"].values())
    assert len({round(p["fp4_share"], 12) for p in solved}) == 1
    assert {p["label"] for p in solved if p["assignment"] != solved[0]["assignment"]}  # not all one plan
    default = json.loads((quick_run / "compare_plans.json").read_text())
    fp8 = [next(r["val_loss"] for r in d["records"] if r["method"] == "uniform_fp8") for d in (data, default)]
    assert fp8[0] == fp8[1]
    with pytest.raises(ValueError, match="per_gemm"):
        merge_results([str(quick_run), str(out)])

    # --versus: the per-GEMM grid against the per-layer one, paired by cell
    assert mod.main(["--report_only", "--output_dir", str(out), "--versus", str(quick_run), "--silent"]) == 0
    md = (out / "compare_plans.md").read_text()
    assert f"## Against the grid in `{quick_run}` (plans solved per layer)" in md
    merged = json.loads((out / "compare_plans.json").read_text())
    rows = {(r["phase"], r["label"]): r for r in versus_rows(merged["records"], merged["versus"]["records"])}

    def val(d, label, key="val_loss"):
        return next(r[key] for r in d["records"] if r["label"] == label)
    for label in ("best λ=2", "quant_err"):
        assert rows[("early", label)]["q"].mean == pytest.approx(val(data, label) - val(default, label), abs=1e-12)
        assert rows[("early", label)]["bf16"].mean == pytest.approx(
            val(data, label, "val_loss_bf16_forward") - val(default, label, "val_loss_bf16_forward"), abs=1e-12)
        assert rows[("all", label)]["q"].n == 1
    assert ("early", "random") not in rows  # not run in the per-GEMM grid: nothing to pair
    # ... so its targets take the random plans from the versus grid, and say so (†)
    targets = md.split("## Targets")[1].split("## Gaps")[0]
    assert "† |" in targets and f"the baseline ran in the `--versus` grid(s) (`{quick_run}`)" in targets
    [check] = target_checks(summarize(merged["records"], 2.0), merged["records"], merged["versus"]["records"])
    assert check["random"]["source"] == "versus" and check["quant_err"]["source"] == "this grid"
    assert check["random"]["diff"].mean == pytest.approx(val(data, "best λ=2") - val(default, "random#0"), abs=1e-12)
    # several grids join; one named twice is refused; a bit-identical rerun of a run counts once; a run held
    # by two grids with another result is refused
    with pytest.raises(ValueError, match="names .* twice"):
        versus_data(data, [str(quick_run), str(quick_run)])
    rerun = tmp_path / "rerun"
    rerun.mkdir()
    (rerun / "compare_plans.json").write_text((quick_run / "compare_plans.json").read_text())
    joined = versus_data(data, [str(quick_run), str(rerun)])
    assert joined["records"] == versus_data(data, [str(quick_run)])["records"]
    again = json.loads((quick_run / "compare_plans.json").read_text())
    next(r for r in again["records"] if r["method"] == "quant_err")["val_loss"] += 1e-6
    (rerun / "compare_plans.json").write_text(json.dumps(again))
    with pytest.raises(ValueError, match="quant_err .* with another plan or result"):
        versus_data(data, [str(quick_run), str(rerun)])
    assert mod.main(["--report_only", "--output_dir", str(out), "--silent"]) == 0  # kept when re-rendered
    assert "## Against the grid in" in (out / "compare_plans.md").read_text()
    other = tmp_path / "other"
    other.mkdir()
    changed = json.loads((quick_run / "compare_plans.json").read_text())
    next(r for r in changed["records"] if r["method"] == "uniform_fp8")["val_loss"] += 1e-6
    (other / "compare_plans.json").write_text(json.dumps(changed))
    with pytest.raises(ValueError, match="uniform FP8 ended differently"):
        versus_data(data, str(other))
    changed["settings"]["lr"] = 1.0
    (other / "compare_plans.json").write_text(json.dumps(changed))
    with pytest.raises(ValueError, match="settings differ in lr"):
        versus_data(data, str(other))
    with pytest.raises(SystemExit):
        mod.parse_args(["--versus", str(quick_run)])  # needs --report_only


def test_gemm_kind_plans(quick_run, tmp_path):
    """fp4_<kind>: that GEMM kind in FP4 in every layer and the rest in FP8, run, recorded and reported; opt-in
    (the default grid has none); the uniform FP8 run is the default grid's, bit for bit."""
    mod = _script()
    assert not set(KIND_PLANS) & set(mod.parse_args([]).methods)
    out = tmp_path / "kinds"
    assert mod.main(["--quick", "--methods", "fp4_fprop,fp4_dgrad,fp4_wgrad,fp4_backward", "--output_dir", str(out),
                     "--silent"]) == 0
    data = json.loads((out / "compare_plans.json").read_text())
    plans = {p["label"]: p for p in data["plans"]["early"]}
    assert set(plans) == {"uniform_fp8", "fp4_fprop", "fp4_dgrad", "fp4_wgrad", "fp4_backward"}
    expect = {"fp4_fprop": {"fprop"}, "fp4_dgrad": {"dgrad"}, "fp4_wgrad": {"wgrad"},
              "fp4_backward": {"dgrad", "wgrad"}}
    for label, kinds in expect.items():
        p = plans[label]
        assert p["rho"] is None
        assert len(p["assignment"]) == data["settings"]["layers"]
        for gemms in p["assignment"].values():
            assert {g for g, prec in gemms.items() if prec == "fp4"} == kinds
            assert {prec for g, prec in gemms.items() if g not in kinds} == {"fp8"}
        assert p["fp4_share"] == pytest.approx(len(kinds) / 3)
    records = {r["label"]: r for r in data["records"]}
    assert set(records) == set(plans)
    assert len({records[k]["val_loss"] for k in expect}) == len(expect)  # four different runs
    default = json.loads((quick_run / "compare_plans.json").read_text())
    fp8 = next(r["val_loss"] for r in default["records"] if r["method"] == "uniform_fp8")
    assert records["uniform_fp8"]["val_loss"] == fp8
    md = (out / "compare_plans.md").read_text()
    assert "## λ calibrated by the GEMM-kind plans" in md
    assert "; no random plans; " in md and "; 1 random plan(s); " in (quick_run / "compare_plans.md").read_text()
    for label, kinds in expect.items():
        gap = (records[label]["val_loss"] - fp8) * 1e3
        assert f"| early | {label} | {len(kinds) / 3:.3f} | {gap:+.2f} ± n/a |" in md


def test_kind_calibration_by_hand():
    """λ = (gap backward / gap fprop) · ΔFLD / ΔBWD, with the gaps paired per cell."""

    def rec(label, seed, val, fld, bwd, phase="early"):
        return dict(label=label, method=label, rho=None, phase=phase, seed=seed, warmup_steps=1, val_loss=val,
                    predicted_fld=fld, predicted_bwd=bwd)
    records = [rec("uniform_fp8", 0, 2.0, 1.0, 0.5), rec("uniform_fp8", 1, 3.0, 1.0, 0.5),
               rec("fp4_fprop", 0, 2.004, 9.0, 0.5), rec("fp4_fprop", 1, 3.002, 9.0, 0.5),
               rec("fp4_backward", 0, 2.0005, 1.0, 0.9), rec("fp4_backward", 1, 3.0001, 1.0, 0.9),
               rec("uniform_fp8", 0, 1.0, 1.0, 0.5, "late"), rec("fp4_fprop", 0, 1.001, 9.0, 0.5, "late"),
               rec("fp4_backward", 0, 0.999, 1.0, 0.9, "late")]
    out = {k["phase"]: k for k in kind_calibration(records, ["early", "late"])}
    early = out["early"]
    assert early["gap_fprop"].mean == pytest.approx(0.003) and early["gap_backward"].mean == pytest.approx(0.0003)
    assert early["d_fld"] == pytest.approx(8.0) and early["d_bwd"] == pytest.approx(0.4)
    assert early["lam"] == pytest.approx(0.1 * 8.0 / 0.4)
    se = math.sqrt(((0.0005 - 0.0003) ** 2 + (0.0001 - 0.0003) ** 2) / 1) / math.sqrt(2)
    assert early["lam_2se"] == pytest.approx((0.0003 + 2 * se) / 0.003 * 8.0 / 0.4)
    assert out["late"]["lam"] is None  # the backward's gap is negative: no ratio to match
    assert kind_calibration([r for r in records if r["label"] != "fp4_backward"], ["early"]) == []
    # with FWD priced (--forward_drift) the fprop plan carries a drift too: λ = r·ΔFLD / (ΔBWD − r·ΔFWD)
    for r in records:
        if r["label"] == "fp4_fprop":
            r["predicted_bwd"] = 0.5 + 1.0  # ΔFWD = 1
    early = {k["phase"]: k for k in kind_calibration(records, ["early"])}["early"]
    assert early["d_fwd"] == pytest.approx(1.0)
    r = 0.1
    assert early["lam"] == pytest.approx(r * 8.0 / (0.4 - r * 1.0))
    r2 = (0.0003 + 2 * se) / 0.003
    assert early["lam_2se"] == pytest.approx(r2 * 8.0 / (0.4 - r2 * 1.0))
    for r in records:
        if r["label"] == "fp4_fprop":
            r["predicted_bwd"] = 0.5 + 5.0  # r·ΔFWD = 0.5 > ΔBWD: no positive λ matches the ratio
    assert {k["phase"]: k for k in kind_calibration(records, ["early"])}["early"]["lam"] is None


def test_predicted_divergence_per_layer_and_per_gemm():
    layers = {"a": {"fld": {"fp8": 1.0, "fp4": 10.0}, "bwd": {"fp8": 2.0, "fp4": 20.0}},
              "b": {"fld": {"fp8": 0.5, "fp4": None}, "bwd": {"fp8": 0.25, "fp4": 4.0}}}
    assert predicted_divergence(layers, {"a": "fp4", "b": "bf16"}) == (10.0, 20.0)
    assert predicted_divergence(layers, {"a": "fp8", "b": "fp4"}) == (1.0, 6.0)  # null FLD counts 0
    per_gemm = {"a": {"fprop": "fp8", "dgrad": "fp4", "wgrad": "fp8"},
                "b": {"fprop": "bf16", "dgrad": "fp8", "wgrad": "fp4"}}
    # fprop carries FLD; dgrad and wgrad each half of BWD
    assert predicted_divergence(layers, per_gemm) == (1.0, (20.0 + 2.0) / 2 + (0.25 + 4.0) / 2)
    for rec, bias in zip(layers.values(), ({"fp8": 0.5, "fp4": -1.0}, {"fp8": 0.25, "fp4": -0.5})):
        rec["bwd_bias"] = bias
    assert predicted_divergence(layers, {"a": "fp4", "b": "fp8"}, bwd_key="bwd_bias") == (10.0 + 0.5, -1.0 + 0.25)
    # forward_drift: each layer's FWD at its fprop precision joins the drift
    layers["a"]["fwd"] = {"fp8": 0.125, "fp4": 8.0}
    layers["b"]["fwd"] = {"fp8": 0.0625, "fp4": 16.0}
    assert predicted_divergence(layers, {"a": "fp4", "b": "fp8"}, forward_drift=True) == (10.5, 20.0 + 8.0 + 0.25
                                                                                           + 0.0625)
    assert predicted_divergence(layers, per_gemm, forward_drift=True) == (1.0, (20.0 + 2.0) / 2 + (0.25 + 4.0) / 2
                                                                          + 0.125)
    # at its own weight μ, μ·FWD joins the forward's price (the first number) and the drift stays BWD's
    assert predicted_divergence(layers, {"a": "fp4", "b": "fp8"}, forward_drift=True, fwd_weight=0.5) == (
        10.5 + 0.5 * (8.0 + 0.0625), 20.0 + 0.25)
    # dgrad priced upstream: the whole BWD at wgrad's precision, bwd_dgrad / calibration at dgrad's
    layers["a"]["bwd_dgrad"] = {"fp8": 3.0, "fp4": 30.0}
    layers["b"]["bwd_dgrad"] = {"fp8": 5.0, "fp4": 50.0}
    assert predicted_divergence(layers, per_gemm, dgrad="upstream", dgrad_calibration=10.0) == (
        1.0, 2.0 + 30.0 / 10.0 + 4.0 + 5.0 / 10.0)
    with pytest.raises(ValueError, match="dgrad"):
        predicted_divergence(layers, per_gemm, dgrad="both")


def test_bad_arguments(tmp_path, capsys):
    mod = _script()
    with pytest.raises(SystemExit):
        mod.parse_args(["--methods", "best,nope"])
    assert "nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mod.parse_args(["--rhos", "1.5"])
    with pytest.raises(SystemExit):
        mod.parse_args(["--phases", "400,100"])
    assert mod.main(["--report_only", "--output_dir", str(tmp_path / "none")]) == 2
    assert "compare_plans.json" in capsys.readouterr().err


def test_parse_phases():
    assert parse_phases("100,400") == {"early": 100, "late": 400}
    assert parse_phases("late:400") == {"late": 400}
    with pytest.raises(ValueError, match="phases"):
        parse_phases("a:x")


# --------------------------------------------------------------------------------------------------------
# snip_ds.experiments
# --------------------------------------------------------------------------------------------------------
def test_mean_se_reference():
    ms = mean_se([1.0, 2.0, 4.0])
    assert ms.mean == pytest.approx(7 / 3)
    # sample SD: sqrt(((1-7/3)^2 + (2-7/3)^2 + (4-7/3)^2) / 2) = sqrt(7/3); SE = that / sqrt(3)
    assert ms.se == pytest.approx(math.sqrt(7 / 3) / math.sqrt(3))
    assert ms.n == 3
    assert math.isnan(mean_se([5.0]).se) and mean_se([5.0]).mean == 5.0
    assert mean_se([]).n == 0
    assert mean_se([1.0]).to_dict() == {"mean": 1.0, "se": None, "n": 1}


def test_paired_differences_per_cell():
    recs = [dict(cell=0, m="a", v=1.0), dict(cell=0, m="r", v=2.0), dict(cell=0, m="r", v=4.0),
            dict(cell=1, m="a", v=5.0), dict(cell=1, m="r", v=5.5),
            dict(cell=2, m="a", v=9.0)]  # cell 2 has no reference: left out
    d = paired_differences(recs, "v", ("cell",), lambda r: r["m"] == "a", lambda r: r["m"] == "r")
    assert d == [1.0 - 3.0, 5.0 - 5.5]


def test_paired_verdict_by_hand():
    # resolved win: |−1.0| > 2·0.3
    v = paired_verdict(MeanSE(-1.0, 0.3, 12), MeanSE(2.0, 0.4, 12))
    assert v == dict(below=True, resolved=True, floor=False, cells_to_resolve=None)
    # a tie with room: the baseline is 1.0 above FP8, more than 2·0.25
    v = paired_verdict(MeanSE(0.1, 0.25, 24), MeanSE(1.0, 0.3, 24))
    assert v["below"] is False and v["resolved"] is False and v["floor"] is False
    assert v["cells_to_resolve"] == math.ceil(24 * (2 * 0.25 / 0.1) ** 2) == 600
    # no room: the baseline is 0.3 above FP8, less than 2·0.25, so FP8's own quality could not be shown below it
    assert paired_verdict(MeanSE(0.1, 0.25, 24), MeanSE(0.3, 0.3, 24))["floor"] is True
    assert paired_verdict(MeanSE(0.1, 0.25, 24), MeanSE(-0.2, 0.3, 24))["floor"] is True
    # z is honoured: at z = 3 the first difference is no longer resolved
    assert paired_verdict(MeanSE(-1.0, 0.4, 12), MeanSE(2.0, 0.4, 12), z=3.0)["resolved"] is False
    # one cell: no SE, so neither resolved nor at a floor; an exact 0 needs no cell count
    assert paired_verdict(MeanSE(0.5, float("nan"), 1), MeanSE(1.0, float("nan"), 1)) == dict(
        below=False, resolved=None, floor=None, cells_to_resolve=None)
    assert paired_verdict(MeanSE(0.0, 0.0, 5), MeanSE(1.0, 0.1, 5))["cells_to_resolve"] is None


def _cell_records(values: dict, phase="early", rho=0.5, start=0):
    """Records of one (phase, ρ) from {label: [val_loss per seed]}; uniform_fp8 is ρ-independent."""
    out = []
    for label, vals in values.items():
        method = "random" if label.startswith("random") else label.split(" ")[0]
        for i, v in enumerate(vals):
            out.append(dict(label=label, method=method, phase=phase, seed=start + i, warmup_steps=10,
                            rho=None if label == "uniform_fp8" else rho, val_loss=v))
    return out


def test_target_checks_by_hand():
    """SNIP − each baseline paired per cell, the baseline's room to FP8, the verdicts and the targets, with a
    baseline taken from the --versus grid where this grid did not run it."""
    fp8 = [2.0, 3.0, 4.0, 5.0]
    here = _cell_records({"uniform_fp8": fp8, "best λ=2": [2.001, 3.001, 4.001, 5.001],
                          "random#0": [2.004, 3.003, 4.005, 5.004], "random#1": [2.002, 3.003, 4.003, 5.004],
                          "quant_err": [2.0015, 3.0005, 4.002, 5.0]}, rho=0.75)
    other = _cell_records({"rel_quant_err": [2.001, 3.002, 4.000, 5.0015]}, rho=0.75)
    summary = dict(snip_label="best λ=2", phases=["early"], rhos=[0.75])
    [c] = target_checks(summary, here, other)
    rnd = c["random"]
    assert rnd["source"] == "this grid" and rnd["diff"].n == 4
    assert rnd["diff"].mean == pytest.approx(mean_se([-0.002, -0.002, -0.003, -0.003]).mean)
    assert rnd["below"] and rnd["resolved"]
    qe = c["quant_err"]
    assert qe["diff"].mean == pytest.approx(mean_se([-0.0005, 0.0005, -0.001, 0.001]).mean, abs=1e-12)
    assert qe["room"].mean == pytest.approx(mean_se([0.0015, 0.0005, 0.002, 0.0]).mean)
    rq = c["rel_quant_err"]
    assert rq["source"] == "versus"
    assert rq["diff"].mean == pytest.approx(mean_se([0.0, -0.001, 0.001, -0.0005]).mean)
    assert c["below_random"] and c["resolved_2se"] and c["below_rel_quant_err"]
    # met only where SNIP is more than 2 SE below every baseline: quant_err's mean difference is 0 here
    assert not qe["resolved"] and c["met"] is False and c["ties_only"] is True
    all_resolved = [dict(r, val_loss=r["val_loss"] + 0.003) if r["label"] in ("quant_err", "rel_quant_err") else r
                    for r in here + other]
    [c_met] = target_checks(summary, all_resolved)
    assert all(c_met[b]["below"] and c_met[b]["resolved"] for b in ("random", "quant_err", "rel_quant_err"))
    assert c_met["met"] is True and c_met["ties_only"] is False
    # SNIP above quant_err in the mean: the target is not met, and the report says which comparison misses
    here_miss = [dict(r, val_loss=r["val_loss"] + 0.0005) if r["label"] == "best λ=2" else r for r in here]
    [c] = target_checks(summary, here_miss, other)
    assert c["quant_err"]["below"] is False and c["met"] is False
    assert c["quant_err"]["resolved"] is False and c["ties_only"] is True  # a tie, not a loss
    better_qe = [dict(r, val_loss=r["val_loss"] - 0.003) if r["label"] == "quant_err" else r for r in here]
    [c] = target_checks(summary, better_qe, other)
    assert c["random"]["below"] and c["random"]["resolved"]  # random's target still met ...
    assert c["quant_err"]["resolved"] is True and c["ties_only"] is False  # ... but quant_err wins resolvably
    misses = _target_misses([c])
    assert any(line.startswith("- early ρ 0.75, SNIP − quant_err:") for line in misses)
    # a baseline this grid ran in some cells only: the versus grid's runs fill the other cells
    part = [r for r in here if not (r["label"] == "quant_err" and r["seed"] >= 2)]
    extra = [dict(r, val_loss=r["val_loss"] + 1.0) for r in here if r["label"] == "quant_err"]
    [c] = target_checks(summary, part, other + extra)
    assert c["quant_err"]["source"] == "both" and c["quant_err"]["diff"].n == 4
    assert c["quant_err"]["diff"].mean == pytest.approx(mean_se([-0.0005, 0.0005, -1.001, -0.999]).mean)
    assert _target_cell(c, "quant_err").endswith(" ‡")
    # a mean that is all but 0 would need an absurd number of cells: the report says so instead of a number
    tiny = MeanSE(1e-9, 3e-4, 12)
    line = _target_misses([dict(phase="early", rho=0.5, random=None, rel_quant_err=None, quant_err=dict(
        diff=tiny, room=MeanSE(2e-3, 3e-4, 12), source="this grid", **paired_verdict(tiny, MeanSE(2e-3, 3e-4, 12))))])
    assert len(line) == 1 and "only at over 100 times these cells" in line[0] and ", a tie;" in line[0]
    # without the versus grid, rel_quant_err is unknown and so is the verdict
    [c] = target_checks(summary, here)
    assert c["rel_quant_err"] is None and c["met"] is None
    # SNIP must beat random by more than 2 SE: a noisy mean below random is not enough
    noisy = _cell_records({"uniform_fp8": fp8, "best λ=2": [2.001, 3.006, 4.0, 5.001],
                           "random#0": [2.004, 3.0, 4.003, 5.002], "quant_err": [2.01] * 1 + [3.01, 4.01, 5.01],
                           "rel_quant_err": [2.01, 3.01, 4.01, 5.01]}, rho=0.75)
    [c] = target_checks(summary, noisy)
    assert c["random"]["below"] and not c["random"]["resolved"] and c["met"] is False
    assert c["ties_only"] is True  # a miss, but by a tie: no baseline is resolvably below SNIP
    assert "(not resolved)" in _target_cell(c, "random")
    # a baseline that solved SNIP's own plan: every difference exactly 0
    same = _cell_records({"uniform_fp8": fp8, "best λ=2": [2.001] * 4, "quant_err": [2.001] * 4,
                          "random#0": [2.01] * 4, "rel_quant_err": [2.01] * 4}, rho=0.5)
    [c] = target_checks(dict(summary, rhos=[0.5]), same)
    assert "(the same plan)" in _target_cell(c, "quant_err") and c["met"] is False


def test_merge_adds_seeds_to_a_phase(quick_run, tmp_path):
    """A part with more seeds of a phase merges into the grid (cells pooled per ρ); repeated cells, another
    warm-up or other plans for the same phase are refused, naming the part."""
    mod = _script()
    base = json.loads((quick_run / "compare_plans.json").read_text())

    def part(name, edit_settings=None, edit_records=None, edit_plans=None):
        d = json.loads(json.dumps(base))
        d["settings"].update(seeds=[7], rhos=[0.5], lambdas=[2.0], methods=["uniform_fp8", "best", "quant_err"])
        d["records"] = [dict(r, seed=7, val_loss=r["val_loss"] + 1e-3) for r in d["records"]
                        if r["method"] in ("uniform_fp8", "quant_err") or r["label"] == "best λ=2"]
        for edit, target in ((edit_settings, d["settings"]), (edit_records, d["records"]), (edit_plans, d["plans"])):
            if edit:
                edit(target)
        out = tmp_path / name
        out.mkdir()
        (out / "compare_plans.json").write_text(json.dumps(d))
        return str(out)

    more = part("more")
    merged = merge_results([str(quick_run), more])
    assert merged["settings"]["seeds"] == [0, 7] and merged["settings"]["lambdas"] == [1.0, 2.0, 1000.0]
    assert merged["settings"]["phases"] == base["settings"]["phases"]
    assert len(merged["records"]) == len(base["records"]) + 3  # fp8, SNIP at λ 2 and quant_err of seed 7
    assert len(merged["plans"]["early"]) == len(base["plans"]["early"])
    summary = summarize(merged["records"], 2.0)
    row = {(r["phase"], r["label"]): r for r in summary["rows"]}
    assert row[("early", "best λ=2")]["vs_fp8_q"].n == 2 and row[("early", "random")]["vs_fp8_q"].n == 1
    # the report renders from the merged grid
    assert mod.main(["--report_only", "--merge", f"{quick_run},{more}", "--output_dir", str(tmp_path / "m"),
                     "--silent"]) == 0
    assert "seeds [0, 7]" in (tmp_path / "m" / "compare_plans.md").read_text()
    with pytest.raises(ValueError, match="appear in an earlier part"):
        merge_results([str(quick_run), str(quick_run)])
    late = part("warm", edit_settings=lambda st: st["phases"].update(early=31))
    with pytest.raises(ValueError, match="warm.*phase 'early' warmed up 31 steps"):
        merge_results([str(quick_run), late])

    def other_plan(plans):
        p = next(p for p in plans["early"] if p["label"] == "quant_err")
        fqn = next(iter(p["assignment"]))
        p["assignment"][fqn] = "fp8" if p["assignment"][fqn] == "fp4" else "fp4"
    changed = part("changed", edit_plans=other_plan)
    with pytest.raises(ValueError, match="changed.*another quant_err plan at rho 0.5"):
        merge_results([str(quick_run), changed])
    steps = part("steps", edit_settings=lambda st: st.update(steps=99))
    with pytest.raises(ValueError, match="settings differ .* in steps"):
        merge_results([str(quick_run), steps])


def test_report_lambda_override(quick_run, tmp_path, capsys):
    """--report_only --lambda_default picks the SNIP the targets check; a λ the grid did not run is refused."""
    mod = _script()
    out = tmp_path / "r"
    assert mod.main(["--report_only", "--merge", str(quick_run), "--output_dir", str(out), "--lambda_default",
                     "1000", "--silent"]) == 0
    md = (out / "compare_plans.md").read_text()
    # the heading names the λ it checks, and whether that is the package default (bwd_lambda = 2)
    assert "## Targets (SNIP at λ = 1000, not the package default 2;" in md
    assert "this report checks SNIP at λ 1000" in md
    assert "## Targets (SNIP at λ = 2, the package default;" in (quick_run / "compare_plans.md").read_text()
    assert mod.main(["--report_only", "--output_dir", str(quick_run), "--lambda_default", "7", "--silent"]) == 2
    assert "--lambda_default 7: the grid ran SNIP at λ 1, 2, 1000 only" in capsys.readouterr().err


def test_spearman_against_scipy():
    from scipy.stats import spearmanr
    gen = torch.Generator().manual_seed(0)
    for n in (3, 7, 20):
        a = torch.randint(0, 5, (n,), generator=gen).tolist()  # ties
        b = torch.randn(n, generator=gen).tolist()
        if len(set(a)) > 1:
            assert spearman(a, b) == pytest.approx(spearmanr(a, b).statistic, abs=1e-12)
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(spearman([1, 2], [2, 1])) and math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError, match="lengths"):
        spearman([1, 2, 3], [1, 2])


def test_objective_ranking_reads_the_records():
    recs = []
    for seed in (0, 1):
        for i, (fld, bwd) in enumerate([(1e-4, 1e-3), (2e-4, 2e-3), (3e-4, 4e-3), (1e-5, 5e-3)]):
            gap = [1.0, 2.0, 3.0, 4.0][i] + 0.1 * seed  # the outcome follows BWD, not FLD
            recs.append(dict(phase="late", rho=0.5, seed=seed, plan_digest=f"p{i}", predicted_fld=fld,
                             predicted_bwd=bwd, gap_to_fp8=gap))
    [row] = objective_ranking(recs, ["late"], [0.5], lam=100.0)
    assert row["plans"] == 4 and row["obj"] == pytest.approx(1.0) and row["bwd"] == pytest.approx(1.0)
    assert row["fld"] == pytest.approx(spearman([1, 2, 3, 0.1], [1, 2, 3, 4]))
    assert row["obj_within_rho"] == pytest.approx(1.0) and row["obj_within_rho_skipped"] == 0
    # a second ρ whose plans all tie has no rank correlation: skipped and counted, not averaged in
    tied = [dict(r, rho=0.9, plan_digest=r["plan_digest"] + "b", gap_to_fp8=1.0) for r in recs]
    [row] = objective_ranking(recs + tied, ["late"], [0.5, 0.9], lam=100.0)
    assert row["obj_within_rho"] == pytest.approx(1.0) and row["obj_within_rho_skipped"] == 1


def test_attainable_share():
    flops = {"a": 1.0, "b": 1.0, "c": 2.0}  # shares reachable: 0, .25, .5, .75, 1
    assert attainable_share(flops, 0.5) == 0.5
    assert attainable_share(flops, 0.6) == 0.75
    assert attainable_share(flops, 0.76) == 1.0
    assert attainable_share(flops, 0.0) == 0.0
    with pytest.raises(ValueError, match="target"):
        attainable_share(flops, 1.2)


def test_train_settings_validation():
    with pytest.raises(ValueError, match="lr"):
        TrainSettings(lr=0.0)
    with pytest.raises(ValueError, match="batch_size"):
        TrainSettings(batch_size=0)
    s = TrainSettings(lr=1.0, lr_warmup_steps=4)
    assert [s.lr_at(i) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    d = TrainSettings(lr=1.0, lr_warmup_steps=0, decay_start=10, decay_steps=4)
    assert [d.lr_at(i) for i in (0, 9, 10, 11, 12, 13, 14, 20)] == [1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    for bad in (dict(decay_start=5, decay_steps=0), dict(decay_start=-1, decay_steps=3)):
        with pytest.raises(ValueError, match="decay"):
            TrainSettings(**bad)
    run = run_settings(s, warmup_steps=100, steps=4, lr_decay="linear")
    assert [run.lr_at(100 + i) for i in range(4)] == [1.0, 0.75, 0.5, 0.25]
    assert run_settings(s, warmup_steps=100, steps=4, lr_decay="none") is s


class _TinyLM(nn.Module):
    """Embedding -> one decoder-named linear -> head; exposes ``.logits`` like a HF causal LM."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 32)
        self.model = nn.Module()
        block = nn.Module()
        block.self_attn = nn.Module()
        block.mlp = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(block.self_attn, name, nn.Linear(32, 32, bias=False))
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(block.mlp, name, nn.Linear(32, 32, bias=False))
        self.model.layers = nn.ModuleList([block])
        self.head = nn.Linear(32, 16, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        b = self.model.layers[0]
        for lin in (b.self_attn.q_proj, b.self_attn.o_proj, b.mlp.up_proj, b.mlp.down_proj):
            h = h + torch.tanh(lin(h))
        h = h + b.self_attn.k_proj(h) * 0.0 + b.self_attn.v_proj(h) * 0.0 + b.mlp.gate_proj(h) * 0.0
        return type("Out", (), {"logits": self.head(h)})()


def test_checkpoint_round_trip_and_training_is_reproducible(tmp_path):
    model = _TinyLM()
    swap_linears(model, "bf16", seed=0)
    settings = TrainSettings(lr=1e-2, batch_size=2, lr_warmup_steps=0)
    opt = make_optimizer(model, settings)
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 16, (2, 16), generator=g)} for _ in range(6)]
    it = iter(batches[:3])
    train_steps(model, opt, lambda: next(it), 3, settings)
    save_checkpoint(model, opt, tmp_path / "ck", meta={"step": 3})

    def resume(plan):
        m = _TinyLM()
        swap_linears(m, "bf16", seed=1)
        o = make_optimizer(m, settings)
        assert load_checkpoint(m, o, tmp_path / "ck") == {"step": 3}
        apply_plan(m, plan)
        it2 = iter(batches[3:])
        losses = train_steps(m, o, lambda: next(it2), 3, settings, start_step=3)
        return m, losses

    fqns = list(snip_layers(model))
    m1, l1 = resume(Plan.uniform(fqns, "fp8"))
    m2, l2 = resume(Plan.uniform(fqns, "fp8"))
    assert l1 == l2  # same checkpoint, data and seeds: bit-identical (what makes runs paired)
    m3, l3 = resume(Plan.uniform(fqns, "bf16"))
    # the reference: continuing the original model unquantized gives the same losses as the resumed BF16 run
    it = iter(batches[3:])
    assert train_steps(model, opt, lambda: next(it), 3, settings, start_step=3) == l3
    assert l1 != l3
    ids = [b["input_ids"] for b in batches]
    q = evaluate(m1, ids)
    with bf16_forward(m1):
        unq = evaluate(m1, ids)
    assert q != unq
    assert all(layer.precision == "fp8" for layer in snip_layers(m1).values())  # restored after the block
    manual = sum(nn.functional.cross_entropy(m1(input_ids=i).logits[:, :-1].reshape(-1, 16),
                                             i[:, 1:].reshape(-1)).item() for i in ids) / len(ids)
    assert q == pytest.approx(manual, rel=1e-6)


def test_load_checkpoint_missing_file(tmp_path):
    model = _TinyLM()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_checkpoint(model, make_optimizer(model, TrainSettings()), tmp_path)


def test_apply_plan_rejects_other_layers():
    model = _TinyLM()
    swap_linears(model, "bf16")
    with pytest.raises(ValueError, match="plan does not match"):
        apply_plan(model, Plan.uniform(["model.layers.9.mlp.up_proj"], "fp4"))


@pytest.mark.slow
def test_dgrad_upstream_grid_against_a_split_grid(tmp_path):
    """--dgrad_cost upstream: recorded and reported; its SNIP is paired against the other grid's baselines
    (--versus), cell by cell; it needs --per_gemm and a positive calibration."""
    mod = _script()
    split, up = tmp_path / "split", tmp_path / "up"
    assert mod.main(["--quick", "--per_gemm", "--methods", "best,quant_err", "--lambdas", "30",
                     "--output_dir", str(split), "--silent"]) == 0
    assert mod.main(["--quick", "--per_gemm", "--dgrad_cost", "upstream", "--dgrad_calibration", "8",
                     "--methods", "best", "--lambdas", "30", "--output_dir", str(up), "--silent"]) == 0
    data = json.loads((up / "compare_plans.json").read_text())
    assert data["settings"]["dgrad_cost"] == "upstream" and data["settings"]["dgrad_calibration"] == 8.0
    assert "bwd_dgrad / 8" in (up / "compare_plans.md").read_text()
    assert mod.main(["--report_only", "--output_dir", str(up), "--versus", str(split), "--silent"]) == 0
    md = (up / "compare_plans.md").read_text()
    assert "### This grid's SNIP (best λ=30) against every plan of the other grid" in md
    other = json.loads((split / "compare_plans.json").read_text())

    def val(d, label):
        return next(r["val_loss"] for r in d["records"] if r["label"] == label)
    cross = {(r["phase"], r["label"]): r for r in versus_rows(data["records"], other["records"], "best λ=30")}
    for label in ("best λ=30", "quant_err"):
        assert cross[("early", label)]["q"].mean == pytest.approx(val(data, "best λ=30") - val(other, label),
                                                                 abs=1e-12)
    for bad in (["--dgrad_cost", "upstream"], ["--per_gemm", "--dgrad_calibration", "0"],
                ["--per_gemm", "--dgrad_cost", "both"]):
        with pytest.raises(SystemExit):
            mod.parse_args(bad)


def test_bwd_rounding_and_key_are_recorded_reported_and_checked(quick_run, tmp_path):
    """--bwd_rounding / --bwd_key: recorded in the settings, named in the md, free to differ under --versus
    (the uniform FP8 runs do not depend on them), and unknown values are refused."""
    mod = _script()
    out = tmp_path / "sys"
    assert mod.main(["--quick", "--methods", "best", "--lambdas", "30", "--bwd_rounding", "nearest",
                     "--bwd_key", "bwd_bias", "--output_dir", str(out), "--silent"]) == 0
    data = json.loads((out / "compare_plans.json").read_text())
    assert data["settings"]["bwd_rounding"] == "nearest" and data["settings"]["bwd_key"] == "bwd_bias"
    assert "SNIP's BWD: the systematic part of the drift, with G_Y rounded to nearest" in (
        out / "compare_plans.md").read_text()
    default = json.loads((quick_run / "compare_plans.json").read_text())
    assert (default["settings"]["bwd_rounding"], default["settings"]["bwd_key"]) == ("recipe", "bwd")
    assert "with G_Y rounded as training does" in (quick_run / "compare_plans.md").read_text()
    assert mod.main(["--report_only", "--output_dir", str(out), "--versus", str(quick_run), "--silent"]) == 0
    for bad in (["--bwd_rounding", "stochastic"], ["--bwd_key", "bwd_noise"]):
        with pytest.raises(SystemExit):
            mod.parse_args(bad)


def test_forward_drift_is_measured_priced_recorded_and_reported(quick_run, tmp_path):
    """--forward_drift: the statistics gain FWD, SNIP's plans are priced with it (the records' predicted drift
    includes it), the settings and md say so, the λ calibration gains its column, and the grid pairs with
    --versus against one without it (whose uniform FP8 runs are the same)."""
    mod = _script()
    out = tmp_path / "fwd"
    assert mod.main(["--quick", "--forward_drift", "--methods", "best,fp4_fprop,fp4_backward", "--lambdas", "2",
                     "--output_dir", str(out), "--silent"]) == 0
    data = json.loads((out / "compare_plans.json").read_text())
    assert data["settings"]["forward_drift"] is True
    assert "forward_drift" not in json.loads((quick_run / "compare_plans.json").read_text())["settings"]
    recs = {r["label"]: r for r in data["records"]}
    assert recs["fp4_fprop"]["predicted_bwd"] > recs["uniform_fp8"]["predicted_bwd"]  # FWD(fp4) > FWD(fp8)
    md = (out / "compare_plans.md").read_text()
    assert "SNIP's costs also price FWD" in md and "| ΔFWD (mnats) |" in md
    assert "λ = r·ΔFLD / (ΔBWD − r·ΔFWD)" in md
    default = json.loads((quick_run / "compare_plans.json").read_text())
    fp8 = next(r["val_loss"] for r in default["records"] if r["method"] == "uniform_fp8")
    assert recs["uniform_fp8"]["val_loss"] == fp8
    assert mod.main(["--report_only", "--output_dir", str(out), "--versus", str(quick_run), "--silent"]) == 0
    # --fwd_lambda: FWD at its own weight, recorded and named; it needs --forward_drift
    mu = tmp_path / "mu"
    assert mod.main(["--quick", "--forward_drift", "--fwd_lambda", "0.05", "--methods", "best,fp4_fprop,fp4_backward",
                     "--lambdas", "2", "--output_dir", str(mu), "--silent"]) == 0
    data = json.loads((mu / "compare_plans.json").read_text())
    assert data["settings"]["fwd_lambda"] == 0.05
    md = (mu / "compare_plans.md").read_text()
    assert "at μ = 0.05" in md and "| ΔFLD + 0.05·ΔFWD (mnats) |" in md and "| ΔFWD (mnats) |" not in md
    recs = {r["label"]: r for r in data["records"]}
    assert recs["fp4_fprop"]["predicted_bwd"] == recs["uniform_fp8"]["predicted_bwd"]  # FWD is in the FLD part
    for bad in (["--fwd_lambda", "0.1"], ["--forward_drift", "--fwd_lambda", "-1"]):
        with pytest.raises(SystemExit):
            mod.parse_args(bad)
