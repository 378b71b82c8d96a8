"""Statistics of paired differences: means with standard errors over cells, and rank correlation.

Every run of one comparison *cell* (a warm-up checkpoint × a data-order seed) starts from the same saved model
and optimizer state, sees the same batches and draws its stochastic rounding from generators seeded the same
way, so the difference of two runs' validation losses is a *paired* difference: the noise the runs share
cancels. The standard error then counts cells, the independent units.

* :class:`MeanSE`, :func:`mean_se` — mean, standard error of the mean and count;
* :func:`cell_means`, :func:`paired_differences` — per-cell means and the differences of two selections;
* :func:`paired_verdict` — whether a difference is resolved (more than z standard errors from 0);
* :func:`spearman` — rank correlation (average ranks for ties; NaN where undefined), the package's only one;
* :func:`finite_mean` — the mean of the defined values, and how many undefined (NaN) ones it skipped.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Sequence, Tuple


@dataclass(frozen=True)
class MeanSE:
    """Mean, standard error of the mean (sample SD / √n; NaN for n < 2) and count."""

    mean: float
    se: float
    n: int

    def to_dict(self) -> Dict[str, Any]:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


def mean_se(values: Iterable[float]) -> MeanSE:
    """:class:`MeanSE` of ``values`` (NaN mean for none)."""
    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        return MeanSE(float("nan"), float("nan"), 0)
    mean = sum(xs) / n
    if n < 2:
        return MeanSE(mean, float("nan"), 1)
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return MeanSE(mean, math.sqrt(var / n), n)


def cell_means(records: Sequence[Mapping[str, Any]], key: str, cell_keys: Sequence[str],
               select: Callable[[Mapping[str, Any]], bool]) -> Dict[tuple, float]:
    """Per cell (the values of ``cell_keys``), the mean of ``key`` over the selected records that have it."""
    cells: Dict[tuple, List[float]] = {}
    for r in records:
        if r.get(key) is not None and select(r):
            cells.setdefault(tuple(r.get(k) for k in cell_keys), []).append(float(r[key]))
    return {c: sum(v) / len(v) for c, v in cells.items()}


def paired_differences(records: Sequence[Mapping[str, Any]], key: str, cell_keys: Sequence[str],
                       select: Callable[[Mapping[str, Any]], bool],
                       reference: Callable[[Mapping[str, Any]], bool]) -> List[float]:
    """Per cell, ``mean(key over selected records) - mean(key over reference records)``.

    Records are grouped by the values of ``cell_keys`` (e.g. phase, seed, rho); a cell without both a
    selected and a reference record contributes nothing. Averaging within a cell first (e.g. over several
    random plans) keeps one difference per cell, so the standard error counts cells, the independent units.
    """
    sel, ref = (cell_means(records, key, cell_keys, f) for f in (select, reference))
    return [m - ref[c] for c, m in sel.items() if c in ref]


def paired_verdict(diff: MeanSE, room: MeanSE, z: float = 2.0) -> Dict[str, Any]:
    """How a paired difference ``method − baseline`` stands (negative: the method is better).

    Args:
        diff: Mean ± SE over cells of the method's loss minus the baseline's.
        room: Mean ± SE over the same cells of the baseline's loss minus the reference's (uniform FP8): how
            far the baseline is from the reference's quality.
        z: Standard errors that resolve a difference.

    Returns:
        ``below`` (mean < 0), ``resolved`` (|mean| > z·SE; ``None`` without an SE), ``floor`` (the room is
        under z·SE of the difference: a plan exactly at the reference's quality could not be shown below the
        baseline with these cells; ``None`` without an SE) and ``cells_to_resolve`` (the cells at which the
        observed mean would stand z standard errors from 0 if it held, n·(z·SE/|mean|)², for an unresolved
        difference; else ``None``).
    """
    has_se = diff.n > 1 and math.isfinite(diff.se)
    resolved = abs(diff.mean) > z * diff.se if has_se else None
    cells = (math.ceil(diff.n * (z * diff.se / abs(diff.mean)) ** 2)
             if has_se and not resolved and diff.mean != 0 else None)
    floor = bool(room.n and room.mean < z * diff.se) if has_se else None
    return dict(below=bool(diff.mean < 0), resolved=resolved, floor=floor, cells_to_resolve=cells)


def _ranks(xs: Sequence[float]) -> List[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of two equally long sequences: NaN where it is undefined (fewer than 3 pairs,
    or a constant sequence), never a stand-in value; a caller that averages several skips the NaNs explicitly
    (:func:`finite_mean`) and reports how many."""
    if len(a) != len(b):
        raise ValueError(f"spearman: sequences of different lengths ({len(a)} and {len(b)})")
    if len(a) < 3:
        return float("nan")
    ra, rb = _ranks([float(x) for x in a]), _ranks([float(x) for x in b])
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va, vb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    return cov / math.sqrt(va * vb) if va > 0 and vb > 0 else float("nan")


def finite_mean(values: Iterable[float]) -> Tuple[float, int]:
    """``(mean of the finite values, number of non-finite ones skipped)``; the mean is NaN when none is finite."""
    xs = [float(v) for v in values]
    finite = [x for x in xs if math.isfinite(x)]
    return (sum(finite) / len(finite) if finite else float("nan")), len(xs) - len(finite)
