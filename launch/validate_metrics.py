"""Validate SNIP's statistics against measured truths on fixed batches (docs/experiments.md, section 1).

Warms a model up (plain torch AdamW, unquantized, FP32), then for every decoder linear measures

* (a) the symmetrised FLD truth ``[ℒ(Y+E) + ℒ(Y-E) - 2ℒ(Y)]/2`` with only that layer's output perturbed by
  its FP4 (RNE) fprop error E (in FP64), its Gauss-Newton part ``(1/2N)Σ_t (JE)_tᵀ(diag p - ppᵀ)(JE)_t`` from
  the same two passes, and the one-shot ``ℒ(layer at fp4) - ℒ(bf16)`` for information;
* (b) the true one-step parameter drift ``Σ‖θ' - θ'_ref‖²`` after one AdamW step from the warmed-up state
  with only that layer's backward (dgrad + wgrad) at FP4 (RNE), against the unquantized step;
* (with ``--fwd_truth``) what only that layer's FP4 fprop does to the *update*: the drift of the decoder
  linears' weights after one AdamW step, against the unquantized step, priced in loss units with an explicit
  Fisher quadratic form from ``--fwd_probes`` sampled-label probes, ``(1/2N)·mean_r ⟨G^probe_r, Δθ⟩²``
  (what the collector's ``fwd`` estimates from a linearisation, with one probe);
* (c) each truth's split-half reproducibility (Spearman between the means over two disjoint halves of the
  batches),

and rank-correlates the predictions of :func:`snip_ds.stats.collect_statistics` (every estimator variant
and the quantization-error baselines) with them. Prints a per-layer table, then one JSON line (last).

Examples::

    python launch/validate_metrics.py                       # embedded default model and stdlib corpus
    python launch/validate_metrics.py --seed 1 --checkpoint /tmp/warm   # reuse a warm-up
    python launch/validate_metrics.py --quick               # tiny model, seconds (used by the tests)

The truths, the scoring and the run live in ``snip_ds/experiments/`` (``truths.py``, ``scores.py``,
``validation.py``; research code, never imported by the training package); this script parses the flags and
calls :func:`snip_ds.experiments.validation.run`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snip_ds.quant_config import BWD_ROUNDINGS  # noqa: E402
from snip_ds.experiments.validation import DEFAULTS, QUICK, run  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model_config", default=None, help="JSON config of a model trained from scratch "
                    "(default: the embedded ~10M Llama; with --quick a 2-block hidden-64 Llama)")
    ap.add_argument("--dataset", default=None, help="text/JSON-lines file or prepared directory "
                    "(default: the Python stdlib corpus)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup_steps", type=int, default=None)
    ap.add_argument("--checkpoint", default=None, help="directory: load the warmed-up model and optimizer "
                    "from it if present, else save them there after warm-up")
    ap.add_argument("--batches", type=int, default=None, help="fixed batches measured (>= 2 for split-half)")
    ap.add_argument("--batch_size", type=int, default=None)
    ap.add_argument("--block_size", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: 1 with --quick, whose tiny GEMMs only lose to threading "
                         "on a busy machine; else torch's default)")
    ap.add_argument("--truth_table", default=None, help="re-score the estimators against the truths an earlier "
                    "run printed for the same checkpoint and batches, instead of measuring them again")
    ap.add_argument("--no_bwd_truth", dest="bwd_truth", action="store_false",
                    help="measure only the FLD truths (BWD figures are null): halves the time of long FLD runs")
    ap.add_argument("--bwd_truth_per_gemm", action="store_true",
                    help="also measure the one-step drift with only the wgrad or only the dgrad GEMM at fp4 (two "
                         "more backward passes per layer and batch) and score the per-GEMM costs against them")
    ap.add_argument("--bwd_rounding", default="recipe", choices=BWD_ROUNDINGS,
                    help="how G_Y is rounded, in the BWD estimate and the drift truths alike: 'recipe' (as training "
                         "does: stochastically for FP4 by default) or 'nearest'")
    ap.add_argument("--sr_draws", type=int, default=4,
                    help="with --bwd_rounding recipe: stochastic-rounding draws averaged per batch in the truths")
    ap.add_argument("--fwd_truth", action="store_true",
                    help="also measure what each layer's FP4 fprop does to one AdamW step (one more backward "
                         "pass per layer and batch) and score the collector's forward-drift estimate (fwd)")
    ap.add_argument("--fwd_probes", type=int, default=8, help="with --fwd_truth: Fisher probes per batch that "
                    "price the truth's drift")
    ap.add_argument("--quick", action="store_true", help="tiny model and data: a smoke run of seconds")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.threads is None:
        args.threads = 1 if args.quick else 0
    for key, val in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    for key in ("warmup_steps",):
        if getattr(args, key) < 0:
            ap.error(f"--{key} must be >= 0")
    for key in ("batches", "batch_size", "block_size", "sr_draws", "fwd_probes"):
        if getattr(args, key) < 1:
            ap.error(f"--{key} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        result = run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"validate_metrics: error: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
