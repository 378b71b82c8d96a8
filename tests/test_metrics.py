"""The precision-map image TensorBoard shows: one row of 7 cells per block, coloured by precision."""
import numpy as np

from snip_ds.metrics import LAYER_KINDS, PRECISION_COLOURS, precision_map_image
from snip_ds.planner import block_index

CELL = 12
KINDS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _plan(blocks, pick):
    return {f"model.layers.{b}.{k}": pick(b, i) for b in range(blocks) for i, k in enumerate(KINDS)}


def _centre(img, row, col):
    return tuple(int(v) for v in img[:, row * CELL + CELL // 2, col * CELL + CELL // 2])


def test_one_cell_per_layer_in_its_precision_colour():
    precs = ("bf16", "fp8", "fp4")
    plan = _plan(3, lambda b, i: precs[(b + i) % 3])
    img = precision_map_image(plan, block_index, cell=CELL)
    assert img.shape == (3, 3 * CELL, 7 * CELL) and img.dtype == np.uint8
    for b in range(3):
        for i, kind in enumerate(KINDS):
            assert LAYER_KINDS[i] == kind.split(".")[1]
            assert _centre(img, b, i) == PRECISION_COLOURS[precs[(b + i) % 3]], (b, kind)
    assert tuple(img[:, 0, 0]) == (255, 255, 255)  # cell borders stay white


def test_per_gemm_plans_get_one_sub_row_per_gemm():
    plan = _plan(2, lambda b, i: {"fprop": "fp8", "dgrad": "fp4", "wgrad": "bf16"})
    img = precision_map_image(plan, block_index, cell=CELL)
    assert img.shape == (3, 2 * 3 * CELL, 7 * CELL)
    for b in range(2):
        for sub, prec in enumerate(("fp8", "fp4", "bf16")):
            assert _centre(img, b * 3 + sub, 4) == PRECISION_COLOURS[prec]
