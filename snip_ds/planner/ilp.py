"""The SNIP plan solver: an integer linear program (python-mip / CBC) over given costs.

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
vs fp4). A 560-layer (Llama-2-70B) instance solves in tens of milliseconds, to optimality. An instance of
more than :data:`LARGE_INSTANCE` free decision units (a Mixture-of-Experts model: ~30k layers for
DeepSeek-V3, its experts' FLOPs following their routed tokens) is solved to a relative gap of
:data:`LARGE_INSTANCE_GAP` unless ``SolverSettings.mip_gap`` says otherwise: proving the last 0.1 % of a
30k-item knapsack costs CBC far more than the planning budget, and the plan it returns then is at most that
far above the optimum (``plan.meta["mip_gap"]`` records it). If CBC stops at its time limit the best
feasible solution is used (status ``"time_limit_feasible"``); if it finds none, a greedy knapsack plan is
(``"greedy_fallback"``).

A layer may have zero FLOPs (an expert that received no tokens): the share constraints do not see it, so it
takes its cheapest precision.

Cost key scheme: per-layer ``costs[fqn][precision] = float``; per-GEMM (``per_gemm=True``)
``costs[fqn][precision] = {"fprop": float, "dgrad": float, "wgrad": float}``.

The costs come from :mod:`snip_ds.planner.costs`; :mod:`snip_ds.planner.baselines` solves each method.
This module is pure data: no torch, no torch.distributed.
"""
from __future__ import annotations

import fnmatch
import math
import time
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence

import mip

from snip_ds.options import reads
from snip_ds.plan import Plan, fp4_share, listed_names
from snip_ds.types import GEMMS, PRECISIONS, QUANTIZED

# Relative cost of one GEMM FLOP per precision (BF16 = 1): tensor-core throughput doubles per halving of
# the operand width. Used only for the optional compute-budget constraint.
GEMM_COST = {"bf16": 1.0, "fp8": 0.5, "fp4": 0.25}

DEFAULT_ALLOWED = QUANTIZED

_SHARE_TOL = 1e-9  # share constraints are checked to this absolute tolerance
EXACT_GAP = 1e-9  # CBC's relative gap for ordinary instances: optimal
LARGE_INSTANCE = 4096  # free decision units above which an instance is solved to LARGE_INSTANCE_GAP
LARGE_INSTANCE_GAP = 1e-3

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


def is_pattern(key: str) -> bool:
    """Whether a ``pinned`` key is a glob (``*``, ``?`` or ``[``) rather than a layer name."""
    return any(ch in key for ch in "*?[")


def expand_pinned(pinned: Mapping[str, Any], names) -> dict:
    """``pinned`` with every glob key (:func:`is_pattern`, e.g. ``"model.layers.*.mlp.experts.*"``) replaced by
    the layers of ``names`` it matches (``fnmatch``, case-sensitive); a layer named exactly keeps its own entry
    over any pattern's.

    Raises:
        ValueError: a name that is not a layer, a pattern that matches none, or two patterns that give one
            layer different precisions (the message names them).
    """
    names = list(names)
    exact = {k: v for k, v in pinned.items() if not is_pattern(k)}
    unknown = set(exact) - set(names)
    if unknown:
        raise ValueError(f"'pinned' names {len(unknown)} layer(s) not in the cost table: {listed_names(unknown)}")
    out, source = {}, {}
    for pattern, value in pinned.items():
        if not is_pattern(pattern):
            continue
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            raise ValueError(f"'pinned' pattern {pattern!r} matches no layer (e.g. {names[0] if names else 'none'})")
        for n in matched:
            if n in exact:
                continue
            if n in out and out[n] != value:
                raise ValueError(f"'pinned' patterns {source[n]!r} and {pattern!r} both match layer {n!r} with "
                                 f"different precisions ({out[n]!r}, {value!r})")
            out[n], source[n] = value, pattern
    return {**out, **exact}


def _setup(costs, flops, target, allowed, pinned, previous, flip_penalty, per_gemm) -> _Problem:
    if not isinstance(costs, Mapping) or not costs:
        raise ValueError("cost table is empty: need costs {fqn: {precision: cost}} for at least one layer")
    if not isinstance(flops, Mapping):
        raise ValueError(f"'flops' must be a mapping fqn -> FLOPs, got {type(flops).__name__}")
    missing, extra = set(costs) - set(flops), set(flops) - set(costs)
    if missing or extra:
        raise ValueError(f"costs and flops name different layers: no FLOPs for {len(missing)} [{listed_names(missing)}], "
                         f"no costs for {len(extra)} [{listed_names(extra)}]")
    for fqn, f in flops.items():
        if not _is_number(f) or not math.isfinite(f) or f < 0:
            raise ValueError(f"flops of layer {fqn!r} must be a finite number >= 0, got {f!r}")
    if not sum(flops.values()) > 0:
        raise ValueError("flops: every layer has 0 FLOPs; the FP4 share of nothing is undefined")
    if not _is_number(flip_penalty) or not math.isfinite(flip_penalty) or flip_penalty < 0:
        raise ValueError(f"'flip_penalty' must be a finite number >= 0, got {flip_penalty!r}")

    pinned = expand_pinned(pinned or {}, costs)
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


def _solve_ilp(prob: _Problem, target, max_share, gemm_cost, compute_budget, time_limit, mip_gap):
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
        start = _greedy(prob, target, max_share, gemm_cost, compute_budget)
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
    if model.optimize(relax=True, max_seconds=time_limit) == mip.OptimizationStatus.OPTIMAL:
        model.max_mip_gap_abs = max(mip_gap * model.objective_value, 1e-12)
    model.max_mip_gap = EXACT_GAP
    return max(time_limit - (time.perf_counter() - start), 1e-3)


def _start_values(choice: dict, classes: dict, counts: dict, onehot_vars: dict, prob: _Problem) -> list:
    """A plan as CBC start values for :func:`_solve_ilp`'s integer variables: each class's count of switches
    as the plan has (CBC completes the continuous switches: its cheapest ones, the same share at no more
    cost); one-hots as chosen."""
    values = [(counts[key], float(sum(choice[u] == key[1][1] for u in units))) for key, units in classes.items()]
    for u, xs in onehot_vars.items():
        values += [(x, float(p == choice[u])) for x, p in zip(xs, prob.choices[u])]
    return values


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
        moves = sorted((u for u in prob.units if choice[u] != "fp4" and "fp4" in prob.choices[u] and w[u] > 0),
                       key=lambda u: (prob.cost[u, "fp4"] - prob.cost[u, choice[u]]) / w[u])
        added = []
        for u in moves:
            if share >= target - _SHARE_TOL:
                break
            added.append((u, choice[u]))
            choice[u] = "fp4"
            share += w[u]
        # the last move may overshoot the target by more than earlier moves weigh: undo those the share no
        # longer needs, the dearest first
        for u, before in sorted(added[:-1], key=lambda m: prob.cost[m[0], "fp4"] - prob.cost[m],
                                reverse=True):
            if share - w[u] >= target - _SHARE_TOL:
                choice[u] = before
                share -= w[u]

    if max_share is not None and share > max_share + _SHARE_TOL:
        def back_cost(u):
            alts = [p for p in prob.choices[u] if p != "fp4"]
            return min(alts, key=lambda p: prob.cost[u, p]) if alts else None
        moves = sorted((u for u in prob.units if choice[u] == "fp4" and back_cost(u) and w[u] > 0),
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
    mip_gap = solver.mip_gap
    if mip_gap is not None and (not _is_number(mip_gap) or not 0 < mip_gap < 1):
        raise ValueError(f"'mip_gap' must be a number in (0, 1) (a relative gap), got {mip_gap!r}")

    prob = _setup(costs, flops, target, allowed, pinned, previous, flip_penalty, per_gemm)
    _check_reachable(prob, target, max_share)

    choice, mip_status, used_gap = _solve_ilp(prob, target, max_share, gemm_cost, compute_budget, time_limit,
                                              mip_gap)
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

    gap_meta = {} if used_gap == EXACT_GAP else {"mip_gap": used_gap}  # plans of ordinary size: as before
    return _make_plan(prob, choice, flops, per_gemm, status, method, start, meta,
                      target=target, max_share=max_share, flip_penalty=float(flip_penalty),
                      time_limit=float(time_limit), solver_status=mip_status.name, **gap_meta)


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
