"""The first-plan study's parts (snip_ds/experiments/first_plan.py, launch/first_plan_stability.py): the
round-off perturbations it applies are exact in real arithmetic and reach the products they name, and its
summary counts what its records say."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from snip_ds.experiments import first_plan as fp

U32 = 2.0 ** -24  # FP32 unit round-off


def _operands(dtype=torch.float32, k=300):
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, k, generator=g).to(dtype), torch.randn(k, 40, generator=g).to(dtype)


@pytest.mark.rounding
def test_split_k_is_the_same_product_in_another_order():
    a, b = _operands()
    want = a.double() @ b.double()
    with fp.SplitK():
        got = a @ b
        with_bias = F.linear(a, b.t(), torch.ones(40))  # addmm
    # Each order's error is at most k·u·Σ|a_i b_i| (the standard summation bound; k = 300)
    bound = 300 * U32 * (a.double().abs() @ b.double().abs())
    assert ((got.double() - want).abs() <= bound).all()
    assert ((with_bias.double() - 1.0 - want).abs() <= bound + U32 * want.abs() + U32).all()
    assert torch.equal(got, a[:, :150] @ b[:150] + a[:, 150:] @ b[150:])  # the mode ran the split


@pytest.mark.rounding
def test_split_k_fp32_only_leaves_bf16_products_alone():
    a, b = _operands(torch.bfloat16)
    with fp.SplitK(fp32_only=True):
        untouched = a @ b
    assert torch.equal(untouched, a @ b)
    with fp.SplitK():
        split = a @ b
    exact = (a.double() @ b.double())
    # BF16 result of an FP32 sum: one BF16 rounding (2^-8 relative) plus the FP32 order's error
    assert ((split.double() - exact).abs() <= 2 ** -8 * exact.abs() + 300 * U32 * (a.double().abs()
                                                                                    @ b.double().abs())).all()


def test_tf32_mode_rounds_every_fp32_operand():
    a, b = _operands(k=64)
    with fp.TF32():
        got = a @ b
    assert torch.equal(got, fp.round_to_tf32(a) @ fp.round_to_tf32(b))
    assert not torch.equal(got, a @ b)
    x = torch.tensor([1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, -3.0 - 2 ** -9 - 2 ** -12])
    assert fp.round_to_tf32(x).tolist() == [1.0, 1.0 + 4 * 2 ** -11, -3.0 - 2 ** -9]  # ties to even


def _record(seed, grad_sq_changes, ref_apart):
    plan = {"a": "fp4", "b": "fp8"}
    def entry(changes):
        return {"plan": plan, "bwd_fp4": {"a": 1.0, "b": 2.0},
                "perturbed": {n: {"changed": c, "max_rel_bwd": 0.5 * c} for n, c in zip(fp.PERTURBATIONS, changes)},
                "vs_reference": {"changed": ref_apart, "spearman_bwd": 1.0}}
    return {"seed": seed, "priors": {"factored": entry((0, 0, 0)), "grad_sq": entry(grad_sq_changes)},
            "reference": {"plan": plan}, "fld_only_plan": plan, "fld_only_perturbed": dict.fromkeys(fp.PERTURBATIONS, 0),
            "fld_only_vs_reference": 1}


def test_summary_counts_the_records():
    s = fp.summary([_record(0, (0, 2, 1), 1), _record(1, (0, 0, 3), 0)])
    g = s["priors"]["grad_sq"]
    assert s["seeds"] == 2 and s["layers"] == 2
    assert g["tf32"]["plans_changed"] == 0 and g["split_k_fp32"]["plans_changed"] == 0.5
    assert g["split_k"] == {"plans_changed": 1.0, "mean_layers_changed": 2.0, "max_rel_bwd": 1.5}
    assert g["vs_reference_changed"] == 0.5 and s["fld_only_vs_reference_changed"] == 1
    md = fp.markdown(s, "# t")
    assert "| `grad_sq` | 0% (0.00); 0.0e+00 | 50% (1.00); 1.0e+00 | 100% (2.00); 1.5e+00 | 0.50 | 1.000 |" in md


def test_summary_skips_an_undefined_spearman_and_counts_it():
    """A constant BWD has no rank correlation (NaN): the mean over seeds skips it and says how many."""
    undefined = _record(1, (0, 0, 0), 0)
    undefined["priors"]["grad_sq"]["vs_reference"]["spearman_bwd"] = float("nan")
    s = fp.summary([_record(0, (0, 0, 0), 0), undefined])
    g = s["priors"]["grad_sq"]
    assert g["vs_reference_spearman"] == 1.0 and g["vs_reference_spearman_skipped"] == 1
    assert s["priors"]["factored"]["vs_reference_spearman_skipped"] == 0
    assert "| 1.000 (1 undefined, skipped) |" in fp.markdown(s, "# t")


def test_launch_script_names_a_bad_flag(capsys):
    spec = importlib.util.spec_from_file_location(
        "first_plan_stability", Path(__file__).resolve().parents[1] / "launch" / "first_plan_stability.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for argv, want in ((["--priors", "adam"], "--priors: unknown ['adam']"),
                       (["--seeds", "0,x"], "--seeds: expected comma-separated integers")):
        with pytest.raises(SystemExit) as exc:
            script.main(argv)
        assert exc.value.code == 2 and want in capsys.readouterr().err
