"""The precision-map image TensorBoard shows: a labelled figure, one row of 7 cells per block, coloured by
precision, with the step and FP4 share in its title and a legend."""
import numpy as np
import pytest

from snip_ds.tensorboard import PRECISION_COLOURS, precision_map_figure, precision_map_image
from snip_ds.plan import fp4_share
from snip_ds.types import block_index

KINDS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _plan(blocks, pick):
    return {f"model.layers.{b}.{k}": pick(b, i) for b in range(blocks) for i, k in enumerate(KINDS)}


def _count(img, precision):
    """Pixels of exactly the precision's colour (cells are drawn without interpolation)."""
    return int(np.all(img.transpose(1, 2, 0) == PRECISION_COLOURS[precision], axis=-1).sum())


def test_image_reads_in_tensorboard_and_grows_with_the_model():
    small = precision_map_image(_plan(2, lambda b, i: "fp8"), block_index, step=0, fp4_share=0.0)
    large = precision_map_image(_plan(24, lambda b, i: "fp8"), block_index, step=0, fp4_share=0.0)
    assert small.dtype == np.uint8 and small.shape[0] == 3
    assert small.shape[2] >= 600 and small.shape[1] >= 200  # TensorBoard shows images at their own size
    assert large.shape[2] == small.shape[2] and large.shape[1] > small.shape[1] + 24 * 10  # >= 10 px a row


def test_cell_colours_follow_the_plan():
    """Moving layers from fp8 to fp4 moves pixels from the fp8 colour to the fp4 colour, in proportion to the
    number of cells. Each cell is drawn with the same size, give or take one pixel row and one column (its
    borders fall on a pixel grid): a cell is ~68 x 26 pixels, so the tolerance is 100 pixels per moved cell."""
    def pick(n_fp4):
        return lambda b, i: "fp4" if b * 7 + i < n_fp4 else "fp8"
    imgs = {n: precision_map_image(_plan(4, pick(n)), block_index, step=5, fp4_share=n / 28) for n in (0, 3, 6)}
    assert not np.array_equal(imgs[0], imgs[3])
    moved3 = _count(imgs[3], "fp4") - _count(imgs[0], "fp4")
    moved6 = _count(imgs[6], "fp4") - _count(imgs[0], "fp4")
    assert moved3 > 0 and moved3 == pytest.approx(_count(imgs[0], "fp8") - _count(imgs[3], "fp8"), abs=3 * 100)
    cell = moved3 / 3
    assert cell > 400  # a cell is larger than 20 x 20 pixels
    assert moved6 == pytest.approx(2 * moved3, abs=6 * 100)
    bf16 = precision_map_image(_plan(4, lambda b, i: "bf16" if i == 6 else "fp8"), block_index)
    assert _count(bf16, "bf16") - _count(imgs[0], "bf16") == pytest.approx(4 * cell, abs=4 * 100)


def test_figure_names_blocks_layers_step_share_and_precisions():
    plan = _plan(3, lambda b, i: "fp4" if i >= 4 else "fp8")
    flops = {fqn: 1.0 for fqn in plan}
    share = fp4_share(plan, flops)
    fig = precision_map_figure(plan, block_index, step=40, fp4_share=share, method="best")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["q", "k", "v", "o", "gate", "up", "down"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "1", "2"]
    assert ax.get_ylabel() == "decoder block"
    title = ax.get_title()
    assert "step 40" in title and f"FP4 share {100 * 9 / 21:.1f}%" in title and "best" in title
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["bf16", "fp8", "fp4"]


def test_per_gemm_plans_split_cells_and_say_so():
    plan = _plan(2, lambda b, i: {"fprop": "fp8", "dgrad": "fp4", "wgrad": "bf16"})
    fig = precision_map_figure(plan, block_index, step=1)
    (legend,) = fig.legends
    assert "fprop" in legend.get_title().get_text() and "wgrad" in legend.get_title().get_text()
    top = fig.axes[0].child_axes[0]  # the secondary x axis naming each stripe
    assert [t.get_text() for t in top.get_xticklabels()] == ["F", "D", "W"] * 7
    img = precision_map_image(plan, block_index, step=1)
    every = {p: precision_map_image(_plan(2, lambda b, i: p), block_index, step=1) for p in ("bf16", "fp8")}
    legend_only = {p: _count(every["bf16"], p) for p in ("fp8", "fp4")}  # no cell is fp8 or fp4 there
    cells = _count(every["fp8"], "fp8") - legend_only["fp8"]
    # each GEMM takes a third of every cell; the two thin white lines between the stripes (0.6 pt: 1-2 pixels
    # each, anti-aliased) take 2-4 of a cell's ~68 pixels of width, up to 6 %, from the stripes beside them
    assert _count(img, "fp8") - legend_only["fp8"] == pytest.approx(cells / 3, rel=0.08)
    assert _count(img, "fp4") - legend_only["fp4"] == pytest.approx(cells / 3, rel=0.08)
    assert _count(img, "bf16") - _count(every["fp8"], "bf16") == pytest.approx(cells / 3, rel=0.08)
