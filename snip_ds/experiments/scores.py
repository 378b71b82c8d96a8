"""How validate_metrics scores the statistics against the truths: rank correlations, split-half
reproducibility, calibration ratios (medians over layers), the per-GEMM figures; and the per-layer table it
prints, which a later run can read the truths back from (``--truth_table``)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from snip_ds.experiments.paired import spearman
from snip_ds.experiments.truths import Measured


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


def split_half(per_batch: Dict[str, List[float]]) -> Optional[float]:
    """Spearman between the per-layer means over the first and the second half of the batches (``None``
    with fewer than two batches; NaN where a half is constant over the layers)."""
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


def variants(m: Measured) -> Tuple[Dict[str, List[float]], Dict[str, List[float]], Dict[str, List[float]]]:
    """Per layer: the truths' means (``fld``, ``one``, ``gn``, ``bwd``; NaN without the BWD truth), and every FLD
    and BWD estimate scored against them (each estimator's and form's, and the quantization-error baselines)."""
    fqns = m.fqns
    truth = {"fld": [mean(m.sym[f]) for f in fqns], "one": [mean(m.one[f]) for f in fqns],
             "gn": [mean(m.gn[f]) for f in fqns],
             "bwd": [mean(m.drift[f]) for f in fqns] if m.drift is not None else [float("nan")] * len(fqns)}

    def pred(est: str, key: str) -> List[float]:
        return [m.stats[est]["layers"][f][key]["fp4"] for f in fqns]

    prop_total = [a + b for a, b in zip(pred("mc_fisher", "bwd_drift"), pred("mc_fisher", "bwd_drift_propagated"))]
    fld_variants = {
        "mc_fisher": pred("mc_fisher", "fld"), "empirical": pred("empirical", "fld"),
        "isotropic": pred("isotropic", "fld"), "mc_fisher_channel": pred("mc_fisher", "fld_channel"),
        "empirical_channel": pred("empirical", "fld_channel"), "isotropic_channel": pred("isotropic", "fld_channel"),
        "quant_err": pred("mc_fisher", "quant_err"),
        "rel_quant_err": pred("mc_fisher", "rel_quant_err"), "first_order": pred("mc_fisher", "first_order"),
        "one_shot_truth": truth["one"]}
    bwd_variants = {
        "direct": pred("mc_fisher", "bwd_drift"), "loss_units_mc_fisher": pred("mc_fisher", "bwd"),
        "direct_systematic": pred("mc_fisher", "bwd_drift_bias"),
        "loss_units_empirical": pred("empirical", "bwd"), "direct_plus_propagated": prop_total,
        "propagated_only": pred("mc_fisher", "bwd_drift_propagated"),
        "quant_err": pred("mc_fisher", "quant_err"), "rel_quant_err": pred("mc_fisher", "rel_quant_err")}
    return truth, fld_variants, bwd_variants


def print_table(m: Measured, truth: Dict[str, List[float]], fld_variants: Dict[str, List[float]],
                bwd_variants: Dict[str, List[float]]) -> None:
    """Prints one row per layer: the truths' means beside the main estimates (what ``--truth_table`` reads)."""
    split, fwd, fwd_pred = m.split, m.fwd, m.fwd_pred
    extra = f" {'wgrad only':>10} {'dgrad only':>10} {'dgrad lin':>10} {'prop pred':>10}" if split else ""
    extra += f" {'FWD truth':>10} {'FWD pred':>10}" if fwd is not None else ""
    print(f"{'layer':<34} {'FLD truth':>10} {'GN part':>10} {'FLD mcF':>10} {'mcF chan':>10} {'one-shot':>10} "
          f"{'BWD truth':>10} {'BWD pred':>10}" + extra)
    for i, f in enumerate(m.fqns):
        row = "".join(f" {mean(split[k][f]):10.3e}" for k in ("wgrad", "dgrad", "dgrad_linears")) if split else ""
        row += f" {bwd_variants['propagated_only'][i]:10.3e}" if split else ""
        row += f" {mean(fwd[f]):10.3e} {fwd_pred[i]:10.3e}" if fwd is not None else ""
        print(f"{f:<34} {truth['fld'][i]:10.3e} {truth['gn'][i]:10.3e} {fld_variants['mc_fisher'][i]:10.3e} "
              f"{fld_variants['mc_fisher_channel'][i]:10.3e} {truth['one'][i]:10.3e} {truth['bwd'][i]:10.3e} "
              f"{bwd_variants['direct'][i]:10.3e}" + row)


def score(m: Measured, truth: Dict[str, List[float]], fld_variants: Dict[str, List[float]],
          bwd_variants: Dict[str, List[float]], args, info: Dict[str, Any], total_seconds: float) -> Dict[str, Any]:
    """The figures of one run (the JSON line): Spearman of every estimate against its truth, split-half
    reproducibility, calibration medians, the per-GEMM and FWD figures, the run's settings and timings.

    Args:
        m: What the run measured.
        truth, fld_variants, bwd_variants: :func:`variants` of ``m``.
        args: The parsed flags (``bwd_rounding``, ``sr_draws``, ``batches``, ``fwd_probes``, ``quick``, ``seed``).
        info: :func:`~snip_ds.experiments.validation.load_or_warm`'s ``warmup_s`` and ``checkpoint``.
        total_seconds: The run's wall-clock seconds, warm-up included.
    """
    fqns, fwd, fwd_pred, drift, timing = m.fqns, m.fwd, m.fwd_pred, m.drift, m.seconds["collect"]
    truth_fld, truth_gn, truth_bwd = truth["fld"], truth["gn"], truth["bwd"]
    main = m.stats["mc_fisher"]
    mc_bwd = [main["layers"][f]["bwd"]["fp4"] for f in fqns]
    result = {
        "spearman_fld": spearman(fld_variants["mc_fisher"], truth_fld),
        "spearman_bwd": spearman(bwd_variants["direct"], truth_bwd),
        "repro_fld": split_half(m.sym), "repro_bwd": split_half(drift) if drift is not None else None,
        "repro_one_shot": split_half(m.one),
        "spearman_fld_gn": spearman(fld_variants["mc_fisher"], truth_gn), "repro_fld_gn": split_half(m.gn),
        "fld_variants_vs_gn": {k: spearman(v, truth_gn) for k, v in fld_variants.items() if k != "one_shot_truth"},
        "gn_share_of_fld_truth": median([a / b for a, b in zip(truth_gn, truth_fld) if b > 0]),
        "calibration_fld_gn": median([p / t for p, t in zip(fld_variants["mc_fisher"], truth_gn) if t > 0]),
        "calibration_fld_gn_channel": median([p / t for p, t in zip(fld_variants["mc_fisher_channel"], truth_gn)
                                              if t > 0]),
        "spearman_gn_truth_vs_fld_truth": spearman(truth_gn, truth_fld),
        "fld_variants": {k: spearman(v, truth_fld) for k, v in fld_variants.items()},
        "bwd_variants": {k: spearman(v, truth_bwd) for k, v in bwd_variants.items()},
        "calibration_fld": median([p / t for p, t in zip(fld_variants["mc_fisher"], truth_fld) if t > 0]),
        "calibration_bwd": median([p / t for p, t in zip(bwd_variants["direct"], truth_bwd) if t > 0]),
        "bwd_rounding": args.bwd_rounding, "sr_draws": args.sr_draws if args.bwd_rounding == "recipe" else 1,
        "calibration_fld_isotropic": median([p / t for p, t in zip(fld_variants["isotropic"], truth_fld) if t > 0]),
        "bwd_over_fld": median([b / f for b, f in zip(mc_bwd, fld_variants["mc_fisher"]) if f > 0]),
        "layers": len(fqns), "batches": args.batches, "tokens": main["tokens"], "loss": main["loss"],
        "optimizer_step": m.optimizer_step, "step_scale": m.step_scale, "precond": main["precond"],
        "alpha": m.stats["isotropic"].get("alpha"), "quadratic_ratio": m.stats["isotropic"].get("quadratic_ratio"),
        "bwd_per_gemm": per_gemm_figures(m.split, fqns, main) if m.split is not None else None,
        "fwd": None if fwd is None else {
            "spearman": spearman(fwd_pred, [mean(fwd[f]) for f in fqns]), "repro": split_half(fwd),
            "calibration": median([p / mean(fwd[f]) for p, f in zip(fwd_pred, fqns) if mean(fwd[f]) > 0]),
            "truth_vs_fld_truth": spearman([mean(fwd[f]) for f in fqns], truth_fld),
            "estimate_vs_fld": spearman(fwd_pred, fld_variants["mc_fisher"]),
            "truth_over_fld_truth": sum(mean(fwd[f]) for f in fqns) / sum(truth_fld),
            "probes": args.fwd_probes},
        "seconds": {"warmup": info["warmup_s"], **m.seconds, "total": total_seconds},
        "collect_step_equivalents": timing["mc_fisher"] / (args.batches * m.step_seconds),
        "checkpoint": info["checkpoint"], "quick": bool(args.quick), "seed": args.seed,
    }
    if drift is None:  # --no_bwd_truth: no BWD figure at all rather than ones computed against NaN
        for key in ("spearman_bwd", "repro_bwd", "bwd_variants", "calibration_bwd"):
            result[key] = None
    return result
