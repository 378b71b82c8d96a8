"""A layer whose three GEMMs run one step decided for its shape (the torch backend's per-tensor FP8 or
block-scaled step) goes through :class:`snip_ds.linear.DecidedStepFn`, which leaves out the backends' lookups;
its output and gradients are those of :class:`snip_ds.linear.QuantizedLinearFn` running the same step, bit for
bit: 2-D and 3-D inputs, with and without a bias, a frozen weight or an input that needs no gradient, FP32 and
BF16, stochastic rounding drawn from the layer's generator, and a pair of experts."""
import pytest
import torch

from snip_ds.backend import layer_step
from snip_ds.linear import SnipLinear
from snip_ds.quant_config import QuantConfig
from triton_mode import DEVICE, SKIP_REASON, interpreter_on, through_kernels  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

CASES = {"fp8_hybrid": ("fp8", {}), "nvfp4": ("fp4", {}), "mxfp8": ("fp8", {"fp8_recipe": "mxfp8"})}


def _layer(case, dtype, bias):
    precision, fields = CASES[case]
    torch.manual_seed(3)
    layer = SnipLinear(48, 40, bias=bias, device=DEVICE, dtype=dtype, precision=precision,
                       quant_config=QuantConfig(backend="torch", **fields))
    if bias:
        with torch.no_grad():
            layer.bias.copy_(torch.linspace(-1, 1, 40))
    return layer


def _run(layer, x, g, need_x=True, need_w=True):
    """(Y, G_X, G_W, G_b, the name of Y's autograd node) of one step, the generator seeded alike."""
    layer.generator = torch.Generator(device=DEVICE).manual_seed(11)
    layer.weight.requires_grad_(need_w)
    xi = x.clone().requires_grad_(need_x)
    y = layer(xi)
    node = y.grad_fn
    while node is not None and node.name().startswith(("View", "Reshape", "Unsafe")):
        node = node.next_functions[0][0]  # (a 3-D input's output: a view of the function's [T, n])
    y.backward(g)
    out = (y.detach(), xi.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad)
    layer.weight.grad = None
    if layer.bias is not None:
        layer.bias.grad = None
    return out, node.name()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_the_decided_step_function_equals_the_general_one(through_kernels, monkeypatch, case, dtype):
    for bias in (False, True):
        layer = _layer(case, dtype, bias)
        for shape in ((24, 48), (2, 12, 48)):
            x = torch.randn(*shape, device=DEVICE).to(dtype)
            g = (torch.randn(*shape[:-1], 40, device=DEVICE) * 1e-2).to(dtype)
            for need_x, need_w in ((True, True), (False, True), (True, False)):
                with monkeypatch.context() as m:
                    m.setattr(layer_step, "decided_step", lambda *a: None)
                    general, general_node = _run(layer, x, g, need_x, need_w)
                decided, node = _run(layer, x, g, need_x, need_w)
                assert general_node == "QuantizedLinearFnBackward"
                assert node == "DecidedStepFnBackward", (case, shape)
                for a, b in zip(general, decided):
                    assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), (
                        case, bias, shape, need_x, need_w)


def test_layers_without_a_decided_step_take_the_general_function(through_kernels):
    """A per-GEMM plan (wgrad at another precision) and a layer under an amax reduction (a tensor-parallel
    shard) have no decided step of their own here: the general function runs them."""
    from snip_ds.backend.operands import shared_amax

    layer = SnipLinear(48, 40, device=DEVICE, precision={"fprop": "fp8", "dgrad": "fp8", "wgrad": "fp4"},
                       quant_config=QuantConfig(backend="torch"))
    x = torch.randn(24, 48, device=DEVICE, requires_grad=True)
    assert layer(x).grad_fn.name() == "QuantizedLinearFnBackward"
    layer.precision = "fp8"
    assert layer(x).grad_fn.name() == "DecidedStepFnBackward"
    with shared_amax(lambda amax: amax):
        assert layer(x).grad_fn.name() == "QuantizedLinearFnBackward"


def test_the_decided_step_is_not_kept_across_a_replan(through_kernels):
    """Each forward asks for its step: a layer planned back to BF16 runs torch's own linear, and one planned
    to another recipe runs that recipe's step (no step from an earlier precision is reused)."""
    layer = _layer("fp8_hybrid", torch.float32, bias=False)
    x = torch.randn(24, 48, device=DEVICE, requires_grad=True)
    fp8 = layer(x)
    layer.precision = "bf16"
    assert layer(x).grad_fn.name() != "DecidedStepFnBackward"
    layer.precision = "fp4"
    fp4 = layer(x)
    assert fp4.grad_fn.name() == "DecidedStepFnBackward" and not torch.equal(fp4, fp8)
