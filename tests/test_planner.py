"""Tests for snip_ds.planner against brute-force enumeration, plus fallbacks, baselines and stats files."""
import itertools
import json
import math
import random
import warnings

import mip
import pytest

import snip_ds.planner.ilp as ilp
from snip_ds.planner.crash_handlers import kept_crash_handlers
from snip_ds.plan import fp4_share
from snip_ds.planner import (GEMM_COST, METHODS, CostSettings, SolverSettings, costs_from_stats, quant_err_costs,
                             solve_baseline, solve_plan)
from snip_ds.stats_file import load_stats, validate_stats
from snip_ds.types import GEMMS, block_index

TOL = 1e-9  # FP64 FLOP shares: sums of ≤ 36 terms err by ≤ 36·2^-53 ≈ 4e-15; 1e-9 only absorbs that
NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _fqns(n):
    return [f"model.layers.{i // 7}.{NAMES[i % 7]}" for i in range(n)]


def _instance(n, seed, precisions=("bf16", "fp8", "fp4"), per_gemm=False):
    rng = random.Random(seed)
    fqns = _fqns(n)
    flops = {f: rng.uniform(1.0, 10.0) for f in fqns}
    if per_gemm:
        costs = {f: {p: {g: rng.random() for g in GEMMS} for p in precisions} for f in fqns}
    else:
        costs = {f: {p: rng.random() for p in precisions} for f in fqns}
    return costs, flops


# ------------------------------------------------------------------------------------------------------
# Independent reference: enumerate every assignment.
# ------------------------------------------------------------------------------------------------------
def _brute_force(costs, flops, target, allowed, pinned=None, previous=None, flip_penalty=0.0,
                 max_share=None, per_gemm=False, compute_budget=None):
    pinned = pinned or {}
    total = sum(flops.values())
    units = [(f, g) for f in sorted(costs) for g in (GEMMS if per_gemm else (None,))]
    options = [(pinned[f],) if f in pinned else allowed for f, _ in units]
    best = (math.inf, None)
    for combo in itertools.product(*options):
        share = compute = obj = 0.0
        for (f, g), p in zip(units, combo):
            w = flops[f] / total / (3 if per_gemm else 1)
            share += w * (p == "fp4")
            compute += w * GEMM_COST[p]
            c = costs[f].get(p, 0.0)
            obj += c[g] if per_gemm else c
            if previous and f in previous:
                prev = previous[f]
                if isinstance(prev, dict) and not per_gemm:  # a per-GEMM previous plan: count differing GEMMs
                    obj += flip_penalty * w * sum(prev[gg] != p for gg in GEMMS) / len(GEMMS)
                else:
                    obj += flip_penalty * w * ((prev[g] if isinstance(prev, dict) else prev) != p)
        if share < target - TOL or (max_share is not None and share > max_share + TOL):
            continue
        if compute_budget is not None and compute > compute_budget + TOL:
            continue
        if obj < best[0]:
            best = (obj, combo)
    return best


def _assert_valid(plan, flops, target, max_share=None):
    share = fp4_share(plan.assignment, flops)
    assert share == pytest.approx(plan.fp4_share)
    assert share >= target - TOL
    if max_share is not None:
        assert share <= max_share + TOL


def _objective(plan, costs, per_gemm=False):
    """The plan's total cost. Tolerances on objectives in this file: sums of ≤ 3·12 FP64 costs in [0, 1]
    (no GEMM, nothing that depends on the CPU's instruction set) err by ≤ 36·2^-53·36 ≈ 1e-13, so abs=1e-9
    (or pytest.approx's default rel=1e-6) only absorbs that; costs scaled to 1e-9 get rel=1e-9."""
    if per_gemm:
        return sum(costs[f][plan.assignment[f][g]][g] for f in costs for g in GEMMS)
    return sum(costs[f][plan.assignment[f]] for f in costs)


# ------------------------------------------------------------------------------------------------------
# Optimality against brute force
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("target", [0.0, 0.3, 0.75, 1.0])
def test_two_precisions_matches_brute_force(seed, target):
    costs, flops = _instance(12, seed)
    plan = solve_plan(costs, flops, target)
    ref, _ = _brute_force(costs, flops, target, ("fp8", "fp4"))
    assert plan.status == "optimal" and plan.method == "best"
    assert set(plan.assignment.values()) <= {"fp8", "fp4"}
    _assert_valid(plan, flops, target)
    assert plan.objective == pytest.approx(ref, abs=1e-9)
    assert _objective(plan, costs) == pytest.approx(plan.objective)
    assert plan.meta["solve_time_s"] > 0


def test_tiny_costs_are_not_lost_to_solver_tolerances():
    costs, flops = _instance(10, 7)
    tiny = {f: {p: c * 1e-9 for p, c in t.items()} for f, t in costs.items()}
    plan = solve_plan(tiny, flops, 0.6)
    ref, _ = _brute_force(tiny, flops, 0.6, ("fp8", "fp4"))
    assert plan.objective == pytest.approx(ref, rel=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_three_precisions_one_hot_matches_brute_force(seed):
    costs, flops = _instance(7, seed)
    allowed = ("bf16", "fp8", "fp4")
    for target, budget in [(0.4, None), (0.2, 0.45), (0.0, 0.3)]:
        plan = solve_plan(costs, flops, target, SolverSettings(allowed=allowed, compute_budget=budget))
        ref, _ = _brute_force(costs, flops, target, allowed, compute_budget=budget)
        assert plan.objective == pytest.approx(ref, abs=1e-9)
        _assert_valid(plan, flops, target)
        if budget is not None:
            compute = sum(flops[f] * GEMM_COST[p] for f, p in plan.assignment.items()) / sum(flops.values())
            assert compute <= budget + TOL


@pytest.mark.parametrize("seed", range(4))
def test_equal_flops_classes_match_brute_force(seed):
    # Few distinct FLOP values: units form interchangeable classes solved as integer counts.
    rng = random.Random(100 + seed)
    fqns = _fqns(12)
    flops = {f: rng.choice([1.0, 3.0]) for f in fqns}
    costs = {f: {p: rng.random() for p in ("bf16", "fp8", "fp4")} for f in fqns}
    previous = {f: rng.choice(["fp8", "fp4"]) for f in fqns}
    pinned = {fqns[0]: "fp4", fqns[1]: "fp8"}
    for allowed in (("fp8", "fp4"), ("bf16", "fp8", "fp4")):
        for target, max_share in ((0.35, None), (0.5, 0.55)):
            plan = solve_plan(costs, flops, target,
                              SolverSettings(allowed=allowed, pinned=pinned, flip_penalty=0.7, max_share=max_share),
                              previous=previous)
            ref, _ = _brute_force(costs, flops, target, allowed, pinned=pinned, previous=previous,
                                  flip_penalty=0.7, max_share=max_share)
            assert plan.status == "optimal"
            assert plan.objective == pytest.approx(ref, abs=1e-9)
            _assert_valid(plan, flops, target, max_share)


def test_symmetric_llama_instance_is_solved_to_optimality_fast():
    # Llama-2-7B per-GEMM, 3 precisions: 672 units in 2 weight classes. As plain 0/1 variables CBC could
    # not close the gap on this instance (5 s limit hit); the class counts make it a 2-variable problem.
    dims = {"q": (4096, 4096), "k": (4096, 4096), "v": (4096, 4096), "o": (4096, 4096),
            "gate": (4096, 11008), "up": (4096, 11008), "down": (11008, 4096)}
    flops = {f"model.layers.{b}.{n}": 6.0 * k * n_ for b in range(32) for n, (k, n_) in dims.items()}
    rng = random.Random(2)
    costs = {f: {p: {g: rng.random() for g in GEMMS} for p in ("bf16", "fp8", "fp4")} for f in flops}
    # "optimal" (not "time_limit_feasible") says CBC closed the gap within the limit; the solve times themselves
    # are benchmarks/bench_planner.py's.
    plan = solve_plan(costs, flops, 0.75, SolverSettings(allowed=("bf16", "fp8", "fp4"), time_limit=5.0),
                      per_gemm=True)
    assert plan.status == "optimal"
    _assert_valid(plan, flops, 0.75)
    # Exchange check: within a class, every fp4 GEMM costs no more to switch than any non-fp4 one.
    for size in (4096 * 4096, 4096 * 11008):
        switched, kept = [], []
        for f, gs in plan.assignment.items():
            if flops[f] / 6.0 != size:
                continue
            for g, p in gs.items():
                cheapest_other = min(costs[f]["bf16"][g], costs[f]["fp8"][g])
                (switched if p == "fp4" else kept).append(costs[f]["fp4"][g] - cheapest_other)
        assert max(switched) <= min(kept) + 1e-12


def test_three_precisions_uses_bf16_when_cheapest():
    fqns = _fqns(4)
    flops = {f: 1.0 for f in fqns}
    costs = {f: {"bf16": 0.0, "fp8": 1.0, "fp4": 5.0} for f in fqns}
    plan = solve_plan(costs, flops, 0.5, SolverSettings(allowed=("bf16", "fp8", "fp4")))
    assert sorted(plan.assignment.values()) == ["bf16", "bf16", "fp4", "fp4"]


@pytest.mark.parametrize("seed", range(3))
def test_per_gemm_matches_brute_force(seed):
    costs, flops = _instance(4, seed, per_gemm=True)  # 12 binary units
    for target in (0.25, 0.6):
        plan = solve_plan(costs, flops, target, per_gemm=True)
        ref, _ = _brute_force(costs, flops, target, ("fp8", "fp4"), per_gemm=True)
        assert plan.per_gemm
        assert plan.objective == pytest.approx(ref, abs=1e-9)
        assert _objective(plan, costs, per_gemm=True) == pytest.approx(plan.objective)
        _assert_valid(plan, flops, target)


def test_per_gemm_splits_a_layer_when_that_is_cheaper():
    fqns = _fqns(2)
    flops = {fqns[0]: 1.0, fqns[1]: 100.0}
    costs = {fqns[0]: {"fp8": {g: 0.0 for g in GEMMS}, "fp4": {g: 10.0 for g in GEMMS}},
             fqns[1]: {"fp8": {g: 0.0 for g in GEMMS}, "fp4": {"fprop": 9.0, "dgrad": 1.0, "wgrad": 2.0}}}
    # 1/3 of the big layer is ~33% of the FLOPs: its cheapest GEMM in fp4 meets a 30% target.
    plan = solve_plan(costs, flops, 0.30, per_gemm=True)
    assert dict(plan.assignment[fqns[1]]) == {"fprop": "fp8", "dgrad": "fp4", "wgrad": "fp8"}
    assert plan.fp4_share == pytest.approx(100 / 3 / 101)


def test_max_share_pins_the_share():
    costs, flops = _instance(10, 3)
    # Costs that make fp4 cheaper everywhere: without an upper bound every layer goes fp4.
    cheap4 = {f: {"fp8": 1.0, "fp4": 0.0} for f in costs}
    assert solve_plan(cheap4, flops, 0.5).fp4_share == pytest.approx(1.0)
    plan = solve_plan(cheap4, flops, 0.5, SolverSettings(max_share=0.6))
    _assert_valid(plan, flops, 0.5, max_share=0.6)
    ref, _ = _brute_force(cheap4, flops, 0.5, ("fp8", "fp4"), max_share=0.6)
    assert plan.objective == pytest.approx(ref)


# ------------------------------------------------------------------------------------------------------
# Pins and flip penalty
# ------------------------------------------------------------------------------------------------------
def test_pinned_layers_are_respected_and_optimal():
    costs, flops = _instance(10, 4)
    fqns = sorted(costs)
    pinned = {fqns[0]: "fp4", fqns[3]: "fp8", fqns[5]: "bf16"}  # bf16 is outside allowed: still fine
    plan = solve_plan(costs, flops, 0.5, SolverSettings(pinned=pinned))
    for f, p in pinned.items():
        assert plan.assignment[f] == p
    ref, _ = _brute_force(costs, flops, 0.5, ("fp8", "fp4"), pinned=pinned)
    assert plan.objective == pytest.approx(ref)
    _assert_valid(plan, flops, 0.5)


def test_flip_penalty_matches_brute_force_and_reduces_flips():
    costs, flops = _instance(12, 5)
    fqns = sorted(costs)
    rng = random.Random(11)
    previous = {f: rng.choice(["fp8", "fp4"]) for f in fqns}
    flips = []
    for penalty in (0.0, 0.5, 2.0, 1000.0):
        plan = solve_plan(costs, flops, 0.5, SolverSettings(flip_penalty=penalty), previous=previous)
        ref, _ = _brute_force(costs, flops, 0.5, ("fp8", "fp4"), previous=previous, flip_penalty=penalty)
        assert plan.objective == pytest.approx(ref, abs=1e-9)
        n = sum(plan.assignment[f] != previous[f] for f in fqns)
        assert plan.meta["flipped_gemms"] == 3 * n
        flips.append(n)
    assert flips == sorted(flips, reverse=True) and flips[0] > flips[-1]


def test_flip_penalty_against_a_per_gemm_previous_plan_counts_each_gemm_a_third():
    """A per-layer re-plan after a per-GEMM plan: a layer flips by the share of its GEMMs whose precision
    changes (brute force over every assignment, the flips counted GEMM by GEMM there)."""
    costs, flops = _instance(9, 21)
    fqns = sorted(costs)
    rng = random.Random(13)
    previous = {f: {g: rng.choice(["fp8", "fp4"]) for g in GEMMS} for f in fqns}
    assert any(len(set(p.values())) == 2 for p in previous.values())  # some layers were split
    for penalty in (0.4, 2.0):
        plan = solve_plan(costs, flops, 0.5, SolverSettings(flip_penalty=penalty), previous=previous)
        ref, _ = _brute_force(costs, flops, 0.5, ("fp8", "fp4"), previous=previous, flip_penalty=penalty)
        assert plan.objective == pytest.approx(ref, abs=1e-9)
        assert plan.meta["flipped_gemms"] == sum(previous[f][g] != plan.assignment[f] for f in fqns for g in GEMMS)
    # a per-GEMM re-plan: each GEMM against its own previous precision
    costs, flops = _instance(4, 22, per_gemm=True)
    previous = {f: {g: rng.choice(["fp8", "fp4"]) for g in GEMMS} for f in sorted(costs)}
    plan = solve_plan(costs, flops, 0.5, SolverSettings(flip_penalty=2.0), previous=previous, per_gemm=True)
    ref, _ = _brute_force(costs, flops, 0.5, ("fp8", "fp4"), previous=previous, flip_penalty=2.0, per_gemm=True)
    assert plan.objective == pytest.approx(ref, abs=1e-9)
    assert plan.meta["flipped_gemms"] == sum(previous[f][g] != plan.assignment[f][g] for f in costs for g in GEMMS)


def test_huge_flip_penalty_keeps_a_feasible_previous_plan():
    costs, flops = _instance(12, 6)
    previous = solve_plan(costs, flops, 0.7)
    new_costs, _ = _instance(12, 60)
    assert solve_plan(new_costs, flops, 0.7).digest() != previous.digest()
    kept = solve_plan(new_costs, flops, 0.7, SolverSettings(flip_penalty=1e6), previous=previous)
    assert kept.digest() == previous.digest()


# ------------------------------------------------------------------------------------------------------
# Greedy fallback and time limits
# ------------------------------------------------------------------------------------------------------
def test_greedy_fallback_when_solver_finds_nothing(monkeypatch):
    costs, flops = _instance(12, 8)
    optimal = solve_plan(costs, flops, 0.6)
    monkeypatch.setattr(ilp, "_optimize", lambda model, t: mip.OptimizationStatus.NO_SOLUTION_FOUND)
    plan = solve_plan(costs, flops, 0.6, SolverSettings(max_share=0.8))
    assert plan.status == "greedy_fallback"
    _assert_valid(plan, flops, 0.6, max_share=0.8)
    assert plan.objective >= optimal.objective - 1e-12
    assert _objective(plan, costs) == pytest.approx(plan.objective)


def test_greedy_is_optimal_for_equal_flops(monkeypatch):
    # With equal FLOPs the knapsack is a sort: greedy (cost delta per FLOP) is exact.
    rng = random.Random(9)
    fqns = _fqns(12)
    flops = {f: 2.0 for f in fqns}
    costs = {f: {"fp8": rng.random(), "fp4": rng.random()} for f in fqns}
    optimal = solve_plan(costs, flops, 0.5)
    monkeypatch.setattr(ilp, "_optimize", lambda model, t: mip.OptimizationStatus.ERROR)
    greedy = solve_plan(costs, flops, 0.5)
    assert greedy.status == "greedy_fallback"
    assert greedy.objective == pytest.approx(optimal.objective)
    assert greedy.digest() == optimal.digest()


def test_greedy_respects_compute_budget(monkeypatch):
    costs, flops = _instance(7, 2)
    monkeypatch.setattr(ilp, "_optimize", lambda model, t: mip.OptimizationStatus.NO_SOLUTION_FOUND)
    plan = solve_plan(costs, flops, 0.2, SolverSettings(allowed=("bf16", "fp8", "fp4"), compute_budget=0.4))
    compute = sum(flops[f] * GEMM_COST[p] for f, p in plan.assignment.items()) / sum(flops.values())
    assert plan.status == "greedy_fallback" and compute <= 0.4 + TOL
    _assert_valid(plan, flops, 0.2)


def test_time_limit_keeps_feasible_solution(monkeypatch):
    costs, flops = _instance(12, 10)

    def stopped(model, t):
        with kept_crash_handlers():  # (as the real seam: CBC's handlers do not outlive the solve)
            model.optimize(max_seconds=t)
        return mip.OptimizationStatus.FEASIBLE  # what CBC reports when it stops with an incumbent

    monkeypatch.setattr(ilp, "_optimize", stopped)
    plan = solve_plan(costs, flops, 0.5)
    assert plan.status == "time_limit_feasible"
    _assert_valid(plan, flops, 0.5)


def test_real_tiny_time_limit_still_returns_a_valid_plan():
    costs, flops = _instance(560, 12, per_gemm=True)
    plan = solve_plan(costs, flops, 0.75, SolverSettings(allowed=("bf16", "fp8", "fp4"), time_limit=1e-4),
                      per_gemm=True)
    assert plan.status in ("optimal", "time_limit_feasible", "greedy_fallback")
    _assert_valid(plan, flops, 0.75)


def test_70b_sized_instance_is_solved_to_optimality_within_a_short_limit():
    # The class-count formulation makes a 560-layer instance small enough for CBC to prove optimality inside
    # a 5 s limit on any machine (a "time_limit_feasible" status would say it did not); how fast it is lives in
    # benchmarks/bench_planner.py, not in a timed test.
    costs, flops = _instance(560, 13)
    plan = solve_plan(costs, flops, 0.75, SolverSettings(time_limit=5.0))
    assert plan.status == "optimal"
    _assert_valid(plan, flops, 0.75)


# ------------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------------
def test_bad_inputs():
    costs, flops = _instance(7, 0)
    fqns = sorted(costs)
    with pytest.raises(ValueError, match="'target' must be a number in"):
        solve_plan(costs, flops, 1.5)
    with pytest.raises(ValueError, match="'target' must be a number in"):
        solve_plan(costs, flops, -0.1)
    with pytest.raises(ValueError, match="cost table is empty"):
        solve_plan({}, {}, 0.5)
    with pytest.raises(ValueError, match="different layers"):
        solve_plan(costs, {f: 1.0 for f in fqns[:-1]}, 0.5)
    with pytest.raises(ValueError, match="unreachable"):
        solve_plan(costs, flops, 0.9, SolverSettings(pinned={fqns[0]: "fp8", fqns[1]: "fp8", fqns[2]: "fp8"}))
    with pytest.raises(ValueError, match="unreachable"):
        solve_plan(costs, flops, 0.5, SolverSettings(allowed=("bf16", "fp8")))
    with pytest.raises(ValueError, match="valid precisions are bf16, fp8, fp4"):
        solve_plan(costs, flops, 0.5, SolverSettings(allowed=("fp8", "int4")))
    with pytest.raises(ValueError, match="not in the cost table"):
        solve_plan(costs, flops, 0.5, SolverSettings(pinned={"model.layers.9.q_proj": "fp8"}))
    with pytest.raises(ValueError, match="'max_share'"):
        solve_plan(costs, flops, 0.5, SolverSettings(max_share=0.4))
    with pytest.raises(ValueError, match="must be a finite number >= 0"):
        solve_plan(costs, {**flops, fqns[0]: -1.0}, 0.5)
    with pytest.raises(ValueError, match="every layer has 0 FLOPs"):
        solve_plan(costs, {f: 0.0 for f in flops}, 0.5)
    no_fp4 = {**costs, fqns[0]: {"fp8": 1.0}}
    with pytest.raises(ValueError, match=f"layer '{fqns[0]}' precision 'fp4' must be a finite number"):
        solve_plan(no_fp4, flops, 0.5)
    with pytest.raises(ValueError, match="infeasible"):
        solve_plan(costs, flops, 0.9, SolverSettings(allowed=("bf16", "fp8", "fp4"), compute_budget=0.2))
    with pytest.raises(ValueError, match="per_gemm=True"):
        solve_plan(costs, flops, 0.5, per_gemm=True)


# ------------------------------------------------------------------------------------------------------
# Stats artifacts and baselines
# ------------------------------------------------------------------------------------------------------
def make_stats(n_blocks=3, seed=0, lam=10.0):
    rng = random.Random(seed)
    layers = {}
    for b in range(n_blocks):
        for name in NAMES:
            rec = {"flops": rng.uniform(1e9, 5e9), "nonfinite": False}
            for field in ("fld", "bwd", "quant_err", "rel_quant_err"):
                rec[field] = {"fp8": rng.random() * 1e-3, "fp4": rng.random()}
            part = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            layers[f"model.layers.{b}.{part}.{name}"] = rec
    return {"format": "snip_ds.stats/1", "step": 100, "lr": 3e-4, "world_size": 2, "estimator": "mc_fisher",
            "lambda": lam, "layers": layers}


def test_costs_from_stats_formula_and_lambda_default():
    stats = make_stats()
    sc = costs_from_stats(stats, 100.0)
    fqn = sorted(stats["layers"])[0]
    rec = stats["layers"][fqn]
    assert sc.costs[fqn]["fp4"] == pytest.approx(rec["fld"]["fp4"] + 100.0 * rec["bwd"]["fp4"])
    assert sc.costs[fqn]["bf16"] == 0.0
    assert sc.flops[fqn] == rec["flops"] and sc.pinned == {}
    default = costs_from_stats(stats)
    assert default.costs[fqn]["fp8"] == pytest.approx(rec["fld"]["fp8"] + 10.0 * rec["bwd"]["fp8"])
    g = costs_from_stats(stats, 100.0, per_gemm=True).costs[fqn]["fp4"]
    assert g["fprop"] == pytest.approx(rec["fld"]["fp4"])
    assert g["dgrad"] == pytest.approx(50.0 * rec["bwd"]["fp4"]) == pytest.approx(g["wgrad"])


def test_nonfinite_layers_are_pinned_to_fp8_with_warning():
    stats = make_stats()
    fqns = sorted(stats["layers"])
    stats["layers"][fqns[0]]["nonfinite"] = True
    stats["layers"][fqns[1]]["bwd"]["fp4"] = float("nan")
    with pytest.warns(RuntimeWarning, match="2 layer"):
        sc = costs_from_stats(stats)
    assert sc.pinned == {fqns[0]: "fp8", fqns[1]: "fp8"}
    with pytest.warns(RuntimeWarning):
        (plan,) = solve_baseline("best", stats, 0.5)
    assert plan.assignment[fqns[0]] == plan.assignment[fqns[1]] == "fp8"


def test_baselines():
    stats = make_stats(n_blocks=4)
    fqns = sorted(stats["layers"])
    flops = {f: stats["layers"][f]["flops"] for f in fqns}
    target = 0.45  # first_last_fp8 pins 2 of 4 blocks: at most ~0.5 is reachable
    plans = {m: solve_baseline(m, stats, target, seed=3, num_random=3) for m in METHODS}
    assert [len(v) for v in plans.values()] == [1, 3, 1, 1, 1, 1, 1, 1]
    for m, ps in plans.items():
        for p in ps:
            assert p.method == m and p.meta["rho"] == target
            if not m.startswith("uniform") and m != "last_k_fp8":
                _assert_valid(p, flops, target)
    assert plans["uniform_fp8"][0].fp4_share == 0.0 and plans["uniform_fp4"][0].fp4_share == 1.0
    # best == the ILP on FLD + λ BWD; quant_err == the ILP on the quant_err table.
    sc = costs_from_stats(stats)
    assert plans["best"][0].digest() == solve_plan(sc.costs, sc.flops, target).digest()
    qe = {f: {p: stats["layers"][f]["quant_err"].get(p, 0.0) for p in ("fp8", "fp4")} for f in fqns}
    assert plans["quant_err"][0].digest() == solve_plan(qe, flops, target).digest()
    # random: seeds 3, 4, 5, reproducible and different from each other.
    assert [p.meta["seed"] for p in plans["random"]] == [3, 4, 5]
    assert len({p.digest() for p in plans["random"]}) == 3
    assert solve_baseline("random", stats, target, seed=4)[0].digest() == plans["random"][1].digest()
    # first_last_fp8: blocks 0 and 3 in fp8, the rest as solved.
    for f, p in plans["first_last_fp8"][0].assignment.items():
        if block_index(f) in (0, 3):
            assert p == "fp8"
    with pytest.raises(ValueError, match="unknown method 'snip'.*valid methods are best, random"):
        solve_baseline("snip", stats, target)


def test_quant_err_per_gemm_prices_each_gemm_by_its_two_operands():
    """Per-GEMM quant_err: fprop carries X and W, dgrad G_Y and W, wgrad G_Y and X, each halved, so a layer's
    three GEMMs sum to its per-layer cost; the baseline is the ILP on that table; old artifacts are refused."""
    stats = make_stats(n_blocks=2)
    rng = random.Random(7)
    for rec in stats["layers"].values():
        for field in ("quant_err", "rel_quant_err"):
            parts = {o: {"fp8": rng.random() * 1e-3, "fp4": rng.random()} for o in "xwg"}
            for o, table in parts.items():
                rec[f"{field}_{o}"] = table
            rec[field] = {p: sum(parts[o][p] for o in "xwg") for p in ("fp8", "fp4")}
    validate_stats(stats)
    fqn = sorted(stats["layers"])[0]
    rec = stats["layers"][fqn]
    for field in ("quant_err", "rel_quant_err"):
        sc = quant_err_costs(stats, field, per_gemm=True)
        for p in ("fp8", "fp4"):
            x, w, g = (rec[f"{field}_{o}"][p] for o in "xwg")
            assert sc.costs[fqn][p] == pytest.approx({"fprop": (x + w) / 2, "dgrad": (g + w) / 2,
                                                      "wgrad": (g + x) / 2})
            assert sum(sc.costs[fqn][p].values()) == pytest.approx(rec[field][p])
        assert quant_err_costs(stats, field).costs[fqn]["fp4"] == rec[field]["fp4"]  # per layer: the sum
        plan = solve_baseline(field, stats, 0.4, cost=CostSettings(per_gemm=True))[0]
        assert plan.per_gemm
        assert plan.digest() == solve_plan(sc.costs, sc.flops, 0.4, per_gemm=True).digest()
    del stats["layers"][fqn]["quant_err_g"]
    with pytest.raises(ValueError, match=r"lack quant_err_g, needed for per-GEMM quant_err"):
        solve_baseline("quant_err", stats, 0.4, cost=CostSettings(per_gemm=True))
    solve_baseline("quant_err", stats, 0.4)  # per layer needs only the sum
    stats["layers"][fqn]["rel_quant_err_w"] = {"fp4": "big"}
    with pytest.raises(ValueError, match=r"rel_quant_err_w.fp4 must be a number"):
        validate_stats(stats)


def test_last_k_fp8_keeps_the_last_blocks_nearest_the_share():
    """The rule: the last k blocks in fp8, the rest in fp4, k the one whose share is nearest ρ (ties: more
    FP8); pins (non-finite statistics, the user's) stay; per GEMM every GEMM of a layer alike."""
    stats = make_stats(n_blocks=4)
    for rec in stats["layers"].values():
        rec["flops"] = 1e9  # every block a quarter of the FLOPs: shares 1, 0.75, 0.5, 0.25, 0
    fqns = sorted(stats["layers"])
    for target, k in ((0.75, 1), (0.7, 1), (0.6, 2), (0.625, 2), (0.95, 0), (0.0, 4)):
        plan = solve_baseline("last_k_fp8", stats, target)[0]
        assert plan.meta["k"] == k and plan.meta["blocks"] == 4 and plan.status == "fixed", target
        assert plan.fp4_share == pytest.approx(1 - k / 4) and plan.meta["rho"] == target
        assert all(p == ("fp8" if block_index(f) >= 4 - k else "fp4") for f, p in plan.assignment.items())
    bad = fqns[0]  # block 0: non-finite, pinned to fp8 like in every solved method
    stats["layers"][bad]["fld"]["fp4"] = float("nan")
    with pytest.warns(RuntimeWarning):
        plan = solve_baseline("last_k_fp8", stats, 0.75, solver=SolverSettings(pinned={fqns[1]: "bf16"}))[0]
    assert plan.assignment[bad] == "fp8" and plan.assignment[fqns[1]] == "bf16" and plan.meta["k"] == 1
    assert plan.fp4_share == pytest.approx(0.75 - 2 / len(fqns))
    per_gemm = solve_baseline("last_k_fp8", stats, 0.75, CostSettings(per_gemm=True))[0]
    assert per_gemm.assignment[fqns[-1]] == {"fprop": "fp8", "dgrad": "fp8", "wgrad": "fp8"}
    assert per_gemm.assignment[fqns[2]] == {"fprop": "fp4", "dgrad": "fp4", "wgrad": "fp4"}



def test_last_k_fp8_below_the_share_warns_once_per_solve_with_the_share_reached():
    """ρ is a minimum: where the nearest whole number of blocks leaves the FP4 share below it, each solve warns
    once, naming the share reached; a share that meets ρ (or passes it) is no warning."""
    stats = make_stats(n_blocks=4)
    for rec in stats["layers"].values():
        rec["flops"] = 1e9  # shares 1, 0.75, 0.5, 0.25, 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            plan = solve_baseline("last_k_fp8", stats, 0.6)[0]
    assert plan.fp4_share == pytest.approx(0.5) and plan.meta["k"] == 2
    assert len(caught) == 2 and all(w.category is RuntimeWarning for w in caught)
    assert "FP4 share reached, 0.5000" in str(caught[0].message) and "efficiency_saving 0.6000" in str(
        caught[0].message) and "1 would give 0.7500" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for target in (0.75, 0.7, 0.0):  # met exactly, passed, no FP4 asked
            assert solve_baseline("last_k_fp8", stats, target)[0].fp4_share >= target

def test_first_last_unreachable_target_is_an_error():
    stats = make_stats(n_blocks=3)
    with pytest.raises(ValueError, match="unreachable"):
        solve_baseline("first_last_fp8", stats, 0.5)  # 2 of 3 blocks pinned: ~1/3 reachable at most


def test_baselines_same_share_with_max_share():
    stats = make_stats(n_blocks=4)
    shares = [solve_baseline(m, stats, 0.5, solver=SolverSettings(max_share=0.52))[0].fp4_share
              for m in ("best", "quant_err", "rel_quant_err", "random")]
    assert all(0.5 - TOL <= s <= 0.52 + TOL for s in shares)


def test_load_stats_round_trip_and_errors(tmp_path):
    stats = make_stats()
    path = tmp_path / "stats.json"
    path.write_text(json.dumps(stats))
    assert load_stats(str(path)) == stats
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_stats(str(tmp_path / "missing.json"))
    path.write_text("{oops")
    with pytest.raises(ValueError, match=f"{path}: not valid JSON"):
        load_stats(str(path))
    fqn = sorted(stats["layers"])[0]
    cases = [
        (lambda s: s.update(format="other"), "field 'format'"),
        (lambda s: s.update(step="ten"), "field 'step' must be int"),
        (lambda s: s.update(layers={}), "field 'layers'"),
        (lambda s: s["layers"][fqn].pop("fld"), f"layers\\['{fqn}'\\] lacks field 'fld'"),
        (lambda s: s["layers"][fqn].update(flops=-1), "flops must be a positive"),
        (lambda s: s["layers"][fqn]["bwd"].update(fp6=1.0), "unknown precision 'fp6'"),
        (lambda s: s["layers"][fqn]["bwd"].pop("fp4"), "bwd lacks precision"),
        (lambda s: s["layers"][fqn]["fld"].update(fp4="big"), "fld.fp4 must be a number"),
        (lambda s: s["layers"][fqn].update(nonfinite="no"), "nonfinite must be true or false"),
    ]
    for mutate, match in cases:
        bad = json.loads(json.dumps(stats))
        mutate(bad)
        with pytest.raises(ValueError, match=match):
            validate_stats(bad, source="s.json")


def test_dgrad_upstream_prices_dgrad_by_its_own_estimate():
    """dgrad='upstream': fprop FLD, wgrad the whole λ·BWD, dgrad λ·bwd_dgrad / calibration; a cheap dgrad
    goes to FP4 first; wrong combinations and missing fields are refused with the reason."""
    stats = make_stats(n_blocks=2)
    for i, rec in enumerate(sorted(stats["layers"])):
        stats["layers"][rec]["bwd_dgrad"] = {"fp8": 1e-9, "fp4": 1e-6 * (i + 1)}
    validate_stats(stats)
    fqn = sorted(stats["layers"])[1]
    rec = stats["layers"][fqn]
    g = costs_from_stats(stats, 100.0, per_gemm=True, dgrad="upstream", dgrad_calibration=4.0).costs[fqn]["fp4"]
    assert g == pytest.approx({"fprop": rec["fld"]["fp4"], "wgrad": 100.0 * rec["bwd"]["fp4"],
                               "dgrad": 25.0 * rec["bwd_dgrad"]["fp4"]})
    # dgrad far cheaper than the rest: at a share of 1/3 every dgrad GEMM and nothing else runs in FP4
    (plan,) = solve_baseline("best", stats, 1 / 3, cost=CostSettings(lam=100.0, per_gemm=True, dgrad="upstream"))
    assert all(a == {"fprop": "fp8", "dgrad": "fp4", "wgrad": "fp8"} for a in plan.assignment.values())
    assert plan.meta["dgrad"] == "upstream" and plan.meta["dgrad_calibration"] == 1.0
    with pytest.raises(ValueError, match="needs per_gemm=True"):
        costs_from_stats(stats, per_gemm=False, dgrad="upstream")
    with pytest.raises(ValueError, match="dgrad must be one of split, upstream"):
        costs_from_stats(stats, per_gemm=True, dgrad="half")
    with pytest.raises(ValueError, match="dgrad_calibration must be a finite number > 0"):
        costs_from_stats(stats, per_gemm=True, dgrad="upstream", dgrad_calibration=0.0)
    del stats["layers"][fqn]["bwd_dgrad"]
    with pytest.raises(ValueError, match=r"lack field 'bwd_dgrad'.*collected with bwd_propagated=True"):
        solve_baseline("best", stats, 0.3, cost=CostSettings(per_gemm=True, dgrad="upstream"))


def test_systematic_bwd_prices_only_the_persistent_part():
    """bwd_key='bwd_bias' (the "systematic" estimate): C = FLD + λ·bwd_bias, split per GEMM like BWD; a
    statistics file without the field is refused naming it; an unknown key lists the valid ones."""
    stats = make_stats(n_blocks=2)
    for i, fqn in enumerate(sorted(stats["layers"])):
        stats["layers"][fqn]["bwd_bias"] = {"fp8": 2e-7, "fp4": 1e-7 * (i % 3)}  # FP4+SR can be below FP8
    validate_stats(stats)
    fqn = sorted(stats["layers"])[1]
    rec = stats["layers"][fqn]
    sc = costs_from_stats(stats, 100.0, bwd_key="bwd_bias")
    assert sc.costs[fqn]["fp4"] == pytest.approx(rec["fld"]["fp4"] + 100.0 * rec["bwd_bias"]["fp4"])
    assert sc.costs[fqn]["fp8"] == pytest.approx(rec["fld"]["fp8"] + 100.0 * rec["bwd_bias"]["fp8"])
    g = costs_from_stats(stats, 100.0, per_gemm=True, bwd_key="bwd_bias").costs[fqn]["fp4"]
    assert g["dgrad"] == pytest.approx(50.0 * rec["bwd_bias"]["fp4"]) == pytest.approx(g["wgrad"])
    (plan,) = solve_baseline("best", stats, 0.5, cost=CostSettings(lam=100.0, bwd_key="bwd_bias"))
    assert plan.meta["bwd_key"] == "bwd_bias"
    (brute,) = solve_baseline("best", stats, 0.5, cost=CostSettings(lam=100.0))
    assert "bwd_key" not in brute.meta
    with pytest.raises(ValueError, match="bwd_key must be one of bwd, bwd_bias, bwd_propagated"):
        costs_from_stats(stats, bwd_key="bwd_noise")
    del stats["layers"][fqn]["bwd_bias"]
    with pytest.raises(ValueError, match="lack field 'bwd_bias'"):
        costs_from_stats(stats, bwd_key="bwd_bias")


def _lp_bound_regret(costs, flops, target):
    """The LP relaxation's optimum of a per-layer fp8/fp4 instance in regret terms (cost above each layer's
    cheaper precision), computed independently of CBC: a fractional knapsack, filled by cost per FLOP."""
    total = sum(flops.values())
    share, bound, rest = 0.0, 0.0, []
    for f, c in costs.items():
        delta, w = c["fp4"] - c["fp8"], flops[f] / total
        if delta <= 0:
            share += w  # fp4 is free or better: taken, regret 0
        elif w > 0:  # a layer of no FLOPs and dearer fp4 never helps the share
            rest.append((delta / w, delta, w))
    for ratio, delta, w in sorted(rest):
        if share >= target:
            break
        take = min(1.0, (target - share) / w)
        bound += take * delta
        share += take * w
    return bound


def test_moe_scale_instance_solves_within_the_large_instance_gap():
    """Thousands of layers of distinct FLOPs (experts with their routed tokens, some with none) are solved to
    LARGE_INSTANCE_GAP: the plan's regret is within that relative distance of the LP bound, which is below the
    optimum; the gap is recorded in the plan. Smaller instances stay exact and record nothing new."""
    from snip_ds.planner import ilp
    rng = random.Random(5)
    n = ilp.LARGE_INSTANCE + 904
    flops = {f"model.layers.{i // 64}.mlp.experts.{i % 64}.down":
             float(0 if rng.random() < 0.05 else rng.randint(1, 10 ** 6)) for i in range(n)}
    costs = {f: {"fp8": rng.uniform(0, 1), "fp4": rng.uniform(0, 2)} for f in flops}
    plan = solve_plan(costs, flops, 0.75)
    assert plan.status == "optimal" and plan.meta["mip_gap"] == ilp.LARGE_INSTANCE_GAP
    assert plan.fp4_share >= 0.75 - 1e-9
    regret = sum(costs[f][p] - min(costs[f].values()) for f, p in plan.assignment.items())
    bound = _lp_bound_regret(costs, flops, 0.75)
    assert bound <= regret <= bound + ilp.LARGE_INSTANCE_GAP * regret + 1e-9
    for f, p in plan.assignment.items():  # a layer with no FLOPs takes its cheaper precision
        if flops[f] == 0:
            assert costs[f][p] == min(costs[f].values())
    small = dict(list(flops.items())[:200])
    small_plan = solve_plan({f: costs[f] for f in small}, small, 0.75)
    assert "mip_gap" not in small_plan.meta and small_plan.status == "optimal"
    with pytest.raises(ValueError, match="'mip_gap' must be a number in \\(0, 1\\)"):
        solve_plan(costs, flops, 0.75, SolverSettings(mip_gap=0.0))


def test_pinned_globs_expand_over_the_layers_and_exact_names_win():
    from snip_ds.planner.problem import expand_pinned

    names = [f"m.layers.{b}.mlp.experts.{e}.{p}" for b in range(2) for e in range(3) for p in ("gate_up_proj", "down_proj")]
    names += ["m.layers.0.self_attn.q_proj"]
    got = expand_pinned({"m.layers.*.mlp.experts.*.down_proj": "fp8", "m.layers.1.mlp.experts.2.down_proj": "fp4"},
                        names)
    assert got == {**{f"m.layers.{b}.mlp.experts.{e}.down_proj": "fp8" for b in range(2) for e in range(3)},
                   "m.layers.1.mlp.experts.2.down_proj": "fp4"}
    assert expand_pinned({"m.layers.0.self_attn.q_proj": "bf16"}, names) == {"m.layers.0.self_attn.q_proj": "bf16"}
    with pytest.raises(ValueError, match=r"'pinned' pattern '\*\.o_proj' matches no layer"):
        expand_pinned({"*.o_proj": "fp8"}, names)
    with pytest.raises(ValueError, match=r"'pinned' patterns 'm.layers.0.\*' and '\*.q_proj' both match layer "
                                         r"'m.layers.0.self_attn.q_proj' with different precisions"):
        expand_pinned({"m.layers.0.*": "fp8", "*.q_proj": "fp4"}, names)
    with pytest.raises(ValueError, match="not in the cost table"):
        expand_pinned({"m.layers.9.mlp.experts.0.down_proj": "fp8"}, names)


def test_pinned_glob_holds_every_layer_it_matches_in_the_plan():
    costs = {f"l.{i}.{p}": {"fp8": 0.0, "fp4": 1e-3 * (i + 1)} for i in range(6) for p in ("a", "b")}
    flops = {f: 1.0 for f in costs}
    plan = solve_plan(costs, flops, 0.4, SolverSettings(pinned={"l.*.b": "fp8"}))
    assert all(plan.assignment[f"l.{i}.b"] == "fp8" for i in range(6))
    assert plan.fp4_share >= 0.4
