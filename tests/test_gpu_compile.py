"""On a CUDA GPU: a SnipLinear step without host synchronisation, captured in a CUDA graph, and compiled by inductor.

* ``torch.cuda.set_sync_debug_mode("error")`` raises on any synchronising CUDA call (a scalar read, a copy to
  the host, a value-dependent operator) inside an eager forward and backward, and HostReads
  (snip_ds.backend.dispatch_audit) finds no read either;
* one layer's forward and backward is captured in a CUDA graph and replayed: the replay gives the eager step's
  output and gradients bit for bit (round to nearest), and with stochastic rounding (the layer's CUDA
  generator registered with the graph) each replay draws afresh;
* ``torch.compile`` with inductor, where the Triton quantization launches are ``triton_op``s that inductor traces
  into: the compiled layer equals eager bit for bit.

Skipped without CUDA (CI has none); the device script runs it (gpu/run_device.sh, step ``gpu_tests``).
"""
import pytest
import torch

from snip_ds.backend.dispatch_audit import HostReads
from snip_ds.linear import SnipLinear
from snip_ds.quant_config import QuantConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
T, K, N = 512, 1024, 768
CASES = {"fp8_hybrid": ("fp8", {}), "mxfp8": ("fp8", {"fp8_recipe": "mxfp8"}),
         "nvfp4_sr": ("fp4", {}), "mxfp4": ("fp4", {"fp4_recipe": "mxfp4", "stochastic_rounding": False})}


def _layer(case):
    precision, fields = CASES[case]
    torch.manual_seed(0)
    layer = SnipLinear(K, N, bias=True, device="cuda", dtype=torch.bfloat16, precision=precision,
                       quant_config=QuantConfig(backend="torch", **fields))
    layer.generator = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(T, N, device="cuda", dtype=torch.bfloat16) * 1e-2
    return layer, x, g


def _step(fn, layer, x, g):
    layer.zero_grad(set_to_none=True)
    xi = x.detach().requires_grad_(True)
    y = fn(xi)
    y.backward(g)
    return [y.detach(), xi.grad, layer.weight.grad, layer.bias.grad]


@pytest.mark.parametrize("case", CASES)
def test_a_layer_step_never_synchronises(case):
    layer, x, g = _layer(case)
    _step(layer, layer, x, g)  # kernels compiled, backends resolved
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with HostReads() as audit:
            _step(layer, layer, x, g)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert not audit.reads, "\n".join(map(str, audit.reads))


@pytest.mark.parametrize("case", CASES)
def test_a_layer_step_is_captured_in_a_cuda_graph(case):
    layer, x, g = _layer(case)
    stochastic = CASES[case][1].get("stochastic_rounding", CASES[case][0] == "fp4")
    graph = torch.cuda.CUDAGraph()
    if stochastic:
        if not hasattr(graph, "register_generator_state"):
            pytest.skip("this torch cannot register a generator with a CUDA graph")
        graph.register_generator_state(layer.generator)
    static_x = x.detach().clone().requires_grad_(True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS picks its kernels, outside the capture
        for _ in range(3):
            _step(layer, layer, static_x, g)
    torch.cuda.current_stream().wait_stream(side)
    layer.zero_grad(set_to_none=True)
    static_x.grad = None
    with torch.cuda.graph(graph):
        static_y = layer(static_x)
        static_y.backward(g)
    replays = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        replays.append([t.clone() for t in (static_y, static_x.grad, layer.weight.grad, layer.bias.grad)])
    if stochastic:  # fresh draws at every replay: the weight gradient (its G_Y rounded stochastically) changes
        assert not torch.equal(replays[0][2], replays[1][2])
        assert all(torch.isfinite(t).all() for t in replays[1])
    else:  # round to nearest: the eager step, bit for bit
        layer.zero_grad(set_to_none=True)
        eager = _step(layer, layer, x, g)
        for a, b in zip(replays[1], eager):
            assert torch.equal(a, b)


@pytest.mark.parametrize("case", CASES)
def test_inductor_compiles_the_layer_and_its_triton_kernels_bit_for_bit(case):
    layer, x, g = _layer(case)
    layer.generator.manual_seed(5)
    eager = _step(layer, layer, x, g)
    layer.generator.manual_seed(5)
    torch._dynamo.reset()
    # fp8_hybrid compiles to ordinary operators (snip_ds/backend/fp8_traced.py): its divisions rounded as eager's
    numerics = getattr(torch._inductor.config, "eager_numerics", None)
    exact = {"eager_numerics.division_rounding": True} if hasattr(numerics, "division_rounding") else {}
    with torch._inductor.config.patch(exact):
        compiled = _step(torch.compile(layer, backend="inductor", fullgraph=True), layer, x, g)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe,axis,out_dtype,transpose", [
    ("fp8_e4m3", 0, torch.float8_e4m3fn, True), ("mxfp8", 0, torch.bfloat16, True),
    ("nvfp4", -1, torch.bfloat16, False), ("nvfp4_2d", 0, torch.bfloat16, True), ("mxfp4", -1, torch.float32, False)])
def test_inductor_traces_into_the_triton_quantization_ops(recipe, axis, out_dtype, transpose):
    """``kernels.quantize_parts`` compiled by inductor (the ``snip_ds::triton_*`` triton_ops, whose launches
    inductor schedules itself): eager's codes and scales bit for bit, stochastic rounding from a seed tensor
    included."""
    from snip_ds.backend import kernels

    stochastic = recipe != "fp8_e4m3"

    def quantize(x, seed):
        p = kernels.quantize_parts(x, recipe, axis, tensor_amax=kernels.tensor_amax(x), stochastic=stochastic,
                                   seed=seed, out_dtype=out_dtype, transpose=transpose)
        return p.values, p.tensor_scale

    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16) * 5
    seed = torch.tensor(99, dtype=torch.int64, device="cuda")
    torch._dynamo.reset()
    got = torch.compile(quantize, backend="inductor", fullgraph=True)(x, seed)
    want = quantize(x, seed)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype.itemsize == 1 else torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_scaled_gemm_result_is_cast_in_the_multiply_s_pass_bit_for_bit(dtype):
    """The torch backend writes ``y * s`` straight into a BF16/FP16 output (``torch.mul(..., out=)``): on CUDA
    too the FP32 product rounded once, what ``y.mul_(s).to(dtype)`` gives, for values of every class."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    y = torch.randn(1024, 1031, device="cuda", generator=gen)
    y *= torch.exp2(torch.randint(-140, 120, y.shape, device="cuda", generator=gen).float())
    y[0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0], device="cuda")
    for s in (torch.tensor(3.0e-5, device="cuda"), torch.tensor(7.25, device="cuda")):
        fused = torch.mul(y, s, out=torch.empty(y.shape, dtype=dtype, device="cuda"))
        assert torch.equal(fused.view(torch.int16), y.clone().mul_(s).to(dtype).view(torch.int16))
