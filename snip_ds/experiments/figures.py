"""A grid's plots: gap to uniform FP8 against the FP4 share, training-loss curves, and the plans' maps (PNG)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Sequence

from snip_ds.swap import block_index


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_gap(summary: Dict[str, Any], path: Path) -> None:
    """Gap to uniform FP8 against the FP4 share, per phase (columns), quantized and BF16 forward (rows)."""
    plt = _plt()
    phases = summary["phases"]
    fig, axes = plt.subplots(2, len(phases), figsize=(5.5 * len(phases), 7), squeeze=False)
    labels = sorted({r["label"] for r in summary["rows"]})
    for j, phase in enumerate(phases):
        for i, tag in enumerate(("q", "bf16")):
            ax = axes[i][j]
            for label in labels:
                pts = [r for r in summary["rows"] if r["phase"] == phase and r["label"] == label]
                if not pts:
                    continue
                x = [r["fp4_share"] for r in pts]
                y = [r[f"vs_fp8_{tag}"].mean * 1e3 for r in pts]
                e = [r[f"vs_fp8_{tag}"].se * 1e3 if math.isfinite(r[f"vs_fp8_{tag}"].se) else 0.0 for r in pts]
                ax.errorbar(x, y, yerr=e, marker="o", capsize=3, label=label)
            for u in summary["uniform"]:
                if u["phase"] == phase and u["label"] == "uniform_fp4" and u[f"vs_fp8_{tag}"].n:
                    ax.plot([1.0], [u[f"vs_fp8_{tag}"].mean * 1e3], "k*", markersize=10, label="uniform_fp4")
            ax.axhline(0.0, color="grey", lw=0.8)
            ax.set_title(f"{phase}: gap to uniform FP8 ({'quantized' if tag == 'q' else 'BF16'} forward)")
            ax.set_xlabel("FP4 share of linear FLOPs")
            ax.set_ylabel("Δ val loss (millinats)")
    if axes[0][0].get_legend_handles_labels()[0]:  # uniform plans only: nothing labelled, no legend
        axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _ema(xs: Sequence[float], alpha: float = 0.1) -> List[float]:
    """Exponential moving average (weight ``alpha`` on the newest value)."""
    out, m = [], None
    for x in xs:
        m = x if m is None else (1 - alpha) * m + alpha * x
        out.append(m)
    return out


def plot_curves(records: List[Dict[str, Any]], summary: Dict[str, Any], path: Path) -> None:
    """Training-loss difference to uniform FP8 (EMA-smoothed, mean over seeds), one panel per phase × ρ."""
    plt = _plt()
    panels = [(p, rho) for p in summary["phases"] for rho in summary["rhos"]]
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(5 * max(len(panels), 1), 4), squeeze=False)
    for ax, (phase, rho) in zip(axes[0], panels):
        fp8 = {r["seed"]: r["train_losses"] for r in records if r["phase"] == phase and r["label"] == "uniform_fp8"}
        labels = sorted({r["label"] for r in records if r["phase"] == phase and r["rho"] in (rho, None)})
        for label in labels:
            diffs = [[a - b for a, b in zip(r["train_losses"], fp8[r["seed"]])] for r in records
                     if r["phase"] == phase and r["label"] == label and r["rho"] in (rho, None) and r["seed"] in fp8]
            if not diffs or label == "uniform_fp8":
                continue
            n = min(len(d) for d in diffs)
            mean = [sum(d[t] for d in diffs) / len(diffs) for t in range(n)]
            ax.plot(range(1, n + 1), [v * 1e3 for v in _ema(mean)], label=label,
                    lw=1.8 if label.startswith("best") else 1.0)
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_title(f"{phase}, ρ={rho:g}")
        ax.set_xlabel("step after checkpoint")
        ax.set_ylabel("Δ train loss vs FP8 (mnats, EMA)")
    if axes[0][0].get_legend_handles_labels()[0]:  # uniform plans only: nothing labelled, no legend
        axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_maps(plans_by_phase: Dict[str, List[Dict[str, Any]]], path: Path) -> None:
    """One precision map per solved plan: a row per (phase, ρ), a column per method label."""
    from snip_ds.report.tensorboard import precision_map_image
    plt = _plt()
    tiles = [(phase, p) for phase, ps in plans_by_phase.items() for p in ps if p["rho"] is not None]
    cols = max(len({p["label"] for _, p in tiles}), 1)
    keys = sorted({(ph, p["rho"]) for ph, p in tiles})
    labels = sorted({p["label"] for _, p in tiles})
    fig, axes = plt.subplots(max(len(keys), 1), cols, figsize=(1.6 * cols, 2.0 * max(len(keys), 1)), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for (phase, p) in tiles:
        i, j = keys.index((phase, p["rho"])), labels.index(p["label"])
        img = precision_map_image(dict(p["plan"].assignment), block_index).transpose(1, 2, 0)
        ax = axes[i][j]
        ax.imshow(img, interpolation="nearest")
        ax.set_title(f"{p['label']}\n{phase} ρ={p['rho']:g}", fontsize=7)
    per_gemm = any(not isinstance(v, str) for _, p in tiles for v in p["plan"].assignment.values())
    rows = "blocks, each split into fprop / dgrad / wgrad" if per_gemm else "blocks"
    fig.suptitle(f"plans: rows = {rows}, columns = q k v o gate up down (blue FP8, orange FP4)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
