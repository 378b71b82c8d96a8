"""What SNIP did, in words for the console: one line per re-plan and the end-of-run summary's plan.

:func:`replan_line`: the layers the re-plan moved FP8 -> FP4 and FP4 -> FP8 (from the uniform FP8 the run starts
from, for the first plan), the plan's FP4 share against its target, the predicted and the measured forward
divergence, SNIP's seconds, and the command that shows the whole map. :func:`plan_line`: a plan in one line
(counts per precision, FP4 share, a compact per-block map while it stays short). Formatting only: the caller
(:class:`snip_ds.engine.state.SnipState`, :mod:`snip_ds.report.run_summary`) prints on rank 0.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional

from snip_ds.plan import Plan, fp4_share
from snip_ds.types import GEMMS, block_index, display_kinds, expert_pair, kind_labels, layer_kind

CHAR = {"bf16": "B", "fp8": "8", "fp4": "4"}  # as `snip-ds show` draws them
MAP_MAX_CHARS = 240  # a longer per-block map is left to `snip-ds show`


def plan_moves(previous: Optional[Plan], plan: Plan) -> Dict[str, Any]:
    """How ``plan`` differs from ``previous`` (None: the uniform FP8 an adaptive run starts from):
    ``{"unit": "layers" or "GEMMs", "to_fp4": n, "to_fp8": n, "other": n, "total": n}`` -- FP8 -> FP4, FP4 -> FP8,
    any other change (to or from bf16), and how many units the plan has. A per-GEMM plan (either one) counts GEMMs."""
    per_gemm = plan.per_gemm or (previous is not None and previous.per_gemm)
    new = plan.gemm_assignment()
    old = previous.gemm_assignment() if previous is not None else {f: {g: "fp8" for g in GEMMS} for f in new}
    gemms = GEMMS if per_gemm else GEMMS[:1]  # a per-layer plan's GEMMs agree: count the layer once
    pairs = [(old.get(f, {}).get(g), new[f][g]) for f in new for g in gemms]
    to_fp4 = sum(o == "fp8" and n == "fp4" for o, n in pairs)
    to_fp8 = sum(o == "fp4" and n == "fp8" for o, n in pairs)
    changed = sum(o != n for o, n in pairs)
    return {"unit": "GEMMs" if per_gemm else "layers", "to_fp4": to_fp4, "to_fp8": to_fp8,
            "other": changed - to_fp4 - to_fp8, "total": len(pairs)}


def _number(x: Optional[float]) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.3g}"


def replan_line(record: Mapping[str, Any], previous: Optional[Plan], plan: Plan, target: float,
                predicted: Optional[float], measured: Optional[float], show_dir: Optional[str] = None,
                first: bool = False) -> str:
    """The console line of one re-plan: ``record`` is the planner's history record (step: the optimizer steps
    done; collect_s, solve_s, fp4_share, status; ``measure_s`` when measured), ``previous`` the plan it replaced
    (None: uniform FP8), ``first`` whether it is the run's first plan (``previous`` its FP8 placeholder),
    ``target`` the FP4 share asked for, ``predicted``/``measured`` the plan's forward divergence (KL per token,
    nats; None when not measured), ``show_dir`` what ``snip-ds show`` reads (omitted when None)."""
    m = plan_moves(previous, plan)
    head = f"snip_ds: {'first plan' if first else 're-plan'} at step {int(record['step'])}: "
    if m["to_fp4"] + m["to_fp8"] + m["other"] == 0:
        moved = "plan unchanged"
    else:
        moved = f"{m['to_fp4']} {m['unit']} FP8->FP4, {m['to_fp8']} FP4->FP8"
        if m["other"]:
            moved += f", {m['other']} to or from BF16"
        if first:
            moved += f" (of {m['total']}, from the uniform FP8 start)"
    status = "" if record.get("status") in (None, "optimal") else f", plan {record['status']}"
    snip_s = record["collect_s"] + record["solve_s"] + record.get("measure_s", 0.0)
    line = (f"{head}{moved}; FP4 share {record['fp4_share']:.3f} (target {target:g}){status}; forward divergence "
            f"predicted {_number(predicted)}, measured {_number(measured)} nats/token; SNIP {snip_s:.1f} s "
            f"(statistics {record['collect_s']:.1f} s, solve {record['solve_s']:.2f} s)")
    if show_dir:
        line += f"; map: snip-ds show {show_dir}"
    return line


def block_map(plan: Plan) -> Optional[str]:
    """``0 8884444 | 1 4444448 | ...``: one group per decoder block, one char per layer kind (three, fprop/dgrad/
    wgrad, in a per-GEMM plan), with the kinds' labels in front; None for MoE pairs, layers outside blocks, or a
    map longer than :data:`MAP_MAX_CHARS`."""
    if any(expert_pair(f) is not None for f in plan.assignment):
        return None
    rows: Dict[int, Dict[str, str]] = {}
    for fqn, value in plan.gemm_assignment().items():
        try:
            block = block_index(fqn)
        except ValueError:
            return None
        cells = value.values() if plan.per_gemm else [value["fprop"]]
        rows.setdefault(block, {})[layer_kind(fqn)] = "".join(CHAR[p] for p in cells)
    kinds = list(display_kinds(plan.assignment))
    labels = kind_labels(kinds)
    blank = "." * (len(GEMMS) if plan.per_gemm else 1)
    sep = "/" if plan.per_gemm else ""
    groups = [f"{b} " + sep.join(rows[b].get(k, blank) for k in kinds) for b in sorted(rows)]
    text = f"({' '.join(labels.get(k, k) for k in kinds)}) " + " | ".join(groups)
    return text if len(text) <= MAP_MAX_CHARS else None


def plan_line(plan: Plan, flops: Mapping[str, float]) -> str:
    """A plan in one line: how many layers (GEMMs in a per-GEMM plan) run at each precision, the FP4 share of the
    linear FLOPs, and the per-block map (:func:`block_map`) where it is short enough."""
    counts: Dict[str, int] = {}
    for value in plan.gemm_assignment().values():
        for p in (value.values() if plan.per_gemm else [value["fprop"]]):
            counts[p] = counts.get(p, 0) + 1
    unit = "GEMMs" if plan.per_gemm else "layers"
    words = ", ".join(f"{p.upper()} {counts[p]}" for p in ("fp4", "fp8", "bf16") if counts.get(p))
    try:
        share = f"{fp4_share(plan.assignment, flops):.3f}"
    except ValueError:
        share = "n/a"
    line = f"{words} of {sum(counts.values())} {unit}, FP4 share {share} of the linear FLOPs"
    m = block_map(plan)
    return line + (f"; by block {m}" if m else "")
