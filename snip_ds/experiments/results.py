"""A grid's result file, ``compare_plans.json``: written atomically, merged from parts, and read as the other
side of a ``--versus`` comparison.

The file holds ``settings`` (the grid's flags and model), ``records`` (one per run), ``skipped`` (plans the
pins made unreachable), ``plans`` (every solved plan's assignment, per phase) and ``wall_seconds``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Sequence

from snip_ds.experiments.grid import METHOD_CHOICES

PREFIX = "compare_plans"
# settings that parts of one grid may hold different subsets of: merged as unions (sort keys)
_UNION = {"seeds": int, "rhos": float, "lambdas": float, "methods": lambda m: METHOD_CHOICES.index(m)}


def json_default(o):
    """What json writes for MeanSE (and anything else with ``to_dict``); other objects as text."""
    return o.to_dict() if hasattr(o, "to_dict") else str(o)


def write_json(data: Dict[str, Any], path: Path) -> None:
    """Writes ``data`` as indented JSON to ``path`` through a temporary file: never a half-written file."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=json_default),
                   encoding="utf-8")
    os.replace(tmp, path)


def merge_results(dirs: Sequence[str], note: str = "") -> Dict[str, Any]:
    """Reads ``compare_plans.json`` from each directory and joins them: one process per phase, or more seeds
    (and a subset of its ρ, λ and methods) for a phase another part ran.

    Parts that share a phase must have warmed up to the same step and run disjoint (phase, seed) cells, and
    every plan both solved (same label and ρ) must be the same plan: the same checkpoint and statistics.
    Seeds, ρ, λ and methods of the merged settings are the unions; every record keeps its own.

    Raises:
        FileNotFoundError: A directory has no ``compare_plans.json``.
        ValueError: The runs disagree on another setting, a shared phase's warm-up or plans, or repeat a cell.
    """
    parts = []
    for d in dirs:
        path = Path(d) / f"{PREFIX}.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        parts.append(json.loads(path.read_text(encoding="utf-8")))
    data = parts[0]
    if len(parts) == 1:
        if note:
            data["settings"]["note"] = note
        return data
    free = {"phases", "command", "note", "threads", "report_lambda"} | set(_UNION)
    settings = dict(data["settings"], phases={}, command=[], note=note, **{k: [] for k in _UNION})
    records, skipped, plans, wall, cells = [], [], {}, 0.0, set()
    for d, part in zip(dirs, parts):
        st = part["settings"]
        diff = sorted(k for k in set(st) | set(data["settings"]) if k not in free
                      and st.get(k) != data["settings"].get(k))
        if diff:
            raise ValueError(f"{d}: settings differ from {dirs[0]} in {', '.join(diff)}; cannot merge")
        phases = st["phases"] if isinstance(st["phases"], dict) else {}
        for name, steps in phases.items():
            if settings["phases"].get(name, steps) != steps:
                raise ValueError(f"{d}: phase {name!r} warmed up {steps} steps here and "
                                 f"{settings['phases'][name]} in an earlier part; cannot merge")
        mine = {(r["phase"], r["seed"]) for r in part["records"]}
        if mine & cells:
            raise ValueError(f"{d}: (phase, seed) cell(s) {sorted(mine & cells)[:3]} appear in an earlier part too")
        cells |= mine
        for name, ps in part.get("plans", {}).items():
            known = {(p["label"], p["rho"]): p for p in plans.setdefault(name, [])}
            for p in ps:
                same = known.get((p["label"], p["rho"]))
                if same is None:
                    plans[name].append(p)
                elif same["assignment"] != p["assignment"]:
                    raise ValueError(f"{d}: phase {name!r} solved another {p['label']} plan at rho {p['rho']:g} "
                                     f"than an earlier part: not the same checkpoint and statistics; cannot merge")
        settings["phases"].update(phases)
        for key, kind in _UNION.items():
            settings[key] = sorted(set(settings[key]) | set(st.get(key, [])), key=kind)
        settings["command"].append(st["command"])
        records += part["records"]
        skipped += [s for s in part.get("skipped", []) if s not in skipped]
        wall += part.get("wall_seconds", 0.0)
    settings["command"] = " ; ".join(settings["command"])
    return dict(settings=settings, records=records, skipped=skipped, plans=plans, wall_seconds=wall)


# settings two grids compared with --versus may differ in (the rest must match, as must their FP8 runs)
VERSUS_FREE = {"phases", "seeds", "methods", "command", "full_command", "note", "threads", "per_gemm", "dgrad_cost",
               "dgrad_calibration", "rhos", "lambdas", "lambda_default", "num_random", "bwd_rounding", "bwd_key",
               "forward_drift", "fwd_lambda", "report_lambda"}
_VERSUS_KEEP = ("phase", "seed", "rho", "label", "method", "fp4_share", "val_loss", "val_loss_bf16_forward")
# what a run repeated in two --versus grids must match to count once (the same plan, run bit for bit alike)
_RERUN_SAME = ("method", "plan_digest", "fp4_share", "val_loss", "val_loss_bf16_forward")


def versus_data(data: Dict[str, Any], other_dirs: Sequence[str]) -> Dict[str, Any]:
    """The solved-plan records of the grids in ``other_dirs`` for a paired comparison with ``data``'s grid.

    Each grid must have run cells of this one: the same settings (apart from :data:`VERSUS_FREE`) and, in
    every (phase, seed) cell they share, bit-identical uniform FP8 runs, i.e. the same checkpoint, data
    order and rounding seeds. Then a plan's validation loss in one grid minus the same method's in the other
    is a paired difference, e.g. per-GEMM against per-layer plans. Several grids (e.g. the parts of one, or
    baselines and another SNIP) are joined; a run that two of them hold (the same plan label in the same cell) counts
    once if it is the same plan with bit-identical losses in both, and is refused otherwise.

    Raises:
        FileNotFoundError: a directory has no ``compare_plans.json``.
        ValueError: a directory is named twice, or a grid differs in a setting, shares no cell, ran a shared
            cell differently, or repeats another's run with another plan or result.
    """
    if isinstance(other_dirs, (str, Path)):
        other_dirs = [other_dirs]
    def fp8(d):
        return {(r["phase"], r["seed"]): r["val_loss"] for r in d["records"] if r["method"] == "uniform_fp8"}

    records, cells, per_gemm, seen = [], set(), set(), {}
    named = [str(Path(d).resolve()) for d in other_dirs]
    twice = sorted({d for d in named if named.count(d) > 1})
    if twice:
        raise ValueError(f"--versus names {twice[0]} twice")
    for other_dir in other_dirs:
        other = merge_results([other_dir])
        mine, theirs = data["settings"], other["settings"]
        diff = sorted(k for k in set(mine) | set(theirs) if k not in VERSUS_FREE and mine.get(k) != theirs.get(k))
        if diff:
            raise ValueError(f"{other_dir}: settings differ in {', '.join(diff)}; --versus compares grids that "
                             f"differ only in {', '.join(sorted(VERSUS_FREE))}")
        a, b = fp8(data), fp8(other)
        common = sorted(set(a) & set(b))
        if not common:
            raise ValueError(f"{other_dir}: no (phase, seed) cell in common with this grid")
        bad = [c for c in common if a[c] != b[c]]
        if bad:
            raise ValueError(f"{other_dir}: uniform FP8 ended differently in cell(s) {bad[:3]}: not the same "
                             f"checkpoints, data orders and seeds, so nothing can be paired")
        shared = set(common)
        cells |= shared
        per_gemm.add(bool(theirs.get("per_gemm", False)))
        for r in other["records"]:
            if r["rho"] is None or (r["phase"], r["seed"]) not in shared:
                continue
            key = (r["phase"], r["seed"], r["rho"], r["label"])
            if key in seen:
                first_dir, first = seen[key]
                if all(first.get(k) == r.get(k) for k in _RERUN_SAME):
                    continue  # a bit-identical rerun of the same plan in the same cell: one observation
                raise ValueError(f"{other_dir}: {r['label']} at rho {r['rho']:g} in cell {key[:2]} ran in "
                                 f"{first_dir} too, with another plan or result; --versus grids may repeat a "
                                 f"run only bit for bit")
            seen[key] = (other_dir, r)
            records.append({k: r.get(k) for k in _VERSUS_KEEP})
    return dict(source=", ".join(str(d) for d in other_dirs), per_gemm=per_gemm.pop() if len(per_gemm) == 1
                else None, cells=len(cells), records=records)
