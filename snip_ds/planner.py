"""The SNIP plan solver: an integer linear program (python-mip / CBC) and the baselines (SNIP.md section 5).

Decision units are layers (per-layer plans) or (layer, GEMM) pairs (per-GEMM plans; each GEMM carries one
third of its layer's FLOPs). With two allowed precisions a unit has one binary x (1 = fp4); with more, a
one-hot x_p. The program is

    minimise   Σ_u Σ_p C_u(p)·x_u,p  +  flip_penalty · Σ_u (F_u/ΣF)·[p_u ≠ previous_u]
    subject to Σ_u F_u·x_u,fp4 ≥ target·ΣF          (FP4 share, the efficiency target ρ)
               Σ_u F_u·x_u,fp4 ≤ max_share·ΣF      (optional: every method lands on the same share)
               Σ_u F_u·gemm_cost[p]·x_u,p ≤ compute_budget·ΣF   (optional; relative to all-BF16)
               x_u,p fixed for pinned units.

It is a knapsack. Units with equal FLOPs and choices are interchangeable, so each such class is solved as
one integer count (its cheapest switches are taken; exact, and it spares CBC the permutations that stall
it on MHA models), and without a compute budget three precisions reduce exactly to two (cheapest non-fp4
vs fp4). A 560-layer (Llama-2-70B) instance solves in tens of milliseconds. If CBC stops at its time limit
the best feasible solution is used (status ``"time_limit_feasible"``); if it finds none, a greedy knapsack
plan is (``"greedy_fallback"``).

Cost key scheme: per-layer ``costs[fqn][precision] = float``; per-GEMM (``per_gemm=True``)
``costs[fqn][precision] = {"fprop": float, "dgrad": float, "wgrad": float}``.

This module is pure data: no torch, no torch.distributed.
"""
from __future__ import annotations

import math
import random
import time
import warnings
from typing import Any, Mapping, NamedTuple, Sequence

import mip

from snip_ds.plan import Plan, fp4_share, _listed
from snip_ds.types import GEMM_OPERANDS, GEMMS, OPERANDS, PRECISIONS, QUANTIZED, block_index

# Relative cost of one GEMM FLOP per precision (BF16 = 1): tensor-core throughput doubles per halving of
# the operand width. Used only for the optional compute-budget constraint.
GEMM_COST = {"bf16": 1.0, "fp8": 0.5, "fp4": 0.25}

DEFAULT_ALLOWED = QUANTIZED
METHODS = ("best", "random", "quant_err", "rel_quant_err", "uniform_fp8", "uniform_fp4", "first_last_fp8")

_SHARE_TOL = 1e-9  # share constraints are checked to this absolute tolerance

Unit = Any  # fqn (per-layer) or (fqn, gemm) (per-GEMM)


# --------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------
def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_allowed(allowed: Sequence[str] | None) -> tuple[str, ...]:
    allowed = DEFAULT_ALLOWED if allowed is None else tuple(allowed)
    if not allowed:
        raise ValueError(f"'allowed' is empty; choose from {', '.join(PRECISIONS)}")
    bad = [p for p in allowed if p not in PRECISIONS]
    if bad:
        raise ValueError(f"'allowed' has unknown precision(s) {bad}; valid precisions are {', '.join(PRECISIONS)}")
    return tuple(p for p in PRECISIONS if p in allowed)  # canonical order, no duplicates


def _check_share(value: Any, name: str) -> float:
    if not _is_number(value) or not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"'{name}' must be a number in [0, 1] (an FP4 share of FLOPs), got {value!r}")
    return float(value)


def _gemm_map(value: Any, where: str) -> dict[str, str]:
    """A pinned / previous entry as {gemm: precision}."""
    if isinstance(value, str):
        value = {g: value for g in GEMMS}
    if not isinstance(value, Mapping) or set(value) != set(GEMMS):
        raise ValueError(f"{where} must be a precision or {{gemm: precision}} naming {', '.join(GEMMS)}, "
                         f"got {value!r}")
    for g, p in value.items():
        if p not in PRECISIONS:
            raise ValueError(f"{where} GEMM {g!r} has precision {p!r}; valid precisions are {', '.join(PRECISIONS)}")
    return dict(value)


# --------------------------------------------------------------------------------------------------------
# Problem set-up (validated, normalised to decision units)
# --------------------------------------------------------------------------------------------------------
class _Problem(NamedTuple):
    units: list            # decision units, in a fixed order
    fqn_of: dict           # unit -> fqn
    weight: dict           # unit -> F_u / ΣF (share of all linear FLOPs)
    choices: dict          # unit -> tuple of precisions it may take (one when pinned)
    cost: dict             # (unit, precision) -> cost incl. flip penalty
    raw_cost: dict         # (unit, precision) -> cost excl. flip penalty
    prev: dict             # unit -> previous precision (units the previous plan names)


def _setup(costs, flops, target, allowed, pinned, previous, flip_penalty, per_gemm) -> _Problem:
    if not isinstance(costs, Mapping) or not costs:
        raise ValueError("cost table is empty: need costs {fqn: {precision: cost}} for at least one layer")
    if not isinstance(flops, Mapping):
        raise ValueError(f"'flops' must be a mapping fqn -> FLOPs, got {type(flops).__name__}")
    missing, extra = set(costs) - set(flops), set(flops) - set(costs)
    if missing or extra:
        raise ValueError(f"costs and flops name different layers: no FLOPs for {len(missing)} [{_listed(missing)}], "
                         f"no costs for {len(extra)} [{_listed(extra)}]")
    for fqn, f in flops.items():
        if not _is_number(f) or not math.isfinite(f) or f <= 0:
            raise ValueError(f"flops of layer {fqn!r} must be a positive finite number, got {f!r}")
    if not _is_number(flip_penalty) or not math.isfinite(flip_penalty) or flip_penalty < 0:
        raise ValueError(f"'flip_penalty' must be a finite number >= 0, got {flip_penalty!r}")

    pinned = dict(pinned or {})
    unknown = set(pinned) - set(costs)
    if unknown:
        raise ValueError(f"'pinned' names {len(unknown)} layer(s) not in the cost table: {_listed(unknown)}")
    pinned = {fqn: _gemm_map(v, f"pinned layer {fqn!r}") for fqn, v in pinned.items()}
    if not per_gemm:
        for fqn, g in pinned.items():
            if len(set(g.values())) != 1:
                raise ValueError(f"pinned layer {fqn!r} gives different GEMMs different precisions; "
                                 f"that needs per_gemm=True")

    if previous is None:
        prev_map = {}
    elif isinstance(previous, Plan):
        prev_map = previous.gemm_assignment()
    elif isinstance(previous, Mapping):
        prev_map = {fqn: _gemm_map(v, f"previous plan layer {fqn!r}") for fqn, v in previous.items()}
    else:
        raise ValueError(f"'previous' must be a Plan or a mapping fqn -> precision, got {type(previous).__name__}")

    total = float(sum(flops.values()))
    units, fqn_of, weight, choices, cost, raw_cost, prev = [], {}, {}, {}, {}, {}, {}
    for fqn in sorted(costs):
        table = costs[fqn]
        if not isinstance(table, Mapping):
            raise ValueError(f"costs of layer {fqn!r} must map precision -> cost, got {type(table).__name__}")
        gemms = GEMMS if per_gemm else (None,)
        for g in gemms:
            u = (fqn, g) if per_gemm else fqn
            units.append(u)
            fqn_of[u] = fqn
            weight[u] = float(flops[fqn]) / total / len(gemms)
            if fqn in pinned:
                choices[u] = (pinned[fqn][g or "fprop"],)
            else:
                choices[u] = allowed
            for p in choices[u]:
                c = table.get(p)
                if per_gemm:
                    if isinstance(c, Mapping):
                        c = c.get(g)
                    elif c is not None:
                        raise ValueError(f"costs of layer {fqn!r} precision {p!r} must be {{gemm: cost}} "
                                         f"with per_gemm=True, got {c!r}")
                if c is None and fqn in pinned:
                    c = 0.0  # a pinned layer's cost is a constant; it may be absent (e.g. bf16)
                if not _is_number(c) or not math.isfinite(c):
                    where = f"layer {fqn!r} precision {p!r}" + (f" GEMM {g!r}" if per_gemm else "")
                    raise ValueError(f"costs of {where} must be a finite number, got {c!r} "
                                     f"(allowed precisions: {', '.join(allowed)})")
                raw_cost[u, p] = float(c)
            if fqn in prev_map:
                prev[u] = prev_map[fqn][g] if per_gemm else prev_map[fqn]
            for p in choices[u]:
                cost[u, p] = raw_cost[u, p] + flip_penalty * _flip_fraction(prev.get(u), p) * weight[u]
    return _Problem(units, fqn_of, weight, choices, cost, raw_cost, prev)


def _flip_fraction(previous: Any, p: str) -> float:
    """Fraction of the unit's GEMMs whose precision differs from ``previous`` when the unit takes ``p``.

    ``previous`` is None (no previous: no flip), a precision (per-GEMM unit), or {gemm: precision}
    (a per-layer unit; a per-GEMM previous plan counts each differing GEMM as a third of a flip).
    """
    if previous is None:
        return 0.0
    if isinstance(previous, str):
        return float(previous != p)
    return sum(q != p for q in previous.values()) / len(GEMMS)


def _check_reachable(prob: _Problem, target: float, max_share: float | None) -> None:
    hi = sum(w for u, w in prob.weight.items() if "fp4" in prob.choices[u])
    lo = sum(w for u, w in prob.weight.items() if prob.choices[u] == ("fp4",))
    if hi < target - _SHARE_TOL:
        raise ValueError(f"target FP4 share {target:.4f} is unreachable: with the allowed precisions and pinned "
                         f"layers at most {hi:.4f} of the FLOPs can run in fp4")
    if max_share is not None and lo > max_share + _SHARE_TOL:
        raise ValueError(f"max_share {max_share:.4f} is unreachable: pinned fp4 layers already hold "
                         f"{lo:.4f} of the FLOPs")


# --------------------------------------------------------------------------------------------------------
# ILP
# --------------------------------------------------------------------------------------------------------
def _optimize(model: mip.Model, time_limit: float) -> mip.OptimizationStatus:
    """Runs CBC (a seam so tests can force solver failures)."""
    return model.optimize(max_seconds=time_limit)


def _reduced_choices(prob: _Problem, u: Unit, compute_budget: float | None) -> tuple[str, ...]:
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


def _binary_classes(prob: _Problem, compute_budget) -> tuple[dict, list]:
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


def _solve_ilp(prob: _Problem, target, max_share, gemm_cost, compute_budget, time_limit):
    """Returns (choice per unit or None, mip status).

    Each class of interchangeable binary units (:func:`_binary_classes`) becomes one integer count n_c and
    continuous switches x_i in [0, 1] with Σ x_i = n_c: sorted by switch cost, the LP fills the cheapest
    first, so for every integer n_c the optimum is integral and equals the 0/1 model's. Other units with
    several choices get a one-hot of binaries.
    """
    model = mip.Model(sense=mip.MINIMIZE, solver_name=mip.CBC)
    model.verbose = 0
    model.threads = 1
    model.max_mip_gap = 1e-9
    model.max_mip_gap_abs = 1e-12
    model.infeas_tol = 1e-9
    # Optimise the regret over each unit's cheapest choice (a constant shift), scaled to O(1): CBC's gap and
    # tolerances then act on the part of the objective the decision changes, even when costs are ~1e-9.
    base = {u: min(prob.cost[u, p] for p in prob.choices[u]) for u in prob.units}
    regret = {(u, p): prob.cost[u, p] - base[u] for u, p in prob.cost}
    scale = max(regret.values(), default=1.0) or 1.0

    classes, onehot = _binary_classes(prob, compute_budget)
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

    status = _optimize(model, time_limit)
    if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE) or model.num_solutions == 0:
        return None, status
    choice = {u: prob.choices[u][0] for u in prob.units if len(prob.choices[u]) == 1}
    for key, units in classes.items():
        ch = key[1]
        n = int(round(counts[key].x))
        for i, u in enumerate(units):
            choice[u] = ch[1] if i < n else ch[0]
    for u, xs in onehot_vars.items():
        choice[u] = prob.choices[u][max(range(len(xs)), key=lambda i: xs[i].x)]
    return choice, status


# --------------------------------------------------------------------------------------------------------
# Greedy knapsack fallback
# --------------------------------------------------------------------------------------------------------
def _greedy(prob: _Problem, target, max_share, gemm_cost, compute_budget) -> dict | None:
    """Greedy knapsack: cheapest precision per unit, then cheapest moves (cost delta per FLOP) to fp4 until
    the target share holds, then back out of fp4 / into cheaper GEMMs for the upper bounds. Returns None
    when the constraints cannot be met this way."""
    choice = {u: min(prob.choices[u], key=lambda p: prob.cost[u, p]) for u in prob.units}
    w = prob.weight
    share = sum(w[u] for u in prob.units if choice[u] == "fp4")

    if share < target - _SHARE_TOL:
        moves = sorted((u for u in prob.units if choice[u] != "fp4" and "fp4" in prob.choices[u]),
                       key=lambda u: (prob.cost[u, "fp4"] - prob.cost[u, choice[u]]) / w[u])
        for u in moves:
            if share >= target - _SHARE_TOL:
                break
            choice[u] = "fp4"
            share += w[u]

    if max_share is not None and share > max_share + _SHARE_TOL:
        def back_cost(u):
            alts = [p for p in prob.choices[u] if p != "fp4"]
            return min(alts, key=lambda p: prob.cost[u, p]) if alts else None
        moves = sorted((u for u in prob.units if choice[u] == "fp4" and back_cost(u)),
                       key=lambda u: (prob.cost[u, back_cost(u)] - prob.cost[u, "fp4"]) / w[u])
        for u in moves:
            if share <= max_share + _SHARE_TOL:
                break
            if share - w[u] >= target - _SHARE_TOL:
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
            if compute() <= compute_budget + _SHARE_TOL:
                break
            if gemm_cost[p] >= gemm_cost[choice[u]]:
                continue
            new_share = share + w[u] * ((p == "fp4") - (choice[u] == "fp4"))
            if max_share is None or new_share <= max_share + _SHARE_TOL:
                choice[u], share = p, new_share
        if compute() > compute_budget + _SHARE_TOL:
            return None

    if share < target - _SHARE_TOL or (max_share is not None and share > max_share + _SHARE_TOL):
        return None
    return choice


# --------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------
def solve_plan(costs: Mapping[str, Mapping[str, Any]], flops: Mapping[str, float], target: float, *,
               allowed: Sequence[str] | None = None, pinned: Mapping[str, Any] | None = None,
               previous: Plan | Mapping[str, Any] | None = None, flip_penalty: float = 0.0,
               time_limit: float = 10.0, max_share: float | None = None, per_gemm: bool = False,
               gemm_cost: Mapping[str, float] | None = None, compute_budget: float | None = None,
               method: str = "best", meta: Mapping[str, Any] | None = None) -> Plan:
    """Solves the SNIP plan ILP (SNIP.md section 5).

    Args:
        costs: Per-layer costs ``{fqn: {precision: C}}``; with ``per_gemm=True``
            ``{fqn: {precision: {"fprop": C, "dgrad": C, "wgrad": C}}}``. Every allowed precision must have a
            finite cost for every unpinned layer.
        flops: ``{fqn: F}``, FLOPs per step of the layer's three GEMMs; same keys as ``costs``.
        target: Minimum FP4 share of the FLOPs, in [0, 1] (ρ).
        allowed: Precisions a layer may take (default ``("fp8", "fp4")``: one binary per unit; with three, a
            one-hot per unit).
        pinned: ``{fqn: precision}`` (or ``{fqn: {gemm: precision}}`` with per_gemm) fixed layers; a pinned
            precision need not be in ``allowed`` and its cost may be absent (then 0).
        previous: The previous plan (Plan or mapping); each unit whose precision differs costs
            ``flip_penalty · F_u/ΣF`` (a per-layer plan against a per-GEMM previous counts a third per GEMM).
            Layers the previous plan lacks cost nothing.
        flip_penalty: Penalty for flipping all FLOPs, in cost units (>= 0).
        time_limit: CBC time limit in seconds.
        max_share: Optional upper bound on the FP4 share (so every method lands on the same share).
        per_gemm: Decide each GEMM (fprop, dgrad, wgrad) separately.
        gemm_cost: Relative cost of a GEMM FLOP per precision for ``compute_budget`` (default
            :data:`GEMM_COST`).
        compute_budget: Optional bound ``Σ_u (F_u/ΣF)·gemm_cost[p_u] <= compute_budget`` (all-BF16 = 1.0).
        method: Recorded in the plan.
        meta: Extra JSON scalars recorded in ``plan.meta``.

    Returns:
        A frozen :class:`Plan`; ``objective`` is Σ cost + flip penalty of the chosen plan (unscaled);
        ``status`` is ``"optimal"``, ``"time_limit_feasible"`` or ``"greedy_fallback"``.

    Raises:
        ValueError: empty or inconsistent inputs, a target outside [0, 1], an unreachable share or budget.
    """
    start = time.perf_counter()
    allowed = _check_allowed(allowed)
    target = _check_share(target, "target")
    if max_share is not None:
        max_share = _check_share(max_share, "max_share")
        if max_share < target:
            raise ValueError(f"'max_share' ({max_share}) is below 'target' ({target})")
    gemm_cost = dict(GEMM_COST if gemm_cost is None else gemm_cost)
    if compute_budget is not None:
        if not _is_number(compute_budget) or compute_budget <= 0:
            raise ValueError(f"'compute_budget' must be a positive number (all-BF16 = 1.0), got {compute_budget!r}")
        missing = [p for p in PRECISIONS if not _is_number(gemm_cost.get(p))]
        if missing:
            raise ValueError(f"'gemm_cost' lacks relative cost(s) for {', '.join(missing)}")
    if not _is_number(time_limit) or time_limit <= 0:
        raise ValueError(f"'time_limit' must be a positive number of seconds, got {time_limit!r}")

    prob = _setup(costs, flops, target, allowed, pinned, previous, flip_penalty, per_gemm)
    _check_reachable(prob, target, max_share)

    choice, mip_status = _solve_ilp(prob, target, max_share, gemm_cost, compute_budget, time_limit)
    if choice is not None:
        status = "optimal" if mip_status == mip.OptimizationStatus.OPTIMAL else "time_limit_feasible"
    elif mip_status in (mip.OptimizationStatus.INFEASIBLE, mip.OptimizationStatus.INT_INFEASIBLE):
        raise ValueError(f"no plan meets the constraints (target {target}, max_share {max_share}, "
                         f"compute_budget {compute_budget}): the ILP is infeasible")
    else:
        choice = _greedy(prob, target, max_share, gemm_cost, compute_budget)
        if choice is None:
            raise ValueError(f"the solver found no plan ({mip_status.name}) and the greedy fallback cannot meet "
                             f"target {target}, max_share {max_share}, compute_budget {compute_budget}")
        status = "greedy_fallback"

    return _make_plan(prob, choice, flops, per_gemm, status, method, start, meta,
                      target=target, max_share=max_share, flip_penalty=float(flip_penalty),
                      time_limit=float(time_limit), solver_status=mip_status.name)


def _make_plan(prob: _Problem, choice: dict, flops, per_gemm, status, method, start, meta, **solver_meta) -> Plan:
    if per_gemm:
        assignment: dict = {}
        for (fqn, g), p in choice.items():
            assignment.setdefault(fqn, {})[g] = p
    else:
        assignment = dict(choice)
    objective = sum(prob.cost[u, choice[u]] for u in prob.units)
    flips = sum(_flip_fraction(prob.prev.get(u), choice[u]) * (1 if per_gemm else len(GEMMS))
                for u in prob.units) if prob.prev else 0
    info = {"solve_time_s": time.perf_counter() - start, "num_layers": len(flops),
            "flipped_gemms": int(round(flips)), **solver_meta, **dict(meta or {})}
    return Plan(assignment=assignment, fp4_share=fp4_share(assignment, flops), objective=objective,
                status=status, method=method, meta=info)


# --------------------------------------------------------------------------------------------------------
# Statistics files and baselines
# --------------------------------------------------------------------------------------------------------
class StatsCosts(NamedTuple):
    """Costs for :func:`solve_plan` derived from a statistics artifact."""

    costs: dict    # {fqn: {precision: C}} or per-GEMM {fqn: {precision: {gemm: C}}}
    flops: dict    # {fqn: F}
    pinned: dict   # {fqn: "fp8"} for layers whose statistics are not finite


def _finite(x: Any) -> bool:
    return _is_number(x) and math.isfinite(x)


def _metric_costs(stats: Mapping, fields: Mapping[str, float], per_gemm: bool,
                  gemm_split: Mapping[str, Mapping[str, float]] | None = None) -> StatsCosts:
    """Costs C(p) = Σ_field weight·layers[fqn][field][p]; bf16 costs 0 (no quantization).

    ``gemm_split[field][gemm]`` says which fraction of a field's cost each GEMM carries (per-GEMM plans).
    Layers flagged ``nonfinite`` or with non-finite values are pinned to fp8 (with one warning).
    """
    costs, flops, pinned = {}, {}, {}
    for fqn, rec in stats["layers"].items():
        flops[fqn] = float(rec["flops"])
        for field in fields:
            if field not in rec:
                raise ValueError(f"statistics layers[{fqn!r}] lack field '{field}' needed for these costs")
        bad = rec.get("nonfinite", False) or not all(
            _finite(rec[field].get(p)) for field in fields for p in ("fp8", "fp4"))
        table: dict = {}
        for p in PRECISIONS:
            if p == "bf16":
                per_field = {field: 0.0 for field in fields}
            elif bad:
                per_field = {field: 0.0 for field in fields}
            else:
                per_field = {field: w * float(rec[field][p]) for field, w in fields.items()}
            if per_gemm:
                split = gemm_split or {field: {g: 1.0 / len(GEMMS) for g in GEMMS} for field in fields}
                table[p] = {g: sum(per_field[fl] * split[fl][g] for fl in fields) for g in GEMMS}
            else:
                table[p] = sum(per_field.values())
        costs[fqn] = table
        if bad:
            pinned[fqn] = "fp8"
    if pinned:
        warnings.warn(f"{len(pinned)} layer(s) have non-finite statistics and are pinned to fp8: "
                      f"{_listed(pinned)}", RuntimeWarning, stacklevel=3)
    return StatsCosts(costs, flops, pinned)


DGRAD_COSTS = ("split", "upstream")
"""How a per-GEMM SNIP plan prices the dgrad GEMM (:func:`costs_from_stats`)."""
BWD_KEYS = ("bwd", "bwd_bias", "bwd_propagated")
"""Which backward estimate of a statistics artifact SNIP's costs use (:func:`costs_from_stats`)."""
BWD_ESTIMATES = {"expected": "bwd", "systematic": "bwd_bias"}
"""The ``"snip"`` section's and the CLI's names for the BWD fields a plan may be priced with."""


def costs_from_stats(stats: Mapping, lam: float | None = None, *, per_gemm: bool = False,
                     bwd_key: str = "bwd", dgrad: str = "split", dgrad_calibration: float = 1.0,
                     forward_drift: bool = False, fwd_lambda: float | None = None) -> StatsCosts:
    """SNIP costs C(p) = FLD(p) + λ·BWD(p) from a statistics artifact (SNIP.md sections 3-5).

    Args:
        stats: A validated statistics dict (:func:`snip_ds.stats.artifact.load_stats` / ``validate_stats``).
        lam: λ, the BWD weight; default the artifact's ``"lambda"``.
        per_gemm: Per-GEMM costs: fprop carries FLD; the backward GEMMs as ``dgrad`` says.
        bwd_key: Which backward estimate to use (one of :data:`BWD_KEYS`): ``"bwd"`` (direct, default: the
            expected drift under the training recipe's rounding), ``"bwd_bias"`` (only its systematic part,
            which persists from step to step; stochastic rounding's noise left out) or ``"bwd_propagated"``
            (ablation).
        dgrad: Per GEMM only. ``"split"`` (default): dgrad and wgrad each carry half of λ·BWD (the direct BWD
            measures the wgrad GEMM; nothing prices dgrad on its own). ``"upstream"``: wgrad carries the
            direct λ·BWD, dgrad carries λ·``bwd_dgrad`` / ``dgrad_calibration``, the upstream weights' drift
            that the dgrad error causes (statistics collected with ``bwd_propagated=True``).
        dgrad_calibration: What ``bwd_dgrad`` overstates the measured dgrad-only drift by
            (``launch/validate_metrics.py --bwd_truth_per_gemm`` measures it).
        forward_drift: Also price the update drift that the fprop GEMM's output error causes, λ·``fwd``
            (statistics collected with ``forward_drift=True``), on the fprop GEMM: C(p) = FLD(p) +
            λ·(FWD(p) + BWD(p)). λ is the horizon of a one-step drift, whichever GEMM caused it.
        fwd_lambda: With ``forward_drift``: FWD's own weight μ in place of λ, C(p) = FLD(p) + μ·FWD(p) + λ·BWD(p).

    Returns:
        :class:`StatsCosts` ``(costs, flops, pinned)``; layers with non-finite statistics are pinned to fp8
        (a RuntimeWarning names them), their costs are 0 placeholders. bf16 costs 0.
    """
    if lam is None:
        if "lambda" not in stats:
            raise ValueError("statistics have no field 'lambda' and no λ was given")
        lam = stats["lambda"]
    if not _finite(lam) or lam < 0:
        raise ValueError(f"λ must be a finite number >= 0, got {lam!r}")
    if bwd_key not in BWD_KEYS:
        raise ValueError(f"bwd_key must be one of {', '.join(BWD_KEYS)}, got {bwd_key!r}")
    if dgrad not in DGRAD_COSTS:
        raise ValueError(f"dgrad must be one of {', '.join(DGRAD_COSTS)}, got {dgrad!r}")
    if fwd_lambda is not None and not forward_drift:
        raise ValueError("fwd_lambda weighs FWD: it needs forward_drift=True")
    if fwd_lambda is not None and (not _finite(fwd_lambda) or fwd_lambda < 0):
        raise ValueError(f"fwd_lambda must be a finite number >= 0, got {fwd_lambda!r}")
    fwd_split = {"fwd": {"fprop": 1.0, "dgrad": 0.0, "wgrad": 0.0}} if forward_drift else {}
    fwd_weight = {"fwd": float(lam if fwd_lambda is None else fwd_lambda)} if forward_drift else {}
    if forward_drift:
        lacking = sorted(fqn for fqn, rec in stats["layers"].items() if "fwd" not in rec)
        if lacking:
            raise ValueError(f"statistics layers[{lacking[0]!r}] (and {len(lacking) - 1} more) lack field 'fwd': "
                             f"forward_drift needs statistics collected with forward_drift=True")
    if dgrad == "split":
        split = {"fld": {"fprop": 1.0, "dgrad": 0.0, "wgrad": 0.0},
                 bwd_key: {"fprop": 0.0, "dgrad": 0.5, "wgrad": 0.5}, **fwd_split}
        return _metric_costs(stats, {"fld": 1.0, bwd_key: float(lam), **fwd_weight}, per_gemm, split)
    if not per_gemm:
        raise ValueError("dgrad='upstream' prices the dgrad GEMM on its own: it needs per_gemm=True")
    if bwd_key == "bwd_propagated":
        raise ValueError("dgrad='upstream' uses the direct BWD for wgrad: bwd_key must be 'bwd' or 'bwd_bias'")
    if not _finite(dgrad_calibration) or dgrad_calibration <= 0:
        raise ValueError(f"dgrad_calibration must be a finite number > 0, got {dgrad_calibration!r}")
    split = {"fld": {"fprop": 1.0, "dgrad": 0.0, "wgrad": 0.0},
             bwd_key: {"fprop": 0.0, "dgrad": 0.0, "wgrad": 1.0},
             "bwd_dgrad": {"fprop": 0.0, "dgrad": 1.0, "wgrad": 0.0}, **fwd_split}
    weights = {"fld": 1.0, bwd_key: float(lam), "bwd_dgrad": float(lam) / float(dgrad_calibration), **fwd_weight}
    lacking = sorted(fqn for fqn, rec in stats["layers"].items() if "bwd_dgrad" not in rec)
    if lacking:
        raise ValueError(f"statistics layers[{lacking[0]!r}] (and {len(lacking) - 1} more) lack field 'bwd_dgrad': "
                         f"dgrad='upstream' needs statistics collected with bwd_propagated=True")
    return _metric_costs(stats, weights, per_gemm, split)


def quant_err_costs(stats: Mapping, field: str = "quant_err", *, per_gemm: bool = False) -> StatsCosts:
    """The quantization-error baselines' costs: ``field`` (``quant_err`` or ``rel_quant_err``) per layer.

    Per-GEMM, each GEMM carries the errors of the two operands it quantizes (fprop X and W, dgrad G_Y and W,
    wgrad G_Y and X), halved so that a layer's three GEMMs sum to its per-layer cost; this needs the
    artifact's per-operand fields ``{field}_x``, ``{field}_w``, ``{field}_g``.
    """
    if field not in ("quant_err", "rel_quant_err"):
        raise ValueError(f"field must be 'quant_err' or 'rel_quant_err', got {field!r}")
    sc = _metric_costs(stats, {field: 1.0}, per_gemm)
    if not per_gemm:
        return sc
    for fqn, rec in stats["layers"].items():
        if fqn in sc.pinned:
            continue
        missing = [f"{field}_{o}" for o in OPERANDS if f"{field}_{o}" not in rec]
        if missing:
            raise ValueError(f"statistics layers[{fqn!r}] lack {', '.join(missing)}, needed for per-GEMM {field} "
                             f"costs (statistics collected by an older snip_ds have only the per-layer sum)")
        for p in ("fp8", "fp4"):
            part = {o: rec[f"{field}_{o}"].get(p) for o in OPERANDS}
            if not all(_finite(v) for v in part.values()):
                raise ValueError(f"statistics layers[{fqn!r}].{field}_x/_w/_g.{p} must be finite numbers, got {part}")
            sc.costs[fqn][p] = {g: 0.5 * sum(float(part[o]) for o in GEMM_OPERANDS[g]) for g in GEMMS}
    return sc


def _random_costs(fqns: Sequence[str], seed: int, per_gemm: bool) -> dict:
    rng = random.Random(seed)
    costs = {}
    for fqn in sorted(fqns):
        if per_gemm:
            costs[fqn] = {p: {g: rng.random() for g in GEMMS} for p in PRECISIONS}
        else:
            costs[fqn] = {p: rng.random() for p in PRECISIONS}
    return costs


def solve_baseline(method: str, stats: Mapping, target: float, *, lam: float | None = None, seed: int = 0,
                   num_random: int = 1, allowed: Sequence[str] | None = None,
                   pinned: Mapping[str, Any] | None = None, previous: Plan | Mapping | None = None,
                   flip_penalty: float = 0.0, max_share: float | None = None, per_gemm: bool = False,
                   time_limit: float = 10.0, compute_budget: float | None = None, dgrad: str = "split",
                   dgrad_calibration: float = 1.0, bwd_key: str = "bwd",
                   forward_drift: bool = False, fwd_lambda: float | None = None) -> list[Plan]:
    """Solves one of :data:`METHODS` from a statistics artifact with the same ILP and share constraint.

    ``allowed``, ``max_share`` and ``compute_budget`` (GEMM cost relative to all-BF16, with
    :data:`GEMM_COST`; it is what makes fp8 worth choosing when bf16 is allowed too) are passed to
    :func:`solve_plan` for every method but the uniform ones.

    Methods:
        best: SNIP costs FLD + λ·BWD (:func:`costs_from_stats`, with ``dgrad``, ``dgrad_calibration``,
            ``bwd_key``, ``forward_drift`` and ``fwd_lambda``).
        random: seeded uniform random costs; ``num_random`` plans for seeds ``seed, seed+1, ...``.
        quant_err / rel_quant_err: costs from the artifact's ``quant_err`` / ``rel_quant_err``
            (:func:`quant_err_costs`; per-GEMM from the per-operand errors).
        uniform_fp8 / uniform_fp4: every layer at that precision (``target`` is not enforced; recorded).
        first_last_fp8: first and last decoder blocks pinned to fp8; the rest solved with the SNIP costs
            (so it differs from ``best`` only by the pin rule).

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

    if method in ("best", "first_last_fp8"):
        sc = costs_from_stats(stats, lam, per_gemm=per_gemm, dgrad=dgrad, dgrad_calibration=dgrad_calibration,
                              bwd_key=bwd_key, forward_drift=forward_drift, fwd_lambda=fwd_lambda)
        meta["lambda"] = float(stats["lambda"] if lam is None else lam)
        if bwd_key != "bwd":
            meta["bwd_key"] = bwd_key
        if forward_drift:
            meta["forward_drift"] = True
        if fwd_lambda is not None:
            meta["fwd_lambda"] = float(fwd_lambda)
        if dgrad != "split":
            meta.update(dgrad=dgrad, dgrad_calibration=float(dgrad_calibration))
    elif method in ("quant_err", "rel_quant_err"):
        sc = quant_err_costs(stats, method, per_gemm=per_gemm)
    else:
        sc = _metric_costs(stats, {"fld": 0.0}, per_gemm)  # only for the flops and non-finite pins
    pins = {**sc.pinned, **dict(pinned or {})}
    if method == "first_last_fp8":
        blocks = {fqn: block_index(fqn) for fqn in fqns}
        ends = {min(blocks.values()), max(blocks.values())}
        pins = {**{fqn: "fp8" for fqn, b in blocks.items() if b in ends}, **pins}

    common = dict(allowed=allowed, pinned=pins, previous=previous, flip_penalty=flip_penalty,
                  time_limit=time_limit, max_share=max_share, per_gemm=per_gemm, method=method,
                  compute_budget=compute_budget)
    if method != "random":
        return [solve_plan(sc.costs, sc.flops, target, meta=meta, **common)]
    return [solve_plan(_random_costs(fqns, s, per_gemm), sc.flops, target, meta={**meta, "seed": s}, **common)
            for s in range(seed, seed + num_random)]
