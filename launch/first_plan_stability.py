"""Does the first adaptive plan (before step 1, no Adam state yet) follow round-off? (docs/experiments.md,
"The first plan").

For each model seed, the first statistics collection of a run is repeated with every matrix product's FP32
operands rounded to TF32 and with every reduction split in two halves (another order of summation, as
another GPU kernel sums), under each preconditioner prior; each prior's first plan is also compared with the
plan Adam's real state gives at the first re-plan (step 16). Writes ``first_plan_stability.json`` and ``.md``.

Examples::

    python launch/first_plan_stability.py                        # 8 seeds of the embedded default model
    python launch/first_plan_stability.py --seeds 0,1 --output_dir /tmp/fp

The study lives in :mod:`snip_ds.experiments.first_plan` (research code, never imported by the training
package); this script parses the flags, runs it and writes the results.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snip_ds.divergence import FALLBACKS  # noqa: E402
from snip_ds.experiments import first_plan  # noqa: E402


def header(args, torch_version: str) -> str:
    """The report's first lines: the command and the learning rate the first plan is priced at."""
    return (f"# The first plan under round-off\n\n`python launch/first_plan_stability.py --seeds {args.seeds} "
            f"--lr {args.lr:g} --warmup_steps {args.warmup_steps}` (torch {torch_version}): the first plan is priced "
            f"at η = {args.lr / args.warmup_steps:g}, the first step's rate of a linear warm-up.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2,3,4,5,6,7", help="comma-separated model seeds")
    ap.add_argument("--priors", default=",".join(FALLBACKS), help="comma-separated preconditioner priors")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    ap.add_argument("--warmup_steps", type=int, default=12, help="linear warm-up: the first plan's lr is lr/warmup")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output_dir", default="benchmarks/results")
    args = ap.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    priors = [p.strip() for p in args.priors.split(",") if p.strip()]
    bad = [p for p in priors if p not in FALLBACKS]
    if bad or not priors or not seeds:
        ap.error(f"--priors: unknown {bad}; valid: {', '.join(FALLBACKS)}" if bad else "--seeds/--priors: empty")
    torch.set_num_threads(args.threads)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = first_plan.run(seeds, priors, lr=args.lr, warmup_steps=args.warmup_steps,
                             log=lambda m: print(m, flush=True))
    summ = first_plan.summary(records)
    (out / "first_plan_stability.json").write_text(json.dumps({"settings": vars(args), "summary": summ,
                                                               "records": records}, indent=1) + "\n")
    md = first_plan.markdown(summ, header(args, torch.__version__))
    (out / "first_plan_stability.md").write_text(md)
    print(md)
    print(json.dumps(summ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
