"""The grouping of snip_ds.experiments.expert_plans: MoE (expert, projection) pairs merged into one pseudo-layer per
(experts path, projection) with summed costs and FLOPs, and a plan over the groups expanded back to every pair.
Pure dicts, no torch, no training (the solver only where the merged ILP is checked against the per-pair one)."""
import pytest

from snip_ds.experiments.expert_plans import (differing_layers, expand_assignment, expert_groups, group_name,
                                              is_shared, merge_expert_groups, solve_arms)
from snip_ds.planner import costs_from_stats
from snip_ds.planner.costs import predicted_divergence

EXP = "model.layers.{b}.mlp.experts"


def _pair(flops, fld4, bwd4, tokens, **extra):
    return dict(flops=float(flops), fld={"fp8": fld4 / 100, "fp4": fld4}, bwd={"fp8": bwd4 / 100, "fp4": bwd4},
                nonfinite=False, routed_tokens=float(tokens), **extra)


def _stats():
    """Two blocks, 3 experts, two projections each, and one attention linear per block."""
    layers = {}
    for b in (0, 1):
        layers[f"model.layers.{b}.self_attn.q_proj"] = dict(flops=600.0, fld={"fp8": 0.01, "fp4": 1.0},
                                                           bwd={"fp8": 0.0, "fp4": 0.1}, nonfinite=False)
        for e, tokens in enumerate((10, 30, 20)):  # the expert with 30 tokens is the expensive one
            scale = 1.0 + e + b
            layers[f"{EXP.format(b=b)}.{e}.gate_up_proj"] = _pair(tokens * 20, 0.1 * scale, 0.02 * scale, tokens)
            layers[f"{EXP.format(b=b)}.{e}.down_proj"] = _pair(tokens * 10, 0.05 * scale, 0.01 * scale, tokens)
    return {"lambda": 2.0, "step": 7, "layers": layers}


def test_group_name_and_refusal():
    assert group_name("model.layers.0.mlp.experts.3.gate_up_proj") == "model.layers.0.mlp.experts.*.gate_up_proj"
    with pytest.raises(ValueError, match="not an expert pair"):
        group_name("model.layers.0.mlp.down_proj")


def test_groups_hold_the_pairs_of_one_block_and_projection_in_expert_order():
    stats = _stats()
    # expert 10 sorts after expert 2 numerically, not as text
    stats["layers"][f"{EXP.format(b=0)}.10.down_proj"] = _pair(5, 0.1, 0.1, 1)
    groups = expert_groups(stats["layers"])
    assert sorted(groups) == sorted(f"{EXP.format(b=b)}.*.{p}" for b in (0, 1) for p in ("gate_up_proj", "down_proj"))
    assert groups[f"{EXP.format(b=0)}.*.down_proj"] == [f"{EXP.format(b=0)}.{e}.down_proj" for e in (0, 1, 2, 10)]
    assert all("self_attn" not in p for ps in groups.values() for p in ps)  # dense layers belong to no group


def test_merged_records_are_sums_and_dense_layers_are_untouched():
    stats = _stats()
    groups = expert_groups(stats["layers"])
    merged = merge_expert_groups(stats, groups)
    assert merged["lambda"] == 2.0 and merged["step"] == 7
    assert set(merged["layers"]) == set(groups) | {f"model.layers.{b}.self_attn.q_proj" for b in (0, 1)}
    q = "model.layers.1.self_attn.q_proj"
    assert merged["layers"][q] is stats["layers"][q]
    g = merged["layers"][f"{EXP.format(b=1)}.*.gate_up_proj"]
    pairs = [stats["layers"][f"{EXP.format(b=1)}.{e}.gate_up_proj"] for e in range(3)]
    assert g["flops"] == sum(p["flops"] for p in pairs) == 1200.0
    assert g["routed_tokens"] == 60.0
    assert g["fld"]["fp4"] == pytest.approx(sum(p["fld"]["fp4"] for p in pairs))
    assert g["bwd"]["fp8"] == pytest.approx(sum(p["bwd"]["fp8"] for p in pairs))
    assert g["nonfinite"] is False
    # the planner's costs of the pseudo-layer are the sums of its pairs' costs at every precision
    per_pair = costs_from_stats(stats, 2.0).costs
    per_group = costs_from_stats(merged, 2.0).costs
    for p in ("fp8", "fp4"):
        assert per_group[f"{EXP.format(b=1)}.*.gate_up_proj"][p] == pytest.approx(
            sum(per_pair[f"{EXP.format(b=1)}.{e}.gate_up_proj"][p] for e in range(3)))
    # a non-finite pair makes its group non-finite (the planner pins it to fp8)
    stats["layers"][f"{EXP.format(b=0)}.1.down_proj"]["nonfinite"] = True
    assert merge_expert_groups(stats, groups)["layers"][f"{EXP.format(b=0)}.*.down_proj"]["nonfinite"] is True


def test_expand_gives_every_pair_its_groups_precision():
    stats = _stats()
    groups = expert_groups(stats["layers"])
    assignment = {name: ("fp4" if "gate_up" in name else "fp8") for name in groups}
    assignment["model.layers.0.self_attn.q_proj"] = "fp8"
    assignment["model.layers.1.self_attn.q_proj"] = {"fprop": "fp8", "dgrad": "fp4", "wgrad": "fp4"}
    out = expand_assignment(assignment, groups)
    assert set(out) == set(stats["layers"])
    assert all(out[p] == ("fp4" if "gate_up" in p else "fp8") for ps in groups.values() for p in ps)
    assert out["model.layers.1.self_attn.q_proj"] == {"fprop": "fp8", "dgrad": "fp4", "wgrad": "fp4"}
    assert is_shared(out, groups)
    out[f"{EXP.format(b=1)}.2.down_proj"] = "fp4"
    assert not is_shared(out, groups)
    with pytest.raises(ValueError, match="no precision for group"):
        expand_assignment({"model.layers.0.self_attn.q_proj": "fp8"}, groups)


def test_differing_layers():
    a = {"x": "fp8", "y": "fp4", "z": "fp4"}
    b = {"x": "fp4", "y": "fp4", "z": "fp8"}
    assert differing_layers(a, b, ["x", "y"]) == ["x"]
    assert differing_layers(a, b, ["x", "y", "z"]) == ["x", "z"]


def test_both_arms_at_one_share_and_per_expert_never_predicted_worse():
    stats = _stats()
    arms = solve_arms(stats, 0.5, lam=2.0)
    groups = arms["groups"]
    shared, per_expert = arms["shared"], arms["per_expert"]
    assert shared.fp4_share == pytest.approx(arms["share"]) and per_expert.fp4_share == pytest.approx(arms["share"])
    assert arms["share"] >= 0.5
    assert is_shared(shared.assignment, groups)
    assert set(shared.assignment) == set(per_expert.assignment) == set(stats["layers"])

    def objective(plan):
        fld, bwd = predicted_divergence(stats["layers"], plan.assignment)
        return fld + 2.0 * bwd
    # the merged ILP's objective is the expanded plan's objective over the pairs (costs are additive) ...
    assert shared.objective == pytest.approx(objective(shared))
    # ... and the per-expert ILP has the shared plan among its choices
    assert objective(per_expert) <= objective(shared) + 1e-12
    # here the freedom is used: the per-expert plan splits a group
    assert not is_shared(per_expert.assignment, groups)


def test_solve_arms_refuses_statistics_without_experts():
    stats = {"lambda": 2.0, "layers": {"model.layers.0.self_attn.q_proj": dict(
        flops=1.0, fld={"fp8": 0.0, "fp4": 1.0}, bwd={"fp8": 0.0, "fp4": 1.0}, nonfinite=False)}}
    with pytest.raises(ValueError, match="no MoE expert pairs"):
        solve_arms(stats, 0.5, lam=2.0)


def test_trained_share_weighs_each_pair_by_the_routing_of_the_run():
    from snip_ds.experiments.expert_plans import trained_share
    dense = {"attn": 100.0}
    per_token = {"e.0.up": 2.0, "e.1.up": 2.0}
    plan = {"attn": "fp8", "e.0.up": "fp4", "e.1.up": "fp8"}
    assert trained_share(plan, dense, per_token, {"e.0.up": 50, "e.1.up": 50}) == pytest.approx(100 / 300)
    assert trained_share(plan, dense, per_token, {"e.0.up": 100, "e.1.up": 0}) == pytest.approx(200 / 300)
    assert trained_share(plan, dense, per_token, {}) == 0.0  # no token routed: the FP4 pair does no work
