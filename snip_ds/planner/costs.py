"""The cost model: what a layer (or one of its GEMMs) costs at each precision, and what a plan is predicted
to cost.

SNIP prices a layer at precision p by C(p) = FLD(p) + λ·BWD(p): the forward loss divergence its quantized
fprop causes plus λ times the loss divergence of the weight drift its quantized backward GEMMs cause (λ is a
horizon in steps), both read from a statistics artifact (:mod:`snip_ds.stats_file`; docs/method.md
derives them). bf16 costs 0. Per GEMM, fprop carries FLD and the backward GEMMs carry λ·BWD as ``dgrad``
says (:func:`costs_from_stats`). The baselines replace C by other numbers of the same artifact
(:func:`method_costs` maps every method of :data:`METHODS` to its costs, once for the whole package).
:func:`predicted_divergence` sums the same terms over a plan's assignment, so that its FLD + λ·BWD is the
plan's objective.

Cost key scheme: per-layer ``costs[fqn][precision] = float``; per-GEMM
``costs[fqn][precision] = {"fprop": float, "dgrad": float, "wgrad": float}``.

This module is pure data: no torch, no solver.
"""
from __future__ import annotations

import math
import random
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence

from snip_ds.options import BWD_ESTIMATES, DGRAD_COSTS, METHODS, reads
from snip_ds.plan import listed_names
from snip_ds.stats_file import STUDY_FIELDS
from snip_ds.types import GEMM_OPERANDS, GEMMS, OPERANDS, PRECISIONS, QUANTIZED

BWD_KEYS = ("bwd", "bwd_bias", "bwd_propagated")
"""Which backward estimate of a statistics artifact SNIP's costs use (:func:`costs_from_stats`)."""


@dataclass(frozen=True)
class CostSettings:
    """How a plan is priced from a statistics artifact (:func:`costs_from_stats` checks the values).

    Attributes:
        lam: λ, the BWD weight; default the artifact's ``"lambda"``.
        per_gemm: Per-GEMM costs (and plans): fprop carries FLD; the backward GEMMs as ``dgrad`` says.
        bwd_key: Which backward estimate to use, one of :data:`BWD_KEYS`.
        dgrad: Per GEMM, how dgrad is priced, one of :data:`DGRAD_COSTS`.
        dgrad_calibration: With ``dgrad="upstream"``: what ``bwd_dgrad`` overstates the dgrad-only drift by.
        forward_drift: Also price the fprop error's update drift ``fwd``.
        fwd_lambda: With ``forward_drift``: FWD's own weight μ in place of λ.
    """

    lam: float | None = reads("bwd_lambda", default=None)
    per_gemm: bool = reads("per_gemm")
    bwd_key: str = reads("bwd_estimate", default="bwd", convert=BWD_ESTIMATES.__getitem__)
    dgrad: str = reads("dgrad_cost")
    dgrad_calibration: float = reads("dgrad_calibration")
    forward_drift: bool = False
    fwd_lambda: float | None = None


class StatsCosts(NamedTuple):
    """Costs for :func:`snip_ds.planner.solve_plan` derived from a statistics artifact."""

    costs: dict    # {fqn: {precision: C}} or per-GEMM {fqn: {precision: {gemm: C}}}
    flops: dict    # {fqn: F}
    pinned: dict   # {fqn: "fp8"} for layers whose statistics are not finite


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _study_hint(stats: Mapping, field: str) -> str:
    """Where a missing study field would come from (a collection records them only when asked)."""
    group = next((g for g, fields in STUDY_FIELDS.items() if field in fields), None)
    if group is None or "study_fields" not in stats:
        return ""
    return (f" (statistics collected without study field group {group!r}: a training run records it when its "
            f"plan needs it or when snip.research.study_fields lists it)")


def metric_costs(stats: Mapping, fields: Mapping[str, float], per_gemm: bool,
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
                raise ValueError(f"statistics layers[{fqn!r}] lack field '{field}' needed for these costs"
                                 + _study_hint(stats, field))
        bad = rec.get("nonfinite", False) or not all(
            _finite(rec[field].get(p)) for field in fields for p in QUANTIZED)
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
                      f"{listed_names(pinned)}", RuntimeWarning, stacklevel=3)
    return StatsCosts(costs, flops, pinned)


def costs_from_stats(stats: Mapping, lam: float | None = None, *, per_gemm: bool = False,
                     bwd_key: str = "bwd", dgrad: str = "split", dgrad_calibration: float = 1.0,
                     forward_drift: bool = False, fwd_lambda: float | None = None) -> StatsCosts:
    """SNIP costs C(p) = FLD(p) + λ·BWD(p) from a statistics artifact (the module docstring).

    Args:
        stats: A validated statistics dict (:func:`snip_ds.stats_file.load_stats` / ``validate_stats``).
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
        return metric_costs(stats, {"fld": 1.0, bwd_key: float(lam), **fwd_weight}, per_gemm, split)
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
    return metric_costs(stats, weights, per_gemm, split)


def quant_err_costs(stats: Mapping, field: str = "quant_err", *, per_gemm: bool = False) -> StatsCosts:
    """The quantization-error baselines' costs: ``field`` (``quant_err`` or ``rel_quant_err``) per layer.

    Per-GEMM, each GEMM carries the errors of the two operands it quantizes (fprop X and W, dgrad G_Y and W,
    wgrad G_Y and X), halved so that a layer's three GEMMs sum to its per-layer cost; this needs the
    artifact's per-operand fields ``{field}_x``, ``{field}_w``, ``{field}_g``.
    """
    if field not in ("quant_err", "rel_quant_err"):
        raise ValueError(f"field must be 'quant_err' or 'rel_quant_err', got {field!r}")
    sc = metric_costs(stats, {field: 1.0}, per_gemm)
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


def random_costs(fqns: Sequence[str], seed: int, per_gemm: bool) -> dict:
    """The ``random`` baseline's costs: uniform in [0, 1), drawn from ``seed`` in sorted-fqn order."""
    rng = random.Random(seed)
    costs = {}
    for fqn in sorted(fqns):
        if per_gemm:
            costs[fqn] = {p: {g: rng.random() for g in GEMMS} for p in PRECISIONS}
        else:
            costs[fqn] = {p: rng.random() for p in PRECISIONS}
    return costs




def method_costs(method: str, stats: Mapping, cost: CostSettings | None = None, *, seed: int = 0) -> StatsCosts:
    """The costs a method of :data:`METHODS` solves with, from one statistics artifact:

    * ``best``, ``first_last_fp8``: SNIP's FLD + λ·BWD (:func:`costs_from_stats` as ``cost`` says);
      ``first_last_fp8`` differs only by the layers it pins (:mod:`snip_ds.planner.baselines`);
    * ``quant_err``, ``rel_quant_err``: the artifact's quantization errors (:func:`quant_err_costs`);
    * ``random``: uniform random costs drawn from ``seed`` (:func:`random_costs`);
    * ``last_k_fp8``: a rule, not costs: zero costs here, for the flops and the pins.

    ``flops`` and ``pinned`` (layers with non-finite statistics, pinned to fp8; layers that no call reached,
    ``no_calls``, pinned to bf16: they run nowhere, and an FP4 label would claim a saving the run does not make)
    come from the artifact for every method. The uniform methods have no costs (a fixed plan): asking for theirs
    is a ValueError.
    """
    c = CostSettings() if cost is None else cost
    if method in ("best", "first_last_fp8"):
        sc = costs_from_stats(stats, c.lam, per_gemm=c.per_gemm, dgrad=c.dgrad, dgrad_calibration=c.dgrad_calibration,
                              bwd_key=c.bwd_key, forward_drift=c.forward_drift, fwd_lambda=c.fwd_lambda)
    elif method in ("quant_err", "rel_quant_err"):
        sc = quant_err_costs(stats, method, per_gemm=c.per_gemm)
    elif method in ("random", "last_k_fp8"):
        sc = metric_costs(stats, {"fld": 0.0}, c.per_gemm)  # only for the flops and non-finite pins
        if method == "random":
            sc = sc._replace(costs=random_costs(sorted(stats["layers"]), seed, c.per_gemm))
    elif method in METHODS:
        raise ValueError(f"method {method!r} is a fixed plan: it has no costs")
    else:
        raise ValueError(f"unknown method {method!r}; valid methods are {', '.join(METHODS)}")
    unrun = {fqn: "bf16" for fqn, rec in stats["layers"].items() if rec.get("no_calls") is True}
    return sc._replace(pinned={**sc.pinned, **unrun}) if unrun else sc


def plan_study_fields(method: str, bwd_key: str = "bwd") -> tuple:
    """The groups of study fields (:data:`snip_ds.stats_file.STUDY_FIELDS`) that a plan of ``method``,
    priced with ``bwd_key``, is solved from: ``quant_err`` for the quantization-error baselines, ``bwd_bias``
    for SNIP's costs on the systematic BWD; none otherwise (``fld``, ``bwd`` and ``flops`` are always
    recorded). A collection that serves only a plan asks for exactly these."""
    groups = set()
    if method in ("quant_err", "rel_quant_err"):
        groups.add("quant_err")
    if method in ("best", "first_last_fp8") and bwd_key == "bwd_bias":
        groups.add("bwd_bias")
    return tuple(sorted(groups))


def predicted_divergence(layers: Mapping[str, Mapping[str, Any]], assignment: Mapping[str, Any],
                         bwd_key: str = "bwd", forward_drift: bool = False,
                         fwd_weight: float | None = None, dgrad: str = "split",
                         dgrad_calibration: float = 1.0) -> tuple[float, float]:
    """A plan's predicted ``(FLD, BWD)``: the sums over its layers of the statistics at each layer's precision.

    A per-GEMM layer's FLD is its fprop GEMM's. Its BWD is priced as :func:`costs_from_stats` priced the
    plan: with ``dgrad="split"``, half at the dgrad GEMM's precision and half at the wgrad GEMM's; with
    ``dgrad="upstream"``, the whole BWD at the wgrad GEMM's precision plus ``bwd_dgrad`` /
    ``dgrad_calibration`` at the dgrad GEMM's. bf16 and missing (non-finite) values count 0.

    Args:
        layers: the statistics artifact's ``layers`` (``{fqn: {"fld": {precision: x}, "bwd": {...}}}``).
        assignment: ``{fqn: precision}`` or ``{fqn: {gemm: precision}}``.
        bwd_key: which BWD to sum (``"bwd"``, the expected drift, or ``"bwd_bias"``, its systematic part):
            the one the plans were priced with.
        forward_drift: add each layer's ``fwd`` at its fprop precision to the second number (the plan's
            predicted drift in loss units, the part λ multiplies), as plans priced with FWD were.
        fwd_weight: with ``forward_drift``, FWD's own weight μ (plans priced FLD + μ·FWD + λ·BWD): μ·FWD then
            joins the first number instead, so that FLD + λ·BWD stays the objective.
        dgrad: how per-GEMM plans priced dgrad, one of :data:`DGRAD_COSTS` (the planner's ``dgrad``).
        dgrad_calibration: with ``dgrad="upstream"``, what ``bwd_dgrad`` was divided by.
    """
    if dgrad not in DGRAD_COSTS:
        raise ValueError(f"dgrad must be one of {', '.join(DGRAD_COSTS)}, got {dgrad!r}")

    def at(table: Mapping[str, Any], precision: str) -> float:
        value = None if precision == "bf16" else table.get(precision)
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0.0

    fld = bwd = 0.0
    for fqn, value in assignment.items():
        rec = layers[fqn]
        if isinstance(value, str):
            fld += at(rec["fld"], value)
            bwd += at(rec[bwd_key], value)
        else:
            fld += at(rec["fld"], value["fprop"])
            if dgrad == "split":
                bwd += 0.5 * (at(rec[bwd_key], value["dgrad"]) + at(rec[bwd_key], value["wgrad"]))
            else:
                bwd += at(rec[bwd_key], value["wgrad"]) + at(rec["bwd_dgrad"], value["dgrad"]) / dgrad_calibration
        if forward_drift:
            fwd = at(rec["fwd"], value if isinstance(value, str) else value["fprop"])
            if fwd_weight is None:
                bwd += fwd
            else:
                fld += fwd_weight * fwd
    return fld, bwd
