"""``launch/ab.py``: the same short training under several plans (bf16, fp8, fp4, adaptive), one table.

Each plan trains ``--max_steps`` steps (default 30) of the user's own model and data -- every ``launch/train.py``
flag is passed on, ``--deepspeed`` included -- from the same seed, in its own process (so that each run's peak
memory is its own), one after another, under ``--launcher`` (default: one rank, plain ``python``; e.g.
``"deepspeed --num_gpus 8"``). Each run leaves its output directory under ``--output_dir`` (``<plan>/``, with its
console in ``console.log``), and its ``summary.json`` (:mod:`snip_ds.report.run_summary`) gives the table's row: tokens/s,
peak memory (the largest rank's), the train loss (mean of the last steps), the validation loss after the last
step, the FP4 share and SNIP's share of the time. ``ab.json`` and ``ab.md`` under ``--output_dir`` keep the table.

Where FP8/FP4 are emulated (always on a CPU) the table says so: the losses are the formats', the speed and memory
are not what FP8/FP4 hardware gives.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from snip_ds.runtime.fileio import atomic_write_text
from snip_ds.report.run_summary import SUMMARY_FILE

PLANS = ("bf16", "fp8", "fp4", "adaptive")
TRAIN = Path(__file__).resolve().parents[2] / "launch" / "train.py"  # snip_ds/run/ab.py -> the checkout
OWN_FLAGS = ("--precision", "--plan", "--output_dir", "--max_steps", "--resume_from_checkpoint")


class ABError(ValueError):
    """A bad flag, or a run that failed (the message names it)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch/ab.py", allow_abbrev=False,
        description="Train the same short run under several plans and compare tokens/s, peak memory and loss. Every "
                    "other flag is launch/train.py's and is passed on to each run.",
        epilog="Example: python launch/ab.py --deepspeed ds_configs/zero3.json --model_config my_model.json "
               "--dataset corpus.txt --max_steps 50")
    p.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated plans (default {','.join(PLANS)})")
    p.add_argument("--max_steps", type=int, default=30, help="training steps of each run (default 30)")
    p.add_argument("--output_dir", default="runs/ab", help="each plan's run goes to OUTPUT_DIR/<plan>; the table "
                   "to OUTPUT_DIR/ab.md and ab.json (default runs/ab)")
    p.add_argument("--launcher", default="", help="command that starts launch/train.py's ranks, e.g. "
                   "\"deepspeed --num_gpus 2\" (default: one rank, this Python)")
    return p


def parse(argv: Optional[Sequence[str]] = None):
    """``(args, train_flags)``: this script's flags, and the rest, checked by launch/train.py's own parser (and
    ``--deepspeed``'s JSON read) so that a bad flag stops before the first run. Raises :class:`ABError`."""
    args, rest = build_parser().parse_known_args(argv)
    plans = [x.strip() for x in args.plans.split(",") if x.strip()]
    bad = [x for x in plans if x not in PLANS]
    if bad or not plans:
        raise ABError(f"--plans: unknown {', '.join(bad) or 'empty list'}; valid: {', '.join(PLANS)}")
    if len(set(plans)) != len(plans):
        raise ABError(f"--plans: a plan is named twice in {args.plans!r}")
    args.plans = plans
    if args.max_steps < 1:
        raise ABError(f"--max_steps: must be >= 1, got {args.max_steps}")
    given = [f for f in OWN_FLAGS[:2] + OWN_FLAGS[4:] if any(a == f or a.startswith(f + "=") for a in rest)]
    if given:
        raise ABError(f"{given[0]}: launch/ab.py sets it for each run; leave it out")
    short = [a for a in rest if a.startswith("--") and len(a) > 2 and any(
        own.startswith(a.split("=")[0]) for own in ("--plans", "--max_steps", "--output_dir", "--launcher"))]
    if short:
        raise ABError(f"{short[0]}: spell out launch/ab.py's own flags (--plans, --max_steps, --output_dir, "
                      f"--launcher)")
    from snip_ds.config.train_args import build_parser as train_parser, settings_from_args

    try:
        checked = train_parser().parse_args([*rest, "--max_steps", str(args.max_steps)])
    except SystemExit as stop:  # argparse said what is wrong on stderr
        raise ABError("launch/train.py's flags: see the message above") from stop
    from snip_ds.config.settings import ConfigError
    from snip_ds.config.train_args import UserError

    try:
        settings_from_args(checked)
    except (UserError, ConfigError) as err:  # naming the file or field
        raise ABError(str(err)) from None
    args.launcher = shlex.split(args.launcher)
    return args, list(rest)


def run_plan(plan: str, args, train_flags: List[str], env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Trains ``plan``; returns its row (the run's summary.json figures). Raises :class:`ABError` if it fails."""
    out = Path(args.output_dir) / plan
    out.mkdir(parents=True, exist_ok=True)
    head = args.launcher or [sys.executable]
    cmd = [*head, str(TRAIN), *train_flags, "--precision", plan, "--max_steps", str(args.max_steps),
           "--eval_steps", str(args.max_steps), "--output_dir", str(out), "--no_progress"]
    log = out / "console.log"
    with open(log, "w") as f:
        code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    summary_path = out / SUMMARY_FILE
    if code != 0 or not summary_path.is_file():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise ABError(f"the {plan} run failed (exit code {code}); its console, {log}, ends:\n{tail}")
    s = json.loads(summary_path.read_text())
    return {"plan": plan, "tokens_per_s": s["tokens_per_s"], "peak_memory_bytes": max(s["peak_memory_bytes"]),
            "peak_memory_kind": s["peak_memory_kind"], "train_loss": s["train_loss"],
            "train_loss_steps": s["train_loss_steps"], "validation_loss": s["validation_loss"],
            "fp4_share": s["fp4_share"], "snip_share": s["snip_share"], "emulation": s["emulation"],
            "steps": s["steps"], "output_dir": str(out)}


def _f(x: Optional[float], fmt: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def table(rows: List[Dict[str, Any]]) -> str:
    """The comparison as a Markdown table, with the emulation note under it where there is one."""
    base = next((r for r in rows if r["plan"] == "bf16"), None)
    lines = ["| plan | tokens/s | vs bf16 | peak memory (largest rank) | train loss | validation loss | FP4 share "
             "| SNIP's time |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        rel = (_f(r["tokens_per_s"] / base["tokens_per_s"], ".2f") + "x"
               if base and base["tokens_per_s"] and r["tokens_per_s"] else "")
        lines.append(f"| {r['plan']} | {_f(r['tokens_per_s'], ',.0f')} | {rel} | "
                     f"{r['peak_memory_bytes'] / 2**30:.2f} GiB | {_f(r['train_loss'], '.4f')} | "
                     f"{_f(r['validation_loss'], '.4f')} | {_f(r['fp4_share'], '.2f')} | "
                     f"{_f(r['snip_share'], '.0%') if r['plan'] == 'adaptive' else ''} |")
    if rows:
        lines += ["", f"{rows[0]['steps']} steps each from the same seed; train loss: the mean of the last "
                      f"{rows[0]['train_loss_steps']} steps; peak memory: {rows[0]['peak_memory_kind']}."]
    notes = sorted({r["emulation"] for r in rows if r.get("emulation")})
    lines += [f"Note: {n}." for n in notes]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args, flags = parse(argv)
    except ABError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("ab: on a CPU FP8 and FP4 are emulated (their grid values in FP32 GEMMs): compare the losses; the "
              "tokens/s and memory of fp8/fp4 are not what FP8/FP4 hardware gives", flush=True)
    rows = []
    for plan in args.plans:
        print(f"ab: training {plan} for {args.max_steps} steps -> {Path(args.output_dir) / plan}", flush=True)
        try:
            rows.append(run_plan(plan, args, flags, env=dict(os.environ)))
        except ABError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        r = rows[-1]
        print(f"ab: {plan}: {_f(r['tokens_per_s'], ',.0f')} tokens/s, validation loss "
              f"{_f(r['validation_loss'], '.4f')}", flush=True)
    text = table(rows)
    out = Path(args.output_dir)
    atomic_write_text(out / "ab.md", text + "\n")
    atomic_write_text(out / "ab.json", json.dumps({"max_steps": args.max_steps, "train_flags": flags,
                                                   "rows": rows}, indent=1) + "\n")
    print(text, flush=True)
    print(f"ab: table in {out / 'ab.md'} and {out / 'ab.json'}; each run's console in {out}/<plan>/console.log",
          flush=True)
    return 0
