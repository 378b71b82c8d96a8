"""Running a plan-comparison grid, and re-rendering the report of finished ones.

:func:`run_grid` warms the model up unquantized, checkpointed at every phase; at each checkpoint it collects
SNIP's statistics once and solves every method's plans; then, for every data-order seed (a *cell*), trains
each plan from the checkpoint with the same batches and rounding seeds and scores it by validation loss.
``compare_plans.json`` is rewritten after every run, so a stopped grid leaves its finished runs.
:func:`rerender` rewrites the report from result files, merged or compared with other grids.
"""
from __future__ import annotations

import dataclasses
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from snip_ds.quant_config import QuantConfig
from snip_ds.run.data import DataStream
from snip_ds.experts.model import take_routed_tokens
from snip_ds.experiments.grid import build
from snip_ds.experiments.plans import apply_plan, bf16_forward, collect_phase_stats, solve_plans
from snip_ds.experiments.report import write_report
from snip_ds.experiments.results import PREFIX, merge_results, versus_data, write_json
from snip_ds.experiments.summary import target_checks
from snip_ds.experiments.training import (TrainSettings, evaluate, load_checkpoint, make_optimizer,
                                          save_checkpoint, train_steps)
from snip_ds.plan import Plan
from snip_ds.swap import block_index, model_layers, swap_model


def _log(args, msg: str) -> None:
    if not args.silent:
        print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------------
# Warm-up
# --------------------------------------------------------------------------------------------------------
def warm_up(model, train_ds, settings: TrainSettings, args, ckpt_dir: Path) -> Dict[str, Path]:
    """One BF16 warm-up run, checkpointed at every phase's step count; returns ``{phase: path}``."""
    opt = make_optimizer(model, settings)
    stream = DataStream(train_ds, settings.batch_size, seed=args.seed)
    paths, done = {}, 0
    for name, steps in args.phases.items():
        path = ckpt_dir / f"{name}_{steps}"
        losses = train_steps(model, opt, stream.next_batch, steps - done, settings, start_step=done)
        done = steps
        save_checkpoint(model, opt, path, meta={"warmup_steps": steps, "seed": args.seed,
                                                "last_train_loss": losses[-1] if losses else None})
        _log(args, f"warm-up to step {steps} ({name}): train loss {losses[-1] if losses else float('nan'):.4f}")
        paths[name] = path
    return paths


# --------------------------------------------------------------------------------------------------------
# One cell: every plan from one checkpoint, one data order, one rounding seed
# --------------------------------------------------------------------------------------------------------
def run_settings(settings: TrainSettings, warmup_steps: int, steps: int, lr_decay: str) -> TrainSettings:
    """The schedule of one comparison run: ``settings``, decaying linearly to zero over the run if asked."""
    if lr_decay == "none":
        return settings
    return dataclasses.replace(settings, decay_start=warmup_steps, decay_steps=steps)


def run_plan(model, ckpt: Path, plan: Plan, train_ds, val_batches, settings: TrainSettings, seed: int,
             warmup_steps: int, steps: int, quant: QuantConfig, bf16_eval: bool = True) -> Dict[str, Any]:
    """Trains ``plan`` for ``steps`` steps from ``ckpt`` with cell ``seed``'s batches and rounding seeds; returns
    its validation losses (quantized and, unless ``bf16_eval`` is false, BF16 forward), training losses and
    seconds, and on an MoE model each (expert, projection) pair's routed tokens per training step
    (``trained_routed_tokens``)."""
    opt = make_optimizer(model, settings)
    load_checkpoint(model, opt, ckpt)
    swap_model(model, "bf16", quant, seed=seed)  # fresh stochastic-rounding generators, seeded alike for every plan
    apply_plan(model, plan)
    stream = DataStream(train_ds, settings.batch_size, seed=10_000 + seed)
    start = time.perf_counter()
    take_routed_tokens(model)  # MoE experts: count the routing of these training steps only
    losses = train_steps(model, opt, stream.next_batch, steps, settings, start_step=warmup_steps)
    routed = take_routed_tokens(model)  # {} without experts
    val = evaluate(model, val_batches)
    result = dict(val_loss=val, train_losses=losses)
    if bf16_eval:
        with bf16_forward(model):
            result["val_loss_bf16_forward"] = evaluate(model, val_batches)
    swap_model(model, "bf16", quant, seed=seed)
    result["seconds"] = time.perf_counter() - start
    if routed:  # per (expert, projection) pair: its routed tokens per training step of this run
        result["trained_routed_tokens"] = {k: v / steps for k, v in routed.items()}
    return result


def checkpoint_fld(model, ckpt: Path, plans: List[Dict[str, Any]], val_batches, settings,
                   quant: QuantConfig) -> None:
    """Measured forward divergence of every distinct plan at the checkpoint (quantized minus BF16 val loss)."""
    opt = make_optimizer(model, settings)
    load_checkpoint(model, opt, ckpt)
    base = evaluate(model, val_batches)
    cache: Dict[str, float] = {}
    for p in plans:
        digest = p["plan"].digest()
        if digest not in cache:
            apply_plan(model, p["plan"])
            cache[digest] = evaluate(model, val_batches) - base
        p["measured_fld_at_ckpt"] = cache[digest]
    swap_model(model, "bf16", quant, seed=0)


def run_cell(model, ckpt: Path, phase: str, warmup_steps: int, seed: int, plans, train_ds, val_batches,
             settings: TrainSettings, args, sink) -> None:
    """Runs every plan of one cell (uniform FP8 first: every gap refers to it) and hands each record to ``sink``;
    a plan identical to one already run in the cell is not trained again (``shared_with``)."""
    done: Dict[str, Dict[str, Any]] = {}
    fp8 = None
    order = sorted(plans, key=lambda p: p["method"] != "uniform_fp8")  # fp8 first: every gap refers to it
    for p in order:
        plan: Plan = p["plan"]
        digest = plan.digest()
        record = dict(method=p["method"], label=p["label"], rho=p["rho"], phase=phase, warmup_steps=warmup_steps,
                      seed=seed, fp4_share=plan.fp4_share, plan_digest=digest[:16],
                      predicted_fld=p["predicted_fld"], predicted_bwd=p["predicted_bwd"],
                      measured_fld_at_ckpt=p.get("measured_fld_at_ckpt"))
        for key in ("lambda", "plan_seed"):
            if key in p:
                record[key] = p[key]
        if digest in done:
            shared = done[digest]
            result = {k: shared[k] for k in ("val_loss", "val_loss_bf16_forward", "train_losses",
                                             "trained_routed_tokens") if k in shared}
            result.update(seconds=0.0, shared_with=f"{shared['label']}" + (
                f" (rho {shared['rho']})" if shared["rho"] is not None else ""))
        else:
            result = run_plan(model, ckpt, plan, train_ds, val_batches,
                              run_settings(settings, warmup_steps, args.steps, args.lr_decay), seed, warmup_steps,
                              args.steps, args.quant)
        record.update(result)
        if p["method"] == "uniform_fp8":
            fp8 = record
        if fp8 is not None:
            record["gap_to_fp8"] = record["val_loss"] - fp8["val_loss"]
            record["gap_to_fp8_bf16_forward"] = record["val_loss_bf16_forward"] - fp8["val_loss_bf16_forward"]
        done.setdefault(digest, record)
        sink(record)
        _log(args, f"[{phase} seed {seed}] {record['label']:<14} rho={record['rho']} val {record['val_loss']:.4f} "
             f"bf16-fwd {record['val_loss_bf16_forward']:.4f} gap {record.get('gap_to_fp8', float('nan')):+.5f} "
             f"({record['seconds']:.0f}s)")


# --------------------------------------------------------------------------------------------------------
# The grid, and its report re-rendered
# --------------------------------------------------------------------------------------------------------
def prepare_run(args):
    """What a comparison run starts from (the flags of ``launch/compare_plans.py`` or
    ``launch/compare_expert_plans.py``): torch seeded and its threads set, the output folder made, the training
    settings, the model with its train data and validation batches, and its planned layers. Returns
    ``(out_dir, settings, model, train_ds, val_batches, layers)``."""
    torch.manual_seed(args.seed)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = TrainSettings(lr=args.lr, batch_size=args.batch_size, lr_warmup_steps=args.lr_warmup_steps)
    model, train_ds, val_batches = build(args)
    return out_dir, settings, model, train_ds, val_batches, model_layers(model)


def run_grid(args) -> Dict[str, Any]:
    """Runs the grid ``args`` describes (the parsed flags of ``launch/compare_plans.py``) and writes its
    result file and report under ``args.output_dir``; returns the summary printed as the JSON line."""
    t0 = time.perf_counter()
    out_dir, settings, model, train_ds, val_batches, layers = prepare_run(args)
    full = "python launch/compare_plans.py" + ("" if args.model_config is None else
                                               f" --model_config {shlex.quote(str(args.model_config))}")
    data: Dict[str, Any] = dict(settings=dict(
        command="python launch/compare_plans.py " + " ".join(shlex.quote(a) for a in args.argv),
        full_command=full, note=args.note, quick=args.quick,
        model=str(args.model_config or args.model), parameters=sum(p.numel() for p in model.parameters()),
        layers=len(layers), blocks=len({block_index(f) for f in layers}), block_size=args.block_size,
        batch_size=args.batch_size, lr=args.lr, lr_warmup_steps=args.lr_warmup_steps, lr_decay=args.lr_decay,
        phases=args.phases,
        steps=args.steps, seeds=args.seeds, rhos=args.rhos, lambdas=args.lambdas,
        lambda_default=args.lambda_default, num_random=args.num_random, methods=args.methods,
        eval_batches=args.eval_batches, stat_batches=args.stat_batches, dataset=args.dataset,
        per_gemm=args.per_gemm, dgrad_cost=args.dgrad_cost, dgrad_calibration=args.dgrad_calibration,
        bwd_rounding=args.bwd_rounding, bwd_key=args.bwd_key, fp4_recipe=args.quant.fp4_recipe,
        stochastic_rounding=args.quant.stochastic_rounding,
        threads=torch.get_num_threads()), records=[], skipped=[], plans={})
    if args.forward_drift:  # recorded only when on: grids from before the option merge with those without it
        data["settings"]["forward_drift"] = True
    if args.fwd_lambda is not None:
        data["settings"]["fwd_lambda"] = args.fwd_lambda
    json_path = out_dir / f"{PREFIX}.json"

    def sink(record: Dict[str, Any]) -> None:
        data["records"].append(record)
        data["wall_seconds"] = time.perf_counter() - t0
        write_json(data, json_path)

    with tempfile.TemporaryDirectory(prefix="compare_plans_") as tmp:
        ckpt_dir = Path(args.checkpoint_dir or tmp)
        ckpts = warm_up(model, train_ds, settings, args, ckpt_dir)
        plans_by_phase = {}
        for (phase, ckpt), warm in zip(ckpts.items(), args.phases.values()):
            stats = collect_phase_stats(model, ckpt, train_ds, settings, args)
            plans, skipped = solve_plans(stats, args)
            checkpoint_fld(model, ckpt, plans, val_batches, settings, args.quant)
            plans_by_phase[phase] = plans
            data["skipped"] += [dict(phase=phase, **s) for s in skipped]
            data["plans"][phase] = [dict(label=p["label"], rho=p["rho"], assignment=p["plan"].to_dict()["assignment"],
                                         fp4_share=p["plan"].fp4_share) for p in plans]
            for sk in skipped:
                _log(args, f"[{phase}] skipped {sk['label']} at rho {sk['rho']}: {sk['reason']}")
            for seed in args.seeds:
                run_cell(model, ckpt, phase, warm, seed, plans, train_ds, val_batches, settings, args, sink)
    data["wall_seconds"] = time.perf_counter() - t0
    write_json(data, json_path)
    summary = write_report(data, out_dir, plans_by_phase)
    return dict(records=len(data["records"]), wall_seconds=data["wall_seconds"],
                targets=target_checks(summary, data["records"]),
                best_lambda=summary["best_lambda"], output_dir=str(out_dir))


def rerender(output_dir: str, merge: Optional[Sequence[str]] = None, versus: Optional[Sequence[str]] = None,
             report_lambda: Optional[float] = None, note: str = "") -> Dict[str, Any]:
    """Rewrites the report (markdown and plots) of finished grids; returns the JSON line's content.

    Args:
        output_dir: Where the report goes (and, without ``merge``, the grid's own result file).
        merge: Result directories joined into one grid (:func:`~snip_ds.experiments.results.merge_results`).
        versus: Result directories of grids that ran the same cells with other plans: the report gains their
            paired differences (:func:`~snip_ds.experiments.results.versus_data`).
        report_lambda: The λ whose SNIP the report checks, in place of the grid's own default.
        note: A line put at the top of the markdown.

    Raises:
        FileNotFoundError: A result file is missing.
        ValueError: The grids cannot be merged or compared, or the grid did not run SNIP at ``report_lambda``.
    """
    data = merge_results(merge or [output_dir], note)
    if versus:
        data["versus"] = versus_data(data, versus)
    if report_lambda is not None:
        lams = sorted({r["lambda"] for r in data["records"] if r["method"] == "best"})
        if report_lambda not in lams:
            raise ValueError(f"--lambda_default {report_lambda:g}: the grid ran SNIP at λ "
                             f"{', '.join(f'{x:g}' for x in lams) or 'none'} only")
        data["settings"]["report_lambda"] = report_lambda
    if merge or versus or report_lambda is not None:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        write_json(data, Path(output_dir) / f"{PREFIX}.json")
    write_report(data, Path(output_dir))
    return {"records": len(data["records"]), "output_dir": output_dir}
