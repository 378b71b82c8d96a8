"""The host's work in an eager per-tensor FP8 (``fp8_hybrid``) layer step (snip_ds.backend.fp8_step): what is
decided once per shape is not worked out again per call, the launches do no Triton host-side arithmetic, and
backward frees dgrad's operands before wgrad's result is allocated.

The torch backend's CUDA code path runs here on CPU tensors (tests/triton_mode.py), the FP8 GEMMs on the
CPU's ``torch._scaled_mm`` where it has one, as on a GPU with FP8 tensor cores.
"""
from contextlib import ExitStack

import pytest
import torch

from snip_ds.backend import fp8_step, torch_native
from snip_ds.backend.dispatch_audit import LiveBytes, patch_triton_launches
from snip_ds.linear import SnipLinear
from snip_ds.quant_config import QuantConfig
from quant_inputs import skip_without_cpu_scaled_mm
from triton_mode import DEVICE, SKIP_REASON, interpreter_on, kg, kq, through_kernels  # noqa: F401 (fixtures)

if SKIP_REASON:
    pytest.skip(SKIP_REASON, allow_module_level=True)

T, K, N = 32, 64, 48  # multiples of 16: every FP8 GEMM runs on torch._scaled_mm


@pytest.fixture
def scaled_mm(through_kernels, monkeypatch):
    if DEVICE == "cpu":
        skip_without_cpu_scaled_mm()
        monkeypatch.setattr(torch_native, "SCALED_MM_DEVICES", ("cpu", "cuda"))
    return through_kernels


def _layer_and_data():
    torch.manual_seed(0)
    layer = SnipLinear(K, N, bias=False, device=DEVICE, dtype=torch.bfloat16, precision="fp8",
                       quant_config=QuantConfig(backend="torch"))
    x = torch.randn(T, K, device=DEVICE).bfloat16()
    g = (torch.randn(T, N, device=DEVICE) * 1e-3).bfloat16()
    return layer, x, g


def _step(layer, x, g):
    layer(x.detach().requires_grad_(True)).backward(g)
    layer.weight.grad = None


def test_every_launch_runs_a_configuration_the_plan_worked_out(scaled_mm, monkeypatch):
    """Forward and backward launch with the launch configurations their shape's plan holds (X's and W's in one
    launch, W's again for dgrad with G_Y's in one, G_Y's alone where dgrad does not run): a call works none out,
    nor looks one up."""
    layer, x, g = _layer_and_data()
    _step(layer, x, g)  # the plan, decided once
    step = scaled_mm.decided_fp8_step(x, layer.weight, layer.gemm_precision, layer.quant_config)
    assert step is not None and step.scaled
    launched = []
    launch, launch_pair = kq.launch, kg.launch_pair
    monkeypatch.setattr(kq, "launch", lambda cfg, *a, **kw: launched.append(cfg) or launch(cfg, *a, **kw))
    monkeypatch.setattr(kg, "launch_pair",
                        lambda cfg, *a, **kw: launched.append(cfg) or launch_pair(cfg, *a, **kw))
    monkeypatch.setattr(kq, "launch_config", lambda *a, **kw: pytest.fail("a launch configuration worked out"))
    monkeypatch.setattr(kq, "cached_launch_config", lambda *a, **kw: pytest.fail("a launch configuration looked up"))
    _step(layer, x, g)
    assert [id(c) for c in launched] == [id(c) for c in (step.xw_pair, step.wg_pairs[True, True])]
    assert (step.xw_pair.first, step.xw_pair.second) == (step.x_cfg, step.w_cfg)
    assert (step.wg_pairs[True, True].first, step.wg_pairs[True, True].second) == (step.w_t_cfg,
                                                                                 step.g_cfgs[True, True, True])
    launched.clear()
    layer(x.detach()).backward(g)  # X needs no gradient: G_Y in the transposed layout alone, no W for dgrad
    layer.weight.grad = None
    assert [id(c) for c in launched] == [id(c) for c in (step.xw_pair, step.g_cfgs[True, False, True])]
    assert step.g_cfgs[True, False, True].shape == (N, T) and not step.g_cfgs[True, False, True].both


def test_a_step_calls_no_triton_function_on_the_host(scaled_mm, monkeypatch):
    """``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions in recent Triton, microseconds a
    call on the host: the step's launches work out the amax pass's tiles per program in plain integers -- the
    same numbers (checked against Triton's for several shapes and program counts)."""
    jit = pytest.importorskip("triton.runtime.jit")
    import triton

    layer, x, g = _layer_and_data()
    _step(layer, x, g)
    calls = []
    if hasattr(jit, "ConstexprFunction"):
        call = jit.ConstexprFunction.__call__
        monkeypatch.setattr(jit.ConstexprFunction, "__call__", lambda self, *a, **kw: calls.append(self)
                            or call(self, *a, **kw))
    with ExitStack() as stack:
        patch_triton_launches(stack, None, run=False)  # the host's work up to each launch
        _step(layer, x, g)
    assert calls == []
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((grid[0], kw["BR"], kw["BC"], kw["TILES_PER_PROGRAM"]))

    monkeypatch.setattr(kq, "_amax_kernel", Recorder())
    shapes = [(1, 1), (17, 300), (64, 64), (100, 1000), (4096, 33), (2500, 4000)]
    for rows, cols in shapes:
        for programs in (1, 3, 7, 512):
            kq._amax(torch.empty(rows, cols, dtype=torch.int16), True, 16, 64, programs)
    for (rows, cols), (programs, br, bc, per) in zip([s for s in shapes for _ in range(4)], seen):
        tiles = triton.cdiv(rows, br) * triton.cdiv(cols, bc)
        assert per == triton.next_power_of_2(triton.cdiv(tiles, programs)), (rows, cols, programs)


def test_dgrad_operands_are_freed_before_wgrads_result(scaled_mm):
    """At a layer step's peak (wgrad's result) what is alive is Y, X's kept codes, G_Y's transposed codes, G_X,
    G_W and 4-byte scales -- not dgrad's operands (G_Y's row-major codes, W's transposed codes), which backward
    drops once dgrad has run."""
    layer, x, g = _layer_and_data()
    _step(layer, x, g)
    with ExitStack() as stack:
        patch_triton_launches(stack, None, run=False)
        _step(layer, x, g)
        with LiveBytes() as mem:
            _step(layer, x, g)
    bf16 = 2
    at_wgrad = T * N * bf16 + T * K + T * N + T * K * bf16 + N * K * bf16  # Y, X codes, G_Y^T codes, G_X, G_W
    dgrad_operands = T * N + K * N  # G_Y's row-major codes, W's transposed codes
    assert at_wgrad <= mem.peak <= at_wgrad + 16 * 4 < at_wgrad + dgrad_operands
