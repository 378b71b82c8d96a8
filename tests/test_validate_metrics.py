"""launch/validate_metrics.py --quick: the JSON line's keys and value ranges; argument errors; the per-GEMM
truths of snip_ds.experiments.truths."""
import importlib.util
import json
import math
from pathlib import Path

import pytest

from snip_ds.experiments.truths import bwd_truth
from snip_ds.experiments.validation import CKPT_MODEL, CKPT_OPT, build, warm_up

_PATH = Path(__file__).resolve().parents[1] / "launch" / "validate_metrics.py"


def _load():
    spec = importlib.util.spec_from_file_location("validate_metrics", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def vm():
    return _load()


def _in_unit(x):
    return isinstance(x, float) and -1.0 <= x <= 1.0


@pytest.mark.slow
def test_quick_run_prints_table_then_json(vm, capsys, tmp_path):
    ckpt = tmp_path / "warm"
    assert vm.main(["--quick", "--checkpoint", str(ckpt)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert lines[0].split()[:3] == ["layer", "FLD", "truth"] and "GN part" in lines[0] and len(lines) == out["layers"] + 2
    for key in ("spearman_fld", "spearman_bwd", "repro_fld", "repro_bwd", "repro_one_shot", "spearman_fld_gn",
                "repro_fld_gn"):
        assert _in_unit(out[key]), key
    assert set(out["fld_variants"]) >= {"mc_fisher", "empirical", "isotropic", "quant_err", "rel_quant_err"}
    assert set(out["bwd_variants"]) >= {"direct", "loss_units_mc_fisher", "direct_plus_propagated"}
    assert all(_in_unit(v) for v in [*out["fld_variants"].values(), *out["bwd_variants"].values()])
    assert out["spearman_fld"] == out["fld_variants"]["mc_fisher"]
    assert out["spearman_bwd"] == out["bwd_variants"]["direct"]
    # the BWD truth is reproducible even on a tiny model, and the direct estimate is calibrated within 10x
    assert out["repro_bwd"] > 0.5 and 0.1 < out["calibration_bwd"] < 10
    assert out["layers"] == 14 and out["precond"] == "tensor" and out["optimizer_step"] == 40
    assert all(math.isfinite(v) for v in out["seconds"]["collect"].values())
    assert (ckpt / CKPT_MODEL).is_file() and (ckpt / CKPT_OPT).is_file()
    # a second (shorter) run reuses the checkpoint: model and optimizer state come back
    assert vm.main(["--quick", "--checkpoint", str(ckpt), "--batches", "2", "--warmup_steps", "0"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["checkpoint"] == "loaded" and again["optimizer_step"] == 40 and again["precond"] == "tensor"
    # the sequence form is the default FLD; both forms are reported; without the BWD truth its figures are null
    assert out["fld_variants"]["mc_fisher"] != out["fld_variants"]["mc_fisher_channel"]
    assert vm.main(["--quick", "--checkpoint", str(ckpt), "--batches", "2", "--no_bwd_truth"]) == 0
    fld_only = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert fld_only["spearman_bwd"] is None and fld_only["bwd_variants"] is None and _in_unit(fld_only["spearman_fld"])
    # re-scoring against the first run's printed table: the same figures (to the table's 4 digits), no split-half
    table = tmp_path / "table.txt"
    table.write_text("\n".join(lines) + "\n")
    assert vm.main(["--quick", "--checkpoint", str(ckpt), "--truth_table", str(table)]) == 0
    rescored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the table rounds to 4 digits, which can swap near-tied layers: one adjacent swap of 14 moves Spearman's ρ
    # by 12/(14·(14²-1)) = 0.0044, so abs=0.02 allows 4 such swaps (no GEMM round-off enters: same process)
    for key in ("spearman_fld", "spearman_bwd", "spearman_fld_gn"):
        assert rescored[key] == pytest.approx(out[key], abs=0.02), key
    assert rescored["repro_fld"] is None and rescored["repro_bwd"] is None


@pytest.mark.slow
def test_per_gemm_truths_land_where_each_gemm_acts(vm, capsys, tmp_path):
    """wgrad-only moves the layer's own weight; dgrad-only moves only what lies upstream of its input: for the
    first block's q_proj that is the embedding, no linear. --bwd_truth_per_gemm scores the per-GEMM costs."""
    import torch
    args = vm.parse_args(["--quick", "--batches", "2", "--warmup_steps", "5"])
    torch.manual_seed(0)
    model, train_ds, val_ds = build(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    warm_up(model, opt, train_ds, args)
    batches = [val_ds.get_batch([0, 1])["input_ids"]]
    split = bwd_truth(model, opt, batches, ("wgrad", "dgrad"))
    first, last = "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"
    assert split["dgrad_linears"][first] == [0.0] and split["dgrad"][first][0] > 0  # the embedding moved
    assert split["wgrad"][first][0] > 0 and split["dgrad_linears"][last][0] > 0
    assert all(lin[0] <= tot[0] for lin, tot in zip(split["dgrad_linears"].values(), split["dgrad"].values()))
    assert vm.main(["--quick", "--batches", "2", "--warmup_steps", "5", "--bwd_truth_per_gemm"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert "wgrad only" in lines[0] and "dgrad only" in lines[0]
    per = out["bwd_per_gemm"]
    assert set(per["dgrad_vs"]) == {"direct", "propagated", "quant_err", "rel_quant_err"}
    assert all(_in_unit(v) for v in [*per["wgrad_vs"].values(), *per["dgrad_vs"].values()])
    assert per["dgrad_over_wgrad_total"] > 0 and 0 < per["linears_share_of_dgrad_total"] <= 1
    assert out["seconds"]["bwd_truth_per_gemm"] > 0


@pytest.mark.slow
def test_forward_drift_estimate_against_its_truth(vm, capsys, tmp_path):
    """--fwd_truth: the collector's linearised one-probe ``fwd`` against one real AdamW step per layer with only
    that layer's fprop at FP4, priced with 8 explicit Fisher probes: it ranks the layers (0.89 measured on this
    tiny model, where the truth's own split-half agreement is 0.79) and is calibrated within 2x (1.18)."""
    assert vm.main(["--quick", "--batches", "4", "--fwd_truth"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert "FWD truth" in lines[0] and "FWD pred" in lines[0]
    fwd = out["fwd"]
    assert fwd["spearman"] > 0.7 and fwd["repro"] > 0.5 and 0.5 < fwd["calibration"] < 2
    assert _in_unit(fwd["truth_vs_fld_truth"]) and fwd["probes"] == 8 and fwd["truth_over_fld_truth"] > 0
    assert out["seconds"]["fwd_truth"] > 0 and out["seconds"]["collect"]["forward_drift"] > 0
    with pytest.raises(SystemExit):
        vm.parse_args(["--fwd_probes", "0"])


def test_bad_truth_table_names_the_file(vm, capsys, tmp_path):
    bad = tmp_path / "t.txt"
    bad.write_text("no table here\n")
    assert vm.main(["--quick", "--batches", "2", "--warmup_steps", "0", "--truth_table", str(bad)]) == 2
    assert f"--truth_table {bad}: no table header" in capsys.readouterr().err
    other = tmp_path / "o.txt"
    other.write_text("layer  FLD truth  GN part  one-shot  BWD truth\nmodel.x.q_proj 1 2 3 4\n")
    assert vm.main(["--quick", "--batches", "2", "--warmup_steps", "0", "--truth_table", str(other)]) == 2
    assert "layers are not this model's" in capsys.readouterr().err


def test_bad_arguments(vm, capsys):
    with pytest.raises(SystemExit) as e:
        vm.parse_args(["--batches", "0"])
    assert e.value.code == 2 and "--batches must be >= 1" in capsys.readouterr().err
    assert vm.main(["--quick", "--batches", "2000"]) == 2
    assert "validation split has" in capsys.readouterr().err
