"""Compare SNIP's plans with the baselines by training from the same checkpoints (docs/experiments.md, section 2).

A model is warmed up unquantized (BF16 plan, FP32 arithmetic, torch AdamW) and checkpointed at each *phase*
(warm-up step counts, e.g. early = 200 and late = 800). At each checkpoint SNIP's statistics are collected once
(Monte-Carlo Fisher FLD, BWD with the optimizer's real Adam state) and every method's plan is solved at every
FP4 share ρ. Then, for every data-order seed, each plan trains ``--steps`` steps from that checkpoint with the
same batches and the same stochastic-rounding seeds (a *cell* = phase × seed: all its runs are paired), its
learning rate decaying linearly to zero over those steps (``--lr_decay linear``, the default: the end of a
constant-rate run is dominated by its last updates' noise, which the decay averages out), and is
scored by validation loss with its own quantized forward and with a BF16 forward. Reported: each run's gap to
uniform FP8 in its cell, and means ± standard errors over cells of the paired differences to uniform FP8 and to
the random plans.

Methods: ``bf16``, ``uniform_fp8``, ``uniform_fp4`` (ρ-independent), on request ``fp4_fprop``, ``fp4_dgrad``,
``fp4_wgrad`` and ``fp4_backward`` (that GEMM kind in FP4 in every layer, the rest FP8: what each kind costs on
its own; ρ-independent), and per ρ ``best`` (SNIP, one run per λ),
``random`` (``--num_random`` plan seeds), ``quant_err``, ``rel_quant_err``, ``first_last_fp8`` (first and last
blocks pinned to FP8, the rest by SNIP at ``--lambda_default``; skipped, and listed, where the pins make ρ
unreachable). Identical plans within a cell are trained once and the record says ``shared_with``.

Examples::

    python launch/compare_plans.py --quick                  # smoke run, tiny model, a minute (CI)
    python launch/compare_plans.py                          # full grid (~2 h on 2 CPU cores)
    python launch/compare_plans.py --phases 100 --seeds 0,1,2 --rhos 0.75,0.9   # a reduced grid
    python launch/compare_plans.py --report_only            # rewrite md/png from compare_plans.json

Outputs under ``--output_dir`` (default ``benchmarks/results``): ``compare_plans.json`` (settings, one record
per run, skipped plans; rewritten after every run, so a stopped grid leaves its finished runs),
``compare_plans.md``, ``compare_plans_gap.png``, ``compare_plans_curves.png``, ``compare_plans_maps.png``.

The grid, its runs, statistics and report live in ``snip_ds/experiments/`` (research code, never imported by
the training package); this script parses the flags and calls :func:`snip_ds.experiments.runs.run_grid` or
:func:`~snip_ds.experiments.runs.rerender`.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snip_ds.quant_config import BWD_ROUNDINGS, FP4_RECIPES, QuantConfig  # noqa: E402
from snip_ds.experiments.grid import DEFAULT_METHODS, FULL, METHOD_CHOICES, QUICK, parse_phases  # noqa: E402
from snip_ds.experiments.results import json_default  # noqa: E402
from snip_ds.experiments.runs import rerender, run_grid  # noqa: E402
from snip_ds.planner import BWD_KEYS, DGRAD_COSTS  # noqa: E402


def _list(kind, name: str):
    def parse(text: str):
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"--{name}: expected comma-separated {kind.__name__}s, got {text!r}")
        if not values:
            raise argparse.ArgumentTypeError(f"--{name}: empty list")
        return values
    return parse


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model_config", default=None, help="JSON config of a model trained from scratch (default: "
                    "a 4-block hidden-128 Llama; with --quick a 4-block hidden-32 one)")
    ap.add_argument("--dataset", default=None, help="text/JSON-lines file or prepared directory (default: the "
                    "Python stdlib corpus)")
    ap.add_argument("--seed", type=int, default=0, help="model init, warm-up data order, statistics, plan seeds")
    ap.add_argument("--seeds", default=None, help="comma-separated data-order / rounding seeds (one cell each)")
    ap.add_argument("--phases", default=None, help="comma-separated warm-up step counts, one checkpoint each")
    ap.add_argument("--rhos", default=None, help="comma-separated FP4 shares")
    ap.add_argument("--lambdas", default=None, help="comma-separated λ values for SNIP ('best')")
    ap.add_argument("--lambda_default", type=float, default=None, help="λ of the target checks, first_last_fp8 "
                    "and the statistics artifact (default 2); with --report_only: the λ whose SNIP the report "
                    "checks, in place of the grid's own default")
    ap.add_argument("--num_random", type=int, default=None, help="random plans per ρ")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated subset of "
                    + ", ".join(METHOD_CHOICES) + " (default: all but the fp4_<kind> plans; uniform_fp8 is always "
                    "run: every gap refers to it)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per run after the checkpoint")
    ap.add_argument("--batch_size", type=int, default=None)
    ap.add_argument("--block_size", type=int, default=None)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--lr_warmup_steps", type=int, default=None)
    ap.add_argument("--lr_decay", default="linear", choices=("linear", "none"),
                    help="learning rate of each comparison run: decaying linearly to 0 over its --steps "
                    "(default), or held at --lr (the warm-up is never decayed)")
    ap.add_argument("--eval_batches", type=int, default=None, help="validation batches (fixed, shared by all runs)")
    ap.add_argument("--stat_batches", type=int, default=None, help="batches of the statistics collection")
    ap.add_argument("--per_gemm", action="store_true", help="solve every plan per GEMM (fprop, dgrad, wgrad each "
                    "FP8 or FP4) instead of per layer; SNIP prices fprop with FLD and dgrad/wgrad with half of "
                    "λ·BWD each, quant_err with the errors of the two operands each GEMM quantizes")
    ap.add_argument("--dgrad_cost", default="split", choices=DGRAD_COSTS,
                    help="per GEMM: how SNIP prices dgrad ('split': half of the direct BWD each for dgrad and "
                         "wgrad; 'upstream': dgrad by the upstream drift its error causes, bwd_dgrad, wgrad by "
                         "the whole direct BWD)")
    ap.add_argument("--dgrad_calibration", type=float, default=1.0,
                    help="with --dgrad_cost upstream: what bwd_dgrad overstates the dgrad-only "
                         "drift by (launch/validate_metrics.py --bwd_truth_per_gemm measures it)")
    ap.add_argument("--bwd_rounding", default="recipe", choices=BWD_ROUNDINGS,
                    help="how the statistics round G_Y for BWD: 'recipe' (as training does: the exact expectation "
                         "over stochastic rounding where the recipe uses it) or 'nearest' (ablation; before)")
    ap.add_argument("--bwd_key", default="bwd", choices=BWD_KEYS,
                    help="which BWD SNIP's costs use: 'bwd' (the expected drift) or 'bwd_bias' (its systematic "
                         "part only), 'bwd_propagated' (ablation)")
    ap.add_argument("--forward_drift", action="store_true",
                    help="also measure FWD, the update drift each layer's fprop error causes, and price it on the "
                         "fprop GEMM: SNIP's costs become FLD + λ·(FWD + BWD)")
    ap.add_argument("--fwd_lambda", type=float, default=None,
                    help="with --forward_drift: FWD's own weight μ instead of λ (costs FLD + μ·FWD + λ·BWD)")
    ap.add_argument("--fp4_recipe", default="nvfp4", choices=FP4_RECIPES, help="FP4 recipe of every run")
    ap.add_argument("--no_stochastic_rounding", dest="stochastic_rounding", action="store_false",
                    help="round FP4 gradients to nearest (default: stochastically, as NVFP4's recipe does)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--checkpoint_dir", default=None, help="keep the warm-up checkpoints here (default: a "
                    "temporary directory)")
    ap.add_argument("--output_dir", default="benchmarks/results")
    ap.add_argument("--note", default="", help="a line put at the top of the md (e.g. 'reduced grid')")
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps, one cell: a smoke run (CI)")
    ap.add_argument("--report_only", action="store_true", help="rewrite md and plots from the existing json")
    ap.add_argument("--merge", default=None, help="with --report_only: comma-separated result directories "
                    "to join (e.g. one process per phase) into --output_dir")
    ap.add_argument("--versus", default=None, help="with --report_only: comma-separated result directories of "
                    "grids that ran the same cells with other plans (e.g. per layer against this grid's per-GEMM "
                    "plans, or the baselines for a SNIP-only grid); the report gains their paired differences, and "
                    "its targets take a baseline from them where this grid did not run it")
    ap.add_argument("--silent", action="store_true")
    args = ap.parse_args(argv)
    args.argv = argv
    args.report_lambda = args.lambda_default if args.report_only else None
    if args.lambda_default is None:
        args.lambda_default = 2.0
    preset = QUICK if args.quick else FULL
    for key, val in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, val)
    try:
        args.seeds = _list(int, "seeds")(str(args.seeds))
        args.phases = parse_phases(args.phases)
        args.rhos = _list(float, "rhos")(str(args.rhos))
        args.lambdas = _list(float, "lambdas")(str(args.lambdas))
        methods = _list(str, "methods")(args.methods)
        args.merge = _list(str, "merge")(args.merge) if args.merge else None
        args.versus = _list(str, "versus")(args.versus) if args.versus else None
    except (argparse.ArgumentTypeError, ValueError) as err:
        ap.error(str(err))
    if args.versus and not args.report_only:
        ap.error("--versus needs --report_only (it compares finished grids)")
    bad = [m for m in methods if m not in METHOD_CHOICES]
    if bad:
        ap.error(f"--methods: unknown {', '.join(bad)}; valid: {', '.join(METHOD_CHOICES)}")
    args.methods = tuple(m for m in METHOD_CHOICES if m in methods or m == "uniform_fp8")
    args.quant = QuantConfig(fp4_recipe=args.fp4_recipe, stochastic_rounding=args.stochastic_rounding)
    if any(not 0.0 <= r <= 1.0 for r in args.rhos):
        ap.error(f"--rhos: every FP4 share must lie in [0, 1], got {args.rhos}")
    if any(lam < 0 for lam in args.lambdas) or args.lambda_default < 0:
        ap.error("--lambdas / --lambda_default must be >= 0")
    for key in ("steps", "batch_size", "block_size", "eval_batches", "stat_batches", "num_random"):
        if getattr(args, key) < 1:
            ap.error(f"--{key} must be >= 1")
    if args.lr_warmup_steps < 0:
        ap.error("--lr_warmup_steps must be >= 0")
    if args.dgrad_cost == "upstream" and not args.per_gemm:
        ap.error("--dgrad_cost upstream prices the dgrad GEMM on its own: it needs --per_gemm")
    if args.fwd_lambda is not None and not args.forward_drift:
        ap.error("--fwd_lambda weighs FWD: it needs --forward_drift")
    if args.fwd_lambda is not None and not (math.isfinite(args.fwd_lambda) and args.fwd_lambda >= 0):
        ap.error(f"--fwd_lambda must be a finite number >= 0, got {args.fwd_lambda}")
    if not (math.isfinite(args.dgrad_calibration) and args.dgrad_calibration > 0):
        ap.error(f"--dgrad_calibration must be a finite number > 0, got {args.dgrad_calibration}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.report_only:
            print(json.dumps(rerender(args.output_dir, merge=args.merge, versus=args.versus,
                                      report_lambda=args.report_lambda, note=args.note)))
            return 0
        result = run_grid(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"compare_plans: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, default=json_default))
    return 0


if __name__ == "__main__":
    sys.exit(main())
