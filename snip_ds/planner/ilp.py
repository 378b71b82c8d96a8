"""The SNIP plan solver: the integer linear program of :mod:`snip_ds.planner.problem`, solved with python-mip /
CBC over given costs (:func:`solve_plan`).

It is a knapsack. Units with equal FLOPs and choices are interchangeable, so each such class is solved as
one integer count (its cheapest switches are taken; exact, and it spares CBC the permutations that stall
it on MHA models), and without a compute budget three precisions reduce exactly to two (cheapest non-fp4
vs fp4). A 560-layer (Llama-2-70B) instance solves in tens of milliseconds, to optimality. An instance of
more than :data:`LARGE_INSTANCE` free decision units (a Mixture-of-Experts model: ~30k layers for
DeepSeek-V3, its experts' FLOPs following their routed tokens) is solved to a relative gap of
:data:`LARGE_INSTANCE_GAP` unless ``SolverSettings.mip_gap`` says otherwise: proving the last 0.1 % of a
30k-item knapsack costs CBC far more than the planning budget, and the plan it returns then is at most that
far above the optimum (``plan.meta["mip_gap"]`` records it). If CBC stops at its time limit the best
feasible solution is used (status ``"time_limit_feasible"``); if it finds none, a greedy knapsack plan is
(``"greedy_fallback"``, :mod:`snip_ds.planner.greedy`). The plan and its record: :mod:`snip_ds.planner.report`.

The costs come from :mod:`snip_ds.planner.costs`; :mod:`snip_ds.planner.baselines` solves each method.
This module is pure data: no torch, no torch.distributed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import mip

from snip_ds.options import reads
from snip_ds.plan import Plan
from snip_ds.planner.crash_handlers import kept_crash_handlers
from snip_ds.planner.greedy import greedy_plan
from snip_ds.planner.problem import (Problem, Unit, build_problem, check_allowed, check_reachable, check_share,
                                     is_number)
from snip_ds.planner.report import make_plan
from snip_ds.types import PRECISIONS

# Relative cost of one GEMM FLOP per precision (BF16 = 1): tensor-core throughput doubles per halving of
# the operand width. Used only for the optional compute-budget constraint.
GEMM_COST = {"bf16": 1.0, "fp8": 0.5, "fp4": 0.25}

EXACT_GAP = 1e-9  # CBC's relative gap for ordinary instances: optimal
LARGE_INSTANCE = 4096  # free decision units above which an instance is solved to LARGE_INSTANCE_GAP
LARGE_INSTANCE_GAP = 1e-3


def _optimize(model: mip.Model, time_limit: float) -> mip.OptimizationStatus:
    """Runs CBC (a seam so tests can force solver failures), the process's crash handlers kept."""
    with kept_crash_handlers():
        return model.optimize(max_seconds=time_limit)


def _reduced_choices(prob: Problem, u: Unit, compute_budget: float | None) -> tuple[str, ...]:
    """The choices the ILP needs for unit ``u``.

    Without a compute budget only the fp4 share couples the units, so among the non-fp4 precisions a unit
    can only ever want its cheapest: the one-hot collapses exactly to one binary (cheapest non-fp4 vs fp4).
    That keeps 3-precision instances as easy as 2-precision ones.
    """
    ch = prob.choices[u]
    if compute_budget is not None or len(ch) <= 2 or "fp4" not in ch:
        return ch
    other = min((p for p in ch if p != "fp4"), key=lambda p: prob.cost[u, p])
    return (other, "fp4")


def _binary_classes(prob: Problem, compute_budget) -> tuple[dict, list]:
    """Splits the free units into classes of interchangeable binaries and a list of one-hot units.

    Units with the same FLOPs and the same two choices differ only in cost (the share and budget
    constraints see weight and precision only; the flip penalty is already in the cost). Such a class needs
    one integer count n_c: its cheapest n_c switches are taken (exchange argument). Without this CBC can
    spend its whole time limit permuting equal-weight units (q/k/v/o of an MHA model, a layer's three
    GEMMs) without closing the gap.
    """
    classes: dict = {}
    onehot = []
    for u in prob.units:
        ch = _reduced_choices(prob, u, compute_budget)
        if len(ch) == 2:
            classes.setdefault((prob.weight[u], ch), []).append(u)
        elif len(ch) > 2:
            onehot.append(u)
    for (_, ch), units in classes.items():
        units.sort(key=lambda u: prob.cost[u, ch[1]] - prob.cost[u, ch[0]])
    return classes, onehot


def _solve_ilp(prob: Problem, target, max_share, gemm_cost, compute_budget, time_limit, mip_gap):
    """Returns (choice per unit or None, mip status, the relative gap CBC was given).

    Each class of interchangeable binary units (:func:`_binary_classes`) becomes one integer count n_c and
    continuous switches x_i in [0, 1] with Σ x_i = n_c: sorted by switch cost, the LP fills the cheapest
    first, so for every integer n_c the optimum is integral and equals the 0/1 model's. Other units with
    several choices get a one-hot of binaries.
    """
    model = mip.Model(sense=mip.MINIMIZE, solver_name=mip.CBC)
    model.verbose = 0
    model.threads = 1
    model.max_mip_gap_abs = 1e-12
    model.infeas_tol = 1e-9
    # Optimise the regret over each unit's cheapest choice (a constant shift), scaled to O(1): CBC's gap and
    # tolerances then act on the part of the objective the decision changes, even when costs are ~1e-9.
    base = {u: min(prob.cost[u, p] for p in prob.choices[u]) for u in prob.units}
    regret = {(u, p): prob.cost[u, p] - base[u] for u, p in prob.cost}
    scale = max(regret.values(), default=1.0) or 1.0

    classes, onehot = _binary_classes(prob, compute_budget)
    if mip_gap is None:
        free = sum(len(units) for units in classes.values()) + len(onehot)
        mip_gap = LARGE_INSTANCE_GAP if free > LARGE_INSTANCE else EXACT_GAP
    model.max_mip_gap = mip_gap
    sel: dict = {}  # (unit, precision) -> LinExpr or variable
    counts = {}
    for key, units in classes.items():
        ch = key[1]  # in PRECISIONS order: ch[1] is the narrower precision
        if len(units) == 1:
            xs = [model.add_var(var_type=mip.BINARY)]
            counts[key] = xs[0]
        else:
            counts[key] = model.add_var(var_type=mip.INTEGER, lb=0, ub=len(units))
            xs = [model.add_var(lb=0.0, ub=1.0) for _ in units]
            model += mip.xsum(xs) == counts[key]
        for u, x in zip(units, xs):
            sel[u, ch[1]] = x
            sel[u, ch[0]] = 1 - x
    onehot_vars = {}
    for u in onehot:
        ch = prob.choices[u]
        xs = [model.add_var(var_type=mip.BINARY) for _ in ch]
        onehot_vars[u] = xs
        model += mip.xsum(xs) == 1
        for x, p in zip(xs, ch):
            sel[u, p] = x

    model.objective = mip.minimize(mip.xsum((regret[k] / scale) * v for k, v in sel.items()))
    fp4 = [prob.weight[u] * v for (u, p), v in sel.items() if p == "fp4"]
    fixed_fp4 = sum(prob.weight[u] for u in prob.units if (u, "fp4") not in sel
                    and _reduced_choices(prob, u, compute_budget) == ("fp4",))
    if fp4:
        model += mip.xsum(fp4) >= target - fixed_fp4
        if max_share is not None:
            model += mip.xsum(fp4) <= max_share - fixed_fp4
    if compute_budget is not None:
        fixed = sum(prob.weight[u] * gemm_cost[prob.choices[u][0]] for u in prob.units
                    if len(prob.choices[u]) == 1)
        model += mip.xsum(prob.weight[u] * gemm_cost[p] * v for (u, p), v in sel.items()) <= compute_budget - fixed

    if mip_gap != EXACT_GAP:
        time_limit = _bound_the_gap(model, mip_gap, time_limit)
        # CBC starts from the greedy plan: on a large instance it may find no plan of its own in time
        start = greedy_plan(prob, target, max_share, gemm_cost, compute_budget)
        if start is not None:
            model.start = _start_values(start, classes, counts, onehot_vars, prob)
    status = _optimize(model, time_limit)
    if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE) or model.num_solutions == 0:
        return None, status, mip_gap
    choice = {u: prob.choices[u][0] for u in prob.units if len(prob.choices[u]) == 1}
    for key, units in classes.items():
        ch = key[1]
        n = int(round(counts[key].x))
        for i, u in enumerate(units):
            choice[u] = ch[1] if i < n else ch[0]
    for u, xs in onehot_vars.items():
        choice[u] = prob.choices[u][max(range(len(xs)), key=lambda i: xs[i].x)]
    return choice, status, mip_gap


def _bound_the_gap(model: mip.Model, mip_gap: float, time_limit: float) -> float:
    """Makes CBC stop within ``mip_gap`` of the optimum, relative to the objective (the regret over each unit's
    cheapest choice); returns the time left. CBC's own relative gap is taken on its objective without the
    model's constant (the ``1 - x`` terms), which can be far larger than the regret, so the gap is set as an
    absolute one: ``mip_gap`` times the LP relaxation's optimum, a lower bound on the optimum."""
    start = time.perf_counter()
    with kept_crash_handlers():
        status = model.optimize(relax=True, max_seconds=time_limit)
    if status == mip.OptimizationStatus.OPTIMAL:
        model.max_mip_gap_abs = max(mip_gap * model.objective_value, 1e-12)
    model.max_mip_gap = EXACT_GAP
    return max(time_limit - (time.perf_counter() - start), 1e-3)


def _start_values(choice: dict, classes: dict, counts: dict, onehot_vars: dict, prob: Problem) -> list:
    """A plan as CBC start values for :func:`_solve_ilp`'s integer variables: each class's count of switches
    as the plan has (CBC completes the continuous switches: its cheapest ones, the same share at no more
    cost); one-hots as chosen."""
    values = [(counts[key], float(sum(choice[u] == key[1][1] for u in units))) for key, units in classes.items()]
    for u, xs in onehot_vars.items():
        values += [(x, float(p == choice[u])) for x, p in zip(xs, prob.choices[u])]
    return values


def _none_if_empty(pinned: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ``"snip"`` section's ``pinned`` (``{}``: none) as :class:`SolverSettings` takes it."""
    return dict(pinned) or None


@dataclass(frozen=True)
class SolverSettings:
    """The constraints and limits of a solve, whatever its costs. :func:`solve_plan` checks them and names a
    bad one.

    Attributes:
        allowed: Precisions a layer may take (default ``("fp8", "fp4")``: one binary per unit; with three, a
            one-hot per unit).
        pinned: ``{fqn: precision}`` (or ``{fqn: {gemm: precision}}`` with per_gemm) fixed layers; a pinned
            precision need not be in ``allowed`` and its cost may be absent (then 0).
        flip_penalty: Penalty for flipping all FLOPs away from the previous plan, in cost units (>= 0).
        max_share: Optional upper bound on the FP4 share (so every method lands on the same share).
        compute_budget: Optional bound ``Σ_u (F_u/ΣF)·gemm_cost[p_u] <= compute_budget`` (all-BF16 = 1.0).
        gemm_cost: Relative cost of a GEMM FLOP per precision for ``compute_budget`` (default
            :data:`GEMM_COST`).
        time_limit: CBC time limit in seconds.
        mip_gap: The relative optimality gap CBC stops at; None: optimal (:data:`EXACT_GAP`) up to
            :data:`LARGE_INSTANCE` free decision units, :data:`LARGE_INSTANCE_GAP` above.
    """

    allowed: Sequence[str] | None = reads("allowed", default=None)
    pinned: Mapping[str, Any] | None = reads("pinned", default=None, convert=_none_if_empty)
    flip_penalty: float = reads("flip_penalty")
    max_share: float | None = reads("max_share")
    compute_budget: float | None = reads("compute_budget")
    gemm_cost: Mapping[str, float] | None = None
    time_limit: float = reads("solver_time_limit")
    mip_gap: float | None = None


def solve_plan(costs: Mapping[str, Mapping[str, Any]], flops: Mapping[str, float], target: float,
               solver: SolverSettings | None = None, *, per_gemm: bool = False,
               previous: Plan | Mapping[str, Any] | None = None, method: str = "best",
               meta: Mapping[str, Any] | None = None) -> Plan:
    """Solves the plan ILP of the module docstring for the given costs.

    Args:
        costs: Per-layer costs ``{fqn: {precision: C}}``; with ``per_gemm=True``
            ``{fqn: {precision: {"fprop": C, "dgrad": C, "wgrad": C}}}``. Every allowed precision must have a
            finite cost for every unpinned layer.
        flops: ``{fqn: F}``, FLOPs per step of the layer's three GEMMs; same keys as ``costs``.
        target: Minimum FP4 share of the FLOPs, in [0, 1] (ρ).
        solver: The constraints and limits (:class:`SolverSettings`); default its defaults.
        per_gemm: Decide each GEMM (fprop, dgrad, wgrad) separately.
        previous: The previous plan (Plan or mapping); each unit whose precision differs costs
            ``flip_penalty · F_u/ΣF`` (a per-layer plan against a per-GEMM previous counts a third per GEMM).
            Layers the previous plan lacks cost nothing.
        method: Recorded in the plan.
        meta: Extra JSON scalars recorded in ``plan.meta``.

    Returns:
        A frozen :class:`Plan`; ``objective`` is Σ cost + flip penalty of the chosen plan (unscaled);
        ``status`` is ``"optimal"``, ``"time_limit_feasible"`` or ``"greedy_fallback"``.

    Raises:
        ValueError: empty or inconsistent inputs, a target outside [0, 1], an unreachable share or budget.
    """
    start = time.perf_counter()
    solver = SolverSettings() if solver is None else solver
    allowed, pinned, flip_penalty = solver.allowed, solver.pinned, solver.flip_penalty
    max_share, compute_budget, gemm_cost, time_limit = (solver.max_share, solver.compute_budget, solver.gemm_cost,
                                                        solver.time_limit)
    allowed = check_allowed(allowed)
    target = check_share(target, "target")
    if max_share is not None:
        max_share = check_share(max_share, "max_share")
        if max_share < target:
            raise ValueError(f"'max_share' ({max_share}) is below 'target' ({target})")
    gemm_cost = dict(GEMM_COST if gemm_cost is None else gemm_cost)
    if compute_budget is not None:
        if not is_number(compute_budget) or compute_budget <= 0:
            raise ValueError(f"'compute_budget' must be a positive number (all-BF16 = 1.0), got {compute_budget!r}")
        missing = [p for p in PRECISIONS if not is_number(gemm_cost.get(p))]
        if missing:
            raise ValueError(f"'gemm_cost' lacks relative cost(s) for {', '.join(missing)}")
    if not is_number(time_limit) or time_limit <= 0:
        raise ValueError(f"'time_limit' must be a positive number of seconds, got {time_limit!r}")
    mip_gap = solver.mip_gap
    if mip_gap is not None and (not is_number(mip_gap) or not 0 < mip_gap < 1):
        raise ValueError(f"'mip_gap' must be a number in (0, 1) (a relative gap), got {mip_gap!r}")

    prob = build_problem(costs, flops, target, allowed, pinned, previous, flip_penalty, per_gemm)
    check_reachable(prob, target, max_share)

    choice, mip_status, used_gap = _solve_ilp(prob, target, max_share, gemm_cost, compute_budget, time_limit,
                                              mip_gap)
    if choice is not None:
        status = "optimal" if mip_status == mip.OptimizationStatus.OPTIMAL else "time_limit_feasible"
    elif mip_status in (mip.OptimizationStatus.INFEASIBLE, mip.OptimizationStatus.INT_INFEASIBLE):
        raise ValueError(f"no plan meets the constraints (target {target}, max_share {max_share}, "
                         f"compute_budget {compute_budget}): the ILP is infeasible")
    else:
        choice = greedy_plan(prob, target, max_share, gemm_cost, compute_budget)
        if choice is None:
            raise ValueError(f"the solver found no plan ({mip_status.name}) and the greedy fallback cannot meet "
                             f"target {target}, max_share {max_share}, compute_budget {compute_budget}")
        status = "greedy_fallback"

    gap_meta = {} if used_gap == EXACT_GAP else {"mip_gap": used_gap}  # plans of ordinary size: as before
    return make_plan(prob, choice, flops, per_gemm, status, method, start, meta,
                      target=target, max_share=max_share, flip_penalty=float(flip_penalty),
                      time_limit=float(time_limit), solver_status=mip_status.name, **gap_meta)
