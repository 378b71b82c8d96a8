"""The plan ILP's model: its decision units, their choices and costs, and the checks that it can be met.

Decision units are layers (per-layer plans) or (layer, GEMM) pairs (per-GEMM plans; each GEMM carries one
third of its layer's FLOPs). With two allowed precisions a unit has one binary x (1 = fp4); with more, a
one-hot x_p. The program is

    minimise   Σ_u Σ_p C_u(p)·x_u,p  +  flip_penalty · Σ_u (F_u/ΣF)·[p_u ≠ previous_u]
    subject to Σ_u F_u·x_u,fp4 ≥ target·ΣF          (FP4 share, the efficiency target ρ)
               Σ_u F_u·x_u,fp4 ≤ max_share·ΣF      (optional: every method lands on the same share)
               Σ_u F_u·gemm_cost[p]·x_u,p ≤ compute_budget·ΣF   (optional; relative to all-BF16)
               x_u,p fixed for pinned units.

:func:`build_problem` validates the inputs (costs, FLOPs, pinned layers and patterns, the previous plan) and
normalises them to decision units (:class:`Problem`), the flip penalty folded into each unit's cost;
:func:`check_reachable` refuses a share the allowed and pinned precisions cannot reach. A layer may have zero
FLOPs (an expert that received no tokens): the share constraints do not see it, so it takes its cheapest
precision.

Cost key scheme: per-layer ``costs[fqn][precision] = float``; per-GEMM (``per_gemm=True``)
``costs[fqn][precision] = {"fprop": float, "dgrad": float, "wgrad": float}``.

Solving it: :mod:`snip_ds.planner.ilp`. Pure data: no torch, no torch.distributed.
"""
from __future__ import annotations

import fnmatch
import math
from typing import Any, Mapping, NamedTuple, Sequence

from snip_ds.plan import Plan, listed_names
from snip_ds.types import GEMMS, PRECISIONS, QUANTIZED

DEFAULT_ALLOWED = QUANTIZED
SHARE_TOL = 1e-9  # share constraints are checked to this absolute tolerance

Unit = Any  # fqn (per-layer) or (fqn, gemm) (per-GEMM)


def is_number(x: Any) -> bool:
    """A real number (``bool`` is not one)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_allowed(allowed: Sequence[str] | None) -> tuple[str, ...]:
    """``allowed`` (None: :data:`DEFAULT_ALLOWED`) in canonical precision order, without duplicates.

    Raises:
        ValueError: empty, or an unknown precision (named).
    """
    allowed = DEFAULT_ALLOWED if allowed is None else tuple(allowed)
    if not allowed:
        raise ValueError(f"'allowed' is empty; choose from {', '.join(PRECISIONS)}")
    bad = [p for p in allowed if p not in PRECISIONS]
    if bad:
        raise ValueError(f"'allowed' has unknown precision(s) {bad}; valid precisions are {', '.join(PRECISIONS)}")
    return tuple(p for p in PRECISIONS if p in allowed)  # canonical order, no duplicates


def check_share(value: Any, name: str) -> float:
    """``value`` as an FP4 share in [0, 1]; a ValueError naming ``name`` otherwise."""
    if not is_number(value) or not math.isfinite(value) or not 0.0 <= value <= 1.0:
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


class Problem(NamedTuple):
    """The ILP's inputs, validated and normalised to decision units (:func:`build_problem`)."""

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


def build_problem(costs, flops, target, allowed, pinned, previous, flip_penalty, per_gemm) -> Problem:
    """The validated problem of :func:`snip_ds.planner.ilp.solve_plan`'s arguments, as decision units.

    Raises:
        ValueError: empty or inconsistent costs and FLOPs, a bad pinned entry or previous plan (named).
    """
    if not isinstance(costs, Mapping) or not costs:
        raise ValueError("cost table is empty: need costs {fqn: {precision: cost}} for at least one layer")
    if not isinstance(flops, Mapping):
        raise ValueError(f"'flops' must be a mapping fqn -> FLOPs, got {type(flops).__name__}")
    missing, extra = set(costs) - set(flops), set(flops) - set(costs)
    if missing or extra:
        raise ValueError(f"costs and flops name different layers: no FLOPs for {len(missing)} "
                         f"[{listed_names(missing)}], no costs for {len(extra)} [{listed_names(extra)}]")
    for fqn, f in flops.items():
        if not is_number(f) or not math.isfinite(f) or f < 0:
            raise ValueError(f"flops of layer {fqn!r} must be a finite number >= 0, got {f!r}")
    if not sum(flops.values()) > 0:
        raise ValueError("flops: every layer has 0 FLOPs; the FP4 share of nothing is undefined")
    if not is_number(flip_penalty) or not math.isfinite(flip_penalty) or flip_penalty < 0:
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
                if not is_number(c) or not math.isfinite(c):
                    where = f"layer {fqn!r} precision {p!r}" + (f" GEMM {g!r}" if per_gemm else "")
                    raise ValueError(f"costs of {where} must be a finite number, got {c!r} "
                                     f"(allowed precisions: {', '.join(allowed)})")
                raw_cost[u, p] = float(c)
            if fqn in prev_map:
                prev[u] = prev_map[fqn][g] if per_gemm else prev_map[fqn]
            for p in choices[u]:
                cost[u, p] = raw_cost[u, p] + flip_penalty * flip_fraction(prev.get(u), p) * weight[u]
    return Problem(units, fqn_of, weight, choices, cost, raw_cost, prev)


def flip_fraction(previous: Any, p: str) -> float:
    """Fraction of the unit's GEMMs whose precision differs from ``previous`` when the unit takes ``p``.

    ``previous`` is None (no previous: no flip), a precision (per-GEMM unit), or {gemm: precision}
    (a per-layer unit; a per-GEMM previous plan counts each differing GEMM as a third of a flip).
    """
    if previous is None:
        return 0.0
    if isinstance(previous, str):
        return float(previous != p)
    return sum(q != p for q in previous.values()) / len(GEMMS)


def check_reachable(prob: Problem, target: float, max_share: float | None) -> None:
    """Raises ValueError when the allowed and pinned precisions cannot reach ``target`` or stay under
    ``max_share``."""
    hi = sum(w for u, w in prob.weight.items() if "fp4" in prob.choices[u])
    lo = sum(w for u, w in prob.weight.items() if prob.choices[u] == ("fp4",))
    if hi < target - SHARE_TOL:
        raise ValueError(f"target FP4 share {target:.4f} is unreachable: with the allowed precisions and pinned "
                         f"layers at most {hi:.4f} of the FLOPs can run in fp4")
    if max_share is not None and lo > max_share + SHARE_TOL:
        raise ValueError(f"max_share {max_share:.4f} is unreachable: pinned fp4 layers already hold "
                         f"{lo:.4f} of the FLOPs")
