"""``snip-ds families``: the survey from the command line.

    snip-ds families --output /tmp/survey             # every family; /tmp/survey/families.md and families.json
    snip-ds families --output docs                    # regenerate the shipped table, docs/families.md
    snip-ds families --only llama,mixtral --output /tmp/survey
    snip-ds families --plans fp8,adaptive --timeout 60 --jobs 2 --output /tmp/survey

Bad input (no output named, an unknown model type or plan, a timeout or job count out of range, an output that
cannot be written) is one line on stderr and exit code 2, before anything runs.
"""
from __future__ import annotations

import argparse
import datetime
import difflib
import os
import shlex
import sys
import time
from pathlib import Path
from typing import List, Optional

from snip_ds.families.probe import PLANS
from snip_ds.families.sweep import DEFAULT_TIMEOUT


class FamiliesError(ValueError):
    """Bad input to ``snip-ds families``: reported as one line, exit code 2."""


def add_parser(sub) -> argparse.ArgumentParser:
    """The ``families`` sub-command of ``snip-ds``."""
    f = sub.add_parser("families", help="build every causal-LM family of the installed transformers tiny, train "
                       "a step of each plan with snip_ds through the Hugging Face Trainer, and write the table "
                       "of supported families")
    f.add_argument("--only", default=None, metavar="TYPE[,TYPE]",
                   help="model types to survey (keys of transformers' causal-LM mapping, e.g. llama,mixtral); "
                   "default: all. The table then holds those families only")
    f.add_argument("--output", default=None, metavar="DIR",
                   help="directory to write the table (families.md) and the raw rows (families.json) to; required "
                   "unless --markdown and --json name both files ('--output docs' replaces the shipped table)")
    f.add_argument("--markdown", default=None, metavar="PATH", help="the table's path (default: DIR/families.md)")
    f.add_argument("--json", default=None, metavar="PATH", help="the rows' path (default: DIR/families.json)")
    f.add_argument("--plans", default=",".join(PLANS), metavar="PLAN[,PLAN]",
                   help=f"plans to run, each one optimizer step (adaptive: one statistics collection and solve "
                   f"first); default: {','.join(PLANS)}")
    f.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                   help=f"per family, all its plans (default {DEFAULT_TIMEOUT:g})")
    f.add_argument("--jobs", type=int, default=1, help="families surveyed at once, each in its own process")
    f.add_argument("--threads", type=int, default=1, help="torch threads per family (default 1)")
    f.set_defaults(func=run)
    return f


def _model_types(only: Optional[str]) -> List[str]:
    from snip_ds.families.sweep import causal_lm_families

    known = list(causal_lm_families())
    if only is None:
        return known
    wanted = [t.strip() for t in only.split(",") if t.strip()]
    if not wanted:
        raise FamiliesError("--only: no model type given")
    for t in wanted:
        if t not in known:
            close = difflib.get_close_matches(t, known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise FamiliesError(f"--only: {t!r} is not a causal-LM model type of the installed transformers "
                                f"({len(known)} are, e.g. llama, mixtral, gpt2){hint}")
    return list(dict.fromkeys(wanted))


def _plans(text: str) -> List[str]:
    plans = [p.strip() for p in text.split(",") if p.strip()]
    if not plans:
        raise FamiliesError("--plans: no plan given")
    for p in plans:
        if p not in PLANS:
            raise FamiliesError(f"--plans: unknown plan {p!r}; valid plans are {', '.join(PLANS)}")
    return list(dict.fromkeys(plans))


def _writable(path: Path, flag: str) -> Path:
    """``path``'s directory exists (made if missing) and takes a file; a one-line error otherwise."""
    directory = path.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise FamiliesError(f"{flag} {path}: cannot make its directory ({err.strerror or err})") from None
    if path.is_dir():
        raise FamiliesError(f"{flag} {path}: is a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise FamiliesError(f"{flag} {path}: directory {directory} is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise FamiliesError(f"{flag} {path}: not writable")
    return path


def run(args: argparse.Namespace) -> int:
    """Runs the survey the arguments describe and writes its table; returns the exit code."""
    if args.output is None and not (args.markdown and args.json):
        raise FamiliesError("--output: name the directory to write families.md and families.json to (e.g. "
                            "--output /tmp/survey; '--output docs' replaces the shipped table), or give both "
                            "--markdown and --json")
    import torch
    import transformers

    from snip_ds.families import report
    from snip_ds.families.sweep import sweep

    if not args.timeout > 0:
        raise FamiliesError(f"--timeout: must be > 0 seconds, got {args.timeout:g}")
    if args.jobs < 1:
        raise FamiliesError(f"--jobs: must be >= 1, got {args.jobs}")
    if args.threads < 1:
        raise FamiliesError(f"--threads: must be >= 1, got {args.threads}")
    plans = _plans(args.plans)
    model_types = _model_types(args.only)
    output = Path(args.output or ".")
    if args.output is not None and output.exists() and not output.is_dir():
        raise FamiliesError(f"--output {output}: not a directory")
    markdown = _writable(Path(args.markdown) if args.markdown else output / "families.md",
                         "--markdown" if args.markdown else "--output")
    json_path = _writable(Path(args.json) if args.json else output / "families.json",
                          "--json" if args.json else "--output")

    width = max(len(t) for t in model_types)

    def progress(done: int, total: int, row: dict) -> None:
        status, note = report.classify(row)
        print(f"[{done:>{len(str(total))}}/{total}] {row['model_type']:<{width}}  {status:<13} "
              f"{row.get('seconds', 0):>6.1f} s  {note[:100]}", flush=True)

    start = time.perf_counter()
    rows = report.annotate(sweep(model_types, plans, timeout=args.timeout, jobs=args.jobs, threads=args.threads,
                                 progress=progress))
    wall = time.perf_counter() - start
    command = "snip-ds " + " ".join(shlex.quote(a) for a in getattr(args, "_argv", sys.argv[1:]))
    meta = {"transformers": transformers.__version__, "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "command": command, "plans": plans,
            "timeout_s": args.timeout, "jobs": args.jobs, "threads": args.threads, "wall_seconds": round(wall, 1),
            "peak_rss_mb": max((r.get("peak_rss_mb", 0.0) for r in rows), default=0.0)}
    report.write(rows, markdown, json_path, meta)
    counts = report.summary(rows)
    a, m = counts["all"], counts["moe"]
    print(f"{markdown}: {a['families']} families, {a['buildable']} buildable, {a['trains']} train, "
          f"{a['fails checks']} fail checks, {a['refused']} refused, {a['crashes']} crash, {a['timeout']} timed out; "
          f"MoE {m['families']}: {m['trains']} train, {m['per_expert']} per expert ({wall:.0f} s)")
    return 0


__all__ = ["FamiliesError", "add_parser", "run"]
