"""What a solve reports: the chosen precisions as a :class:`~snip_ds.plan.Plan`, with its objective (Σ cost and
flip penalty), its FP4 share, the GEMMs that changed precision against the previous plan, and the solver's
record in ``plan.meta`` (solve time, status, limits).

Pure data: no torch, no torch.distributed.
"""
from __future__ import annotations

import time

from snip_ds.plan import Plan, fp4_share
from snip_ds.planner.problem import Problem, flip_fraction
from snip_ds.types import GEMMS


def make_plan(prob: Problem, choice: dict, flops, per_gemm, status, method, start, meta, **solver_meta) -> Plan:
    """The plan of ``choice`` (precision per decision unit); ``start`` is the solve's ``time.perf_counter()``
    at its start, ``meta`` and ``solver_meta`` go into ``plan.meta``."""
    if per_gemm:
        assignment: dict = {}
        for (fqn, g), p in choice.items():
            assignment.setdefault(fqn, {})[g] = p
    else:
        assignment = dict(choice)
    objective = sum(prob.cost[u, choice[u]] for u in prob.units)
    flips = sum(flip_fraction(prob.prev.get(u), choice[u]) * (1 if per_gemm else len(GEMMS))
                for u in prob.units) if prob.prev else 0
    info = {"solve_time_s": time.perf_counter() - start, "num_layers": len(flops),
            "flipped_gemms": int(round(flips)), **solver_meta, **dict(meta or {})}
    return Plan(assignment=assignment, fp4_share=fp4_share(assignment, flops), objective=objective,
                status=status, method=method, meta=info)
