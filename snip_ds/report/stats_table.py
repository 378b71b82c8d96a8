"""``snip-ds show STATS.json``: a statistics file as a table, one row per layer.

Each row holds the layer's share of the linear FLOPs, its FLD and BWD at fp8 and fp4 (nats of training loss:
what running its GEMMs at that precision is predicted to cost the loss, docs/method.md) and, where a plan is at
hand (``--plan``, else the ``plan.json`` beside the statistics file, as a run writes them), the precision the plan
gives it. ``--sort`` orders the rows by name or, largest first, by a column's fp4 value. No torch.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Optional

from snip_ds.report.artifacts import PLAN_FILE, kind_of, load_plan, load_stats
from snip_ds.types import GEMMS

SORTS = ("layer", "fld", "bwd", "cost", "flops")
"""``layer``: the model's order (the statistics file's: block by block); ``fld``, ``bwd``: the fp4 value, largest
first; ``cost``: FLD + λ·BWD at fp4, the planner's cost, largest first; ``flops``: the layer's FLOPs, largest
first."""
_DEFAULT_LAMBDA = 2.0  # a statistics file without "lambda": the "snip" section's default bwd_lambda


def is_stats_file(path: str) -> bool:
    """Whether ``path`` is a file holding a statistics artifact (``format`` snip_ds.stats/1)."""
    p = Path(path)
    if not p.is_file():
        return False
    try:
        return kind_of(json.loads(p.read_text(encoding="utf-8"))) == "statistics"
    except (OSError, ValueError):
        return False  # the plan reader names what is wrong with it


def _number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _cell(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.3e}"


def _precision(value: Any) -> str:
    return value if isinstance(value, str) else "/".join(value[g] for g in GEMMS)


def _plan_beside(stats_path: Path, plan_path: Optional[str]):
    """The plan to show beside the statistics, its source, and a note for the table's head."""
    if plan_path is not None:
        plan, source = load_plan(plan_path)
        return plan, f"precisions from {source}"
    beside = stats_path.parent / PLAN_FILE
    if not beside.is_file():
        return None, f"no {PLAN_FILE} beside it: no precisions (name a plan with --plan)"
    try:
        plan, source = load_plan(beside)
    except ValueError as err:
        return None, f"no precisions: {err}"
    return plan, f"precisions from {source}"


def show_stats(path: str, sort: str = "layer", plan_path: Optional[str] = None) -> str:
    """The table of the statistics file ``path`` (see the module), rows in ``sort`` order (:data:`SORTS`).

    Raises:
        FileNotFoundError, ValueError: a missing or bad statistics or plan file (one line naming it).
    """
    if sort not in SORTS:
        raise ValueError(f"--sort: unknown value {sort!r}; valid: {', '.join(SORTS)}")
    stats, source = load_stats(path)
    plan, note = _plan_beside(Path(path), plan_path)
    lam = _number(stats.get("lambda"))
    lam = _DEFAULT_LAMBDA if lam is None else lam
    layers: Mapping[str, Mapping[str, Any]] = stats["layers"]
    total = sum(rec["flops"] for rec in layers.values()) or 1.0
    rows = []
    for order, (fqn, rec) in enumerate(layers.items()):
        fld = {p: _number(rec["fld"].get(p)) for p in ("fp8", "fp4")}
        bwd = {p: _number(rec["bwd"].get(p)) for p in ("fp8", "fp4")}
        cost = None if fld["fp4"] is None or bwd["fp4"] is None else fld["fp4"] + lam * bwd["fp4"]
        if plan is None:
            chosen = ""
        else:
            chosen = _precision(plan.assignment[fqn]) if fqn in plan.assignment else "(not in plan)"
        flags = [name for name in ("nonfinite", "no_calls", "no_tokens") if rec.get(name) is True]
        rows.append({"name": fqn, "order": order, "flops": rec["flops"], "fld": fld, "bwd": bwd, "cost": cost, "plan": chosen,
                     "flags": ", ".join(flags)})
    if sort != "layer":  # largest first; a value that is not finite last; ties in the model's order
        def value(r):
            v = r[sort] if sort in ("cost", "flops") else r[sort]["fp4"]
            return (v is None, -(v or 0.0), r["order"])
        rows.sort(key=value)
    head = ["layer", "FLOPs %", "FLD fp8", "FLD fp4", "BWD fp8", "BWD fp4", f"FLD+{lam:g}·BWD fp4"]
    head += ["plan"] if plan is not None else []
    table = []
    for r in rows:
        cells = [r["name"], f"{100.0 * r['flops'] / total:.2f}", _cell(r["fld"]["fp8"]), _cell(r["fld"]["fp4"]),
                 _cell(r["bwd"]["fp8"]), _cell(r["bwd"]["fp4"]), _cell(r["cost"])]
        cells += [r["plan"]] if plan is not None else []
        table.append(cells + ([f"({r['flags']})"] if r["flags"] else []))
    widths = [max(len(row[i]) for row in table + [head] if i < len(row)) for i in range(len(head))]
    lines = [f"{source}: statistics at step {stats.get('step', '?')} (after that many optimizer steps), "
             f"{len(rows)} layers, λ {lam:g}; {note}",
             "FLD, BWD: the loss increase predicted for running the layer's GEMMs at that precision, nats; "
             + ("rows in the model's order" if sort == "layer" else f"rows sorted by {sort} at fp4, largest first"),
             "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths)))]
    for cells in table:
        lines.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) if i < len(widths) else c
                               for i, c in enumerate(cells)).rstrip())
    return "\n".join(lines)


__all__ = ["SORTS", "is_stats_file", "show_stats"]
