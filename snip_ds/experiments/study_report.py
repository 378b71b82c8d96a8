"""The plan study's report: ``summary.json``, ``summary.md`` and ``summary_seeds.png`` (paired differences per
model seed) from ``cells.json`` (:mod:`snip_ds.experiments.study_stats` computes every figure)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, List

from snip_ds.experiments.results import json_default
from snip_ds.experiments.study_stats import (EQUIVALENCE, FP4_Z_TARGET, SE_TARGET, Z_RESOLVE, ClusteredMean,
                                             analyse)

REGIME_WORDS = {"main": "main grid", "stress": "**stress regime** (a harsher recipe, reported apart from the main "
                "grid; not evidence about NVFP4)"}


def _m(x: float) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x * 1e3:+.2f}"


def _s(x: float) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x * 1e3:.2f}"


def _diff(d: ClusteredMean) -> str:
    return f"{_m(d.mean)} ± {_s(d.se)}"


def write_summary(out_dir: Path) -> Dict[str, Any]:
    """Writes the report of the study in ``out_dir`` (its ``cells.json``, and ``plans.json`` where present);
    returns :func:`~snip_ds.experiments.study_stats.analyse`'s result with the settings.

    Raises:
        FileNotFoundError: ``out_dir`` has no ``cells.json``.
        ValueError: It holds no rows, or pairs two arms at unequal FP4 shares.
    """
    out_dir = Path(out_dir)
    path = out_dir / "cells.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run the study first")
    data = json.loads(path.read_text(encoding="utf-8"))
    if not data["rows"]:
        raise ValueError(f"{path}: no rows to summarise")
    plans_path = out_dir / "plans.json"
    plans = json.loads(plans_path.read_text(encoding="utf-8")) if plans_path.is_file() else {}
    ran = {}
    for r in data["rows"]:
        if not r.get("shared_with") and r.get("seconds") is not None:
            ran.setdefault(r["arm"], []).append(r["seconds"])
    summary = dict(analyse(data["rows"]), settings=data["settings"], wall_seconds=data.get("wall_seconds"),
                   run_seconds={arm: sum(v) / len(v) for arm, v in ran.items()},
                   shares={ms: p["share"] for ms, p in plans.items()},
                   skipped=[dict(model_seed=ms, **s) for ms, p in plans.items() for s in p.get("skipped", [])])
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=json_default), encoding="utf-8")
    (out_dir / "summary.md").write_text("\n".join(markdown(summary)) + "\n", encoding="utf-8")
    plot_seeds(summary, out_dir / "summary_seeds.png")
    return summary


def markdown(s: Dict[str, Any]) -> List[str]:
    """The lines of ``summary.md``."""
    st, cost, t = s["settings"], s["fp4_cost"], s["targets"]
    lines = [f"# Plan study: {REGIME_WORDS.get(st['regime'], st['regime'])}", "",
             f"Model `{st['model_config']}`, warm-up {st['warmup_steps']} steps per model seed, {st['steps']} steps "
             f"per run (learning rate {st['lr']:g} decaying linearly to 0), ρ {st['rho']:g}, λ {st['lam']:g}, FP4 "
             f"{st['fp4_recipe']}, gradients rounded {'stochastically' if st['stochastic_rounding'] else 'to nearest'}"
             f"; {len(s['model_seeds'])} model seed(s) × {len(s['data_seeds'])} data seed(s); "
             f"{st['eval_batches']}×{st['batch_size']} validation sequences. FP4 share of the solved arms: "
             + (", ".join(f"{v:.4f} (model seed {k})" for k, v in s["shares"].items()) or "–")
             + (f". {s['wall_seconds'] / 60:.1f} min in all." if s.get("wall_seconds") else "."), "",
             "Every number is a paired difference of validation loss in **millinats**: per cell (a model seed × a "
             "data seed: one checkpoint, one data order, one set of rounding seeds) one arm minus the other, then "
             "the mean over cells. *SE*: the larger of the cluster-robust (CR1) SE by model seed, which allows the "
             "cells of one model seed to be correlated, and the pooled SE (with one model seed: the pooled SE, "
             "said so); *CR1* and *pooled* (every cell taken as independent) beside it; *between seeds*: the SD "
             "of the model seeds' own means.", "",
             "## FP4's cost (uniform FP4 − uniform FP8)", "",
             f"{_diff(cost)} (SE: {cost.se_kind}; CR1 {_s(cost.se_cluster)}, pooled {_s(cost.se_pooled)}, between "
             f"seeds {_s(cost.between_sd)}; {cost.n} cells)" + ("" if t["fp4_cost_in_se"] is None else
                                   f": {t['fp4_cost_in_se']:.1f} SE (target ≥ {FP4_Z_TARGET:g})") + ".", "",
             "## SNIP against each arm, at the same FP4 share", "",
             f"SNIP − arm (negative: SNIP better). A **win** (or **loss**) only beyond {Z_RESOLVE:g} SE; a **tie** "
             f"only when the 90 % interval lies inside ± {EQUIVALENCE:.0%} of FP4's cost; else *unresolved*. "
             "Each arm is paired with SNIP solved at the arm's own FP4 share (a rule that lands elsewhere, as "
             "`last_k_fp8` in whole blocks can, is paired with `snip@<share>`), checked cell by cell.", "",
             "| arm | paired with | FP4 share | SNIP − arm | SE | CR1 | pooled | between seeds | 90 % interval | "
             "cells | verdict |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in s["comparisons"]:
        d = c["diff"]
        lines.append(f"| {c['arm']} | {c['reference']} | {c['fp4_share']:.4f} | {_m(d.mean)} | {_s(d.se)} | "
                     f"{_s(d.se_cluster)} | {_s(d.se_pooled)} | {_s(d.between_sd)} | "
                     f"[{_m(c['ci90'][0])}, {_m(c['ci90'][1])}] | {d.n} | {c['verdict']} |")
    lines += ["", f"Equivalence bound: ± {_s(s['comparisons'][0]['bound']) if s['comparisons'] else '–'}.", "",
              "## Every arm against uniform FP8", "", "| arm | arm − uniform FP8 | pooled SE | cells |",
              "|---|---|---|---|"]
    lines += [f"| {g['arm']} | {_diff(g['diff'])} | {_s(g['diff'].se_pooled)} | {g['diff'].n} |" for g in s["gaps"]]
    seeds = [str(m) for m in s["model_seeds"]]
    lines += ["", "## Per model seed (SNIP − arm; mean ± SE over that seed's data seeds)", "",
              "| arm | " + " | ".join(f"model seed {m}" for m in seeds) + " |", "|---|" + "---|" * len(seeds)]
    for c in s["comparisons"]:
        per = c["per_seed"]
        lines.append(f"| {c['arm']} | " + " | ".join(
            "–" if m not in per else f"{_m(per[m]['mean'])} ± {_s(per[m]['se'])}" for m in seeds) + " |")
    resolved = ", ".join(f"{a}: {'–' if v is None else 'yes' if v else '**no**'}" for a, v in t["resolved"].items())
    lines += ["", "## Targets", "",
              f"- FP4 − FP8 at least {FP4_Z_TARGET:g} SE: {'yes' if t['fp4_cost_met'] else '**no**'}.",
              f"- Every SE against SNIP at most {SE_TARGET * 1e3:g} millinats: {'yes' if t['se_met'] else '**no**'}"
              f" (largest {_s(t['max_se'])}).",
              f"- SNIP against each resolved (a win, a loss or a tie): {resolved}."]
    if s["skipped"]:
        lines += ["", "Arms not run: " + "; ".join(f"model seed {k['model_seed']} {k['arm']} ({k['reason']})"
                                                   for k in s["skipped"]) + "."]
    lines += ["", "Mean seconds per run (training and evaluation; identical plans of a cell run once): " + ", ".join(
        f"{arm} {sec:.1f}" for arm, sec in s["run_seconds"].items()) + ".",
              "", "Plot: `summary_seeds.png` (SNIP − arm per model seed, and pooled with its SE)."]
    return lines


def plot_seeds(s: Dict[str, Any], path: Path) -> None:
    """SNIP − arm per comparison: each model seed's mean ± SE (colours) and the study's mean ± SE (black), with
    the equivalence band shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    comps = s["comparisons"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(comps) + 2), 4.5))
    seeds = [str(m) for m in s["model_seeds"]]
    width = 0.6 / max(len(seeds), 1)
    for j, m in enumerate(seeds):
        xs, ys, es = [], [], []
        for i, c in enumerate(comps):
            p = c["per_seed"].get(m)
            if p and p["mean"] is not None:
                xs.append(i - 0.3 + (j + 0.5) * width)
                ys.append(p["mean"] * 1e3)
                es.append((p["se"] or 0.0) * 1e3)
        ax.errorbar(xs, ys, yerr=es, fmt="o", ms=4, capsize=2, label=f"model seed {m}")
    for i, c in enumerate(comps):
        d = c["diff"]
        ax.errorbar([i + 0.38], [d.mean * 1e3], yerr=[(d.se if math.isfinite(d.se) else 0.0) * 1e3], fmt="s",
                    color="black", capsize=3, label="all cells (SE)" if i == 0 else None)
    if comps and math.isfinite(comps[0]["bound"]):
        b = comps[0]["bound"] * 1e3
        ax.axhspan(-b, b, color="grey", alpha=0.15, label=f"± {EQUIVALENCE:.0%} of FP4's cost")
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(comps)))
    ax.set_xticklabels([c["arm"] for c in comps], rotation=20, fontsize=8)
    ax.set_ylabel("SNIP − arm, val loss (millinats)")
    ax.set_title(f"Plan study ({s['settings']['regime']}): negative = SNIP better")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
