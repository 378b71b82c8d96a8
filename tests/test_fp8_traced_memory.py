"""The per-tensor FP8 layer under ``torch.compile`` (snip_ds/backend/fp8_traced.py): eager's numbers bit for bit,
and what the compiled graph keeps for backward.

The torch backend's CUDA code path runs on CPU tensors (tests/triton_mode.py: the eager step's Triton kernels
under Triton's interpreter, ``torch._scaled_mm`` on the CPU where oneDNN has it), so a SnipLinear compiled by
inductor takes :class:`~snip_ds.backend.fp8_traced.Fp8Linear`, whose C++ division rounds as eager's does.
What is kept is read with ``saved_tensors_hooks`` around the compiled step, as the benchmark reads it.
"""
import pytest
import torch

from snip_ds.backend import custom_ops, fp8_traced, torch_native
from snip_ds.linear import SnipLinear
from snip_ds.quant_config import QuantConfig
from quant_inputs import skip_without_cpu_scaled_mm
from triton_mode import DEVICE, SKIP_REASON, interpreter_on, kq, through_kernels  # noqa: F401 (fixtures)

if SKIP_REASON:
    pytest.skip(SKIP_REASON, allow_module_level=True)

T, K, N = 32, 64, 48  # multiples of 16: every GEMM on torch._scaled_mm


@pytest.fixture(autouse=True)
def scaled_mm(through_kernels, monkeypatch):
    """The kernels' path with every per-tensor FP8 GEMM on torch._scaled_mm (as on a GPU with FP8 tensor
    cores); a fresh dynamo before and after."""
    if DEVICE == "cpu":
        skip_without_cpu_scaled_mm()
        monkeypatch.setattr(torch_native, "SCALED_MM_DEVICES", ("cpu", "cuda"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class NormThenLinear(torch.nn.Module):
    """An RMSNorm (as Llama's: FP32 arithmetic, rounded to the input's dtype, times a weight) and a linear."""

    def __init__(self, linear: torch.nn.Module):
        super().__init__()
        self.norm_weight = torch.nn.Parameter(torch.ones(K, device=DEVICE, dtype=torch.bfloat16))
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.linear(self.norm_weight * h.to(x.dtype))


def _linear(recipe: str, dtype=torch.bfloat16, bias=False) -> torch.nn.Module:
    torch.manual_seed(0)
    linear = torch.nn.Linear(K, N, bias=bias, device=DEVICE, dtype=dtype)
    return linear if recipe == "bf16" else SnipLinear.from_linear(linear, "fp8", QuantConfig(backend="torch"))


def _data(dtype=torch.bfloat16, shape=(T, K)):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen) * torch.logspace(-2, 2, shape[-1])
    g = torch.randn(*shape[:-1], N, generator=gen) * 1e-2
    return x.to(DEVICE, dtype), g.to(DEVICE, dtype)


def _step(fn, module, x, g):
    """Output, input gradient and parameter gradients of one step of ``fn`` (``module`` or its compiled form)."""
    module.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    y = fn(xi)
    y.backward(g)
    return [y.detach(), xi.grad] + [p.grad for p in module.parameters()]


def _kept(module, x, g):
    """(shape, dtype) of each tensor the compiled step keeps for backward, parameters left out (their storage
    is the parameter's: nothing allocated)."""
    compiled = torch.compile(module, fullgraph=True)
    _step(compiled, module, x, g)  # (compiles)
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            kept.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _step(compiled, module, x, g)
    return sorted(kept, key=str)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_compiled_layer_equals_the_eager_step_bit_for_bit(dtype, bias):
    """Inductor's code of :class:`Fp8Linear` (the layer's compiled form here: :func:`fp8_traced.applies`) gives
    the eager Triton step's output and X's and W's gradients bit for bit, X three-dimensional as a model's. The
    bias gradient is a sum over tokens that inductor adds in another order than eager: equal to FP32 rounding."""
    layer = _linear("fp8", dtype, bias)
    x, g = _data(dtype, (2, T // 2, K))
    assert fp8_traced.applies(custom_ops.op_spec(layer.gemm_precision, layer.quant_config), False, x, layer.matrix)
    eager = _step(layer, layer, x, g)
    compiled = _step(torch.compile(layer, fullgraph=True), layer, x, g)
    assert len(eager) == len(compiled) == (4 if bias else 3)
    for a, b in zip(eager[:3], compiled[:3]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if bias:
        torch.testing.assert_close(compiled[3], eager[3], rtol=1e-5, atol=1e-7)


def test_a_lone_compiled_layer_keeps_xs_codes_and_two_scales():
    """X a graph input (kept for nothing else): the compiled layer keeps X's E4M3 codes (one byte an element,
    where BF16's linear keeps X's two) and two FP32 scales; W is the parameter itself."""
    x, g = _data()
    assert _kept(_linear("bf16"), x, g) == [((T, K), torch.bfloat16)]
    assert _kept(_linear("fp8"), x, g) == [((), torch.float32)] * 2 + [((T, K), torch.float8_e4m3fn)]


def test_after_a_norm_the_compiled_layer_keeps_only_the_norms_tensors_and_two_scales():
    """X an RMSNorm's output: the norm keeps its input and reciprocal root anyway, so backward recomputes X and
    casts it again -- the compiled FP8 layer adds two FP32 scales to the norm's tensors, where BF16's keeps X."""
    x, g = _data()
    norm = [((T, 1), torch.float32), ((T, K), torch.bfloat16)]
    assert _kept(NormThenLinear(_linear("bf16")), x, g) == sorted(norm + [((T, K), torch.bfloat16)], key=str)
    assert _kept(NormThenLinear(_linear("fp8")), x, g) == sorted(norm + [((), torch.float32)] * 2, key=str)


class TwoReaders(torch.nn.Module):
    """Two FP8 linears reading one X (as query and key do)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _linear("fp8"), _linear("fp8")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


def test_layers_reading_one_x_share_its_cast_and_keep_it_once():
    """Two layers reading one X: the graph computes X's amax, scale and codes once (common subexpression
    elimination) and keeps them once -- X's codes and scale, each W's scale: three FP32 scalars -- with the
    step's results those of the eager step (which shares X's quantization too) bit for bit."""
    module = TwoReaders()
    x, g = _data()
    assert _kept(module, x, g) == [((), torch.float32)] * 3 + [((T, K), torch.float8_e4m3fn)]
    torch._dynamo.reset()
    eager = _step(module, module, x, g)
    compiled = _step(torch.compile(module, fullgraph=True), module, x, g)
    for a, b in zip(eager, compiled):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_a_non_finite_x_gives_the_eager_steps_non_finite_results(bad):
    """An infinite or NaN element in X makes X's scale NaN (its codes NaN, 0x7F): the compiled layer's output
    and gradients are the eager step's, NaN where eager's are NaN and equal elsewhere."""
    layer = _linear("fp8")
    x, g = _data()
    x[3, 5] = bad
    eager = _step(layer, layer, x, g)
    compiled = _step(torch.compile(layer, fullgraph=True), layer, x, g)
    assert eager[0].isnan().all()
    for a, b in zip(eager, compiled):
        assert a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
