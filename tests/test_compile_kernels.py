"""The Triton kernels' path under ``torch.compile`` and without host reads: what the torch backend runs on CUDA.

Where there is no GPU, the kernels run under Triton's interpreter on CPU tensors (tests/triton_mode.py), the
``snip_ds::triton_quantize`` / ``triton_amax`` ops are then opaque custom ops with shape functions (on a GPU
they are ``triton_op``s that inductor traces into), and the torch backend takes the kernels' path on the CPU
(``KERNEL_DEVICES`` widened): per-tensor FP8 keeps X's E4M3 codes from the forward for wgrad and quantizes G_Y
once for both backward GEMMs, the path whose custom op returns the codes. Compiled results are compared with
eager bit for bit (the same functions run inside the ops), and the eager step must not read a tensor's value
on the host (snip_ds.backend.dispatch_audit.HostReads).
"""
import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from snip_ds.backend import kernels
from snip_ds.backend.dispatch_audit import HostReads
from snip_ds.linear import SnipLinear
from snip_ds.quant_config import QuantConfig
from triton_mode import DEVICE, SKIP_REASON, interpreter_on, kq, through_kernels  # noqa: F401 (fixtures)

if SKIP_REASON:
    pytest.skip(SKIP_REASON, allow_module_level=True)

CASES = {
    "fp8_hybrid": ("fp8", {}),
    "mxfp8": ("fp8", {"fp8_recipe": "mxfp8"}),
    "nvfp4_sr": ("fp4", {}),
    "mxfp4_hadamard_sr": ("fp4", {"fp4_recipe": "mxfp4", "hadamard": True}),
    "fp8_fprop_fp4_wgrad": ({"fprop": "fp8", "dgrad": "fp8", "wgrad": "fp4"}, {}),
}
K, N, X_SHAPE = 96, 80, (2, 32, 96)  # multiples of 16: the FP8 GEMM's shapes on a GPU


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _layer(precision, fields, dtype):
    torch.manual_seed(0)
    return SnipLinear(K, N, bias=True, device=DEVICE, dtype=dtype, precision=precision,
                      quant_config=QuantConfig(backend="torch", **fields))


def _step(fn, layer, x, g):
    layer.generator = torch.Generator(device=DEVICE).manual_seed(7)
    layer.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    y = fn(xi)
    y.backward(g)
    return [y.detach(), xi.grad, layer.weight.grad, layer.bias.grad], layer.generator.get_state()


def _data(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(X_SHAPE, generator=gen) * torch.logspace(-2, 2, X_SHAPE[1]).view(1, -1, 1)
    g = torch.randn(*X_SHAPE[:-1], N, generator=gen) * 1e-2
    return x.to(DEVICE, dtype), g.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_compiled_layer_through_the_kernels_equals_eager(through_kernels, case, dtype):
    precision, fields = CASES[case]
    layer = _layer(precision, fields, dtype)
    x, g = _data(dtype)
    kept = []

    def keep(gm, example_inputs):  # the forward graph's outputs: what the op keeps for backward
        kept.extend(n.meta["val"].dtype for n in gm.graph.nodes if n.op == "call_function"
                    and str(n.target) == "<built-in function getitem>" and n.args[1] == 1)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=keep, bw_compiler=lambda gm, _: make_boxed_func(gm.forward))
    eager, eager_state = _step(layer, layer, x, g)
    compiled, compiled_state = _step(torch.compile(layer, backend=backend, fullgraph=True), layer, x, g)
    for a, b in zip(eager, compiled):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(eager_state, compiled_state)
    # per-tensor FP8 fprop and wgrad: the op returns X's E4M3 codes, kept instead of X; one block recipe in every
    # GEMM, without wgrad's Hadamard transform: X's BF16 values for wgrad (snip_ds.backend.block_step); else an
    # unused placeholder
    assert kept == {"fp8_hybrid": [torch.float8_e4m3fn], "mxfp8": [torch.bfloat16],
                    "nvfp4_sr": [torch.bfloat16]}.get(case, [])


@pytest.mark.parametrize("case", CASES)
def test_a_layer_step_through_the_kernels_reads_nothing_on_the_host(through_kernels, case):
    """Forward and backward of a SnipLinear on the kernels' path, stochastic rounding included: no scalar
    read, no value-dependent operator, no copy to the host (the seeds are drawn into tensors the kernels
    read). The first step is left out: it only adds one-off set-up."""
    precision, fields = CASES[case]
    layer = _layer(precision, fields, torch.bfloat16)
    x, g = _data(torch.bfloat16)
    _step(layer, layer, x, g)
    with HostReads() as audit:
        _step(layer, layer, x, g)
    assert not audit.reads, "\n".join(map(str, audit.reads))


@pytest.mark.parametrize("recipe,axis,out_dtype,transpose", [
    ("fp8_e4m3", 0, torch.float8_e4m3fn, True), ("fp8_e5m2", -1, torch.bfloat16, False),
    ("mxfp8", 0, torch.bfloat16, True), ("nvfp4", -1, torch.float32, False), ("nvfp4_2d", 0, torch.bfloat16, True),
    ("mxfp4", -1, torch.float32, False)])
def test_the_triton_launches_trace_as_one_operator(recipe, axis, out_dtype, transpose):
    """``kernels.quantize_parts`` and ``tensor_amax`` under torch.compile: the launches become the
    ``snip_ds::triton_*`` ops and compute eager's values and scales bit for bit, stochastic rounding from a
    seed tensor included."""
    stochastic = out_dtype != torch.float8_e4m3fn

    def quantize(x, seed):
        amax = kernels.tensor_amax(x)
        p = kernels.quantize_parts(x, recipe, axis, tensor_amax=amax, stochastic=stochastic, seed=seed,
                                   out_dtype=out_dtype, transpose=transpose)
        return p.values, p.tensor_scale

    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    x = (torch.randn(40, 64, generator=torch.Generator().manual_seed(2)) * 5).to(DEVICE)
    seed = torch.tensor(99, dtype=torch.int64, device=DEVICE)
    got = torch.compile(quantize, backend=backend, fullgraph=True)(x, seed)
    want = quantize(x, seed)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                                                  b.view(torch.uint8) if b.dtype.itemsize == 1 else b)
    assert ops.count("snip_ds.triton_amax.default") == 1 and ops.count("snip_ds.triton_quantize.default") == 1
