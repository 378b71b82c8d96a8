"""How plans with MoE pairs are shown: `snip-ds show`'s experts table and the TensorBoard map's experts panel."""
import numpy as np

from snip_ds.cli import render_plan
from snip_ds.plan import Plan
from snip_ds.report.tensorboard import PRECISION_COLOURS, precision_map_figure
from snip_ds.types import block_index, expert_pair


def _plan(n_experts, blocks=(0, 1), per_gemm=False):
    assignment = {f"model.layers.{b}.self_attn.{k}_proj": "fp8" for b in blocks for k in "qkvo"}
    for b in blocks:
        for e in range(n_experts):
            assignment[f"model.layers.{b}.mlp.experts.{e}.gate_up_proj"] = "fp4" if e % 3 == 0 else "fp8"
            assignment[f"model.layers.{b}.mlp.experts.{e}.down_proj"] = (
                {"fprop": "fp4", "dgrad": "fp8", "wgrad": "fp8"} if per_gemm and e == 1 else "fp8")
    return Plan.fixed(assignment)


def test_expert_pair_names():
    assert expert_pair("model.layers.3.mlp.experts.17.down_proj") == ("model.layers.3.mlp.experts", 17, "down_proj")
    assert expert_pair("model.layers.3.mlp.shared_expert.down_proj") is None
    assert expert_pair("model.layers.3.mlp.experts") is None


def test_show_lists_each_experts_precision_in_order_or_counts_them():
    lines = render_plan(_plan(4)).splitlines()
    assert lines[1].split() == ["block", "q", "k", "v", "o"]  # the dense map holds no expert columns
    at = lines.index("experts (4 per module; each cell string lists the experts in order)")
    assert lines[at + 1].split() == ["module", "gate_up", "down"]
    assert lines[at + 2].split() == ["model.layers.0.mlp.experts", "4884", "8888"]
    assert lines[at + 3].split() == ["model.layers.1.mlp.experts", "4884", "8888"]
    per_gemm = render_plan(_plan(2, per_gemm=True)).splitlines()
    row = next(line for line in per_gemm if line.startswith("model.layers.0.mlp.experts"))
    assert row.split() == ["model.layers.0.mlp.experts", "444|888", "888|488"]
    many = render_plan(_plan(100, blocks=(0,))).splitlines()
    assert "experts (100 per module; counts per precision)" in many
    assert next(line for line in many if line.startswith("model.layers.0.mlp.experts")).split() == [
        "model.layers.0.mlp.experts", "fp8:66", "fp4:34", "fp8:100"]


def test_precision_map_draws_experts_as_rows_of_a_second_panel():
    plan = _plan(8, blocks=(0, 1, 2))
    fig = precision_map_figure(plan.assignment, block_index)
    dense_ax, experts_ax = sorted(fig.axes, key=lambda a: -a.get_position().y0)[:2]
    assert experts_ax.get_ylabel() == "expert"
    grid = experts_ax.get_images()[0].get_array()
    assert grid.shape == (8, 6, 3)  # 8 experts x (3 blocks x 2 projections)
    for e in range(8):
        want = PRECISION_COLOURS["fp4" if e % 3 == 0 else "fp8"]
        assert tuple(grid[e, 2]) == want and tuple(grid[e, 3]) == PRECISION_COLOURS["fp8"]  # block 1 gate_up, down
    assert [t.get_text() for t in experts_ax.get_xticklabels()][:2] == ["0:gate_up", "0:down"]
    dense = dense_ax.get_images()[0].get_array()
    assert dense.shape == (3, 4, 3) and np.all(dense == np.array(PRECISION_COLOURS["fp8"], dtype=np.uint8))
