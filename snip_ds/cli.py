"""The ``snip-ds`` command line: solve, show and compare precision plans.

    snip-ds plan STATS.json --efficiency-saving 0.75 --method best -o plan.json
    snip-ds plan STATS.json --efficiency-saving 0.75 --method random --num-random 5 -o random.json
    snip-ds show plan.json
    snip-ds diff a.json b.json
    snip-ds show runs/zero3/checkpoints/step_120      # a checkpoint directory holds the plan and statistics
    snip-ds plan runs/zero3 --efficiency-saving 0.5 -o plan.json   # a run's output directory: its stats.json
    snip-ds export runs/zero3/checkpoints hf_model
    snip-ds universal runs/zero3 runs/zero3_universal   # resumable on any number of ranks
    snip-ds show runs/hf/checkpoint-60              # a Hugging Face Trainer's checkpoint (snip_ds.hf.SnipCallback)
    snip-ds show runs/zero3/stats.json --sort fld   # per-layer FLD, BWD and the plan's precision
    snip-ds families --output /tmp/survey           # which transformers families train (docs/families.md)
    snip-ds --version

User errors (missing file, bad JSON, bad field, impossible target) print one line to stderr and exit 2.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Sequence

from snip_ds import __version__
from snip_ds.report.artifacts import load_plan, load_stats
from snip_ds.plan import Plan
from snip_ds.options import OPTIONS, add_flags, build, check_flags, from_flags, plain
from snip_ds.planner import CostSettings, SolverSettings, solve_baseline
from snip_ds.report.stats_table import SORTS as STATS_SORTS, is_stats_file, show_stats
from snip_ds.types import display_kinds, kind_labels
from snip_ds.types import GEMMS, PRECISIONS, block_index, expert_pair, layer_kind

_CHAR = {"bf16": "B", "fp8": "8", "fp4": "4"}
_MISSING = "."


class UserError(Exception):
    """A problem with the user's input: reported as one line, exit code 2."""


def _parse_pin(text: str) -> tuple[str, str]:
    fqn, sep, precision = text.partition("=")
    if not sep or not fqn:
        raise UserError(f"--pin {text!r}: expected FQN=PRECISION, e.g. model.layers.0.mlp.down_proj=fp8")
    if precision not in PRECISIONS:
        raise UserError(f"--pin {text!r}: unknown precision {precision!r}; valid precisions are "
                        f"{', '.join(PRECISIONS)}")
    return fqn, precision


def _output_paths(output: str, seeds: Sequence[int]) -> list[str]:
    if len(seeds) == 1:
        return [output]
    stem, ext = os.path.splitext(output)
    return [f"{stem}.seed{s}{ext or '.json'}" for s in seeds]


_OBJECTIVE_UNITS = {"best": "nats, Σ FLD + λ·BWD: the predicted loss increase",
                    "first_last_fp8": "nats, Σ FLD + λ·BWD: the predicted loss increase",
                    "quant_err": "Σ quantization error, no unit", "rel_quant_err": "Σ relative quantization error",
                    "random": "Σ random costs, no unit"}


def _describe(plan: Plan) -> str:
    """One line: method, status, layers, the FP4 share of the linear FLOPs and the objective with its unit."""
    share = "unknown" if plan.fp4_share is None else f"{plan.fp4_share:.4f}"
    objective = ""
    if plan.objective is not None:
        unit = _OBJECTIVE_UNITS.get(plan.method, "the method's costs")
        objective = f", objective {plan.objective:.6g} ({unit})"
    return (f"method {plan.method}, status {plan.status}, {len(plan.assignment)} layers, FP4 share {share} of the "
            f"linear FLOPs{objective}")


# --------------------------------------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------------------------------------
def _cmd_plan(args: argparse.Namespace) -> int:
    check_flags(args, args._argv)  # each value checked as the "snip" section checks it, named as the flag
    if args.num_random < 1:
        raise UserError(f"--num-random: must be at least 1, got {args.num_random}")
    if args.max_share is not None and not args.efficiency_saving <= args.max_share <= 1.0:
        raise UserError(f"--max-share: must lie in [--efficiency-saving, 1] = [{args.efficiency_saving:g}, 1], "
                        f"got {args.max_share:g}")
    if args.dgrad_cost == "upstream" and not args.per_gemm:
        raise UserError("--dgrad-cost upstream: prices the dgrad GEMM on its own, so it needs --per-gemm")
    pinned = dict(_parse_pin(p) for p in args.pin or [])
    allowed = OPTIONS["allowed"].validate("--allowed", tuple(a.strip() for a in args.allowed.split(",") if a.strip()))
    stats, _ = load_stats(args.stats)
    previous = load_plan(args.previous)[0] if args.previous else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        settings = from_flags(args, allowed=allowed, pinned=pinned)
        cost, solver = build(CostSettings, settings), build(SolverSettings, settings)
        plans = solve_baseline(args.method, stats, args.efficiency_saving, cost, solver, previous=previous,
                               seed=args.seed, num_random=args.num_random)
    for w in caught:
        print(f"snip-ds: warning: {w.message}", file=sys.stderr)
    seeds = [p.meta.get("seed", args.seed) for p in plans]
    for plan, path in zip(plans, _output_paths(args.output, seeds)):
        plan.save(path)
        print(f"{path}: {_describe(plan)}")
    return 0


# --------------------------------------------------------------------------------------------------------
# show
# --------------------------------------------------------------------------------------------------------
def _cell(value) -> str:
    if isinstance(value, str):
        return _CHAR[value]
    return "".join(_CHAR[value[g]] for g in GEMMS)


def render_plan(plan: Plan, title: str = "plan") -> str:
    """Per-block precision map: rows are decoder blocks, columns the kinds of layer (their paths inside a block,
    headed by a short label: q, k, v, o, gate, up, down for a Llama; qkv, o, gate_up, down for a Phi-3), one
    char a precision (three for a per-GEMM plan: fprop, dgrad, wgrad)."""
    rows: dict = {}
    dense = {f: v for f, v in plan.assignment.items() if expert_pair(f) is None}
    for fqn, value in dense.items():
        try:
            block = block_index(fqn)
        except ValueError:
            block = "-"
        rows.setdefault(block, {})[layer_kind(fqn)] = _cell(value)
    columns = list(display_kinds(dense))
    header = kind_labels(columns)
    width = 3 if plan.per_gemm else 1
    widths = [max(len(header.get(c, c)), width) for c in columns]
    order = sorted((b for b in rows if b != "-")) + (["-"] if "-" in rows else [])
    lines = [f"{title}: {_describe(plan)}",
             "block  " + "  ".join(header.get(c, c).ljust(w) for c, w in zip(columns, widths))]
    for b in order:
        cells = [rows[b].get(c, _MISSING * width).ljust(w) for c, w in zip(columns, widths)]
        lines.append((f"{str(b):>5}  " + "  ".join(cells)).rstrip())
    lines += _render_experts(plan)
    legend = ", ".join(f"{ch} = {p}" for p, ch in _CHAR.items()) + f", {_MISSING} = not in plan"
    if plan.per_gemm:
        legend += f"; per-GEMM cells read {'/'.join(GEMMS)}"
    counts = {}
    for v in plan.gemm_assignment().values():
        for p in v.values():
            counts[p] = counts.get(p, 0) + 1
    total = sum(counts.values())
    lines.append("legend: " + legend)
    lines.append("GEMMs counted (fprop, dgrad and wgrad of each layer, not weighted by FLOPs): "
                 + ", ".join(f"{p} {counts.get(p, 0)}/{total}" for p in PRECISIONS))
    return "\n".join(lines)


_EXPERTS_SPELLED_OUT = 64  # up to this many experts a row spells out each expert's precision


def _render_experts(plan: Plan) -> list:
    """The MoE pairs of ``plan``: per experts module (one row) and projection, one cell per expert in expert
    order (``_EXPERTS_SPELLED_OUT`` experts at most; more are summed up as counts per precision)."""
    modules: dict = {}
    for fqn, value in plan.assignment.items():
        pair = expert_pair(fqn)
        if pair is not None:
            path, expert, projection = pair
            modules.setdefault(path, {}).setdefault(projection, {})[expert] = value
    if not modules:
        return []
    n = max(max(e) + 1 for projections in modules.values() for e in projections.values())
    projections = sorted(dict.fromkeys(p for projs in modules.values() for p in projs),
                         key=lambda p: p.startswith("down"))  # a block's order: gate/up before down
    lines = [f"experts ({n} per module; each cell string lists the experts in order)"
             if n <= _EXPERTS_SPELLED_OUT else f"experts ({n} per module; counts per precision)"]

    def text(cells: dict) -> str:
        if n <= _EXPERTS_SPELLED_OUT:
            return "|".join(_cell(cells[e]) if e in cells else _MISSING for e in range(n)) if plan.per_gemm \
                else "".join(_cell(cells[e]) if e in cells else _MISSING for e in range(n))
        counts: dict = {}
        for value in cells.values():
            for p in (value,) if isinstance(value, str) else value.values():
                counts[p] = counts.get(p, 0) + 1
        return " ".join(f"{p}:{counts[p]}" for p in PRECISIONS if p in counts)

    table = [[path] + [text(projs.get(p, {})) for p in projections] for path, projs in modules.items()]
    widths = [max(len(r[i]) for r in table + [["module"] + [p.removesuffix("_proj") for p in projections]])
              for i in range(len(projections) + 1)]
    head = ["module"] + [p.removesuffix("_proj") for p in projections]
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    return lines


def _cmd_show(args: argparse.Namespace) -> int:
    if is_stats_file(args.plan):  # a stats.json: per-layer FLD, BWD and the plan beside it
        print(show_stats(args.plan, sort=args.sort, plan_path=args.with_plan))
        return 0
    if args.with_plan is not None:
        raise UserError(f"--plan: only with a statistics file; {args.plan} is a plan")
    plan, source = load_plan(args.plan)
    print(render_plan(plan, title=source))
    return 0


# --------------------------------------------------------------------------------------------------------
# diff
# --------------------------------------------------------------------------------------------------------
def _label(value) -> str:
    return value if isinstance(value, str) else "/".join(value[g] for g in GEMMS)


def _cmd_diff(args: argparse.Namespace) -> int:
    (a, source_a), (b, source_b) = load_plan(args.a), load_plan(args.b)
    print(f"A {source_a}: {_describe(a)}")
    print(f"B {source_b}: {_describe(b)}")
    only_a = sorted(set(a.assignment) - set(b.assignment))
    only_b = sorted(set(b.assignment) - set(a.assignment))
    ga, gb = a.gemm_assignment(), b.gemm_assignment()
    common = sorted(set(ga) & set(gb))
    differ = [f for f in common if ga[f] != gb[f]]
    transitions: dict = {}
    for f in differ:
        key = f"{_label(a.assignment[f])} -> {_label(b.assignment[f])}"
        transitions[key] = transitions.get(key, 0) + 1
    print(f"{len(differ)} of {len(common)} common layers differ"
          + (": " + ", ".join(f"{k}: {n}" for k, n in sorted(transitions.items())) if differ else ""))
    if only_a or only_b:
        print(f"{len(only_a)} layer(s) only in A, {len(only_b)} only in B")
    width = max((len(f) for f in differ + only_a + only_b), default=0)
    for f in differ:
        print(f"  {f.ljust(width)}  {_label(a.assignment[f])} -> {_label(b.assignment[f])}")
    for f in only_a:
        print(f"  {f.ljust(width)}  {_label(a.assignment[f])} -> (absent)")
    for f in only_b:
        print(f"  {f.ljust(width)}  (absent) -> {_label(b.assignment[f])}")
    return 0


# --------------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation and tests)."""
    parser = argparse.ArgumentParser(prog="snip-ds", description="SNIP FP8/FP4 precision plans: solve, show and "
                                     "compare them; export and convert checkpoints; survey model families.")
    parser.add_argument("--version", action="version", version=f"snip-ds {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("plan", help="solve a plan from a statistics file")
    p.add_argument("stats", help="statistics JSON (format snip_ds.stats/1), a run's output directory (its "
                   "stats.json) or a checkpoint directory of an adaptive run")
    add_flags(p)  # --efficiency-saving, --method, --lambda ...: the "snip" section's settings that a solve takes
    p.add_argument("--num-random", type=int, default=1,
                   help="number of random plans (seeds seed..seed+N-1; files OUT.seedS.json when N > 1; default 1)")
    p.add_argument("--pin", action="append", metavar="FQN=PRECISION",
                   help="hold a layer at a precision, e.g. --pin model.layers.0.mlp.down_proj=fp8 (repeatable; "
                   "PRECISION one of bf16, fp8, fp4; FQN a layer's full name or a glob such as "
                   "'model.layers.*.mlp.down_proj'; an exact name beats a glob; default: none)")
    p.add_argument("--allowed", default=",".join(OPTIONS["allowed"].default),
                   help=f"comma-separated: {plain(OPTIONS['allowed'].help)} (default "
                   f"{','.join(OPTIONS['allowed'].default)})")
    p.add_argument("--previous", default=None, help="previous plan JSON or checkpoint directory (for --flip-penalty)")
    p.add_argument("-o", "--output", required=True, help="plan JSON to write")
    p.set_defaults(func=_cmd_plan)

    s = sub.add_parser("show", help="print a plan as a per-block precision map, or a statistics file as a "
                       "per-layer table")
    s.add_argument("plan", help="plan JSON, a run's output directory (its plan.json) or a checkpoint directory "
                   "(step_N, or a Hugging Face Trainer's checkpoint-N); or a statistics file (a run's stats.json): "
                   "per layer its FLOPs, FLD and BWD at fp8 and fp4, and its precision in the plan.json beside it")
    s.add_argument("--sort", choices=STATS_SORTS, default="layer",
                   help="statistics only: the rows in the model's order (layer), or by a column's fp4 value, "
                   "largest first: fld, bwd, cost (FLD + λ·BWD), flops (default: layer)")
    s.add_argument("--plan", dest="with_plan", metavar="PLAN", default=None,
                   help="statistics only: the plan whose precisions the table shows (a plan JSON, output or "
                   "checkpoint directory; default: the plan.json beside the statistics file, if there is one)")
    s.set_defaults(func=_cmd_show)

    d = sub.add_parser("diff", help="compare two plans")
    d.add_argument("a", help="plan JSON, output directory or checkpoint directory")
    d.add_argument("b", help="the same, compared with a")
    d.set_defaults(func=_cmd_diff)

    e = sub.add_parser("export", help="write a Hugging Face model directory from a training checkpoint")
    e.add_argument("checkpoint", help="a checkpoint directory (step_N) or the checkpoints directory (its 'latest'); "
                   "a Hugging Face Trainer's checkpoint-N or output directory (its last checkpoint-N)")
    e.add_argument("out_dir", help="the model directory to write (AutoModelForCausalLM.from_pretrained loads it)")
    e.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="dtype of the exported master weights")
    e.add_argument("--force", action="store_true", help="replace a previous export in OUT_DIR")
    from snip_ds.export.cli import add_format_arguments  # (imports neither torch nor transformers)
    add_format_arguments(e)
    e.set_defaults(func=_cmd_export)

    u = sub.add_parser("universal", help="convert a training checkpoint into a universal one, which a run of any "
                       "number of ranks resumes")
    u.add_argument("checkpoint", help="a checkpoint directory (step_N), the checkpoints directory (its 'latest') or a "
                   "run's output directory (its last complete checkpoint); ZeRO stage 1, 2 or 3")
    u.add_argument("out_dir", help="the directory to write: OUT_DIR/step_N and OUT_DIR/latest (pass OUT_DIR to "
                   "--resume_from_checkpoint)")
    u.set_defaults(func=_cmd_universal)

    from snip_ds.families.command import add_parser as add_families  # (imports neither torch nor transformers)
    add_families(sub)
    return parser


def _cmd_universal(args: argparse.Namespace) -> int:
    from snip_ds.engine.checkpoint_layout import CheckpointError
    from snip_ds.engine.universal import convert_to_universal  # imports DeepSpeed

    try:
        out = convert_to_universal(Path(args.checkpoint), Path(args.out_dir))
    except CheckpointError as err:
        raise UserError(str(err)) from None
    print(f"{out}: universal checkpoint written; resume it on any number of ranks (any tensor-parallel degree) "
          f"with --resume_from_checkpoint {out.parent}, keeping the global batch (micro-batch x gradient "
          f"accumulation x data-parallel ranks)")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from snip_ds.export import export_checkpoint  # imports DeepSpeed and transformers: only when exporting
    from snip_ds.export.serve import serve_options

    record = export_checkpoint(args.checkpoint, args.out_dir, dtype=args.dtype, force=args.force,
                               warn=lambda msg: print(f"snip-ds: warning: {msg}", file=sys.stderr),
                               serve=serve_options(args))
    tokenizer = "with its tokenizer" if record["tokenizer"]["exported"] else "without a tokenizer"
    stored = f"in {args.dtype}" if args.format == "hf" else \
        f"as compressed-tensors (layers: {record['schemes']}; the rest in {args.dtype})"
    print(f"{args.out_dir}: step {record['step']}, {record['parameters']} parameters {stored}, {tokenizer}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``snip-ds``; returns the exit code (2 for user errors)."""
    args = build_parser().parse_args(argv)
    args._argv = list(argv) if argv is not None else sys.argv[1:]  # the command line, for what records it
    try:
        return args.func(args)
    except (UserError, ValueError, FileNotFoundError, IsADirectoryError, PermissionError) as e:
        print(f"snip-ds: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
