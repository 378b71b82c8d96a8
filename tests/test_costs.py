"""snip_ds.planner.costs: one cost model. A solved plan's predicted FLD + λ·BWD is its ILP objective, per
layer and per GEMM, and every method maps to the costs solve_baseline solves with."""
import math

import pytest

from snip_ds.planner.costs import (METHODS, CostSettings, costs_from_stats, method_costs, predicted_divergence,
                                   quant_err_costs)
from snip_ds.planner.baselines import solve_baseline

NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _stats(blocks=3, lam=1.5):
    layers = {}
    for b in range(blocks):
        for i, name in enumerate(NAMES):
            k = 1 + (b * 7 + i) % 5
            rec = {"flops": float(100 * (1 + i % 3)), "fld": {"fp8": 0.01 * k, "fp4": 0.2 * k},
                   "bwd": {"fp8": 0.003 * (6 - k), "fp4": 0.05 * (6 - k)},
                   "bwd_dgrad": {"fp8": 0.002 * k, "fp4": 0.03 * k}}
            for m in ("quant_err", "rel_quant_err"):
                ops = {o: {"fp8": 0.1 * k + j, "fp4": 1.0 * k + j} for j, o in enumerate("xwg")}
                rec.update({f"{m}_{o}": v for o, v in ops.items()})
                rec[m] = {p: sum(ops[o][p] for o in "xwg") for p in ("fp8", "fp4")}
            layers[f"model.layers.{b}.{'mlp' if i > 3 else 'self_attn'}.{name}"] = rec
    return {"format": "snip_ds.stats/1", "lambda": lam, "layers": layers}


# The objective and the prediction add the same ≤ 63 terms of size ≤ 1 in different orders: FP64 round-off
# of each sum is below 63·2^-53·Σ|terms| ≈ 1e-13; 1e-9 relative only absorbs that.
REL = 1e-9


@pytest.mark.parametrize("per_gemm, dgrad", [(False, "split"), (True, "split"), (True, "upstream")])
def test_prediction_is_the_objective(per_gemm, dgrad):
    stats, lam = _stats(), 1.5
    cal = 2.0 if dgrad == "upstream" else 1.0
    plan = solve_baseline("best", stats, 0.5, CostSettings(per_gemm=per_gemm, dgrad=dgrad, dgrad_calibration=cal))[0]
    fld, bwd = predicted_divergence(stats["layers"], plan.assignment, dgrad=dgrad, dgrad_calibration=cal)
    assert fld + lam * bwd == pytest.approx(plan.objective, rel=REL)


def test_costs_are_fld_plus_lambda_bwd_by_hand():
    stats = _stats()
    fqn = "model.layers.1.self_attn.k_proj"
    rec = stats["layers"][fqn]
    c = costs_from_stats(stats, 3.0).costs[fqn]
    assert c == {"bf16": 0.0, "fp8": rec["fld"]["fp8"] + 3.0 * rec["bwd"]["fp8"],
                 "fp4": rec["fld"]["fp4"] + 3.0 * rec["bwd"]["fp4"]}
    g = costs_from_stats(stats, 3.0, per_gemm=True).costs[fqn]["fp4"]
    assert g["fprop"] == rec["fld"]["fp4"] and g["dgrad"] == g["wgrad"] == 0.5 * 3.0 * rec["bwd"]["fp4"]
    # dgrad="upstream": wgrad carries all of λ·BWD, dgrad λ·bwd_dgrad/calibration (rel 1e-15: a few FP64 roundings
    # of 2^-53 each; k_proj of block 1 has k = 4:
    # bwd fp4 = 0.05·2, bwd_dgrad fp4 = 0.03·4; numbers typed out, not re-derived from the record)
    u = costs_from_stats(stats, 3.0, per_gemm=True, dgrad="upstream", dgrad_calibration=4.0).costs[fqn]["fp4"]
    assert u == pytest.approx({"fprop": 0.8, "dgrad": 3.0 * 0.12 / 4.0, "wgrad": 3.0 * 0.1}, rel=1e-15)
    fld, bwd = predicted_divergence(stats["layers"], {fqn: {"fprop": "bf16", "dgrad": "fp4", "wgrad": "fp8"}},
                                    dgrad="upstream", dgrad_calibration=4.0)
    # fp8 of k = 4: bwd 0.003·2; bwd_dgrad fp4 0.12 priced at 1/calibration
    assert (fld, bwd) == pytest.approx((0.0, 0.006 + 0.12 / 4.0), rel=1e-15)


def test_every_method_has_its_costs():
    stats = _stats()
    assert method_costs("best", stats).costs == costs_from_stats(stats).costs
    assert method_costs("first_last_fp8", stats).costs == costs_from_stats(stats).costs
    assert method_costs("rel_quant_err", stats, CostSettings(per_gemm=True)).costs == quant_err_costs(
        stats, "rel_quant_err", per_gemm=True).costs
    r0, r1 = (method_costs("random", stats, seed=s).costs for s in (0, 1))
    assert r0 != r1 and r0 == method_costs("random", stats, seed=0).costs
    assert all(0.0 <= v < 1.0 for t in r0.values() for v in t.values())
    for method in ("uniform_fp8", "uniform_fp4"):
        with pytest.raises(ValueError, match="fixed plan"):
            method_costs(method, stats)
    with pytest.raises(ValueError, match="unknown method 'snip'"):
        method_costs("snip", stats)
    assert set(METHODS) >= {"best", "random", "quant_err", "rel_quant_err", "first_last_fp8"}


def test_prediction_skips_bf16_and_nonfinite():
    layers = {"a": {"fld": {"fp8": None, "fp4": 2.0}, "bwd": {"fp8": 1.0, "fp4": math.nan}}}
    assert predicted_divergence(layers, {"a": "fp8"}) == (0.0, 1.0)
    assert predicted_divergence(layers, {"a": "fp4"}) == (2.0, 0.0)
    assert predicted_divergence(layers, {"a": "bf16"}) == (0.0, 0.0)
