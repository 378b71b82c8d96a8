"""What BWD measures when G_Y is rounded as training rounds it: round-to-nearest vs stochastic rounding.

FP4 rounds gradients stochastically in training (NVFP4's recipe), so the backward GEMMs' error is random. The
statistics take its exact expectation (``bwd_rounding: recipe``) and record its systematic part apart
(``bwd_bias``). This benchmark warms the plan comparison's model up (the same checkpoints as
``launch/compare_plans.py``'s default phases), collects the statistics both ways and prints, per layer, what
moving it from FP8 to FP4 adds to BWD: with G_Y rounded to nearest (what the collector did before), the
expected drift under stochastic rounding, and that drift's systematic part alone.

Run from the repository root (about 4 minutes on one core):

    python benchmarks/bench_bwd_rounding.py [--output_dir benchmarks/results]

Writes ``bench_bwd_rounding.json`` and ``bench_bwd_rounding.md``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))

import compare_plans as cp  # noqa: E402  (its flags and defaults)
from snip_ds.experiments.grid import build  # noqa: E402
from snip_ds.experiments.plans import collect_phase_stats  # noqa: E402
from snip_ds.experiments.runs import warm_up  # noqa: E402
from snip_ds.experiments.training import TrainSettings  # noqa: E402

COLUMNS = {"nearest": ("nearest", "bwd"), "expected": ("recipe", "bwd"), "systematic": ("recipe", "bwd_bias")}


def measure(args) -> dict:
    cargs = cp.parse_args(["--phases", args.phases, "--threads", "1", "--stat_batches", str(args.stat_batches)])
    torch.manual_seed(cargs.seed)
    torch.set_num_threads(1)
    settings = TrainSettings(lr=cargs.lr, batch_size=cargs.batch_size, lr_warmup_steps=cargs.lr_warmup_steps)
    model, train_ds, _ = build(cargs)
    out = {"phases": cargs.phases, "stat_batches": cargs.stat_batches, "lambda": cargs.lambda_default,
           "layers": {}, "seconds": {}}
    with tempfile.TemporaryDirectory(prefix="bench_bwd_rounding_") as tmp:
        ckpts = warm_up(model, train_ds, settings, cargs, Path(tmp))
        for phase, ckpt in ckpts.items():
            stats = {}
            for rounding in ("nearest", "recipe"):
                cargs.bwd_rounding = rounding
                t = time.perf_counter()
                stats[rounding] = collect_phase_stats(model, ckpt, train_ds, settings, cargs)
                out["seconds"][f"{phase}/{rounding}"] = time.perf_counter() - t
            rows = {}
            for fqn in sorted(stats["nearest"]["layers"]):
                row = {"fld": _delta(stats["nearest"]["layers"][fqn]["fld"])}
                for col, (rounding, key) in COLUMNS.items():
                    rec = stats[rounding]["layers"][fqn]
                    row[col] = _delta(rec[key])
                    row[f"{col}_fp8"] = rec[key]["fp8"]
                rows[fqn] = row
            out["layers"][phase] = rows
    return out


def _delta(per_precision: dict) -> float:
    return per_precision["fp4"] - per_precision["fp8"]


def summary(data: dict) -> dict:
    lam = data["lambda"]
    out = {}
    for phase, rows in data["layers"].items():
        vals = list(rows.values())
        out[phase] = {
            "total_fld": sum(r["fld"] for r in vals),
            **{f"total_lambda_{c}": lam * sum(r[c] for r in vals) for c in COLUMNS},
            "median_expected_over_nearest": statistics.median(r["expected"] / r["nearest"] for r in vals),
            "layers_fp4_systematic_below_fp8": sum(r["systematic"] < 0 for r in vals),
            "layers": len(vals),
        }
    return out


def write_markdown(data: dict, summ: dict, path: Path) -> None:
    lam = data["lambda"]
    lines = ["# bench_bwd_rounding: BWD with G_Y rounded to nearest vs as training rounds it", "",
             "Command: `python benchmarks/bench_bwd_rounding.py`. The plan comparison's 4-block model, "
             f"checkpoints after {data['phases']} warm-up steps, statistics from {data['stat_batches']} batches. "
             f"Per layer, what FP4 instead of FP8 adds: FLD, and λ·BWD at λ = {lam:g} three ways: G_Y rounded "
             "to nearest (the collector before), the expected drift under FP4's stochastic rounding "
             "(`bwd_rounding: recipe`, the default), and its systematic part alone (`bwd_bias`). "
             "Units: 1e-6 nats. A negative systematic part: FP4 with stochastic rounding is less biased "
             "than FP8 (E5M2, rounded to nearest).", ""]
    for phase, rows in data["layers"].items():
        s = summ[phase]
        lines += [f"## {phase}", "",
                  f"Totals: FLD {1e6 * s['total_fld']:.1f}; λ·BWD nearest {1e6 * s['total_lambda_nearest']:.1f}, "
                  f"expected {1e6 * s['total_lambda_expected']:.1f}, systematic "
                  f"{1e6 * s['total_lambda_systematic']:.1f}. Expected / nearest per layer (median): "
                  f"{s['median_expected_over_nearest']:.2f}. Layers whose FP4 systematic part is below FP8's: "
                  f"{s['layers_fp4_systematic_below_fp8']} of {s['layers']}.", "",
                  "| layer | FLD | λ·BWD nearest | λ·BWD expected | λ·BWD systematic |", "|---|---|---|---|---|"]
        for fqn, r in rows.items():
            lines.append(f"| {fqn.replace('model.layers.', '')} | {1e6 * r['fld']:.2f} | "
                         f"{1e6 * lam * r['nearest']:.2f} | {1e6 * lam * r['expected']:.2f} | "
                         f"{1e6 * lam * r['systematic']:.2f} |")
        lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phases", default="200,800", help="warm-up step counts (compare_plans' default phases)")
    ap.add_argument("--stat_batches", type=int, default=64)
    ap.add_argument("--output_dir", default="benchmarks/results")
    args = ap.parse_args(argv)
    data = measure(args)
    data["summary"] = summary(data)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_bwd_rounding.json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    write_markdown(data, data["summary"], out / "bench_bwd_rounding.md")
    print(json.dumps(data["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
