"""benchmarks/where_bytes.py: who keeps the bytes autograd saves, what is live at an eager step's peak, and the
CPU allocator's peak without operators' scratch -- on steps whose bytes are known exactly."""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from train_utils import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from where_bytes import (PeakLive, allocator_peaks, held_difference, is_linear, peaks,  # noqa: E402
                         saved_by_owner)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Sigmoid(), torch.nn.Linear(6, 3))


def test_linears_are_told_by_structure():
    model = _model()
    assert [is_linear(m) for m in model] == [True, False, True]
    assert not is_linear(model)  # (children)
    assert not is_linear(torch.nn.LayerNorm(4))  # (a 1-D weight)
    assert is_linear(torch.nn.Bilinear(2, 2, 2)) is False  # (a 3-D weight)


def test_saved_bytes_are_split_by_who_keeps_them():
    model = _model()
    x = torch.randn(5, 4)

    def step(context):
        with context:
            y = model(x.requires_grad_(True))
        y.sum().backward()

    linears = [m for m in model if is_linear(m)]
    kept = saved_by_owner(step, list(model.parameters()), linears)
    # the first linear keeps x (5 x 4); sigmoid keeps its output (5 x 6), which the second linear keeps too
    assert kept["bytes"] == (5 * 4 + 5 * 6) * 4
    assert kept["linear_only_bytes"] == 5 * 4 * 4
    assert sorted(tuple(t[1:]) for t in kept["tensors"]) == [([5, 4], "float32", "linear"),
                                                            ([5, 6], "float32", "both")]
    # without the hooks nothing is told apart, and the bytes are the same
    plain = saved_by_owner(step, list(model.parameters()))
    assert plain["bytes"] == kept["bytes"] and plain["linear_only_bytes"] == 0
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model)  # (the hooks removed)


def test_the_peak_s_live_tensors_and_the_operator_that_reached_it():
    x = torch.randn(8, requires_grad=True)
    with PeakLive() as mem:
        a = x * 2              # 32 B
        b = a * 3              # 32 B
        c = torch.cat([a, b])  # 64 B: the peak, 128 B
        del b
    assert mem.peak == 128 and mem.live == 96
    assert mem.peak_op == {"op": "aten.cat.default", "phase": "forward", "index": 3}
    assert sorted(mem.at_peak) == [[32, "forward", "aten.mul.Tensor", [8], "float32"]] * 2 + [
        [64, "forward", "aten.cat.default", [16], "float32"]]
    del a, c
    x = torch.randn(8, requires_grad=True)
    with PeakLive() as mem:
        y = (x * 2).sum()  # x * 2 (32 B) freed once summed (4 B)
        y.backward()       # the seed's 4 B (made before the engine runs), then x's gradient: 32 B
    assert mem.peak == 40 and mem.peak_op == {"op": "aten.mul.Tensor", "phase": "backward", "index": 5}
    assert sorted(mem.at_peak) == [[4, "forward", "aten.ones_like.default", [], "float32"],
                                   [4, "forward", "aten.sum.default", [], "float32"],
                                   [32, "backward", "aten.mul.Tensor", [8], "float32"]]


def test_the_difference_of_two_peaks_matches_tensors_whatever_made_them():
    mine = [[64, "backward", "aten._scaled_mm.default", [4, 4], "bfloat16"],
            [16, "forward", "aten.empty.memory_format", [4, 4], "float8_e4m3fn"],
            [4, "forward", "aten.empty.memory_format", [], "float32"],
            [4, "forward", "aten.empty.memory_format", [], "float32"]]
    theirs = [[64, "backward", "aten.mm.default", [4, 4], "bfloat16"],
              [32, "forward", "aten.mul.Tensor", [4, 4], "bfloat16"]]
    assert held_difference(mine, theirs) == [
        [-32, 1, "forward", "aten.mul.Tensor", [4, 4], "bfloat16"],
        [16, 1, "forward", "aten.empty.memory_format", [4, 4], "float8_e4m3fn"],
        [8, 2, "forward", "aten.empty.memory_format", [], "float32"]]
    assert held_difference(theirs, theirs) == []


def test_allocator_peaks_leave_out_what_an_operator_frees_inside_its_call():
    # (time, address, bytes, the aten:: calls around it, their names): an operator 1 whose call allocates 100 B
    # of scratch and its 40 B output, frees the scratch and returns; then 60 B outside any operator; then the
    # output freed inside operator 2, which did not make it (not scratch)
    events = [(0, 0xA, 100, (1,), ("aten::op1",)), (1, 0xB, 40, (1,), ("aten::op1",)),
              (2, 0xA, -100, (1,), ("aten::op1",)), (3, 0xC, 60, (), ()),
              (4, 0xB, -40, (2,), ("aten::op2",)), (5, 0xC, -60, (), ())]
    assert peaks(events) == {"peak_bytes": 140, "outliving_peak_bytes": 100, "scratch_at_peak_bytes": 100,
                             "peak_in": ["aten::op1"]}
    # a free inside a nested call of the operator that allocated is still its scratch
    nested = [(0, 0xA, 8, (1,), ("aten::outer",)), (1, 0xA, -8, (1, 2), ("aten::outer", "aten::inner"))]
    assert peaks(nested)["outliving_peak_bytes"] == 0


def test_allocator_peaks_from_a_real_profile():
    a = torch.randn(4, 8, 16).transpose(0, 1)  # (einsum may copy it to a contiguous scratch inside its call)
    b = torch.randn(16, 32)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        c = torch.einsum("bij,jk->bik", a, b)
    got = allocator_peaks(prof)
    assert got["outliving_peak_bytes"] == c.numel() * 4  # the result alone outlives the call
    assert got["peak_bytes"] == got["outliving_peak_bytes"] + got["scratch_at_peak_bytes"]
    assert got["peak_in"][0] == "aten::einsum"
