"""A greedy knapsack plan for the ILP's problem (:mod:`snip_ds.planner.problem`): CBC's start on a large
instance, and the plan when CBC finds none in its time (status ``"greedy_fallback"``).

Pure data: no torch, no torch.distributed.
"""
from __future__ import annotations

from snip_ds.planner.problem import SHARE_TOL, Problem


def greedy_plan(prob: Problem, target, max_share, gemm_cost, compute_budget) -> dict | None:
    """Greedy knapsack: cheapest precision per unit, then cheapest moves (cost delta per FLOP) to fp4 until
    the target share holds, then back out of fp4 / into cheaper GEMMs for the upper bounds. Returns None
    when the constraints cannot be met this way."""
    choice = {u: min(prob.choices[u], key=lambda p: prob.cost[u, p]) for u in prob.units}
    w = prob.weight
    share = sum(w[u] for u in prob.units if choice[u] == "fp4")

    if share < target - SHARE_TOL:
        moves = sorted((u for u in prob.units if choice[u] != "fp4" and "fp4" in prob.choices[u] and w[u] > 0),
                       key=lambda u: (prob.cost[u, "fp4"] - prob.cost[u, choice[u]]) / w[u])
        added = []
        for u in moves:
            if share >= target - SHARE_TOL:
                break
            added.append((u, choice[u]))
            choice[u] = "fp4"
            share += w[u]
        # the last move may overshoot the target by more than earlier moves weigh: undo those the share no
        # longer needs, the dearest first
        for u, before in sorted(added[:-1], key=lambda m: prob.cost[m[0], "fp4"] - prob.cost[m],
                                reverse=True):
            if share - w[u] >= target - SHARE_TOL:
                choice[u] = before
                share -= w[u]

    if max_share is not None and share > max_share + SHARE_TOL:
        def back_cost(u):
            alts = [p for p in prob.choices[u] if p != "fp4"]
            return min(alts, key=lambda p: prob.cost[u, p]) if alts else None
        moves = sorted((u for u in prob.units if choice[u] == "fp4" and back_cost(u) and w[u] > 0),
                       key=lambda u: (prob.cost[u, back_cost(u)] - prob.cost[u, "fp4"]) / w[u])
        for u in moves:
            if share <= max_share + SHARE_TOL:
                break
            if share - w[u] >= target - SHARE_TOL:
                choice[u] = back_cost(u)
                share -= w[u]

    if compute_budget is not None:
        def compute():
            return sum(w[u] * gemm_cost[choice[u]] for u in prob.units)
        cand = []
        for u in prob.units:
            for p in prob.choices[u]:
                saved = w[u] * (gemm_cost[choice[u]] - gemm_cost[p])
                if saved > 0:
                    cand.append(((prob.cost[u, p] - prob.cost[u, choice[u]]) / saved, u, p))
        for _, u, p in sorted(cand, key=lambda t: t[0]):
            if compute() <= compute_budget + SHARE_TOL:
                break
            if gemm_cost[p] >= gemm_cost[choice[u]]:
                continue
            new_share = share + w[u] * ((p == "fp4") - (choice[u] == "fp4"))
            if max_share is None or new_share <= max_share + SHARE_TOL:
                choice[u], share = p, new_share
        if compute() > compute_budget + SHARE_TOL:
            return None

    if share < target - SHARE_TOL or (max_share is not None and share > max_share + SHARE_TOL):
        return None
    return choice
