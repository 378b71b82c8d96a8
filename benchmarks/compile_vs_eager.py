"""How far a compiled training run is from the eager one, step by step: losses and gradients, per plan.

    python benchmarks/compile_vs_eager.py      # writes benchmarks/results/compile_vs_eager.{json,md}

The default model (``snip_ds.run.model.build_model``, byte vocabulary, 64-token blocks), ds_configs/zero1.json on one
rank (FP32 on a CPU), a fixed plan (``bf16``: plain ``F.linear``, no quantization; ``fp8``), four optimizer steps of
the same batches, run eagerly and under ``engine.ds.compile(backend="aot_eager")`` (AOTAutograd's graphs, without
inductor's code generation), each run in a process of its own. Per step: the loss of each run, and how many
parameters' gradients are not bit for bit equal between the two runs (with the largest difference relative to the
gradient's largest magnitude). A difference at step 1, before any update, is the compiled graph's own arithmetic;
with the BF16 plan it is torch.compile's, not snip_ds's (docs/compile.md says where it comes from).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PLANS = ("bf16", "fp8")
STEPS = 4

_RUN = r"""
import json, sys, torch
import snip_ds
from snip_ds.run.model import build_model
mode, plan, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
model = build_model(None, None, vocab_size=257, seed=0, block_size=64)
cfg = json.load(open(%r))
cfg["snip"]["plan"] = plan
engine = snip_ds.initialize(model, cfg, tokens_per_step=4 * 64)
if mode == "compiled":
    engine.ds.compile(backend="aot_eager")
grads = {}
for name, p in model.named_parameters():
    p.register_hook(lambda g, name=name: grads.setdefault(name, []).append(g.detach().clone()))
gen = torch.Generator().manual_seed(1)
losses = []
for _ in range(steps):
    ids = torch.randint(0, 257, (4, 64), generator=gen)
    losses.append(engine.train_step([{"input_ids": ids, "labels": ids}]))
torch.save({"losses": losses, "grads": grads}, out)
"""


def run(mode: str, plan: str, steps: int, out: Path) -> None:
    """One training run (``mode``: eager or compiled) in a process of its own, its losses and gradients saved."""
    code = _RUN % str(REPO / "ds_configs" / "zero1.json")
    proc = subprocess.run([sys.executable, "-c", code, mode, plan, str(steps), str(out)], cwd=REPO,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{plan} {mode}: the run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def compare(eager: dict, compiled: dict) -> list:
    """Per step: both losses, their difference, the parameters whose gradients differ and the largest
    difference relative to the eager gradient's largest magnitude."""
    import torch

    rows = []
    for step, (a, b) in enumerate(zip(eager["losses"], compiled["losses"]), start=1):
        differ, worst = 0, 0.0
        for name, ga in eager["grads"].items():
            x, y = ga[step - 1], compiled["grads"][name][step - 1]
            if not torch.equal(x, y):
                differ += 1
                worst = max(worst, float((x - y).abs().max() / x.abs().max().clamp_min(1e-30)))
        rows.append({"step": step, "eager_loss": a, "compiled_loss": b, "loss_difference": b - a,
                     "gradients_differing": differ, "gradients": len(eager["grads"]),
                     "largest_relative_difference": worst})
    return rows


def markdown(res: dict) -> str:
    lines = ["# compile_vs_eager: a compiled run against the eager one, step by step", "",
             f"Commit {res['commit']}; torch {res['torch']}; the default model, ds_configs/zero1.json, one rank, FP32, "
             f"{res['steps']} steps, `engine.ds.compile(backend=\"aot_eager\")` against eager. Gradients differing: "
             "parameters whose gradient is not bit for bit the eager run's (largest difference relative to the "
             "eager gradient's largest magnitude).", "",
             "| plan | step | eager loss | compiled loss | difference | gradients differing | largest relative |",
             "|---|---|---|---|---|---|---|"]
    for plan, rows in res["plans"].items():
        for r in rows:
            lines.append(f"| {plan} | {r['step']} | {r['eager_loss']:.7f} | {r['compiled_loss']:.7f} | "
                         f"{r['loss_difference']:.2e} | {r['gradients_differing']} of {r['gradients']} | "
                         f"{r['largest_relative_difference']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plans", nargs="+", choices=PLANS, default=list(PLANS))
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--output_dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps: must be at least 1, got {args.steps}")
    import torch

    sys.path.insert(0, str(REPO))
    from snip_ds.runtime.fileio import atomic_write_text

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    res = {"commit": commit, "torch": torch.__version__, "steps": args.steps, "plans": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for plan in args.plans:
            dumps = {}
            for mode in ("eager", "compiled"):
                out = Path(tmp) / f"{plan}_{mode}.pt"
                run(mode, plan, args.steps, out)
                dumps[mode] = torch.load(out, weights_only=True)
            res["plans"][plan] = compare(dumps["eager"], dumps["compiled"])
    args.output_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.output_dir / "compile_vs_eager.json", json.dumps(res, indent=2) + "\n")
    atomic_write_text(args.output_dir / "compile_vs_eager.md", markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
