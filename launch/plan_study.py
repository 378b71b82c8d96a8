"""The plan study: does SNIP's plan beat simpler plans, across model seeds? (docs/experiments.md, "The plan study").

Per model seed its own warm-up, statistics and plans; per cell (model seed × data seed) every arm trains from that
checkpoint with the same batches and rounding seeds; arms are paired with SNIP at the same FP4 share; standard
errors are clustered by model seed. Resumable: ``cells.json`` is rewritten after every cell, and a rerun into
the same ``--output_dir`` skips what is done. Design and budget: :mod:`snip_ds.experiments.plan_study`.

Examples::

    python launch/plan_study.py                                  # the main study (estimated ~55 min, 2 cores)
    python launch/plan_study.py --regime stress                  # MXFP4 stress grid, reported apart (~12 min)
    python launch/plan_study.py --model_seeds 0,1 --data_seeds 0,1 --blocks 2 --warmup_steps 20 --steps 4 \\
        --eval_batches 2 --stat_batches 2 --output_dir /tmp/plan_study_smoke   # a smoke run, about a minute
    python launch/plan_study.py --summary_only                   # rewrite summary.{json,md} and the plot
    python launch/plan_study.py --regime gpu --model_seeds 0     # on a CUDA GPU, one model seed per piece

Outputs under ``--output_dir`` (default ``benchmarks/results/plan_study``, ``…/plan_study/stress`` for the
stress regime): ``cells.json``, ``plans.json``, ``summary.json``, ``summary.md``, ``summary_seeds.png``; warm-up
checkpoints and statistics under ``--checkpoint_dir`` (default ``<output_dir>/checkpoints``, git-ignored).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from snip_ds.experiments.plan_study import ARMS, REGIMES, run_study  # noqa: E402
from snip_ds.experiments.results import json_default  # noqa: E402
from snip_ds.experiments.study_report import write_summary  # noqa: E402
from snip_ds.options import OPTIONS  # noqa: E402
from snip_ds.quant_config import FP4_RECIPES  # noqa: E402

DEFAULT_MODEL = "benchmarks/configs/llama_8x96.json"  # relative to the working directory, else to the checkout


def _ints(name: str, text: str):
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{name}: expected comma-separated integers, got {text!r}")
    if not values or len(set(values)) != len(values) or any(not 0 <= v < 1000 for v in values):
        raise ValueError(f"--{name}: expected distinct integers in [0, 999], got {text!r}")
    return values


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regime", default="main", choices=tuple(REGIMES),
                    help="main: NVFP4 (default); stress: MXFP4, a smaller grid reported apart; gpu: the main design "
                         "on a CUDA GPU with a larger model (12 blocks x 256), run one model seed at a time")
    ap.add_argument("--model_seeds", default=None, help="comma-separated model seeds (init and warm-up order)")
    ap.add_argument("--data_seeds", default=None, help="comma-separated data seeds (one cell per model seed each)")
    ap.add_argument("--arms", default=None, help="comma-separated subset of " + ", ".join(ARMS) +
                    " (uniform_fp8 and snip always run: every difference refers to them)")
    ap.add_argument("--model_config", default=None, help="JSON config of the model (default: the regime's; "
                    "main and stress: 8 blocks × hidden 96)")
    ap.add_argument("--device", default=None, choices=("cpu", "cuda"), help="where the runs train (default: the "
                    "regime's: cpu, cuda for --regime gpu)")
    ap.add_argument("--blocks", type=int, default=None, help="decoder blocks, in place of the config's (e.g. 2 "
                    "for a smoke run)")
    ap.add_argument("--dataset", default=None, help="text/JSON-lines file or prepared directory (default: the "
                    "Python stdlib corpus)")
    ap.add_argument("--warmup_steps", type=int, default=800, help="unquantized warm-up steps per model seed")
    ap.add_argument("--steps", type=int, default=100, help="training steps per run after the warm-up")
    ap.add_argument("--rho", type=float, default=0.75, help="target FP4 share of the linear FLOPs")
    ap.add_argument("--lam", type=float, default=float(OPTIONS["bwd_lambda"].default),
                    help="λ of SNIP's cost FLD + λ·BWD (default: the package default)")
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--block_size", type=int, default=64)
    ap.add_argument("--eval_batches", type=int, default=64)
    ap.add_argument("--stat_batches", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--lr_warmup_steps", type=int, default=20)
    ap.add_argument("--fp4_recipe", default=None, choices=FP4_RECIPES, help="default: the regime's")
    ap.add_argument("--no_stochastic_rounding", dest="stochastic_rounding", action="store_false")
    ap.add_argument("--workers", type=int, default=None, help="processes running cells, one torch thread each "
                    "(default 2 on the CPU; 1 on a GPU, the only choice there)")
    ap.add_argument("--max_minutes", type=float, default=0.0, help="stop after this many minutes (0: no limit), "
                    "keeping every finished cell; the same command resumes")
    ap.add_argument("--output_dir", default=None)
    ap.add_argument("--checkpoint_dir", default=None)
    ap.add_argument("--summary_only", action="store_true", help="rewrite the summary from cells.json")
    ap.add_argument("--silent", action="store_true")
    args = ap.parse_args(argv)
    regime = REGIMES[args.regime]
    try:
        args.model_seeds = _ints("model_seeds", args.model_seeds or regime["model_seeds"])
        args.data_seeds = _ints("data_seeds", args.data_seeds or regime["data_seeds"])
    except ValueError as err:
        ap.error(str(err))
    arms = [a.strip() for a in (args.arms or regime["arms"]).split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        ap.error(f"--arms: unknown {', '.join(bad)}; valid: {', '.join(ARMS)}")
    args.arms = tuple(a for a in ARMS if a in arms or a in ("uniform_fp8", "snip"))
    args.fp4_recipe = args.fp4_recipe or regime["fp4_recipe"]
    args.model_config = args.model_config or regime.get("model_config", DEFAULT_MODEL)
    args.device = args.device or regime.get("device", "cpu")
    if args.workers is None:
        args.workers = 1 if args.device == "cuda" else 2
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            ap.error("--device cuda: torch sees no CUDA GPU here (--regime gpu runs on a GPU machine: "
                     "gpu/run_device.sh's plan_study step)")
        if args.workers != 1:
            ap.error(f"--workers must be 1 with --device cuda (one process drives the GPU), got {args.workers}")
    if args.output_dir is None:
        args.output_dir = str(Path("benchmarks/results/plan_study") / regime["subdir"])
    if args.checkpoint_dir is None:
        args.checkpoint_dir = str(Path(args.output_dir) / "checkpoints")
    if args.blocks is not None and args.blocks < 1:
        ap.error(f"--blocks must be >= 1, got {args.blocks}")
    for key in ("warmup_steps", "steps", "batch_size", "block_size", "eval_batches", "stat_batches", "workers"):
        if getattr(args, key) < 1:
            ap.error(f"--{key} must be >= 1, got {getattr(args, key)}")
    if not (math.isfinite(args.max_minutes) and args.max_minutes >= 0):
        ap.error(f"--max_minutes must be a finite number >= 0, got {args.max_minutes}")
    if args.lr_warmup_steps < 0:
        ap.error(f"--lr_warmup_steps must be >= 0, got {args.lr_warmup_steps}")
    if not 0.0 < args.rho < 1.0:
        ap.error(f"--rho must lie strictly between 0 and 1, got {args.rho}")
    if not (math.isfinite(args.lam) and args.lam >= 0):
        ap.error(f"--lam must be a finite number >= 0, got {args.lam}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        ap.error(f"--lr must be a finite number > 0, got {args.lr}")
    path = Path(args.model_config)
    args.model_config_path = str(path if path.is_file() or path.is_absolute() else ROOT / path)
    if not Path(args.model_config_path).is_file():
        ap.error(f"--model_config {args.model_config}: no such file")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.summary_only:
            s = write_summary(Path(args.output_dir))
            print(json.dumps(dict(output_dir=args.output_dir, targets=s["targets"]), default=json_default))
            return 0
        ckpt = Path(args.checkpoint_dir)
        ckpt.mkdir(parents=True, exist_ok=True)
        if ckpt.resolve().parent == Path(args.output_dir).resolve():  # keep checkpoints out of git
            (Path(args.output_dir) / ".gitignore").write_text(f"{ckpt.name}/\n", encoding="utf-8")
        result = run_study(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"plan_study: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, default=json_default))
    return 0


if __name__ == "__main__":
    sys.exit(main())
