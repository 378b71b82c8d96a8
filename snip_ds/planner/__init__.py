"""The SNIP planner: from a statistics artifact to a precision plan. Pure: no torch, no torch.distributed.

* :mod:`snip_ds.planner.costs`: the cost model, C(p) = FLD(p) + λ·BWD(p) per layer or per GEMM, the
  baselines' costs (one mapping of every method to its costs) and a plan's predicted (FLD, BWD);
* :mod:`snip_ds.planner.problem`: the integer linear program's model (decision units, costs, constraints),
  :mod:`snip_ds.planner.ilp` its solve over given costs (python-mip / CBC), :mod:`snip_ds.planner.greedy` the
  greedy knapsack fallback, :mod:`snip_ds.planner.report` the plan a solve returns;
* :mod:`snip_ds.planner.baselines`: :func:`solve_baseline`, any method end to end.

The plan object itself is :class:`snip_ds.plan.Plan`. Names are loaded lazily, so that importing the cost
model does not load the solver.

May import: the plan, options, types and the statistics file (snip_ds.stats_file); nothing heavier (no torch), never
stats/' collector or anything above.
"""
import importlib

_EXPORTS = {
    "METHODS": "snip_ds.planner.costs",
    "DGRAD_COSTS": "snip_ds.planner.costs",
    "BWD_KEYS": "snip_ds.planner.costs",
    "BWD_ESTIMATES": "snip_ds.planner.costs",
    "StatsCosts": "snip_ds.planner.costs",
    "CostSettings": "snip_ds.planner.costs",
    "SolverSettings": "snip_ds.planner.ilp",
    "costs_from_stats": "snip_ds.planner.costs",
    "quant_err_costs": "snip_ds.planner.costs",
    "method_costs": "snip_ds.planner.costs",
    "predicted_divergence": "snip_ds.planner.costs",
    "GEMM_COST": "snip_ds.planner.ilp",
    "DEFAULT_ALLOWED": "snip_ds.planner.problem",
    "solve_plan": "snip_ds.planner.ilp",
    "solve_baseline": "snip_ds.planner.baselines",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'snip_ds.planner' has no attribute {name!r}")
