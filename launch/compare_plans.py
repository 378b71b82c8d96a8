"""Compare SNIP's plans with the baselines by training from the same checkpoints (SNIP.md section 7, plan quality).

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
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snip_ds.stats import CollectSettings, adam_precond, collect_statistics  # noqa: E402
from snip_ds.quant_config import BWD_ROUNDINGS, FP4_RECIPES, QuantConfig  # noqa: E402
from snip_ds.compare import (MeanSE, TrainSettings, apply_plan, attainable_share, bf16_forward,  # noqa: E402
                             cell_means, evaluate, load_checkpoint, make_optimizer, mean_se, paired_differences,
                             paired_verdict, predicted_divergence, save_checkpoint, spearman, train_steps)
from snip_ds.data import DataStream, load_dataset_blocks  # noqa: E402
from snip_ds.model import build_model  # noqa: E402
from snip_ds.omp import preserve_torch_threads  # noqa: E402
from snip_ds.plan import GEMMS, Plan  # noqa: E402
from snip_ds.planner import BWD_KEYS, DGRAD_COSTS, CostSettings, SolverSettings, solve_baseline  # noqa: E402
from snip_ds.swap import block_index, snip_layers, swap_linears  # noqa: E402

PREFIX = "compare_plans"
# settings that parts of one grid may hold different subsets of: merged as unions (sort keys)
_UNION = {"seeds": int, "rhos": float, "lambdas": float, "methods": lambda m: METHOD_CHOICES.index(m)}
SOLVED = ("best", "random", "quant_err", "rel_quant_err", "first_last_fp8")
UNIFORM = ("bf16", "uniform_fp8", "uniform_fp4")
# one GEMM kind in FP4 in every layer, the rest FP8 (ρ-independent, opt-in): what each kind costs on its own
KIND_PLANS = {"fp4_fprop": ("fprop",), "fp4_dgrad": ("dgrad",), "fp4_wgrad": ("wgrad",),
              "fp4_backward": ("dgrad", "wgrad")}
DEFAULT_METHODS = UNIFORM + SOLVED
METHOD_CHOICES = DEFAULT_METHODS + tuple(KIND_PLANS)
# model: "tiny" (--quick) or "small" (default), see _model_config; the rest are argparse defaults
QUICK = dict(model="tiny", block_size=32, batch_size=4, phases="30", seeds="0", rhos="0.5", lambdas="1,2,1000",
             num_random=1, steps=4, eval_batches=2, stat_batches=2, lr_warmup_steps=5)
FULL = dict(model="small", block_size=64, batch_size=8, phases="200,800", seeds="0,1,2", rhos="0.5,0.75,0.9",
            lambdas="1,2,30,100,1000", num_random=3, steps=100, eval_batches=64, stat_batches=64, lr_warmup_steps=20)


# --------------------------------------------------------------------------------------------------------
# Set-up: model, data, warm-up checkpoints
# --------------------------------------------------------------------------------------------------------
def _model_config(name: str, block_size: int):
    from transformers import LlamaConfig
    sizes = {"tiny": dict(hidden_size=32, intermediate_size=96, num_attention_heads=2),
             "small": dict(hidden_size=128, intermediate_size=384, num_attention_heads=4)}
    return LlamaConfig(vocab_size=264, num_hidden_layers=4, num_key_value_heads=2, max_position_embeddings=max(
        block_size, 256), use_cache=False, tie_word_embeddings=False, **sizes[name])


def build(args):
    caps = dict(max_bytes=2 ** 18, max_validation_bytes=2 ** 15) if args.quick and args.dataset is None else {}
    train_ds, val_ds, vocab, _ = load_dataset_blocks(args.dataset, args.block_size, **caps)
    config = args.model_config or _model_config(args.model, args.block_size)
    model = build_model(model_config=config, vocab_size=vocab, seed=args.seed, block_size=args.block_size)
    swap_linears(model, "bf16", args.quant, seed=args.seed)
    need = args.eval_batches * args.batch_size
    if len(val_ds) < need:
        raise ValueError(f"validation split has {len(val_ds)} blocks; --eval_batches x --batch_size needs {need}")
    g = torch.Generator().manual_seed(12345)
    order = torch.randperm(len(val_ds), generator=g).tolist()[:need]
    val_batches = [val_ds.get_batch(order[i * args.batch_size:(i + 1) * args.batch_size])["input_ids"]
                   for i in range(args.eval_batches)]
    return model, train_ds, val_batches


def parse_phases(text: str) -> Dict[str, int]:
    """``"100,400"`` -> ``{"early": 100, "late": 400}``; ``"late:400"`` names a phase explicitly."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    default = ["early"] if len(items) == 1 else ["early", "late"] if len(items) == 2 else \
        [f"phase{i}" for i in range(len(items))]
    phases = {}
    for item, name in zip(items, default):
        if ":" in item:
            name, item = item.split(":", 1)
        try:
            phases[name] = int(item)
        except ValueError:
            raise ValueError(f"--phases: {item!r} is not a step count; expected e.g. '100,400' or 'late:400'")
    steps = list(phases.values())
    if not steps or len(phases) != len(items) or any(s < 1 for s in steps) or steps != sorted(set(steps)):
        raise ValueError(f"--phases: warm-up step counts must be positive, increasing and uniquely named, "
                         f"got {text!r}")
    return phases


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
# Plans
# --------------------------------------------------------------------------------------------------------
def collect_phase_stats(model, ckpt: Path, train_ds, settings: TrainSettings, args) -> Dict[str, Any]:
    opt = make_optimizer(model, settings)
    load_checkpoint(model, opt, ckpt)
    pc = adam_precond(model, opt)
    stream = DataStream(train_ds, settings.batch_size, seed=args.seed + 777)
    batches = [stream.next_batch()["input_ids"] for _ in range(args.stat_batches)]
    how = CollectSettings(estimator="mc_fisher", num_probes=1, seed=args.seed, lam=args.lambda_default,
                          bwd_propagated=args.dgrad_cost == "upstream" or args.bwd_key == "bwd_propagated",
                          bwd_rounding=args.bwd_rounding, forward_drift=args.forward_drift)
    return collect_statistics(model, batches, how, lr=pc.lr, precond=pc.precond, step=pc.step)


def solve_plans(stats: Dict[str, Any], args) -> tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """Every (method, ρ, λ / plan seed) plan of one phase, and the plans skipped as unreachable."""
    fqns = sorted(stats["layers"])
    flops = {f: float(stats["layers"][f]["flops"]) for f in fqns}
    units = ({f"{f}.{g}": flops[f] / len(GEMMS) for f in fqns for g in GEMMS} if args.per_gemm else flops)
    plans, skipped = [], []
    for method in args.methods:
        if method in UNIFORM:
            precision = "bf16" if method == "bf16" else method.split("_")[1]
            plan = Plan.uniform(fqns, precision, flops)
            plans.append(dict(method=method, label=method, rho=None, plan=plan))
        elif method in KIND_PLANS:
            kinds = KIND_PLANS[method]
            plan = Plan.fixed({f: {g: "fp4" if g in kinds else "fp8" for g in GEMMS} for f in fqns}, flops,
                              method=method)
            plans.append(dict(method=method, label=method, rho=None, plan=plan))
    for rho in args.rhos:
        share = attainable_share(units, rho)  # every method on exactly this share (ρ is rarely exact)
        for method in (m for m in args.methods if m in SOLVED):
            variants = ([dict(lam=lam) for lam in args.lambdas] if method == "best" else
                        [dict(lam=args.lambda_default)] if method == "first_last_fp8" else [dict()])
            for v in variants:
                label = method if "lam" not in v or method != "best" else f"best λ={_num(v['lam'])}"
                try:
                    with preserve_torch_threads():  # CBC would leave torch single-threaded
                        cost = CostSettings(lam=v.get("lam"), per_gemm=args.per_gemm, dgrad=args.dgrad_cost,
                                            dgrad_calibration=args.dgrad_calibration, bwd_key=args.bwd_key,
                                            forward_drift=args.forward_drift, fwd_lambda=args.fwd_lambda)
                        solver = SolverSettings(max_share=min(share + 1e-9, 1.0))
                        solved = solve_baseline(method, stats, share, cost, solver, seed=args.seed,
                                                num_random=args.num_random)
                except ValueError as err:
                    skipped.append(dict(method=method, label=label, rho=rho, reason=str(err)))
                    continue
                for i, plan in enumerate(solved):
                    entry = dict(method=method, label=label, rho=rho, plan=plan)
                    if "lam" in v:
                        entry["lambda"] = float(v["lam"])
                    if method == "random":
                        entry.update(label=f"random#{i}", plan_seed=int(plan.meta["seed"]))
                    plans.append(entry)
    for p in plans:
        p["predicted_fld"], p["predicted_bwd"] = predicted_divergence(stats["layers"], p["plan"].assignment,
                                                                      bwd_key=args.bwd_key,
                                                                      forward_drift=args.forward_drift,
                                                                      fwd_weight=args.fwd_lambda,
                                                                      dgrad=args.dgrad_cost,
                                                                      dgrad_calibration=args.dgrad_calibration)
    return plans, skipped


def _num(x: float) -> str:
    return f"{x:g}"


# --------------------------------------------------------------------------------------------------------
# One cell: every plan from one checkpoint, one data order, one rounding seed
# --------------------------------------------------------------------------------------------------------
def run_settings(settings: TrainSettings, warmup_steps: int, steps: int, lr_decay: str) -> TrainSettings:
    """The schedule of one comparison run: ``settings``, decaying linearly to zero over the run if asked."""
    if lr_decay == "none":
        return settings
    return dataclasses.replace(settings, decay_start=warmup_steps, decay_steps=steps)


def run_plan(model, ckpt: Path, plan: Plan, train_ds, val_batches, settings: TrainSettings, seed: int,
             warmup_steps: int, steps: int, quant: QuantConfig) -> Dict[str, Any]:
    opt = make_optimizer(model, settings)
    load_checkpoint(model, opt, ckpt)
    swap_linears(model, "bf16", quant, seed=seed)  # fresh stochastic-rounding generators, seeded alike for every plan
    apply_plan(model, plan)
    stream = DataStream(train_ds, settings.batch_size, seed=10_000 + seed)
    start = time.perf_counter()
    losses = train_steps(model, opt, stream.next_batch, steps, settings, start_step=warmup_steps)
    val = evaluate(model, val_batches)
    with bf16_forward(model):
        val_bf16 = evaluate(model, val_batches)
    swap_linears(model, "bf16", quant, seed=seed)
    return dict(val_loss=val, val_loss_bf16_forward=val_bf16, train_losses=losses,
                seconds=time.perf_counter() - start)


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
    swap_linears(model, "bf16", quant, seed=0)


def run_cell(model, ckpt: Path, phase: str, warmup_steps: int, seed: int, plans, train_ds, val_batches,
             settings: TrainSettings, args, sink) -> None:
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
            result = {k: shared[k] for k in ("val_loss", "val_loss_bf16_forward", "train_losses")}
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
# Report
# --------------------------------------------------------------------------------------------------------
def _fmt(ms, scale: float = 1e3) -> str:
    if ms.n == 0:
        return "–"
    se = "n/a" if not math.isfinite(ms.se) else f"{ms.se * scale:.2f}"
    return f"{ms.mean * scale:+.2f} ± {se}"


def _is(label: str):
    return lambda r: r["label"] == label


def _is_random(r) -> bool:
    return r["method"] == "random"


def report_lambda(s: Dict[str, Any]) -> float:
    """The λ whose SNIP a report checks: ``--lambda_default`` given with ``--report_only``, else the grid's."""
    return s.get("report_lambda", s["lambda_default"])


def _report_lambda_words(s: Dict[str, Any]) -> str:
    return "" if "report_lambda" not in s else f"; this report checks SNIP at λ {s['report_lambda']:g}"


def summarize(records: List[Dict[str, Any]], lambda_default: float) -> Dict[str, Any]:
    """Paired statistics per (phase, ρ, label), pooled per ρ, the λ sweep and the target checks."""
    cells = ("phase", "seed")
    solved = [r for r in records if r["rho"] is not None]
    phases = sorted({r["phase"] for r in records}, key=lambda p: min(r["warmup_steps"] for r in records
                                                                      if r["phase"] == p))
    rhos = sorted({r["rho"] for r in solved})
    labels = sorted({r["label"] for r in solved if not _is_random(r)}) + ["random"]
    rows = []
    for scope in phases + ["all"]:
        for rho in rhos:
            sub = [r for r in records if (scope == "all" or r["phase"] == scope) and (r["rho"] in (rho, None))]
            for label in labels:
                sel = _is_random if label == "random" else _is(label)
                if not any(sel(r) and r["rho"] == rho for r in sub):
                    continue
                sel_rho = (lambda r, sel=sel: sel(r) and r["rho"] == rho)
                row = dict(phase=scope, rho=rho, label=label,
                           fp4_share=mean_se(r["fp4_share"] for r in sub if sel_rho(r)).mean)
                for key, tag in (("val_loss", "q"), ("val_loss_bf16_forward", "bf16")):
                    row[f"vs_fp8_{tag}"] = mean_se(paired_differences(sub, key, cells, sel_rho,
                                                                      _is("uniform_fp8")))
                    row[f"vs_random_{tag}"] = mean_se(paired_differences(
                        sub, key, cells, sel_rho, lambda r: _is_random(r) and r["rho"] == rho))
                rows.append(row)
    uniform = []
    for scope in phases + ["all"]:
        sub = [r for r in records if scope == "all" or r["phase"] == scope]
        for label in ("bf16", "uniform_fp4") + tuple(KIND_PLANS):
            if any(r["label"] == label for r in sub):
                uniform.append(dict(phase=scope, label=label, fp4_share=mean_se(
                    r["fp4_share"] for r in sub if r["label"] == label).mean, **{
                    f"vs_fp8_{tag}": mean_se(paired_differences(sub, key, cells, _is(label), _is("uniform_fp8")))
                    for key, tag in (("val_loss", "q"), ("val_loss_bf16_forward", "bf16"))}))
    # random-plan spread: SD of the gaps among random plans of one cell, averaged over cells
    spreads = []
    for key in {(r["phase"], r["seed"], r["rho"]) for r in records if _is_random(r)}:
        gaps = [r["val_loss"] for r in records if _is_random(r) and (r["phase"], r["seed"], r["rho"]) == key]
        if len(gaps) > 1:
            m = sum(gaps) / len(gaps)
            spreads.append(math.sqrt(sum((g - m) ** 2 for g in gaps) / (len(gaps) - 1)))
    lambdas = sorted({r["lambda"] for r in records if r["method"] == "best"})
    sweep = {lam: mean_se([d for rho in rhos for d in paired_differences(
        [r for r in records if r["rho"] in (rho, None)], "val_loss", cells,
        lambda r, lam=lam, rho=rho: r["method"] == "best" and r["lambda"] == lam and r["rho"] == rho,
        _is("uniform_fp8"))]) for lam in lambdas}
    best_lambda = min(sweep, key=lambda lam: sweep[lam].mean) if sweep else None
    return dict(rows=rows, uniform=uniform, random_spread=mean_se(spreads), lambda_sweep=sweep,
                best_lambda=best_lambda, snip_label=f"best λ={_num(lambda_default)}", phases=phases, rhos=rhos,
                ranking=objective_ranking(records, phases, rhos, lambda_default),
                kinds=kind_calibration(records, phases))


def kind_calibration(records: List[Dict[str, Any]], phases: Sequence[str]) -> List[Dict[str, Any]]:
    """Per phase where the fp4_fprop and fp4_backward plans ran: the λ at which the statistics price the
    forward and the backward GEMMs in the ratio their runs measured.

    SNIP prices a layer's fprop GEMM with FLD (plus λ·FWD with ``--forward_drift``) and its backward GEMMs with
    λ·BWD (per layer together; per GEMM split over dgrad and wgrad). Matching the measured ratio
    ``r = gap(fp4_backward) / gap(fp4_fprop) = λ·ΔD_b / (ΔFLD + λ·ΔD_f)`` gives
    ``λ = r·ΔFLD / (ΔD_b − r·ΔD_f)``, where ΔFLD and the drifts ΔD (ΔD_f: FWD, 0 without it; ΔD_b: BWD) are the
    statistics' totals over the layers, FP4 minus FP8, read from the two plans' predicted divergences
    (:func:`snip_ds.compare.predicted_divergence`; BWD is the one the grid prices with, its ``bwd_key``). The
    gaps are paired means over the phase's cells; ``lam`` is ``None`` where a gap or the denominator is not
    positive (no price ratio to match), and ``lam_2se`` is the same with the backward's gap two standard
    errors higher (an upper end for λ).
    """
    out = []
    for phase in phases:
        sub = [r for r in records if r["phase"] == phase]
        pred = {r["label"]: r for r in sub if r["label"] in ("uniform_fp8", "fp4_fprop", "fp4_backward")}
        if len(pred) < 3:
            continue
        gap = {k: mean_se(paired_differences(sub, "val_loss", ("phase", "seed"), _is(k), _is("uniform_fp8")))
               for k in ("fp4_fprop", "fp4_backward")}
        d_fld = pred["fp4_fprop"]["predicted_fld"] - pred["uniform_fp8"]["predicted_fld"]
        d_fwd = pred["fp4_fprop"]["predicted_bwd"] - pred["uniform_fp8"]["predicted_bwd"]
        d_bwd = pred["fp4_backward"]["predicted_bwd"] - pred["uniform_fp8"]["predicted_bwd"]

        def lam(backward: float) -> Optional[float]:
            if not (gap["fp4_fprop"].mean > 0 and backward > 0):
                return None
            r = backward / gap["fp4_fprop"].mean
            return r * d_fld / (d_bwd - r * d_fwd) if d_bwd - r * d_fwd > 0 else None
        b = gap["fp4_backward"]
        out.append(dict(phase=phase, gap_fprop=gap["fp4_fprop"], gap_backward=b, d_fld=d_fld, d_bwd=d_bwd,
                        d_fwd=d_fwd, lam=lam(b.mean),
                        lam_2se=lam(b.mean + 2 * b.se) if math.isfinite(b.se) else None))
    return out


def objective_ranking(records, phases, rhos, lam: float) -> List[Dict[str, Any]]:
    """Per phase: does the planner's objective rank the plans by their outcome?

    Every distinct solved plan (by ρ and plan digest) is one point: its predicted FLD, BWD and FLD + λ·BWD
    (what the planner minimises, at the default λ) against its mean quantized-forward gap to uniform FP8
    over the phase's cells. Spearman pooled over ρ, and averaged over ρ within each ρ.
    """
    out = []
    for phase in phases:
        points: Dict[tuple, Dict[str, Any]] = {}
        for r in records:
            if r["phase"] != phase or r["rho"] is None or r.get("gap_to_fp8") is None:
                continue
            # a plan shared by several labels is one point (its runs are one run, see run_cell)
            points.setdefault((r["rho"], r["plan_digest"], r["seed"]), dict(
                rho=r["rho"], fld=r["predicted_fld"], bwd=r["predicted_bwd"], gap=r["gap_to_fp8"]))
        plans: Dict[tuple, Dict[str, Any]] = {}
        for (rho, digest, _), p in points.items():
            q = plans.setdefault((rho, digest), dict(rho=rho, fld=p["fld"], bwd=p["bwd"], gaps=[]))
            q["gaps"].append(p["gap"])
        pts = [dict(rho=q["rho"], fld=q["fld"], bwd=q["bwd"], obj=q["fld"] + lam * q["bwd"],
                    gap=sum(q["gaps"]) / len(q["gaps"])) for q in plans.values()]
        if not pts:
            continue
        row = dict(phase=phase, plans=len(pts), **{
            key: spearman([p[key] for p in pts], [p["gap"] for p in pts]) for key in ("obj", "fld", "bwd")})
        within = [spearman([p["obj"] for p in pts if p["rho"] == rho], [p["gap"] for p in pts if p["rho"] == rho])
                  for rho in rhos]
        within = [w for w in within if math.isfinite(w)]
        row["obj_within_rho"] = sum(within) / len(within) if within else float("nan")
        out.append(row)
    return out


BASELINES = ("random", "quant_err", "rel_quant_err")


def _cell_losses(records, select) -> Dict[tuple, float]:
    """``(phase, seed) -> mean val_loss`` of the selected records of each cell (random: over its plans)."""
    return cell_means(records, "val_loss", ("phase", "seed"), select)


def _needs_resolved(rho: float) -> bool:
    """At ρ ≥ 0.75 the target asks SNIP to beat random by more than 2 SE, not only in the mean."""
    return rho >= 0.75 - 1e-9


def _is_miss(check: Dict[str, Any], base: str) -> bool:
    """SNIP misses its target against ``base`` in this cell."""
    v = check[base]
    return v is not None and not (v["below"] and (base != "random" or not _needs_resolved(check["rho"])
                                                  or v["resolved"]))


def target_checks(summary: Dict[str, Any], records: List[Dict[str, Any]],
                  others: Sequence[Dict[str, Any]] = ()) -> List[Dict[str, Any]]:
    """Issue 6's targets for SNIP at the default λ, per phase and ρ (quantized forward).

    Targets: SNIP's mean gap below random's, quant_err's and rel_quant_err's, and at ρ ≥ 0.75 below random's by
    more than 2 SE. A baseline's run in a cell comes from this grid, or, where this grid did not run it there,
    from ``others`` (the ``--versus`` grids' records, same cells). Per baseline: the paired difference
    SNIP − baseline, the baseline's own paired gap to uniform FP8 (``room``) and
    :func:`snip_ds.compare.paired_verdict`.
    """
    snip_label = summary["snip_label"]
    fp8 = _cell_losses(records, _is("uniform_fp8"))
    out = []
    for phase in summary["phases"]:
        for rho in summary["rhos"]:
            here = [r for r in records if r["phase"] == phase and r["rho"] == rho]
            snip = _cell_losses(here, _is(snip_label))
            if not snip:
                continue
            check: Dict[str, Any] = dict(phase=phase, rho=rho)
            for base in BASELINES:
                sel = _is_random if base == "random" else _is(base)
                own = _cell_losses(here, sel)
                base_cells = {**_cell_losses([r for r in others if r["phase"] == phase and r["rho"] == rho], sel),
                              **own}  # this grid's run where it has one, else the versus grid's
                common = sorted(set(snip) & set(base_cells))
                if not common:
                    check[base] = None
                    continue
                source = ("this grid" if all(c in own for c in common) else
                          "versus" if not any(c in own for c in common) else "both")
                diff = mean_se(snip[c] - base_cells[c] for c in common)
                room = mean_se(base_cells[c] - fp8[c] for c in common if c in fp8)
                check[base] = dict(diff=diff, room=room, source=source, **paired_verdict(diff, room))
            rnd = check["random"]
            needs_resolved = _needs_resolved(rho)
            check["met"] = (None if any(check[b] is None for b in BASELINES) else
                            all(check[b]["below"] for b in BASELINES)
                            and (not needs_resolved or bool(rnd["below"] and rnd["resolved"])))
            # missed only by ties: random's target met, and no quant-error baseline resolvably below SNIP
            check["ties_only"] = (check["met"] is False and bool(rnd["below"]) and
                                  (not needs_resolved or bool(rnd["resolved"])) and
                                  all(check[b]["below"] or check[b]["resolved"] is False
                                      for b in BASELINES[1:]))
            # the summary's earlier keys
            for base in BASELINES:
                check[f"below_{base}"] = None if check[base] is None else check[base]["below"]
            check["diff_vs_random"] = rnd["diff"] if rnd else MeanSE(float("nan"), float("nan"), 0)
            check["resolved_2se"] = None if rnd is None or rnd["resolved"] is None else \
                bool(rnd["below"] and rnd["resolved"])
            out.append(check)
    return out


def _same_plan(c: Dict[str, Any]) -> bool:
    """Every paired difference exactly 0: the baseline solved SNIP's plan (runs of one plan are bit-identical)."""
    return c["diff"].n > 0 and c["diff"].mean == 0 and (c["diff"].n == 1 or c["diff"].se == 0)


def _target_cell(check: Dict[str, Any], base: str) -> str:
    """A Targets table entry: SNIP − baseline, bold where resolved, and what a miss is."""
    c = check[base]
    if c is None:
        return "–"
    text = _fmt(c["diff"])
    if c["resolved"]:
        text = f"**{text}**"
    if _same_plan(c):
        text += " (the same plan)"
    elif not c["below"]:
        text += (" (above; one cell, no SE)" if c["resolved"] is None else " (resolved loss)" if c["resolved"]
                 else " (tie, no room)" if c["floor"] else " (tie)")
    elif _is_miss(check, base):
        text += " (not resolved)"
    return text + {"this grid": "", "versus": " †", "both": " ‡"}[c["source"]]


def _target_misses(checks: List[Dict[str, Any]]) -> List[str]:
    """One line per unmet comparison: the difference, the baseline's room to FP8, and the cells to resolve it."""
    lines = []
    for c in checks:
        for base in BASELINES:
            if not _is_miss(c, base):
                continue
            v = c[base]
            what = ("the same plan, run for run" if _same_plan(v) else
                    "above, with one cell (no SE)" if v["resolved"] is None and not v["below"] else
                    "a resolved loss" if v["resolved"] and not v["below"] else
                    "below, but not by 2 SE" if v["below"] else "a tie")
            floor = (f"; {base}'s own gap to uniform FP8 is {_fmt(v['room'])}, less than 2 SE of the difference, "
                     f"so even a plan exactly at FP8's quality could not be shown below it here" if v["floor"] else
                     f"; {base}'s own gap to uniform FP8 is {_fmt(v['room'])}")
            n, need = v["diff"].n, v["cells_to_resolve"]
            more = ("" if need is None else
                    f"; the observed mean would stand 2 SE from 0 at about {need} cells" if need <= 100 * n else
                    f"; the observed mean would stand 2 SE from 0 only at over 100 times these cells")
            lines.append(f"- {c['phase']} ρ {c['rho']:g}, SNIP − {base}: {_fmt(v['diff'])} over {v['diff'].n} "
                         f"cells, {what}{floor}{more}.")
    return lines


def _yn(x) -> str:
    return "–" if x is None else ("yes" if x else "**no**")


def _dgrad_words(s: Dict[str, Any]) -> str:
    if s.get("dgrad_cost", "split") != "upstream":
        return ""
    return (f" (SNIP prices dgrad by the upstream drift its error causes, bwd_dgrad / "
            f"{s['dgrad_calibration']:g}, and wgrad by the whole direct BWD)")


def _bwd_words(s: Dict[str, Any]) -> str:
    rounding = s.get("bwd_rounding", "nearest")  # grids from before the setting rounded G_Y to nearest
    part = {"bwd": "expected", "bwd_bias": "systematic part of the", "bwd_propagated": "propagated"}[
        s.get("bwd_key", "bwd")]
    how = ("as training does" if rounding == "recipe" else "to nearest")
    weight = "λ" if s.get("fwd_lambda") is None else f"μ = {s['fwd_lambda']:g}"
    fwd = (f"; SNIP's costs also price FWD, the update drift of each layer's fprop error, at {weight}"
           if s.get("forward_drift") else "")
    return f"SNIP's BWD: the {part} drift, with G_Y rounded {how} in the statistics{fwd}"


def _table(heading: str, columns: Sequence[str], rows) -> List[str]:
    """A markdown section: heading, header and rows, followed by a blank line; nothing when there are no rows."""
    rows = list(rows)
    if not rows:
        return []
    return [heading, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *rows, ""]


def _random_words(s: Dict[str, Any]) -> str:
    return f"{s['num_random']} random plan(s); " if "random" in s.get("methods", SOLVED) else "no random plans; "


def write_markdown(data: Dict[str, Any], summary: Dict[str, Any], path: Path) -> None:
    s = data["settings"]
    lines = ["# compare_plans: plan quality from paired training runs (SNIP.md section 7)", ""]
    if s.get("note"):
        lines += [f"**{s['note']}**", ""]
    lines += [f"Command: `{s['command']}`", "",
              f"Full grid: `{s['full_command']}`", "",
              f"Model: {s['model']} ({s['parameters']:,} parameters, {s['layers']} planned linears in "
              f"{s['blocks']} blocks); {s['batch_size']}×{s['block_size']} tokens per step; AdamW lr {s['lr']:g}"
              f"{', decaying linearly to 0 over each run' if s.get('lr_decay', 'none') == 'linear' else ''}; "
              f"phases (warm-up steps) {s['phases']}; {s['steps']} steps per run; seeds {s['seeds']}; "
              f"ρ {s['rhos']}; λ {s['lambdas']} (default {s['lambda_default']:g}{_report_lambda_words(s)}); "
              f"{_random_words(s)}"
              f"plans solved {'per GEMM' if s.get('per_gemm') else 'per layer'}"
              f"{_dgrad_words(s)}; {_bwd_words(s)}; "
              f"{s['eval_batches']}×{s['batch_size']} validation sequences; FP4 "
              f"{s.get('fp4_recipe', 'nvfp4')}, gradients rounded "
              f"{'stochastically' if s.get('stochastic_rounding', True) else 'to nearest'}. "
              f"{len(data['records'])} records, {data.get('wall_seconds', 0) / 60:.1f} min.", "",
              "All numbers are paired differences in **millinats** (1e-3 nats): per cell (phase × seed, same "
              "checkpoint, data order and rounding seeds) the method's validation loss minus uniform FP8's (or "
              "minus the mean of the random plans'), then mean ± standard error over cells. *q* = the plan's "
              "quantized forward, *bf16* = BF16 forward of the same weights. Negative is better.", ""]
    checks = target_checks(summary, data["records"], (data.get("versus") or {}).get("records", ()))
    lines += _table(f"## Targets ({summary['snip_label']}, the default λ; quantized-forward loss, SNIP − baseline)",
                    ("phase", "ρ", "SNIP − random", "SNIP − quant_err", "SNIP − rel_quant_err", "targets met"),
                    (f"| {c['phase']} | {c['rho']:g} | " + " | ".join(_target_cell(c, b) for b in BASELINES) +
                     f" | {_yn(c['met'])}{' (ties only)' if c['ties_only'] else ''} |" for c in checks))
    if checks:
        lines += ["Targets: SNIP below every baseline, and below random by more than 2 SE at ρ ≥ 0.75. Paired "
                  "differences in millinats, bold where more than 2 SE from 0. *No room*: the baseline's own gap "
                  "to uniform FP8 is less than 2 SE of the difference, so not even a plan exactly at FP8's "
                  "quality could be shown below it with these cells. *Ties only*: random's target is met and no "
                  "quant-error baseline is more than 2 SE below SNIP."
                  + (f" †: the baseline ran in the `--versus` grid(s) (`{data['versus']['source']}`), same cells."
                     if any(c[b] and c[b]["source"] == "versus" for c in checks for b in BASELINES) else "")
                  + (" ‡: in some cells from this grid, in the others from the `--versus` grid(s)."
                     if any(c[b] and c[b]["source"] == "both" for c in checks for b in BASELINES) else ""), ""]
        misses = _target_misses(checks)
        if misses:
            lines += ["Comparisons that miss their target:", "", *misses, ""]
    lines += _table("## Gaps per phase and ρ",
                    ("phase", "ρ", "method", "FP4 share", "vs fp8 (q)", "vs fp8 (bf16)", "vs random (q)",
                     "vs random (bf16)", "n"),
                    (f"| {r['phase']} | {r['rho']:g} | {r['label']} | {r['fp4_share']:.3f} | {_fmt(r['vs_fp8_q'])} | "
                     f"{_fmt(r['vs_fp8_bf16'])} | {_fmt(r['vs_random_q'])} | {_fmt(r['vs_random_bf16'])} | "
                     f"{r['vs_fp8_q'].n} |" for r in summary["rows"]))
    lines += _table("Fixed plans (ρ-independent; fp4_<kind>: that GEMM kind in FP4 in every layer, the rest FP8):",
                    ("phase", "method", "FP4 share", "vs fp8 (q)", "vs fp8 (bf16)", "n"),
                    (f"| {u['phase']} | {u['label']} | {u['fp4_share']:.3f} | {_fmt(u['vs_fp8_q'])} | "
                     f"{_fmt(u['vs_fp8_bf16'])} | {u['vs_fp8_q'].n} |" for u in summary["uniform"]))
    if summary["kinds"]:
        fwd = bool(s.get("forward_drift")) and s.get("fwd_lambda") is None  # FWD at λ: a drift of its own
        mu = s.get("fwd_lambda") if s.get("forward_drift") else None  # FWD at μ: part of the forward's price
        how = ("SNIP prices the forward GEMM with FLD + λ·FWD and the backward GEMMs with λ·BWD. The λ at which "
               "the statistics' totals (FP4 minus FP8 over all layers, in loss units) stand in the ratio r = gap "
               "backward / gap fprop that the fp4_backward and fp4_fprop runs measured: λ = r·ΔFLD / (ΔBWD − "
               "r·ΔFWD)" if fwd else
               f"SNIP prices the forward GEMM with FLD{'' if mu is None else f' + {mu:g}·FWD'} and the backward "
               "GEMMs with λ·BWD. The λ at which the statistics' totals (FP4 minus FP8 over all layers, in loss "
               "units) stand in the ratio the fp4_backward and fp4_fprop runs measured: λ = (gap backward / gap "
               f"fprop) · ΔFLD{'' if mu is None else f' (+ {mu:g}·ΔFWD)'} / ΔBWD")
        lines += ["## λ calibrated by the GEMM-kind plans", "",
                  how + "; 'λ at +2 SE' puts the backward's gap 2 standard errors higher.", ""]
        lines += _table("", ("phase", "gap fp4_fprop", "gap fp4_backward",
                             "ΔFLD (mnats)" if mu is None else f"ΔFLD + {mu:g}·ΔFWD (mnats)",
                         *(("ΔFWD (mnats)",) if fwd else ()), "ΔBWD (mnats)", "λ", "λ at +2 SE"),
                        (f"| {k['phase']} | {_fmt(k['gap_fprop'])} | {_fmt(k['gap_backward'])} | "
                         f"{k['d_fld'] * 1e3:.3g} | " + (f"{k['d_fwd'] * 1e3:.3g} | " if fwd else "") +
                         f"{k['d_bwd'] * 1e3:.3g} | " + " | ".join(
                             "n/a (no positive ratio)" if x is None else f"{x:.3g}" for x in (k["lam"], k["lam_2se"]))
                         + " |" for k in summary["kinds"]))[2:]  # the heading is above
    if summary["lambda_sweep"]:
        lines += ["## λ sweep (SNIP vs uniform FP8, quantized forward, pooled over phases, seeds and ρ)", "",
                  "| λ | gap (mnats) | n |", "|---|---|---|"]
        for lam, ms in summary["lambda_sweep"].items():
            lines.append(f"| {_num(lam)} | {_fmt(ms)} | {ms.n} |")
        lines += ["", f"Lowest mean gap at λ = {_num(summary['best_lambda'])} (the target rows above check λ = "
                      f"{report_lambda(s):g}).", ""]
    sp = summary["random_spread"]
    if sp.n:
        lines += [f"Spread of random plans within a cell (SD of val loss): {_fmt(sp)} mnats over {sp.n} cell(s).",
                  ""]
    if summary["ranking"]:
        lines += ["## Does the planner's objective rank the plans' outcomes?", "",
                  f"Spearman, over the distinct solved plans of a phase (every method, ρ and λ), between a "
                  f"prediction and the plan's mean quantized-forward gap to uniform FP8 after training. "
                  f"Objective = FLD + λ·BWD at λ = {report_lambda(s):g}, what the planner minimises; 'within ρ' "
                  f"averages the objective's Spearman over the ρ values (the FP4 share held fixed, as the planner's "
                  f"choice is).",
                  "", "| phase | plans | objective | FLD alone | BWD alone | objective within ρ |",
                  "|---|---|---|---|---|---|"]
        for r in summary["ranking"]:
            lines.append(f"| {r['phase']} | {r['plans']} | " + " | ".join(
                "n/a" if not math.isfinite(r[k]) else f"{r[k]:+.2f}" for k in ("obj", "fld", "bwd",
                                                                                 "obj_within_rho")) + " |")
    if data.get("versus"):
        lines += versus_markdown(data)
    lines += ["", "## Predicted vs measured forward divergence at the checkpoint", "",
              "Per plan: Σ predicted FLD of its layers (MC Fisher, from the statistics) and the measured "
              "quantized-minus-BF16 validation loss at the checkpoint, before any training (mnats).", "",
              "| phase | ρ | method | predicted FLD | measured | predicted BWD (loss units) |", "|---|---|---|---|---|---|"]
    seen = set()
    for r in data["records"]:
        key = (r["phase"], r["rho"], r["label"])
        if key in seen or r.get("measured_fld_at_ckpt") is None:
            continue
        seen.add(key)
        rho = "–" if r["rho"] is None else f"{r['rho']:g}"
        lines.append(f"| {r['phase']} | {rho} | {r['label']} | {r['predicted_fld'] * 1e3:.3g} | "
                     f"{r['measured_fld_at_ckpt'] * 1e3:+.3g} | {r['predicted_bwd'] * 1e3:.3g} |")
    if data.get("skipped"):
        lines += ["", "## Skipped plans", ""]
        for sk in data["skipped"]:
            lines.append(f"- {sk['phase']} ρ={sk['rho']:g} {sk['label']}: {sk['reason']}")
    lines += ["", "Plots: `compare_plans_gap.png` (gap against FP4 share), `compare_plans_curves.png` (training-"
              "loss difference to uniform FP8), `compare_plans_maps.png` (plan maps: blue FP8, orange FP4).", ""]
    path.write_text("\n".join(lines), encoding="utf-8")


# --------------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------------
def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_gap(summary: Dict[str, Any], path: Path) -> None:
    plt = _plt()
    phases = summary["phases"]
    fig, axes = plt.subplots(2, len(phases), figsize=(5.5 * len(phases), 7), squeeze=False)
    labels = sorted({r["label"] for r in summary["rows"]})
    for j, phase in enumerate(phases):
        for i, tag in enumerate(("q", "bf16")):
            ax = axes[i][j]
            for label in labels:
                pts = [r for r in summary["rows"] if r["phase"] == phase and r["label"] == label]
                if not pts:
                    continue
                x = [r["fp4_share"] for r in pts]
                y = [r[f"vs_fp8_{tag}"].mean * 1e3 for r in pts]
                e = [r[f"vs_fp8_{tag}"].se * 1e3 if math.isfinite(r[f"vs_fp8_{tag}"].se) else 0.0 for r in pts]
                ax.errorbar(x, y, yerr=e, marker="o", capsize=3, label=label)
            for u in summary["uniform"]:
                if u["phase"] == phase and u["label"] == "uniform_fp4" and u[f"vs_fp8_{tag}"].n:
                    ax.plot([1.0], [u[f"vs_fp8_{tag}"].mean * 1e3], "k*", markersize=10, label="uniform_fp4")
            ax.axhline(0.0, color="grey", lw=0.8)
            ax.set_title(f"{phase}: gap to uniform FP8 ({'quantized' if tag == 'q' else 'BF16'} forward)")
            ax.set_xlabel("FP4 share of linear FLOPs")
            ax.set_ylabel("Δ val loss (millinats)")
    if axes[0][0].get_legend_handles_labels()[0]:  # uniform plans only: nothing labelled, no legend
        axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _ema(xs: Sequence[float], alpha: float = 0.1) -> List[float]:
    out, m = [], None
    for x in xs:
        m = x if m is None else (1 - alpha) * m + alpha * x
        out.append(m)
    return out


def plot_curves(records: List[Dict[str, Any]], summary: Dict[str, Any], path: Path) -> None:
    """Training-loss difference to uniform FP8 (EMA-smoothed, mean over seeds), one panel per phase × ρ."""
    plt = _plt()
    panels = [(p, rho) for p in summary["phases"] for rho in summary["rhos"]]
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(5 * max(len(panels), 1), 4), squeeze=False)
    for ax, (phase, rho) in zip(axes[0], panels):
        fp8 = {r["seed"]: r["train_losses"] for r in records if r["phase"] == phase and r["label"] == "uniform_fp8"}
        labels = sorted({r["label"] for r in records if r["phase"] == phase and r["rho"] in (rho, None)})
        for label in labels:
            diffs = [[a - b for a, b in zip(r["train_losses"], fp8[r["seed"]])] for r in records
                     if r["phase"] == phase and r["label"] == label and r["rho"] in (rho, None) and r["seed"] in fp8]
            if not diffs or label == "uniform_fp8":
                continue
            n = min(len(d) for d in diffs)
            mean = [sum(d[t] for d in diffs) / len(diffs) for t in range(n)]
            ax.plot(range(1, n + 1), [v * 1e3 for v in _ema(mean)], label=label,
                    lw=1.8 if label.startswith("best") else 1.0)
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_title(f"{phase}, ρ={rho:g}")
        ax.set_xlabel("step after checkpoint")
        ax.set_ylabel("Δ train loss vs FP8 (mnats, EMA)")
    if axes[0][0].get_legend_handles_labels()[0]:  # uniform plans only: nothing labelled, no legend
        axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_maps(plans_by_phase: Dict[str, List[Dict[str, Any]]], path: Path) -> None:
    from snip_ds.tensorboard import precision_map_image
    plt = _plt()
    tiles = [(phase, p) for phase, ps in plans_by_phase.items() for p in ps if p["rho"] is not None]
    cols = max(len({p["label"] for _, p in tiles}), 1)
    keys = sorted({(ph, p["rho"]) for ph, p in tiles})
    labels = sorted({p["label"] for _, p in tiles})
    fig, axes = plt.subplots(max(len(keys), 1), cols, figsize=(1.6 * cols, 2.0 * max(len(keys), 1)), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for (phase, p) in tiles:
        i, j = keys.index((phase, p["rho"])), labels.index(p["label"])
        img = precision_map_image(dict(p["plan"].assignment), block_index).transpose(1, 2, 0)
        ax = axes[i][j]
        ax.imshow(img, interpolation="nearest")
        ax.set_title(f"{p['label']}\n{phase} ρ={p['rho']:g}", fontsize=7)
    per_gemm = any(not isinstance(v, str) for _, p in tiles for v in p["plan"].assignment.values())
    rows = "blocks, each split into fprop / dgrad / wgrad" if per_gemm else "blocks"
    fig.suptitle(f"plans: rows = {rows}, columns = q k v o gate up down (blue FP8, orange FP4)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(data: Dict[str, Any], out_dir: Path, plans_by_phase=None) -> Dict[str, Any]:
    records = data["records"]
    if not records:
        raise ValueError(f"{out_dir / (PREFIX + '.json')}: no records to report")
    summary = summarize(records, report_lambda(data["settings"]))
    write_markdown(data, summary, out_dir / f"{PREFIX}.md")
    plot_gap(summary, out_dir / f"{PREFIX}_gap.png")
    plot_curves(records, summary, out_dir / f"{PREFIX}_curves.png")
    if plans_by_phase is None:
        plans_by_phase = {ph: [dict(label=p["label"], rho=p["rho"], plan=Plan(assignment=p["assignment"]))
                               for p in ps] for ph, ps in data.get("plans", {}).items()}
    plot_maps(plans_by_phase, out_dir / f"{PREFIX}_maps.png")
    return summary


# --------------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------------
def _log(args, msg: str) -> None:
    if not args.silent:
        print(msg, file=sys.stderr, flush=True)


def _json_default(o):
    """What json writes for MeanSE (and anything else with ``to_dict``); other objects as text."""
    return o.to_dict() if hasattr(o, "to_dict") else str(o)


def _write_json(data: Dict[str, Any], path: Path) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=_json_default),
                   encoding="utf-8")
    os.replace(tmp, path)


def run(args) -> Dict[str, Any]:
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = TrainSettings(lr=args.lr, batch_size=args.batch_size, lr_warmup_steps=args.lr_warmup_steps)
    model, train_ds, val_batches = build(args)
    layers = snip_layers(model)
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
        _write_json(data, json_path)

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
    _write_json(data, json_path)
    summary = write_report(data, out_dir, plans_by_phase)
    return dict(records=len(data["records"]), wall_seconds=data["wall_seconds"],
                targets=target_checks(summary, data["records"]),
                best_lambda=summary["best_lambda"], output_dir=str(out_dir))


def merge_results(dirs: Sequence[str], note: str = "") -> Dict[str, Any]:
    """Reads ``compare_plans.json`` from each directory and joins them: one process per phase, or more seeds
    (and a subset of its ρ, λ and methods) for a phase another part ran.

    Parts that share a phase must have warmed up to the same step and run disjoint (phase, seed) cells, and
    every plan both solved (same label and ρ) must be the same plan: the same checkpoint and statistics.
    Seeds, ρ, λ and methods of the merged settings are the unions; every record keeps its own.

    Raises:
        FileNotFoundError: A directory has no ``compare_plans.json``.
        ValueError: The runs disagree on another setting, a shared phase's warm-up or plans, or repeat a cell.
    """
    parts = []
    for d in dirs:
        path = Path(d) / f"{PREFIX}.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        parts.append(json.loads(path.read_text(encoding="utf-8")))
    data = parts[0]
    if len(parts) == 1:
        if note:
            data["settings"]["note"] = note
        return data
    free = {"phases", "command", "note", "threads", "report_lambda"} | set(_UNION)
    settings = dict(data["settings"], phases={}, command=[], note=note, **{k: [] for k in _UNION})
    records, skipped, plans, wall, cells = [], [], {}, 0.0, set()
    for d, part in zip(dirs, parts):
        st = part["settings"]
        diff = sorted(k for k in set(st) | set(data["settings"]) if k not in free
                      and st.get(k) != data["settings"].get(k))
        if diff:
            raise ValueError(f"{d}: settings differ from {dirs[0]} in {', '.join(diff)}; cannot merge")
        phases = st["phases"] if isinstance(st["phases"], dict) else {}
        for name, steps in phases.items():
            if settings["phases"].get(name, steps) != steps:
                raise ValueError(f"{d}: phase {name!r} warmed up {steps} steps here and "
                                 f"{settings['phases'][name]} in an earlier part; cannot merge")
        mine = {(r["phase"], r["seed"]) for r in part["records"]}
        if mine & cells:
            raise ValueError(f"{d}: (phase, seed) cell(s) {sorted(mine & cells)[:3]} appear in an earlier part too")
        cells |= mine
        for name, ps in part.get("plans", {}).items():
            known = {(p["label"], p["rho"]): p for p in plans.setdefault(name, [])}
            for p in ps:
                same = known.get((p["label"], p["rho"]))
                if same is None:
                    plans[name].append(p)
                elif same["assignment"] != p["assignment"]:
                    raise ValueError(f"{d}: phase {name!r} solved another {p['label']} plan at rho {p['rho']:g} "
                                     f"than an earlier part: not the same checkpoint and statistics; cannot merge")
        settings["phases"].update(phases)
        for key, kind in _UNION.items():
            settings[key] = sorted(set(settings[key]) | set(st.get(key, [])), key=kind)
        settings["command"].append(st["command"])
        records += part["records"]
        skipped += [s for s in part.get("skipped", []) if s not in skipped]
        wall += part.get("wall_seconds", 0.0)
    settings["command"] = " ; ".join(settings["command"])
    return dict(settings=settings, records=records, skipped=skipped, plans=plans, wall_seconds=wall)


# settings two grids compared with --versus may differ in (the rest must match, as must their FP8 runs)
VERSUS_FREE = {"phases", "seeds", "methods", "command", "full_command", "note", "threads", "per_gemm", "dgrad_cost",
               "dgrad_calibration", "rhos", "lambdas", "lambda_default", "num_random", "bwd_rounding", "bwd_key",
               "forward_drift", "fwd_lambda", "report_lambda"}
_VERSUS_KEEP = ("phase", "seed", "rho", "label", "method", "fp4_share", "val_loss", "val_loss_bf16_forward")
# what a run repeated in two --versus grids must match to count once (the same plan, run bit for bit alike)
_RERUN_SAME = ("method", "plan_digest", "fp4_share", "val_loss", "val_loss_bf16_forward")


def versus_data(data: Dict[str, Any], other_dirs: Sequence[str]) -> Dict[str, Any]:
    """The solved-plan records of the grids in ``other_dirs`` for a paired comparison with ``data``'s grid.

    Each grid must have run cells of this one: the same settings (apart from :data:`VERSUS_FREE`) and, in
    every (phase, seed) cell they share, bit-identical uniform FP8 runs, i.e. the same checkpoint, data
    order and rounding seeds. Then a plan's validation loss in one grid minus the same method's in the other
    is a paired difference, e.g. per-GEMM against per-layer plans. Several grids (e.g. the parts of one, or
    baselines and another SNIP) are joined; a run that two of them hold (the same plan label in the same cell) counts
    once if it is the same plan with bit-identical losses in both, and is refused otherwise.

    Raises:
        FileNotFoundError: a directory has no ``compare_plans.json``.
        ValueError: a directory is named twice, or a grid differs in a setting, shares no cell, ran a shared
            cell differently, or repeats another's run with another plan or result.
    """
    if isinstance(other_dirs, (str, Path)):
        other_dirs = [other_dirs]
    def fp8(d):
        return {(r["phase"], r["seed"]): r["val_loss"] for r in d["records"] if r["method"] == "uniform_fp8"}

    records, cells, per_gemm, seen = [], set(), set(), {}
    named = [str(Path(d).resolve()) for d in other_dirs]
    twice = sorted({d for d in named if named.count(d) > 1})
    if twice:
        raise ValueError(f"--versus names {twice[0]} twice")
    for other_dir in other_dirs:
        other = merge_results([other_dir])
        mine, theirs = data["settings"], other["settings"]
        diff = sorted(k for k in set(mine) | set(theirs) if k not in VERSUS_FREE and mine.get(k) != theirs.get(k))
        if diff:
            raise ValueError(f"{other_dir}: settings differ in {', '.join(diff)}; --versus compares grids that "
                             f"differ only in {', '.join(sorted(VERSUS_FREE))}")
        a, b = fp8(data), fp8(other)
        common = sorted(set(a) & set(b))
        if not common:
            raise ValueError(f"{other_dir}: no (phase, seed) cell in common with this grid")
        bad = [c for c in common if a[c] != b[c]]
        if bad:
            raise ValueError(f"{other_dir}: uniform FP8 ended differently in cell(s) {bad[:3]}: not the same "
                             f"checkpoints, data orders and seeds, so nothing can be paired")
        shared = set(common)
        cells |= shared
        per_gemm.add(bool(theirs.get("per_gemm", False)))
        for r in other["records"]:
            if r["rho"] is None or (r["phase"], r["seed"]) not in shared:
                continue
            key = (r["phase"], r["seed"], r["rho"], r["label"])
            if key in seen:
                first_dir, first = seen[key]
                if all(first.get(k) == r.get(k) for k in _RERUN_SAME):
                    continue  # a bit-identical rerun of the same plan in the same cell: one observation
                raise ValueError(f"{other_dir}: {r['label']} at rho {r['rho']:g} in cell {key[:2]} ran in "
                                 f"{first_dir} too, with another plan or result; --versus grids may repeat a "
                                 f"run only bit for bit")
            seen[key] = (other_dir, r)
            records.append({k: r.get(k) for k in _VERSUS_KEEP})
    return dict(source=", ".join(str(d) for d in other_dirs), per_gemm=per_gemm.pop() if len(per_gemm) == 1
                else None, cells=len(cells), records=records)


def versus_rows(records: List[Dict[str, Any]], others: List[Dict[str, Any]],
                mine_label: Optional[str] = None) -> List[Dict[str, Any]]:
    """Per (phase or "all", ρ, method label): paired differences, this grid's run minus the other grid's run of
    the same label in the same cell (random plans: the mean of the cell's random plans on each side).

    With ``mine_label`` (e.g. ``"best λ=100"``): that plan of this grid against every plan of the other grid
    instead (``label`` is then the other grid's), e.g. a re-priced SNIP against the baselines run before.
    """
    def group(r):
        return "random" if r["method"] == "random" else r["label"]

    if mine_label is not None:
        records = [r for r in records if r["rho"] is not None and group(r) == mine_label]
        records = [dict(r, label=o) for r in records for o in {group(x) for x in others if x["rho"] == r["rho"]}]

    both = ([dict(r, side=0, group=group(r)) for r in records if r["rho"] is not None]
            + [dict(r, side=1, group=group(r)) for r in others if r["rho"] is not None])
    phases = list(dict.fromkeys(r["phase"] for r in records))
    rows = []
    for scope in phases + ["all"]:
        sub = [r for r in both if scope == "all" or r["phase"] == scope]
        for rho, label in sorted({(r["rho"], r["group"]) for r in sub}):
            diff = {field: paired_differences(
                sub, field, ("phase", "seed"),
                select=lambda r, l=label, q=rho: r["side"] == 0 and r["group"] == l and r["rho"] == q,
                reference=lambda r, l=label, q=rho: r["side"] == 1 and r["group"] == l and r["rho"] == q)
                for field in ("val_loss", "val_loss_bf16_forward")}
            if diff["val_loss"]:
                rows.append(dict(phase=scope, rho=rho, label=label, q=mean_se(diff["val_loss"]),
                                 bf16=mean_se(diff["val_loss_bf16_forward"])))
    return rows


def versus_markdown(data: Dict[str, Any]) -> List[str]:
    v = data["versus"]
    mine = "per GEMM" if data["settings"].get("per_gemm") else "per layer"
    theirs = {True: "per GEMM", False: "per layer", None: "per layer and per GEMM"}[v["per_gemm"]]
    lines = ["", f"## Against the grid in `{v['source']}` (plans solved {theirs})", "",
             f"Paired over the {v['cells']} (phase, seed) cells both grids ran (their uniform FP8 runs are "
             f"bit-identical): this grid's validation loss minus the other's for the same method, ρ and λ "
             f"(plans solved {mine} here), in millinats; negative: this grid's plan is better.", "",
             "| phase | ρ | method | Δ (q) | Δ (bf16) | n |", "|---|---|---|---|---|---|"]
    for r in versus_rows(data["records"], v["records"]):
        lines.append(f"| {r['phase']} | {r['rho']:g} | {r['label']} | {_fmt(r['q'])} | {_fmt(r['bf16'])} | "
                     f"{r['q'].n} |")
    for snip in sorted({r["label"] for r in data["records"] if r["method"] == "best"}):
        lines += _versus_cross(data, v, snip)
    return lines


def _versus_cross(data: Dict[str, Any], v: Dict[str, Any], snip: str) -> List[str]:
    lines = []
    cross = versus_rows(data["records"], v["records"], mine_label=snip)
    if cross:
        lines += ["", f"### This grid's SNIP ({snip}) against every plan of the other grid", "",
                  "Paired in the same cells: this grid's SNIP run minus the other grid's run of the named method "
                  "(random: the mean of its random plans), in millinats; negative: this grid's SNIP is better.", "",
                  "| phase | ρ | other grid's method | Δ (q) | Δ (bf16) | n |", "|---|---|---|---|---|---|"]
        for r in cross:
            lines.append(f"| {r['phase']} | {r['rho']:g} | {r['label']} | {_fmt(r['q'])} | {_fmt(r['bf16'])} | "
                         f"{r['q'].n} |")
    return lines


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
            data = merge_results(args.merge or [args.output_dir], args.note)
            if args.versus:
                data["versus"] = versus_data(data, args.versus)
            if args.report_lambda is not None:
                lams = sorted({r["lambda"] for r in data["records"] if r["method"] == "best"})
                if args.report_lambda not in lams:
                    raise ValueError(f"--lambda_default {args.report_lambda:g}: the grid ran SNIP at λ "
                                     f"{', '.join(f'{x:g}' for x in lams) or 'none'} only")
                data["settings"]["report_lambda"] = args.report_lambda
            if args.merge or args.versus or args.report_lambda is not None:
                Path(args.output_dir).mkdir(parents=True, exist_ok=True)
                _write_json(data, Path(args.output_dir) / f"{PREFIX}.json")
            write_report(data, Path(args.output_dir))
            print(json.dumps({"records": len(data["records"]), "output_dir": args.output_dir}))
            return 0
        result = run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"compare_plans: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, default=_json_default))
    return 0


if __name__ == "__main__":
    sys.exit(main())
