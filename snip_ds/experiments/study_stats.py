"""The plan study's analysis (docs/experiments.md, "The plan study"): paired differences at an equal FP4 share,
standard errors clustered by model seed, and the rules that call a difference a win, a tie or unresolved.
Pure data in, data out: rows are the plain dicts of ``cells.json``.

* :class:`ClusteredMean`, :func:`clustered_mean` — mean over every cell, with the cluster-robust (CR1) standard
  error by model seed, the pooled (cells independent) one beside it and the spread of the model seeds' means;
* :func:`paired_by_cell` — per cell, one arm's validation loss minus another's, refused where their FP4 shares
  differ;
* :func:`classify` — win / loss beyond 2 SE, tie only inside the equivalence bound, else unresolved;
* :func:`analyse` — every comparison of a study, and its targets.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, Hashable, List, Mapping, Sequence

from snip_ds.experiments.paired import mean_se

Z_RESOLVE = 2.0  # a difference is a win or a loss only beyond this many standard errors
Z_CI90 = 1.6448536269514722  # half-width of a two-sided 90 % interval, in standard errors
EQUIVALENCE = 0.10  # a tie: the 90 % interval inside ± this fraction of FP4's cost (uniform FP4 − uniform FP8)
SHARE_TOL = 1e-6  # two plans are at the same FP4 share when their shares differ by no more than this
SE_TARGET = 0.3e-3  # nats: the largest standard error a paired difference against SNIP may have
FP4_Z_TARGET = 20.0  # FP4's cost must stand this many standard errors from 0
RESOLVE_TARGETS = ("last_k_fp8", "quant_err", "rel_quant_err", "random")  # SNIP against each must be resolved
SNIP = "snip"


@dataclass(frozen=True)
class ClusteredMean:
    """Mean of per-cell values grouped by model seed.

    Attributes:
        mean: Mean over all ``n`` cells.
        se: The standard error the verdicts use: the larger of ``se_cluster`` and ``se_pooled`` (CR1 with a
            handful of model seeds has few degrees of freedom and can come out below the pooled SE by chance);
            ``se_pooled`` with one model seed.
        se_cluster: CR1 cluster-robust standard error of the mean by model seed (NaN for one model seed).
        se_pooled: Sample SD / √n, every cell taken as independent (NaN for one cell).
        between_sd: Sample SD of the model seeds' own means (NaN for one model seed).
        n: Cells.
        clusters: Model seeds.
    """

    mean: float
    se: float
    se_cluster: float
    se_pooled: float
    between_sd: float
    n: int
    clusters: int

    @property
    def se_kind(self) -> str:
        return "max(CR1 by model seed, pooled)" if self.clusters >= 2 else "pooled (one model seed)"

    def to_dict(self) -> Dict[str, Any]:
        out = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}
        out["se_kind"] = self.se_kind
        return out


def clustered_mean(values: Mapping[Hashable, Sequence[float]]) -> ClusteredMean:
    """:class:`ClusteredMean` of ``{model_seed: [per-cell values]}``.

    CR1 for the mean (a regression on a constant, clusters g of sizes n_g, N cells, G clusters): with
    e_g = Σ_j (x_gj − x̄), Var = G / (G − 1) · Σ_g e_g² / N² (the small-sample factor (N − 1) / (N − k) is 1
    for k = 1 coefficient). It allows the cells of one model seed to be correlated, which the pooled SE does not.
    """
    groups = {g: [float(v) for v in vs] for g, vs in values.items() if len(vs)}
    xs = [v for vs in groups.values() for v in vs]
    n, big_g = len(xs), len(groups)
    nan = float("nan")
    if n == 0:
        return ClusteredMean(nan, nan, nan, nan, nan, 0, 0)
    mean = sum(xs) / n
    pooled = mean_se(xs).se
    if big_g < 2:
        return ClusteredMean(mean, pooled, nan, pooled, nan, n, big_g)
    resid = [sum(v - mean for v in vs) for vs in groups.values()]
    cluster = math.sqrt(big_g / (big_g - 1) * sum(e * e for e in resid) / n ** 2)
    seed_means = [sum(vs) / len(vs) for vs in groups.values()]
    m = sum(seed_means) / big_g
    between = math.sqrt(sum((x - m) ** 2 for x in seed_means) / (big_g - 1))
    return ClusteredMean(mean, max(cluster, pooled), cluster, pooled, between, n, big_g)


def _cells(rows: Sequence[Mapping[str, Any]], arm: str) -> Dict[tuple, Mapping[str, Any]]:
    return {(r["model_seed"], r["data_seed"]): r for r in rows if r["arm"] == arm}


def paired_by_cell(rows: Sequence[Mapping[str, Any]], arm: str, reference: str,
                   check_share: bool = True) -> Dict[Hashable, List[float]]:
    """``{model_seed: [val_loss(arm) − val_loss(reference) per cell]}`` over the cells that ran both.

    Raises:
        ValueError: ``check_share`` and the two arms' FP4 shares differ by more than :data:`SHARE_TOL` in a
            cell (named): a difference at unequal shares says nothing about which layers were chosen.
    """
    a, b = _cells(rows, arm), _cells(rows, reference)
    out: Dict[Hashable, List[float]] = {}
    for cell in sorted(set(a) & set(b)):
        if check_share and abs(a[cell]["fp4_share"] - b[cell]["fp4_share"]) > SHARE_TOL:
            raise ValueError(f"{arm} (FP4 share {a[cell]['fp4_share']:.6f}) and {reference} (FP4 share "
                             f"{b[cell]['fp4_share']:.6f}) in cell (model seed {cell[0]}, data seed {cell[1]}): "
                             f"shares differ by more than {SHARE_TOL:g}; refusing to pair them")
        out.setdefault(cell[0], []).append(a[cell]["val_loss"] - b[cell]["val_loss"])
    return out


def classify(diff: ClusteredMean, fp4_cost: float) -> Dict[str, Any]:
    """How a paired difference SNIP − arm stands (negative: SNIP better).

    ``win`` (SNIP below by more than :data:`Z_RESOLVE` SE), ``loss`` (above by more), ``tie`` (its 90 %
    interval lies inside ± :data:`EQUIVALENCE` × ``fp4_cost``), else ``unresolved``. No SE or no positive
    FP4 cost: no tie can be declared.
    """
    bound = EQUIVALENCE * fp4_cost if math.isfinite(fp4_cost) and fp4_cost > 0 else float("nan")
    lo, hi = diff.mean - Z_CI90 * diff.se, diff.mean + Z_CI90 * diff.se
    if not math.isfinite(diff.se):
        verdict = "unresolved"
    elif diff.mean < -Z_RESOLVE * diff.se:
        verdict = "win"
    elif diff.mean > Z_RESOLVE * diff.se:
        verdict = "loss"
    elif math.isfinite(bound) and -bound <= lo and hi <= bound:
        verdict = "tie"
    else:
        verdict = "unresolved"
    return dict(verdict=verdict, bound=bound, ci90=(lo, hi))


def _per_seed(values: Mapping[Hashable, Sequence[float]]) -> Dict[str, Any]:
    return {str(g): mean_se(vs).to_dict() for g, vs in sorted(values.items())}


def analyse(rows: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Every comparison of a study's rows.

    * ``fp4_cost``: uniform FP4 − uniform FP8 (the shares differ by design: not share-checked);
    * ``gaps``: every arm − uniform FP8;
    * ``comparisons``: SNIP − arm for every other arm, against the SNIP arm at the arm's own FP4 share (the
      row's ``pair_with``, ``snip`` unless a rule reached another share), share-checked, with its verdict;
    * ``targets``: FP4's cost in SE, the largest SE against SNIP, and whether SNIP against each of
      :data:`RESOLVE_TARGETS` is resolved (a win, a loss or a tie).

    Raises:
        ValueError: Two arms paired at unequal FP4 shares (:func:`paired_by_cell`).
    """
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    cost = clustered_mean(paired_by_cell(rows, "uniform_fp4", "uniform_fp8", check_share=False))
    gaps = []
    for arm in arms:
        if arm != "uniform_fp8":
            per = paired_by_cell(rows, arm, "uniform_fp8", check_share=False)
            if per:
                gaps.append(dict(arm=arm, diff=clustered_mean(per), per_seed=_per_seed(per)))
    comparisons = []
    for arm in arms:
        if arm == SNIP or arm.startswith(SNIP + "@") or arm.startswith("uniform_"):
            continue
        refs = {r.get("pair_with") or SNIP for r in rows if r["arm"] == arm}
        for ref in sorted(refs):
            sub = [r for r in rows if r["arm"] != arm or (r.get("pair_with") or SNIP) == ref]
            per = paired_by_cell(sub, ref, arm)  # SNIP − arm
            if not per:
                continue
            diff = clustered_mean(per)
            share = next(r["fp4_share"] for r in sub if r["arm"] == arm)
            comparisons.append(dict(arm=arm, reference=ref, fp4_share=share, diff=diff, per_seed=_per_seed(per),
                                    **classify(diff, cost.mean)))
    ses = [c["diff"].se for c in comparisons if math.isfinite(c["diff"].se)]
    verdicts = {c["arm"]: c["verdict"] for c in comparisons}
    targets = dict(
        fp4_cost_in_se=cost.mean / cost.se if cost.n and math.isfinite(cost.se) and cost.se > 0 else None,
        fp4_cost_met=bool(cost.n and math.isfinite(cost.se) and cost.mean >= FP4_Z_TARGET * cost.se),
        max_se=max(ses) if ses else None,
        se_met=bool(ses) and len(ses) == len(comparisons) and max(ses) <= SE_TARGET,
        resolved={a: (verdicts[a] in ("win", "loss", "tie")) if a in verdicts else None
                  for a in RESOLVE_TARGETS})
    cells = {arm: len(_cells(rows, arm)) for arm in arms}
    return dict(fp4_cost=cost, gaps=gaps, comparisons=comparisons, targets=targets, cells=cells,
                model_seeds=sorted({r["model_seed"] for r in rows}),
                data_seeds=sorted({r["data_seed"] for r in rows}))
