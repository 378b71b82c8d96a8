"""What a grid's records say: paired gaps per phase and ρ, the λ sweep, the targets SNIP is checked against,
the λ the GEMM-kind plans calibrate, whether the planner's objective ranks the outcomes, and the paired
differences to another grid's runs (``--versus``). Pure data in, data out (records are plain dicts)."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

from snip_ds.experiments.grid import KIND_PLANS, snip_label
from snip_ds.experiments.paired import (MeanSE, cell_means, finite_mean, mean_se, paired_differences, paired_verdict,
                                        spearman)


def _is(label: str):
    return lambda r: r["label"] == label


def _is_random(r) -> bool:
    return r["method"] == "random"


def report_lambda(s: Dict[str, Any]) -> float:
    """The λ whose SNIP a report checks: ``--lambda_default`` given with ``--report_only``, else the grid's."""
    return s.get("report_lambda", s["lambda_default"])


def summarize(records: List[Dict[str, Any]], lambda_default: float) -> Dict[str, Any]:
    """Paired statistics per (phase, ρ, label), pooled per ρ, the λ sweep and the target checks."""
    cells = ("phase", "seed")
    solved = [r for r in records if r["rho"] is not None]
    phases = sorted({r["phase"] for r in records}, key=lambda p: min(r["warmup_steps"] for r in records
                                                                      if r["phase"] == p))
    rhos = sorted({r["rho"] for r in solved})
    labels = sorted({r["label"] for r in solved if not _is_random(r)}) + ["random"]
    rows = []
    for scope in phases + ["all"]:
        for rho in rhos:
            sub = [r for r in records if (scope == "all" or r["phase"] == scope) and (r["rho"] in (rho, None))]
            for label in labels:
                sel = _is_random if label == "random" else _is(label)
                if not any(sel(r) and r["rho"] == rho for r in sub):
                    continue
                sel_rho = (lambda r, sel=sel: sel(r) and r["rho"] == rho)
                row = dict(phase=scope, rho=rho, label=label,
                           fp4_share=mean_se(r["fp4_share"] for r in sub if sel_rho(r)).mean)
                for key, tag in (("val_loss", "q"), ("val_loss_bf16_forward", "bf16")):
                    row[f"vs_fp8_{tag}"] = mean_se(paired_differences(sub, key, cells, sel_rho,
                                                                      _is("uniform_fp8")))
                    row[f"vs_random_{tag}"] = mean_se(paired_differences(
                        sub, key, cells, sel_rho, lambda r: _is_random(r) and r["rho"] == rho))
                rows.append(row)
    uniform = []
    for scope in phases + ["all"]:
        sub = [r for r in records if scope == "all" or r["phase"] == scope]
        for label in ("bf16", "uniform_fp4") + tuple(KIND_PLANS):
            if any(r["label"] == label for r in sub):
                uniform.append(dict(phase=scope, label=label, fp4_share=mean_se(
                    r["fp4_share"] for r in sub if r["label"] == label).mean, **{
                    f"vs_fp8_{tag}": mean_se(paired_differences(sub, key, cells, _is(label), _is("uniform_fp8")))
                    for key, tag in (("val_loss", "q"), ("val_loss_bf16_forward", "bf16"))}))
    # random-plan spread: SD of the gaps among random plans of one cell, averaged over cells
    spreads = []
    for key in {(r["phase"], r["seed"], r["rho"]) for r in records if _is_random(r)}:
        gaps = [r["val_loss"] for r in records if _is_random(r) and (r["phase"], r["seed"], r["rho"]) == key]
        if len(gaps) > 1:
            m = sum(gaps) / len(gaps)
            spreads.append(math.sqrt(sum((g - m) ** 2 for g in gaps) / (len(gaps) - 1)))
    lambdas = sorted({r["lambda"] for r in records if r["method"] == "best"})
    sweep = {lam: mean_se([d for rho in rhos for d in paired_differences(
        [r for r in records if r["rho"] in (rho, None)], "val_loss", cells,
        lambda r, lam=lam, rho=rho: r["method"] == "best" and r["lambda"] == lam and r["rho"] == rho,
        _is("uniform_fp8"))]) for lam in lambdas}
    best_lambda = min(sweep, key=lambda lam: sweep[lam].mean) if sweep else None
    return dict(rows=rows, uniform=uniform, random_spread=mean_se(spreads), lambda_sweep=sweep,
                best_lambda=best_lambda, snip_label=snip_label(lambda_default), phases=phases, rhos=rhos,
                ranking=objective_ranking(records, phases, rhos, lambda_default),
                kinds=kind_calibration(records, phases))


def kind_calibration(records: List[Dict[str, Any]], phases: Sequence[str]) -> List[Dict[str, Any]]:
    """Per phase where the fp4_fprop and fp4_backward plans ran: the λ at which the statistics price the
    forward and the backward GEMMs in the ratio their runs measured.

    SNIP prices a layer's fprop GEMM with FLD (plus λ·FWD with ``--forward_drift``) and its backward GEMMs with
    λ·BWD (per layer together; per GEMM split over dgrad and wgrad). Matching the measured ratio
    ``r = gap(fp4_backward) / gap(fp4_fprop) = λ·ΔD_b / (ΔFLD + λ·ΔD_f)`` gives
    ``λ = r·ΔFLD / (ΔD_b − r·ΔD_f)``, where ΔFLD and the drifts ΔD (ΔD_f: FWD, 0 without it; ΔD_b: BWD) are the
    statistics' totals over the layers, FP4 minus FP8, read from the two plans' predicted divergences
    (:func:`snip_ds.experiments.plans.predicted_divergence`; BWD is the one the grid prices with, its ``bwd_key``). The
    gaps are paired means over the phase's cells; ``lam`` is ``None`` where a gap or the denominator is not
    positive (no price ratio to match), and ``lam_2se`` is the same with the backward's gap two standard
    errors higher (an upper end for λ).
    """
    out = []
    for phase in phases:
        sub = [r for r in records if r["phase"] == phase]
        pred = {r["label"]: r for r in sub if r["label"] in ("uniform_fp8", "fp4_fprop", "fp4_backward")}
        if len(pred) < 3:
            continue
        gap = {k: mean_se(paired_differences(sub, "val_loss", ("phase", "seed"), _is(k), _is("uniform_fp8")))
               for k in ("fp4_fprop", "fp4_backward")}
        d_fld = pred["fp4_fprop"]["predicted_fld"] - pred["uniform_fp8"]["predicted_fld"]
        d_fwd = pred["fp4_fprop"]["predicted_bwd"] - pred["uniform_fp8"]["predicted_bwd"]
        d_bwd = pred["fp4_backward"]["predicted_bwd"] - pred["uniform_fp8"]["predicted_bwd"]

        def lam(backward: float) -> Optional[float]:
            if not (gap["fp4_fprop"].mean > 0 and backward > 0):
                return None
            r = backward / gap["fp4_fprop"].mean
            return r * d_fld / (d_bwd - r * d_fwd) if d_bwd - r * d_fwd > 0 else None
        b = gap["fp4_backward"]
        out.append(dict(phase=phase, gap_fprop=gap["fp4_fprop"], gap_backward=b, d_fld=d_fld, d_bwd=d_bwd,
                        d_fwd=d_fwd, lam=lam(b.mean),
                        lam_2se=lam(b.mean + 2 * b.se) if math.isfinite(b.se) else None))
    return out


def objective_ranking(records, phases, rhos, lam: float) -> List[Dict[str, Any]]:
    """Per phase: does the planner's objective rank the plans by their outcome?

    Every distinct solved plan (by ρ and plan digest) is one point: its predicted FLD, BWD and FLD + λ·BWD
    (what the planner minimises, at the default λ) against its mean quantized-forward gap to uniform FP8
    over the phase's cells. Spearman pooled over ρ, and averaged over ρ within each ρ.
    """
    out = []
    for phase in phases:
        points: Dict[tuple, Dict[str, Any]] = {}
        for r in records:
            if r["phase"] != phase or r["rho"] is None or r.get("gap_to_fp8") is None:
                continue
            # a plan shared by several labels is one point (its runs are one run, see run_cell)
            points.setdefault((r["rho"], r["plan_digest"], r["seed"]), dict(
                rho=r["rho"], fld=r["predicted_fld"], bwd=r["predicted_bwd"], gap=r["gap_to_fp8"]))
        plans: Dict[tuple, Dict[str, Any]] = {}
        for (rho, digest, _), p in points.items():
            q = plans.setdefault((rho, digest), dict(rho=rho, fld=p["fld"], bwd=p["bwd"], gaps=[]))
            q["gaps"].append(p["gap"])
        pts = [dict(rho=q["rho"], fld=q["fld"], bwd=q["bwd"], obj=q["fld"] + lam * q["bwd"],
                    gap=sum(q["gaps"]) / len(q["gaps"])) for q in plans.values()]
        if not pts:
            continue
        row = dict(phase=phase, plans=len(pts), **{
            key: spearman([p[key] for p in pts], [p["gap"] for p in pts]) for key in ("obj", "fld", "bwd")})
        within = [spearman([p["obj"] for p in pts if p["rho"] == rho], [p["gap"] for p in pts if p["rho"] == rho])
                  for rho in rhos]
        # a ρ whose plans all tie (or number under 3) has no rank correlation: skipped, and counted
        row["obj_within_rho"], row["obj_within_rho_skipped"] = finite_mean(within)
        out.append(row)
    return out


BASELINES = ("random", "quant_err", "rel_quant_err")


def _cell_losses(records, select) -> Dict[tuple, float]:
    """``(phase, seed) -> mean val_loss`` of the selected records of each cell (random: over its plans)."""
    return cell_means(records, "val_loss", ("phase", "seed"), select)


def is_miss(check: Dict[str, Any], base: str) -> bool:
    """SNIP misses its target against ``base`` in this cell: it is not below it by more than 2 SE (a mean
    below it without that is no evidence, and is not counted as met)."""
    v = check[base]
    return v is not None and not (v["below"] and v["resolved"])


def target_checks(summary: Dict[str, Any], records: List[Dict[str, Any]],
                  others: Sequence[Dict[str, Any]] = ()) -> List[Dict[str, Any]]:
    """The plan-quality targets for SNIP at the default λ, per phase and ρ (quantized forward).

    Targets: SNIP's mean gap below random's, quant_err's and rel_quant_err's by more than 2 SE each (a mean
    below without that is not counted as met). A baseline's run in a cell comes from this grid, or, where this
    grid did not run it there, from ``others`` (the ``--versus`` grids' records, same cells). Per baseline: the paired difference
    SNIP − baseline, the baseline's own paired gap to uniform FP8 (``room``) and
    :func:`snip_ds.experiments.paired.paired_verdict`.
    """
    snip_label = summary["snip_label"]
    fp8 = _cell_losses(records, _is("uniform_fp8"))
    out = []
    for phase in summary["phases"]:
        for rho in summary["rhos"]:
            here = [r for r in records if r["phase"] == phase and r["rho"] == rho]
            snip = _cell_losses(here, _is(snip_label))
            if not snip:
                continue
            check: Dict[str, Any] = dict(phase=phase, rho=rho)
            for base in BASELINES:
                sel = _is_random if base == "random" else _is(base)
                own = _cell_losses(here, sel)
                base_cells = {**_cell_losses([r for r in others if r["phase"] == phase and r["rho"] == rho], sel),
                              **own}  # this grid's run where it has one, else the versus grid's
                common = sorted(set(snip) & set(base_cells))
                if not common:
                    check[base] = None
                    continue
                source = ("this grid" if all(c in own for c in common) else
                          "versus" if not any(c in own for c in common) else "both")
                diff = mean_se(snip[c] - base_cells[c] for c in common)
                room = mean_se(base_cells[c] - fp8[c] for c in common if c in fp8)
                check[base] = dict(diff=diff, room=room, source=source, **paired_verdict(diff, room))
            rnd = check["random"]
            # unknown without every baseline, or without a standard error (one cell) to resolve a difference
            check["met"] = (None if any(check[b] is None or check[b]["resolved"] is None for b in BASELINES) else
                            all(bool(check[b]["below"] and check[b]["resolved"]) for b in BASELINES))
            # missed only by ties: no baseline resolvably below SNIP (each miss is an unresolved difference)
            check["ties_only"] = (check["met"] is False and
                                  all(check[b]["below"] or not check[b]["resolved"] for b in BASELINES))
            # the summary's earlier keys
            for base in BASELINES:
                check[f"below_{base}"] = None if check[base] is None else check[base]["below"]
            check["diff_vs_random"] = rnd["diff"] if rnd else MeanSE(float("nan"), float("nan"), 0)
            check["resolved_2se"] = None if rnd is None or rnd["resolved"] is None else \
                bool(rnd["below"] and rnd["resolved"])
            out.append(check)
    return out


def versus_rows(records: List[Dict[str, Any]], others: List[Dict[str, Any]],
                mine_label: Optional[str] = None) -> List[Dict[str, Any]]:
    """Per (phase or "all", ρ, method label): paired differences, this grid's run minus the other grid's run of
    the same label in the same cell (random plans: the mean of the cell's random plans on each side).

    With ``mine_label`` (e.g. ``"best λ=100"``): that plan of this grid against every plan of the other grid
    instead (``label`` is then the other grid's), e.g. a re-priced SNIP against the baselines run before.
    """
    def group(r):
        return "random" if r["method"] == "random" else r["label"]

    if mine_label is not None:
        records = [r for r in records if r["rho"] is not None and group(r) == mine_label]
        records = [dict(r, label=o) for r in records for o in {group(x) for x in others if x["rho"] == r["rho"]}]

    both = ([dict(r, side=0, group=group(r)) for r in records if r["rho"] is not None]
            + [dict(r, side=1, group=group(r)) for r in others if r["rho"] is not None])
    phases = list(dict.fromkeys(r["phase"] for r in records))
    rows = []
    for scope in phases + ["all"]:
        sub = [r for r in both if scope == "all" or r["phase"] == scope]
        for rho, label in sorted({(r["rho"], r["group"]) for r in sub}):
            diff = {field: paired_differences(
                sub, field, ("phase", "seed"),
                select=lambda r, l=label, q=rho: r["side"] == 0 and r["group"] == l and r["rho"] == q,
                reference=lambda r, l=label, q=rho: r["side"] == 1 and r["group"] == l and r["rho"] == q)
                for field in ("val_loss", "val_loss_bf16_forward")}
            if diff["val_loss"]:
                rows.append(dict(phase=scope, rho=rho, label=label, q=mean_se(diff["val_loss"]),
                                 bf16=mean_se(diff["val_loss_bf16_forward"])))
    return rows
