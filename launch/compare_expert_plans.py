"""Per-expert precisions against one precision for all experts of a (block, projection), on an MoE model
(docs/experiments.md, "Per-expert precisions").

The model (default ``benchmarks/configs/mixtral_4x64_e8.json``: 4 blocks, 8 experts, top-2, built from the
config) is warmed up unquantized and checkpointed; SNIP's statistics are collected once there; at every FP4
share ρ two plans are solved from them, ``per_expert`` (every (expert, projection) pair free) and ``shared``
(the pairs of one (block, projection) merged into one pseudo-layer with their summed costs and FLOPs, solved,
and expanded back), at the same FP4 share; uniform FP8 and FP4 run as references. Every plan then trains
``--steps`` steps from the checkpoint for every seed with the same batches and rounding seeds (paired), and is
scored by validation loss. Outputs: ``compare_expert_plans.json`` and ``.md`` under ``--output_dir``.

The code lives in :mod:`snip_ds.experiments.expert_plans`; this script parses the flags.

Example::

    python launch/compare_expert_plans.py --seeds 0,1,2,3,4,5 --rhos 0.5,0.75
    python launch/compare_expert_plans.py --quick          # a smoke run (tiny model, a few steps)
    python launch/compare_expert_plans.py --seeds 6,7 --rhos 0.5,0.75 --output_dir /tmp/more
    python launch/compare_expert_plans.py --report_only --merge benchmarks/results/compare_expert_plans,/tmp/more
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snip_ds.experiments.expert_plans import rerender, run_comparison  # noqa: E402
from snip_ds.experiments.results import json_default  # noqa: E402
from snip_ds.quant_config import QuantConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "benchmarks" / "configs" / "mixtral_4x64_e8.json"
QUICK = dict(warmup_steps=20, seeds="0", rhos="0.5", steps=4, eval_batches=2, stat_batches=2, batch_size=4,
             block_size=32, lr_warmup_steps=5)
FULL = dict(warmup_steps=200, seeds="0,1,2", rhos="0.5,0.75", steps=100, eval_batches=64, stat_batches=64,
            batch_size=8, block_size=64, lr_warmup_steps=20)


def _list(kind, name: str, text: str):
    try:
        values = [kind(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--{name}: expected comma-separated {kind.__name__}s, got {text!r}")
    if not values:
        raise SystemExit(f"--{name}: empty list")
    return values


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model_config", default=str(DEFAULT_CONFIG), help="JSON config of an MoE causal LM")
    ap.add_argument("--dataset", default=None, help="text/JSON-lines file or prepared directory (default: the "
                    "Python stdlib corpus)")
    ap.add_argument("--seed", type=int, default=0, help="model init, warm-up data order, statistics")
    ap.add_argument("--seeds", default=None, help="comma-separated data-order / rounding seeds (one cell each)")
    ap.add_argument("--warmup_steps", type=int, default=None, help="BF16 warm-up steps before the checkpoint")
    ap.add_argument("--rhos", default=None, help="comma-separated FP4 shares")
    ap.add_argument("--lambda", dest="lambda_default", type=float, default=2.0, help="SNIP's λ (default 2)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per run after the checkpoint")
    ap.add_argument("--batch_size", type=int, default=None)
    ap.add_argument("--block_size", type=int, default=None)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--lr_warmup_steps", type=int, default=None)
    ap.add_argument("--lr_decay", default="linear", choices=("linear", "none"))
    ap.add_argument("--eval_batches", type=int, default=None)
    ap.add_argument("--stat_batches", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--output_dir", default="benchmarks/results/compare_expert_plans")
    ap.add_argument("--quick", action="store_true", help="few steps, one seed: a smoke run")
    ap.add_argument("--report_only", action="store_true", help="rewrite the summary and markdown from the json "
                    "(of a finished or stopped run)")
    ap.add_argument("--merge", default=None, help="with --report_only: comma-separated result directories whose "
                    "records (e.g. extra seeds of the same comparison) are joined into --output_dir")
    ap.add_argument("--silent", action="store_true")
    args = ap.parse_args(argv)
    args.argv = argv
    for key, val in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    args.merge = _list(str, "merge", args.merge) if args.merge else None
    if args.merge and not args.report_only:
        ap.error("--merge needs --report_only")
    args.seeds = _list(int, "seeds", args.seeds)
    args.rhos = _list(float, "rhos", args.rhos)
    if any(not 0.0 <= r <= 1.0 for r in args.rhos):
        ap.error(f"--rhos: every FP4 share must lie in [0, 1], got {args.rhos}")
    for key in ("warmup_steps", "steps", "batch_size", "block_size", "eval_batches", "stat_batches"):
        if getattr(args, key) < 1:
            ap.error(f"--{key} must be >= 1")
    if args.lambda_default < 0:
        ap.error("--lambda must be >= 0")
    # what the shared machinery of snip_ds.experiments reads (grid.build, runs.warm_up / run_cell, plans'
    # statistics collection): the defaults of launch/compare_plans.py
    args.model, args.phases = None, {"early": args.warmup_steps}
    args.dgrad_cost, args.bwd_key, args.bwd_rounding, args.forward_drift = "split", "bwd", "recipe", False
    args.quant = QuantConfig()
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        result = rerender(args.output_dir, args.merge) if args.report_only else run_comparison(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"compare_expert_plans: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, default=json_default))
    return 0


if __name__ == "__main__":
    sys.exit(main())
