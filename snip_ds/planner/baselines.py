"""Solving a plan by any method of :data:`~snip_ds.planner.costs.METHODS` from a statistics artifact: the
costs of :func:`~snip_ds.planner.costs.method_costs`, the pins each method adds, one ILP
(:func:`~snip_ds.planner.ilp.solve_plan`) for all of them.

This module is pure data: no torch, no torch.distributed.
"""
from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any, Mapping

from snip_ds.plan import GEMMS, Plan, fp4_share
from snip_ds.planner.costs import METHODS, CostSettings, method_costs, random_costs
from snip_ds.planner.ilp import SolverSettings, solve_plan
from snip_ds.planner.problem import expand_pinned
from snip_ds.types import block_index


def solve_baseline(method: str, stats: Mapping, target: float, cost: CostSettings | None = None,
                   solver: SolverSettings | None = None, *, previous: Plan | Mapping | None = None, seed: int = 0,
                   num_random: int = 1) -> list[Plan]:
    """Solves one of :data:`METHODS` from a statistics artifact with the same ILP and share constraint.

    ``cost`` (:class:`~snip_ds.planner.costs.CostSettings`) says how ``best`` and ``first_last_fp8`` price
    layers and whether plans are per GEMM; ``solver`` (:class:`~snip_ds.planner.ilp.SolverSettings`: allowed
    precisions, pins, flip penalty against ``previous``, ``max_share``, ``compute_budget``, the time limit)
    is passed to :func:`~snip_ds.planner.ilp.solve_plan` for every method but the uniform ones, with the
    pins each method adds.

    Methods:
        best: SNIP costs FLD + λ·BWD (:func:`~snip_ds.planner.costs.costs_from_stats`, as ``cost`` says).
        random: seeded uniform random costs; ``num_random`` plans for seeds ``seed, seed+1, ...``.
        quant_err / rel_quant_err: costs from the artifact's ``quant_err`` / ``rel_quant_err``
            (:func:`~snip_ds.planner.costs.quant_err_costs`; per-GEMM from the per-operand errors).
        uniform_fp8 / uniform_fp4: every layer at that precision (``target`` is not enforced; recorded).
        first_last_fp8: first and last decoder blocks pinned to fp8; the rest solved with the SNIP costs
            (so it differs from ``best`` only by the pin rule).
        last_k_fp8: a rule, not a solve (:func:`last_k_plan`): the last k decoder blocks in fp8 and every other
            layer in fp4, k chosen so that the FP4 share comes as close to ``target`` as whole blocks allow
            (the share reached is the plan's ``fp4_share``); only the solver's pins apply to it.

    Returns:
        A list of plans (one, or ``num_random`` for ``random``). Layers with non-finite statistics are
        pinned to fp8 in every method except the uniform ones.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid methods are {', '.join(METHODS)}")
    if not isinstance(num_random, int) or num_random < 1:
        raise ValueError(f"'num_random' must be a positive integer, got {num_random!r}")
    fqns = sorted(stats["layers"])
    flops = {fqn: float(stats["layers"][fqn]["flops"]) for fqn in fqns}
    meta = {"rho": float(target), "step": stats.get("step")}

    if method in ("uniform_fp8", "uniform_fp4"):
        precision = method.split("_")[1]
        plan = Plan.uniform(fqns, precision, flops)
        return [Plan(assignment=plan.assignment, fp4_share=plan.fp4_share, objective=None, status="fixed",
                     method=method, meta=meta)]

    cost = CostSettings() if cost is None else cost
    solver = SolverSettings() if solver is None else solver
    lam, per_gemm, bwd_key, dgrad = cost.lam, cost.per_gemm, cost.bwd_key, cost.dgrad
    sc = method_costs(method, stats, cost, seed=seed)
    if method in ("best", "first_last_fp8"):
        meta["lambda"] = float(stats["lambda"] if lam is None else lam)
        if bwd_key != "bwd":
            meta["bwd_key"] = bwd_key
        if cost.forward_drift:
            meta["forward_drift"] = True
        if cost.fwd_lambda is not None:
            meta["fwd_lambda"] = float(cost.fwd_lambda)
        if dgrad != "split":
            meta.update(dgrad=dgrad, dgrad_calibration=float(cost.dgrad_calibration))
    pins = {**sc.pinned, **expand_pinned(solver.pinned or {}, fqns)}  # the user's (globs expanded) win
    if method == "first_last_fp8":
        blocks = {fqn: block_index(fqn) for fqn in fqns}
        ends = {min(blocks.values()), max(blocks.values())}
        pins = {**{fqn: "fp8" for fqn, b in blocks.items() if b in ends}, **pins}

    if method == "last_k_fp8":
        return [last_k_plan(fqns, sc.flops, target, pins, per_gemm, meta)]

    common = dict(previous=previous, per_gemm=per_gemm, method=method)
    solver = replace(solver, pinned=pins)
    if method != "random":
        return [solve_plan(sc.costs, sc.flops, target, solver, meta=meta, **common)]
    return [solve_plan(random_costs(fqns, s, per_gemm), sc.flops, target, solver, meta={**meta, "seed": s}, **common)
            for s in range(seed, seed + num_random)]


def last_k_plan(fqns: list, flops: Mapping[str, float], target: float, pins: Mapping[str, Any],
                per_gemm: bool = False, meta: Mapping[str, Any] | None = None) -> Plan:
    """The "last k blocks in FP8" rule (NVIDIA's NVFP4 pretraining recipe keeps the last blocks in high
    precision by rule): every layer of the last ``k`` decoder blocks in fp8, every other in fp4, ``pins`` (the
    layers with non-finite statistics, those no call reached, the user's) as pinned. ``k`` (0 to all blocks) is
    the one whose FP4 share is nearest ``target``; between two equally near, the larger k (more FP8). The plan
    records ``k`` and the block count in its meta; its ``fp4_share`` is the share reached, not ``target``. A share
    below ``target`` (ρ is a minimum) is one ``RuntimeWarning`` naming the share reached."""
    blocks = {fqn: block_index(fqn) for fqn in fqns}
    order = sorted(set(blocks.values()))

    def assignment(k: int) -> dict:
        kept = set(order[len(order) - k:]) if k else set()
        out = {f: pins.get(f, "fp8" if blocks[f] in kept else "fp4") for f in fqns}
        return {f: {g: p for g in GEMMS} if per_gemm and isinstance(p, str) else p for f, p in out.items()}

    reached = [(k, fp4_share(assignment(k), flops)) for k in range(len(order) + 1)]
    # nearest share first; shares equally near up to round-off (equal blocks around ρ) go to the larger k
    k, share = min(reached, key=lambda ks: (round(abs(ks[1] - target), 9), -ks[0]))
    if round(share - target, 9) < 0:
        above = f"; {k - 1} would give {reached[k - 1][1]:.4f}" if k else ""
        warnings.warn(f"last_k_fp8: the FP4 share reached, {share:.4f} (the last {k} of {len(order)} blocks in "
                      f"fp8), is below efficiency_saving {target:.4f}, as near as whole blocks come{above}",
                      RuntimeWarning, stacklevel=3)
    return Plan(assignment=assignment(k), fp4_share=share, objective=None, status="fixed", method="last_k_fp8",
                meta={**(meta or {}), "k": k, "blocks": len(order)})
