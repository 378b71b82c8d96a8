"""How validate_metrics scores the statistics against the truths: rank correlations, split-half
reproducibility, calibration ratios (medians over layers), the per-GEMM figures, and reading the truths back
from a table an earlier run printed."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from snip_ds.experiments.paired import spearman as rank_correlation


TABLE_COLUMNS = {"FLD truth": "sym", "GN part": "gn", "one-shot": "one", "BWD truth": "drift"}


def read_truth_table(path: str, fqns: Sequence[str]) -> tuple:
    """The per-layer truths of an earlier run's printed table, as one-"batch" lists ``(sym, one, gn, drift)``.

    The table holds means only, so split-half figures are not available from it (they come out null).

    Raises:
        ValueError: the file is not such a table, or its layers are not this model's.
    """
    text = Path(path).read_text(encoding="utf-8").splitlines()
    header = next((i for i, line in enumerate(text) if line.startswith("layer ")), None)
    if header is None:
        raise ValueError(f"--truth_table {path}: no table header (a line starting with 'layer') found")
    names = [c.strip() for c in text[header][len("layer"):].strip().split("  ") if c.strip()]
    missing = [c for c in TABLE_COLUMNS if c not in names]
    if missing:
        raise ValueError(f"--truth_table {path}: the table lacks column(s) {missing}")
    out = {key: {} for key in TABLE_COLUMNS.values()}
    for line in text[header + 1:]:
        cells = line.split()
        if len(cells) != len(names) + 1 or not cells[0].startswith("model."):
            continue
        try:
            for col, key in TABLE_COLUMNS.items():
                out[key][cells[0]] = [float(cells[1 + names.index(col)])]
        except ValueError:
            raise ValueError(f"--truth_table {path}: unreadable row {line!r}")
    if set(out["sym"]) != set(fqns):
        raise ValueError(f"--truth_table {path}: its {len(out['sym'])} layers are not this model's {len(fqns)} "
                         f"(e.g. {sorted(set(fqns) ^ set(out['sym']))[:2]})")
    return out["sym"], out["one"], out["gn"], out["drift"]


def mean(xs: Sequence[float]) -> float:
    """Arithmetic mean of a non-empty sequence."""
    return sum(xs) / len(xs)


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation, 0 where it is undefined (a constant input)."""
    rho = rank_correlation(a, b)
    return rho if rho == rho else 0.0  # constant input -> NaN -> 0


def split_half(per_batch: Dict[str, List[float]]) -> Optional[float]:
    """Spearman between the per-layer means over the first and the second half of the batches (``None``
    with fewer than two batches)."""
    fqns = list(per_batch)
    half = len(next(iter(per_batch.values()))) // 2
    if half == 0:
        return None
    a = [mean(per_batch[f][:half]) for f in fqns]
    b = [mean(per_batch[f][half:2 * half]) for f in fqns]
    return spearman(a, b)


def median(xs: List[float]) -> float:
    """The middle element (the upper one of an even count; NaN for none)."""
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def per_gemm_figures(split: Dict[str, Dict], fqns: Sequence[str], stats: Dict[str, Any]) -> Dict[str, Any]:
    """How well each per-GEMM cost ranks and scales against the wgrad-only and dgrad-only drift truths.

    ``calibration_*`` is the median over layers of prediction / truth (as elsewhere in this script). The
    per-GEMM baselines price a GEMM by half its two operands' quantization errors (dgrad: G_Y and W; wgrad:
    G_Y and X), as :func:`snip_ds.planner.quant_err_costs` does; SNIP's default split gives dgrad and wgrad
    half of the direct BWD each, so its dgrad ranking is the direct estimate's.
    """
    def field(key: str) -> List[float]:
        return [float(stats["layers"][f][key]["fp4"]) for f in fqns]

    def half(field_name: str, a: str, b: str) -> List[float]:
        return [0.5 * (x + y) for x, y in zip(field(f"{field_name}_{a}"), field(f"{field_name}_{b}"))]

    truth = {k: [mean(split[k][f]) for f in fqns] for k in split}
    direct, prop = field("bwd_drift"), field("bwd_drift_propagated")
    dgrad_preds = {"direct": direct, "propagated": prop,
                   "quant_err": half("quant_err", "g", "w"), "rel_quant_err": half("rel_quant_err", "g", "w")}
    wgrad_preds = {"direct": direct,
                   "quant_err": half("quant_err", "g", "x"), "rel_quant_err": half("rel_quant_err", "g", "x")}
    ratios = [d / w for d, w in zip(truth["dgrad"], truth["wgrad"]) if w > 0]
    return {
        "wgrad_vs": {k: spearman(v, truth["wgrad"]) for k, v in wgrad_preds.items()},
        "dgrad_vs": {k: spearman(v, truth["dgrad"]) for k, v in dgrad_preds.items()},
        "dgrad_linears_vs": {k: spearman(v, truth["dgrad_linears"]) for k, v in dgrad_preds.items()},
        "calibration_direct_wgrad": median([p / t for p, t in zip(direct, truth["wgrad"]) if t > 0]),
        "calibration_propagated_dgrad": median([p / t for p, t in zip(prop, truth["dgrad"]) if t > 0]),
        "calibration_propagated_dgrad_linears": median([p / t for p, t in zip(prop, truth["dgrad_linears"])
                                                         if t > 0]),
        "dgrad_over_wgrad_median": median(ratios) if ratios else None,
        "dgrad_over_wgrad_total": sum(truth["dgrad"]) / sum(truth["wgrad"]) if sum(truth["wgrad"]) > 0 else None,
        "linears_share_of_dgrad_total": (sum(truth["dgrad_linears"]) / sum(truth["dgrad"])
                                         if sum(truth["dgrad"]) > 0 else None),
        "repro": {k: split_half(split[k]) for k in split},
    }
