"""Each family's status, the reasons grouped, and the survey written as a Markdown table and JSON rows.

A family's status, from its row (:func:`snip_ds.families.sweep.survey_family`):

* ``trains``: every plan ran its step, with quantized layers (linears or expert pairs), every planned layer
  ran (quantized under a quantized plan), every loss finite, and the adaptive run solved a plan;
* ``fails checks``: every plan ran, but a claim did not hold (a planned layer never ran, a loss was not
  finite, no adaptive plan was solved, nothing was quantized); the note says which;
* ``refused``: snip_ds stopped a plan before training with a one-line error (the note);
* ``crashes``: a plan raised anything else (the note: the error and its innermost frame in snip_ds, else the
  innermost frame), or the family's process died;
* ``timeout``: the family did not finish in the time given;
* ``not buildable``: the tiny model fails its plain forward and backward without snip_ds (the note: why).

A family is MoE when its model holds experts by structure (:mod:`snip_ds.families.structure`); it trains "per
expert" when it trains and snip_ds planned its (expert, projection) pairs.
"""
from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

from snip_ds.runtime.fileio import atomic_write_text

STATUSES = ("trains", "fails checks", "refused", "crashes", "timeout", "not buildable")
FORMAT = "snip_ds.families/1"


def _planned(row: dict) -> Tuple[int, int]:
    """(quantized linears, expert pairs) as planned (the largest over the plans that swapped)."""
    plans = row.get("plans", {}).values()
    return (max((p.get("quantized_linears", 0) for p in plans), default=0),
            max((p.get("expert_pairs", 0) for p in plans), default=0))


def problems(row: dict) -> List[Tuple[str, str]]:
    """Every problem of one family's row as ``(kind, message)``, kinds being the statuses other than
    ``trains``; a family's status is its most severe problem's kind."""
    if row.get("timed_out"):
        return [("timeout", row.get("error", ""))]
    if row.get("died"):
        return [("crashes", row.get("error", ""))]
    if not row.get("buildable"):
        where = row.get("build_where", "")
        return [("not buildable", row.get("build_error", "") + (f" ({where})" if where else ""))]
    plans: Dict[str, dict] = row.get("plans", {})
    found: List[Tuple[str, str]] = []
    crashes = OrderedDict()
    for p in plans.values():
        if p["result"] == "crash":
            crashes.setdefault(f"{p['error']} at {p.get('snip_frame') or p.get('where')}", []).append(p["plan"])
    found += [("crashes", f"{'/'.join(ps)}: {msg}") for msg, ps in crashes.items()]
    refusals = list(dict.fromkeys(p["error"] for p in plans.values() if p["result"] == "refused"))
    found += [("refused", msg) for msg in refusals]
    linears, pairs = _planned(row)
    if linears + pairs == 0 and not refusals and not crashes:
        found.append(("fails checks", "no layer quantized"))
    unrun = sorted({_pattern(n) for p in plans.values() for n in p.get("unrun", [])})
    if unrun:
        found.append(("fails checks", "planned but never run quantized: " + ", ".join(unrun)))
    nonfinite = [p["plan"] for p in plans.values() if p["result"] == "nonfinite"]
    if nonfinite:
        errors = [p["error"] for p in plans.values() if p["result"] == "nonfinite" and p["error"]]
        found.append(("fails checks", "loss not finite: " + ", ".join(nonfinite) + (f" ({errors[0]})" if errors
                                                                                     else "")))
    adaptive = plans.get("adaptive")
    if adaptive is not None and adaptive["result"] == "ok" and adaptive.get("fp4_share") is None:
        found.append(("fails checks", "adaptive: no plan solved"))
    return found


def classify(row: dict) -> Tuple[str, str]:
    """``(status, note)`` of one family's row: its most severe problem's kind and every problem, or
    ``trains`` and the adaptive plan's FP4 share."""
    found = problems(row)
    if found:
        order = {s: i for i, s in enumerate(("timeout", "not buildable", "crashes", "refused", "fails checks"))}
        status = min((kind for kind, _ in found), key=order.__getitem__)
        return status, "; ".join(msg for _, msg in found)
    share = row.get("plans", {}).get("adaptive", {}).get("fp4_share")
    note = "" if share is None else f"adaptive FP4 share {share:.2f}"
    left_out = sorted({_pattern(n) for p in row.get("plans", {}).values() for n in p.get("left_out", [])})
    if left_out:  # named by snip_ds as never run, and out of the plan's share
        note += ("; " if note else "") + "never run, left out of the plan: " + ", ".join(left_out)
    return "trains", note


def _pattern(name: str) -> str:
    """A layer name with its indices as ``N`` (``model.layers.N.mamba.dt_proj``)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "N", name)


def reason_key(text: str) -> str:
    """A failure message with what differs between families replaced (quoted names, class names, numbers),
    so that one cause gathers its families."""
    kind, sep, rest = text.partition(": ")
    if not sep or " " in kind:
        kind, rest = "", text
    if sep and re.fullmatch(r"[a-z0-9/]+", kind):  # a crash's plans: keep them, and the exception type after
        inner = reason_key(rest)
        return f"{kind}: {inner}"
    rest = re.sub(r"'[^']*'", "'…'", rest)
    rest = re.sub(r"\btransformers\.models\.\w+\.\w+", "transformers.models.…", rest)
    rest = re.sub(r"\btransformers/models/\w+/\w+\.py", "transformers/models/….py", rest)
    rest = re.sub(r" \(and \d+ more\)", "", rest)
    rest = re.sub(r"\b\w*[A-Z]\w*[A-Z]\w*\b", lambda m: m.group(0) if m.group(0).isupper() else "<class>", rest)
    rest = re.sub(r"\d+", "N", rest)
    return ((kind + ": ") if kind else "") + rest[:240]


def annotate(rows: Sequence[dict]) -> List[dict]:
    """The rows with ``status``, ``note``, ``quantized_linears``, ``expert_pairs`` and ``per_expert`` set."""
    out = []
    for row in rows:
        row = dict(row)
        row["status"], row["note"] = classify(row)
        row["quantized_linears"], row["expert_pairs"] = _planned(row)
        row["per_expert"] = bool(row.get("moe")) and row["status"] == "trains" and row["expert_pairs"] > 0
        out.append(row)
    return out


def summary(rows: Sequence[dict]) -> Dict[str, Dict[str, int]]:
    """Counts per status, of all families and of the MoE ones (annotated rows)."""
    def count(selected):
        c = {s: sum(1 for r in selected if r["status"] == s) for s in STATUSES}
        c["families"] = len(selected)
        c["buildable"] = len(selected) - c["not buildable"]
        return c

    moe = [r for r in rows if r.get("moe")]
    result = {"all": count(rows), "moe": count(moe)}
    result["moe"]["per_expert"] = sum(1 for r in moe if r["per_expert"])
    return result


def groups(rows: Sequence[dict]) -> Dict[str, Dict[str, List[str]]]:
    """``{kind: {cause: [model types]}}`` of every problem of every family (a family that crashes and also
    leaves a layer unrun is under both), the causes ordered by how many families share them."""
    out: Dict[str, Dict[str, List[str]]] = {}
    for row in rows:
        for kind, message in problems(row):
            key = reason_key(message)
            if kind == "refused" and "expert" in message.lower():  # experts refused: are there any by structure?
                key += " [MoE by structure]" if row.get("moe") else " [no experts by structure]"
            members = out.setdefault(kind, {}).setdefault(key, [])
            if row["model_type"] not in members:
                members.append(row["model_type"])
    return {s: OrderedDict(sorted(g.items(), key=lambda kv: (-len(kv[1]), kv[0]))) for s, g in out.items()}


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(rows: Sequence[dict], meta: Dict[str, Any]) -> str:
    """The table users read: counts, the causes of what does not train, and one row per family."""
    counts = summary(rows)
    a, m = counts["all"], counts["moe"]
    lines = [
        "# Supported model families",
        "",
        f"Every causal-LM family of the installed transformers ({meta['transformers']}; torch {meta['torch']}), "
        "built tiny from its own config class and trained one step with snip_ds through the Hugging Face "
        "`Trainer` and `snip_ds.hf.add_snip` (CPU, FP32 weights, AdamW, no DeepSpeed) at each plan: "
        f"{', '.join(meta['plans'])}. Generated {meta['date']} by",
        "",
        "```",
        meta["command"],
        "```",
        "",
        f"({meta['wall_seconds']:.0f} s with {meta['jobs']} job(s), each family in a process of its own that "
        f"peaked at {meta.get('peak_rss_mb', 0):.0f} MB resident at most; raw rows: [{meta['json_name']}]"
        f"({meta['json_name']})). How a family is built, run and judged: `snip_ds/families/`; rows named "
        "`<model type>:<variant>` switch on what the family's defaults leave off (its MoE layers).",
        "",
        "A family **trains** when every plan ran its step with quantized layers, every planned layer ran "
        "quantized in the step (each `SnipLinear` called, each MoE expert routed tokens), the losses were "
        "finite and the adaptive run collected statistics and solved a plan before its step. **Refused**: "
        "snip_ds stopped before training with a one-line error. **Crashes**: any other error. **Not "
        "buildable**: the tiny model fails a plain forward and backward without snip_ds. A family is **MoE** "
        "when its model holds experts (stacked, flattened or listed expert weights beside a router); **per "
        "expert**: it trains with a precision per (expert, projection) pair.",
        "",
        "| | families | buildable | trains | fails checks | refused | crashes | timeout | per expert |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| all | {a['families']} | {a['buildable']} | {a['trains']} | {a['fails checks']} | {a['refused']} | "
        f"{a['crashes']} | {a['timeout']} | |",
        f"| MoE | {m['families']} | {m['buildable']} | {m['trains']} | {m['fails checks']} | {m['refused']} | "
        f"{m['crashes']} | {m['timeout']} | {m['per_expert']} |",
        "",
    ]
    titles = {"fails checks": "Runs, but a check fails", "refused": "Refused", "crashes": "Crashes",
              "timeout": "Timed out", "not buildable": "Not buildable"}
    found = groups(rows)
    if found:
        lines += ["## Why the others do not train", ""]
    for status in STATUSES[1:]:
        if status not in found:
            continue
        lines += [f"### {titles[status]}", ""]
        for cause, types in found[status].items():
            lines.append(f"- {len(types)} × `{_cell(cause)}`: {', '.join(types)}")
        lines.append("")
    lines += ["## Families", "",
              "| model type | class | MoE | status | quantized linears | expert pairs | note |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        moe = "per expert" if r["per_expert"] else "yes" if r.get("moe") else ""
        note = r["note"]
        if r.get("override"):
            note = (note + "; " if note else "") + f"config override: {r['override']}"
        lines.append(f"| {r['model_type']} | {_cell(r.get('class', ''))} | {moe} | {r['status']} | "
                     f"{r['quantized_linears']} | {r['expert_pairs']} | {_cell(note)} |")
    return "\n".join(lines) + "\n"


def write(rows: Sequence[dict], markdown: Path, json_path: Path, meta: Dict[str, Any]) -> None:
    """Writes the table and the raw rows (each file atomically)."""
    meta = dict(meta, json_name=os.path.relpath(json_path, markdown.parent))
    head = {"format": FORMAT, "meta": meta, "summary": summary(rows)}
    # one row a line: small, and a re-run's diff shows the families that changed
    lines = [json.dumps(head)[:-1] + ', "rows": ['] + [json.dumps(r) + "," for r in rows]
    if rows:
        lines[-1] = lines[-1][:-1]
    atomic_write_text(json_path, "\n".join(lines) + "\n]}\n")
    atomic_write_text(markdown, render_markdown(rows, meta))


__all__ = ["FORMAT", "STATUSES", "annotate", "classify", "groups", "reason_key", "render_markdown", "summary",
           "write"]
