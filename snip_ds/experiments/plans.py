"""A grid's plans: solved from the statistics at a checkpoint, put on a model, and what the statistics predict.

* :func:`collect_phase_stats`, :func:`solve_plans` — SNIP's statistics at a warm-up checkpoint, and every
  method's plan at every FP4 share from them;
* :func:`apply_plan`, :func:`bf16_forward` — put a :class:`~snip_ds.plan.Plan` on the model, or run a
  BF16 (unquantized) forward whatever the plan;
* :func:`predicted_divergence`, :func:`attainable_share` — what the statistics predict for a plan, and the
  FP4 share every method is solved at.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping

from torch import nn

from snip_ds.stats import STUDY_FIELDS, CollectSettings, adam_precond, collect_statistics
from snip_ds.run.data import DataStream
from snip_ds.experiments.grid import KIND_PLANS, SOLVED, UNIFORM, snip_label
from snip_ds.experiments.training import TrainSettings, load_checkpoint, make_optimizer
from snip_ds.runtime.omp import preserve_torch_threads
from snip_ds.plan import GEMMS, Plan
from snip_ds.planner import CostSettings, SolverSettings, solve_baseline
from snip_ds.planner.costs import predicted_divergence  # noqa: F401  (the product's cost model; imported from here too)
from snip_ds.swap import apply_plan, model_layers  # noqa: F401  (apply_plan: the product's, imported from here too)


# --------------------------------------------------------------------------------------------------------
# Solving a phase's plans
# --------------------------------------------------------------------------------------------------------
def collect_phase_stats(model, ckpt: Path, train_ds, settings: TrainSettings, args) -> Dict[str, Any]:
    """SNIP's statistics at checkpoint ``ckpt`` (MC Fisher FLD, BWD with the checkpoint's Adam state), as the
    grid's flags ask for them; loads the checkpoint into ``model``."""
    opt = make_optimizer(model, settings)
    load_checkpoint(model, opt, ckpt)
    pc = adam_precond(model, opt)
    stream = DataStream(train_ds, settings.batch_size, seed=args.seed + 777)
    batches = [stream.next_batch()["input_ids"] for _ in range(args.stat_batches)]
    how = CollectSettings(estimator="mc_fisher", num_probes=1, seed=args.seed, lam=args.lambda_default,
                          bwd_propagated=args.dgrad_cost == "upstream" or args.bwd_key == "bwd_propagated",
                          bwd_rounding=args.bwd_rounding, forward_drift=args.forward_drift,
                          study_fields=tuple(STUDY_FIELDS))  # the baselines and the report read them
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
                label = method if "lam" not in v or method != "best" else snip_label(v["lam"])
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


# --------------------------------------------------------------------------------------------------------
# Plans on a model
# --------------------------------------------------------------------------------------------------------
@contextmanager
def bf16_forward(model: nn.Module) -> Iterator[None]:
    """Every planned layer (SnipLinear or MoE expert pair) at ``bf16`` (unquantized) inside the block; the
    previous precisions after it."""
    layers = model_layers(model)
    saved = {fqn: m.precision for fqn, m in layers.items()}
    try:
        for m in layers.values():
            m.precision = "bf16"
        yield
    finally:
        for fqn, m in layers.items():
            m.precision = saved[fqn]


# --------------------------------------------------------------------------------------------------------
# Predictions
# --------------------------------------------------------------------------------------------------------

def attainable_share(flops: Mapping[str, float], target: float, tol: float = 1e-9) -> float:
    """The smallest FP4 share ``>= target`` that some set of whole layers reaches exactly.

    Layer FLOPs are discrete, so a share such as 0.9 is usually not reachable exactly; solving every method
    at this share, as both the lower and the upper bound, lands all of them on the same FP4 share.

    Args:
        flops: ``{fqn: F}`` per-step FLOPs of each layer.
        target: The nominal share ρ in [0, 1].
        tol: Absolute tolerance of the comparison with ``target``.
    """
    if not 0.0 <= target <= 1.0:
        raise ValueError(f"target must lie in [0, 1], got {target!r}")
    values = [float(f) for f in flops.values()]
    if not values or any(not (math.isfinite(f) and f >= 0) for f in values):
        raise ValueError("flops must be a non-empty mapping of finite numbers >= 0")
    total = sum(values)
    if total == 0:
        return 0.0 if target <= tol else 1.0
    sums = {0.0}
    for f in values:  # distinct subset sums; few, since a model has few distinct layer shapes
        sums |= {s + f for s in sums}
    return min(s / total for s in sums if s / total >= target - tol)

