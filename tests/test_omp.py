"""A python-mip solve must not leave torch single-threaded (CBC shares the OpenMP runtime)."""
import torch

from snip_ds.runtime.omp import preserve_torch_threads
from snip_ds.planner import solve_plan

COSTS = {f"model.layers.{i}.mlp.up_proj": {"fp8": 0.0, "fp4": float(i + 1)} for i in range(4)}
FLOPS = {fqn: 1.0 for fqn in COSTS}


def test_solve_keeps_torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with preserve_torch_threads():
            plan = solve_plan(COSTS, FLOPS, 0.5)
        assert torch.get_num_threads() == 2
        assert plan.fp4_share == 0.5
    finally:
        torch.set_num_threads(before)
