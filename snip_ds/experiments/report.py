"""A grid's report: ``compare_plans.md`` (targets, gaps, λ sweep and calibration, objective ranking, the
``--versus`` comparison, predicted against measured FLD) and, through :mod:`snip_ds.experiments.figures`, its
three plots. Every number is a paired difference in millinats (mean ± standard error over cells)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Sequence

from snip_ds.experiments.figures import plot_curves, plot_gap, plot_maps
from snip_ds.experiments.grid import SOLVED
from snip_ds.experiments.results import PREFIX
from snip_ds.experiments.summary import (BASELINES, is_miss, report_lambda, summarize, target_checks,
                                         versus_rows)
from snip_ds.options import OPTIONS
from snip_ds.plan import Plan


def write_report(data: Dict[str, Any], out_dir: Path, plans_by_phase=None) -> Dict[str, Any]:
    """Writes the markdown and the plots of ``data`` (a result file's content) under ``out_dir``.

    Args:
        data: ``settings``, ``records``, ``plans`` (and optionally ``skipped``, ``versus``, ``wall_seconds``).
        out_dir: Existing directory the files go to.
        plans_by_phase: ``{phase: [{label, rho, plan}]}`` of the plan maps (default: rebuilt from ``data``).

    Returns:
        The records' :func:`~snip_ds.experiments.summary.summarize`.

    Raises:
        ValueError: ``data`` holds no records.
    """
    records = data["records"]
    if not records:
        raise ValueError(f"{out_dir / (PREFIX + '.json')}: no records to report")
    summary = summarize(records, report_lambda(data["settings"]))
    write_markdown(data, summary, out_dir / f"{PREFIX}.md")
    plot_gap(summary, out_dir / f"{PREFIX}_gap.png")
    plot_curves(records, summary, out_dir / f"{PREFIX}_curves.png")
    if plans_by_phase is None:
        plans_by_phase = {ph: [dict(label=p["label"], rho=p["rho"], plan=Plan(assignment=p["assignment"]))
                               for p in ps] for ph, ps in data.get("plans", {}).items()}
    plot_maps(plans_by_phase, out_dir / f"{PREFIX}_maps.png")
    return summary


def _fmt(ms, scale: float = 1e3) -> str:
    """``mean ± SE`` of a :class:`~snip_ds.experiments.paired.MeanSE` in millinats (``–`` without values)."""
    if ms.n == 0:
        return "–"
    se = "n/a" if not math.isfinite(ms.se) else f"{ms.se * scale:.2f}"
    return f"{ms.mean * scale:+.2f} ± {se}"


def _which_lambda(lam: float) -> str:
    """Whether the λ a report checks is the package default (``bwd_lambda``), said in words."""
    default = float(OPTIONS["bwd_lambda"].default)
    return "the package default" if lam == default else f"not the package default {default:g}"


def _report_lambda_words(s: Dict[str, Any]) -> str:
    return "" if "report_lambda" not in s else f"; this report checks SNIP at λ {s['report_lambda']:g}"


def _same_plan(c: Dict[str, Any]) -> bool:
    """Every paired difference exactly 0: the baseline solved SNIP's plan (runs of one plan are bit-identical)."""
    return c["diff"].n > 0 and c["diff"].mean == 0 and (c["diff"].n == 1 or c["diff"].se == 0)


def _target_cell(check: Dict[str, Any], base: str) -> str:
    """A Targets table entry: SNIP − baseline, bold where resolved, and what a miss is."""
    c = check[base]
    if c is None:
        return "–"
    text = _fmt(c["diff"])
    if c["resolved"]:
        text = f"**{text}**"
    if _same_plan(c):
        text += " (the same plan)"
    elif not c["below"]:
        text += (" (above; one cell, no SE)" if c["resolved"] is None else " (resolved loss)" if c["resolved"]
                 else " (tie, no room)" if c["floor"] else " (tie)")
    elif is_miss(check, base):
        text += " (not resolved)" if c["resolved"] is False else " (one cell, no SE)"
    return text + {"this grid": "", "versus": " †", "both": " ‡"}[c["source"]]


def _target_misses(checks: List[Dict[str, Any]]) -> List[str]:
    """One line per unmet comparison: the difference, the baseline's room to FP8, and the cells to resolve it."""
    lines = []
    for c in checks:
        for base in BASELINES:
            if not is_miss(c, base):
                continue
            v = c[base]
            what = ("the same plan, run for run" if _same_plan(v) else
                    "above, with one cell (no SE)" if v["resolved"] is None and not v["below"] else
                    "a resolved loss" if v["resolved"] and not v["below"] else
                    "below, but not by 2 SE" if v["below"] else "a tie")
            floor = (f"; {base}'s own gap to uniform FP8 is {_fmt(v['room'])}, less than 2 SE of the difference, "
                     f"so even a plan exactly at FP8's quality could not be shown below it here" if v["floor"] else
                     f"; {base}'s own gap to uniform FP8 is {_fmt(v['room'])}")
            n, need = v["diff"].n, v["cells_to_resolve"]
            more = ("" if need is None else
                    f"; the observed mean would stand 2 SE from 0 at about {need} cells" if need <= 100 * n else
                    "; the observed mean would stand 2 SE from 0 only at over 100 times these cells")
            lines.append(f"- {c['phase']} ρ {c['rho']:g}, SNIP − {base}: {_fmt(v['diff'])} over {v['diff'].n} "
                         f"cells, {what}{floor}{more}.")
    return lines


def _yn(x) -> str:
    return "–" if x is None else ("yes" if x else "**no**")


def _dgrad_words(s: Dict[str, Any]) -> str:
    if s.get("dgrad_cost", "split") != "upstream":
        return ""
    return (f" (SNIP prices dgrad by the upstream drift its error causes, bwd_dgrad / "
            f"{s['dgrad_calibration']:g}, and wgrad by the whole direct BWD)")


def _bwd_words(s: Dict[str, Any]) -> str:
    rounding = s.get("bwd_rounding", "nearest")  # grids from before the setting rounded G_Y to nearest
    part = {"bwd": "expected", "bwd_bias": "systematic part of the", "bwd_propagated": "propagated"}[
        s.get("bwd_key", "bwd")]
    how = ("as training does" if rounding == "recipe" else "to nearest")
    weight = "λ" if s.get("fwd_lambda") is None else f"μ = {s['fwd_lambda']:g}"
    fwd = (f"; SNIP's costs also price FWD, the update drift of each layer's fprop error, at {weight}"
           if s.get("forward_drift") else "")
    return f"SNIP's BWD: the {part} drift, with G_Y rounded {how} in the statistics{fwd}"


def _table(heading: str, columns: Sequence[str], rows) -> List[str]:
    """A markdown section: heading, header and rows, followed by a blank line; nothing when there are no rows."""
    rows = list(rows)
    if not rows:
        return []
    return [heading, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *rows, ""]


def _random_words(s: Dict[str, Any]) -> str:
    return f"{s['num_random']} random plan(s); " if "random" in s.get("methods", SOLVED) else "no random plans; "


def write_markdown(data: Dict[str, Any], summary: Dict[str, Any], path: Path) -> None:
    """Writes ``compare_plans.md`` from a result file's content and its summary."""
    s = data["settings"]
    lines = ["# compare_plans: plan quality from paired training runs", ""]
    if s.get("note"):
        lines += [f"**{s['note']}**", ""]
    lines += [f"Command: `{s['command']}`", "",
              f"Full grid: `{s['full_command']}`", "",
              f"Model: {s['model']} ({s['parameters']:,} parameters, {s['layers']} planned linears in "
              f"{s['blocks']} blocks); {s['batch_size']}×{s['block_size']} tokens per step; AdamW lr {s['lr']:g}"
              f"{', decaying linearly to 0 over each run' if s.get('lr_decay', 'none') == 'linear' else ''}; "
              f"phases (warm-up steps) {s['phases']}; {s['steps']} steps per run; seeds {s['seeds']}; "
              f"ρ {s['rhos']}; λ {s['lambdas']} (default {s['lambda_default']:g}{_report_lambda_words(s)}); "
              f"{_random_words(s)}"
              f"plans solved {'per GEMM' if s.get('per_gemm') else 'per layer'}"
              f"{_dgrad_words(s)}; {_bwd_words(s)}; "
              f"{s['eval_batches']}×{s['batch_size']} validation sequences; FP4 "
              f"{s.get('fp4_recipe', 'nvfp4')}, gradients rounded "
              f"{'stochastically' if s.get('stochastic_rounding', True) else 'to nearest'}. "
              f"{len(data['records'])} records, {data.get('wall_seconds', 0) / 60:.1f} min.", "",
              "All numbers are paired differences in **millinats** (1e-3 nats): per cell (phase × seed, same "
              "checkpoint, data order and rounding seeds) the method's validation loss minus uniform FP8's (or "
              "minus the mean of the random plans'), then mean ± standard error over cells. *q* = the plan's "
              "quantized forward, *bf16* = BF16 forward of the same weights. Negative is better.", ""]
    checks = target_checks(summary, data["records"], (data.get("versus") or {}).get("records", ()))
    lines += _table(f"## Targets (SNIP at λ = {report_lambda(s):g}, {_which_lambda(report_lambda(s))}; "
                    f"quantized-forward loss, SNIP − baseline)",
                    ("phase", "ρ", "SNIP − random", "SNIP − quant_err", "SNIP − rel_quant_err", "targets met"),
                    (f"| {c['phase']} | {c['rho']:g} | " + " | ".join(_target_cell(c, b) for b in BASELINES) +
                     f" | {_yn(c['met'])}{' (ties only)' if c['ties_only'] else ''} |" for c in checks))
    if checks:
        lines += ["Targets: SNIP more than 2 SE below every baseline; a mean below a baseline without 2 SE is not "
                  "counted as met. Paired differences in millinats, bold where more than 2 SE from 0. *No room*: "
                  "the baseline's own gap to uniform FP8 is less than 2 SE of the difference, so not even a plan "
                  "exactly at FP8's quality could be shown below it with these cells. *Ties only*: no baseline is "
                  "more than 2 SE below SNIP."
                  + (f" †: the baseline ran in the `--versus` grid(s) (`{data['versus']['source']}`), same cells."
                     if any(c[b] and c[b]["source"] == "versus" for c in checks for b in BASELINES) else "")
                  + (" ‡: in some cells from this grid, in the others from the `--versus` grid(s)."
                     if any(c[b] and c[b]["source"] == "both" for c in checks for b in BASELINES) else ""), ""]
        misses = _target_misses(checks)
        if misses:
            lines += ["Comparisons that miss their target:", "", *misses, ""]
    lines += _table("## Gaps per phase and ρ",
                    ("phase", "ρ", "method", "FP4 share", "vs fp8 (q)", "vs fp8 (bf16)", "vs random (q)",
                     "vs random (bf16)", "n"),
                    (f"| {r['phase']} | {r['rho']:g} | {r['label']} | {r['fp4_share']:.3f} | {_fmt(r['vs_fp8_q'])} | "
                     f"{_fmt(r['vs_fp8_bf16'])} | {_fmt(r['vs_random_q'])} | {_fmt(r['vs_random_bf16'])} | "
                     f"{r['vs_fp8_q'].n} |" for r in summary["rows"]))
    lines += _table("Fixed plans (ρ-independent; fp4_<kind>: that GEMM kind in FP4 in every layer, the rest FP8):",
                    ("phase", "method", "FP4 share", "vs fp8 (q)", "vs fp8 (bf16)", "n"),
                    (f"| {u['phase']} | {u['label']} | {u['fp4_share']:.3f} | {_fmt(u['vs_fp8_q'])} | "
                     f"{_fmt(u['vs_fp8_bf16'])} | {u['vs_fp8_q'].n} |" for u in summary["uniform"]))
    if summary["kinds"]:
        fwd = bool(s.get("forward_drift")) and s.get("fwd_lambda") is None  # FWD at λ: a drift of its own
        mu = s.get("fwd_lambda") if s.get("forward_drift") else None  # FWD at μ: part of the forward's price
        how = ("SNIP prices the forward GEMM with FLD + λ·FWD and the backward GEMMs with λ·BWD. The λ at which "
               "the statistics' totals (FP4 minus FP8 over all layers, in loss units) stand in the ratio r = gap "
               "backward / gap fprop that the fp4_backward and fp4_fprop runs measured: λ = r·ΔFLD / (ΔBWD − "
               "r·ΔFWD)" if fwd else
               f"SNIP prices the forward GEMM with FLD{'' if mu is None else f' + {mu:g}·FWD'} and the backward "
               "GEMMs with λ·BWD. The λ at which the statistics' totals (FP4 minus FP8 over all layers, in loss "
               "units) stand in the ratio the fp4_backward and fp4_fprop runs measured: λ = (gap backward / gap "
               f"fprop) · ΔFLD{'' if mu is None else f' (+ {mu:g}·ΔFWD)'} / ΔBWD")
        lines += ["## λ calibrated by the GEMM-kind plans", "",
                  how + "; 'λ at +2 SE' puts the backward's gap 2 standard errors higher.", ""]
        lines += _table("", ("phase", "gap fp4_fprop", "gap fp4_backward",
                             "ΔFLD (mnats)" if mu is None else f"ΔFLD + {mu:g}·ΔFWD (mnats)",
                         *(("ΔFWD (mnats)",) if fwd else ()), "ΔBWD (mnats)", "λ", "λ at +2 SE"),
                        (f"| {k['phase']} | {_fmt(k['gap_fprop'])} | {_fmt(k['gap_backward'])} | "
                         f"{k['d_fld'] * 1e3:.3g} | " + (f"{k['d_fwd'] * 1e3:.3g} | " if fwd else "") +
                         f"{k['d_bwd'] * 1e3:.3g} | " + " | ".join(
                             "n/a (no positive ratio)" if x is None else f"{x:.3g}" for x in (k["lam"], k["lam_2se"]))
                         + " |" for k in summary["kinds"]))[2:]  # the heading is above
    if summary["lambda_sweep"]:
        lines += ["## λ sweep (SNIP vs uniform FP8, quantized forward, pooled over phases, seeds and ρ)", "",
                  "| λ | gap (mnats) | n |", "|---|---|---|"]
        for lam, ms in summary["lambda_sweep"].items():
            lines.append(f"| {lam:g} | {_fmt(ms)} | {ms.n} |")
        lines += ["", f"Lowest mean gap at λ = {summary['best_lambda']:g} (the target rows above check λ = "
                      f"{report_lambda(s):g}).", ""]
    sp = summary["random_spread"]
    if sp.n:
        lines += [f"Spread of random plans within a cell (SD of val loss): {_fmt(sp)} mnats over {sp.n} cell(s).",
                  ""]
    if summary["ranking"]:
        lines += ["## Does the planner's objective rank the plans' outcomes?", "",
                  f"Spearman, over the distinct solved plans of a phase (every method, ρ and λ), between a "
                  f"prediction and the plan's mean quantized-forward gap to uniform FP8 after training. "
                  f"Objective = FLD + λ·BWD at λ = {report_lambda(s):g}, what the planner minimises; 'within ρ' "
                  f"averages the objective's Spearman over the ρ values (the FP4 share held fixed, as the planner's "
                  f"choice is), skipping a ρ where it is undefined (all plans tied, or fewer than 3; counted).",
                  "", "| phase | plans | objective | FLD alone | BWD alone | objective within ρ |",
                  "|---|---|---|---|---|---|"]
        for r in summary["ranking"]:
            lines.append(f"| {r['phase']} | {r['plans']} | " + " | ".join(
                "n/a" if not math.isfinite(r[k]) else f"{r[k]:+.2f}" for k in ("obj", "fld", "bwd",
                                                                                 "obj_within_rho"))
                + (f" ({r['obj_within_rho_skipped']} ρ skipped)" if r.get("obj_within_rho_skipped") else "") + " |")
    if data.get("versus"):
        lines += versus_markdown(data)
    lines += ["", "## Predicted vs measured forward divergence at the checkpoint", "",
              "Per plan: Σ predicted FLD of its layers (MC Fisher, from the statistics) and the measured "
              "quantized-minus-BF16 validation loss at the checkpoint, before any training (mnats).", "",
              "| phase | ρ | method | predicted FLD | measured | predicted BWD (loss units) |", "|---|---|---|---|---|---|"]
    seen = set()
    for r in data["records"]:
        key = (r["phase"], r["rho"], r["label"])
        if key in seen or r.get("measured_fld_at_ckpt") is None:
            continue
        seen.add(key)
        rho = "–" if r["rho"] is None else f"{r['rho']:g}"
        lines.append(f"| {r['phase']} | {rho} | {r['label']} | {r['predicted_fld'] * 1e3:.3g} | "
                     f"{r['measured_fld_at_ckpt'] * 1e3:+.3g} | {r['predicted_bwd'] * 1e3:.3g} |")
    if data.get("skipped"):
        lines += ["", "## Skipped plans", ""]
        for sk in data["skipped"]:
            lines.append(f"- {sk['phase']} ρ={sk['rho']:g} {sk['label']}: {sk['reason']}")
    lines += ["", "Plots: `compare_plans_gap.png` (gap against FP4 share), `compare_plans_curves.png` (training-"
              "loss difference to uniform FP8), `compare_plans_maps.png` (plan maps: blue FP8, orange FP4).", ""]
    path.write_text("\n".join(lines), encoding="utf-8")


def versus_markdown(data: Dict[str, Any]) -> List[str]:
    """The report's section on the ``--versus`` grids: paired differences per method, then SNIP against each."""
    v = data["versus"]
    mine = "per GEMM" if data["settings"].get("per_gemm") else "per layer"
    theirs = {True: "per GEMM", False: "per layer", None: "per layer and per GEMM"}[v["per_gemm"]]
    lines = ["", f"## Against the grid in `{v['source']}` (plans solved {theirs})", "",
             f"Paired over the {v['cells']} (phase, seed) cells both grids ran (their uniform FP8 runs are "
             f"bit-identical): this grid's validation loss minus the other's for the same method, ρ and λ "
             f"(plans solved {mine} here), in millinats; negative: this grid's plan is better.", "",
             "| phase | ρ | method | Δ (q) | Δ (bf16) | n |", "|---|---|---|---|---|---|"]
    for r in versus_rows(data["records"], v["records"]):
        lines.append(f"| {r['phase']} | {r['rho']:g} | {r['label']} | {_fmt(r['q'])} | {_fmt(r['bf16'])} | "
                     f"{r['q'].n} |")
    for snip in sorted({r["label"] for r in data["records"] if r["method"] == "best"}):
        lines += _versus_cross(data, v, snip)
    return lines


def _versus_cross(data: Dict[str, Any], v: Dict[str, Any], snip: str) -> List[str]:
    lines = []
    cross = versus_rows(data["records"], v["records"], mine_label=snip)
    if cross:
        lines += ["", f"### This grid's SNIP ({snip}) against every plan of the other grid", "",
                  "Paired in the same cells: this grid's SNIP run minus the other grid's run of the named method "
                  "(random: the mean of its random plans), in millinats; negative: this grid's SNIP is better.", "",
                  "| phase | ρ | other grid's method | Δ (q) | Δ (bf16) | n |", "|---|---|---|---|---|---|"]
        for r in cross:
            lines.append(f"| {r['phase']} | {r['rho']:g} | {r['label']} | {_fmt(r['q'])} | {_fmt(r['bf16'])} | "
                         f"{r['q'].n} |")
    return lines
