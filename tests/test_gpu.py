"""On a CUDA GPU: the emulated backend against the hardware's own FP8 GEMM, and CUDA against the CPU.

The emulated backend is the numerical reference of every quantized GEMM (snip_ds/backend/emulated.py). Here it is held
to an independent one, the GPU's FP8 tensor-core GEMM (``torch._scaled_mm``, FP8 operands with per-tensor
scales, FP32 output): with the same per-tensor current scaling (scale = amax / max normal, E4M3 for X and W,
E5M2 for G_Y) the two must agree to the tensor cores' accumulation error, far closer than either is to the
unquantized product, and lose exactly as much against it. Then every recipe's quantizer must give on CUDA bit
for bit what it gives on the CPU, stochastic rounding must stay unbiased with a CUDA generator, and a
SnipLinear must train on CUDA as it does on the CPU.

The torch backend (compiled Triton kernels, ``torch._scaled_mm``, BF16 GEMMs with FP32 output) is held to the
emulated reference recipe by recipe in tests/test_torch_backend_kernels.py, which runs on CUDA where there is a
GPU; here it must train a SnipLinear in FP32, BF16 and FP16 with the compiled kernels, not the interpreter.

Skipped without CUDA (CI has none); the FP8 GEMM tests also need compute capability 8.9 or newer.
"""
import os
import sys

import math

import pytest
import torch

from snip_ds.backend import get_backend
from snip_ds.quant_config import QuantConfig
from snip_ds.linear import SnipLinear
from snip_ds.quant import RECIPES, fake_quantize

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
needs_fp8 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                               reason="FP8 tensor-core GEMMs need compute capability 8.9 or newer")
DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
T, K, N = 512, 1024, 768  # tokens, in, out (multiples of 16, as the FP8 GEMM wants)


def sqnr_db(ref: torch.Tensor, actual: torch.Tensor) -> float:
    ref, actual = ref.double(), actual.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - actual).pow(2).sum()))


def to_fp8(a: torch.Tensor, fmt: str):
    """(FP8 tensor, FP32 scale) with per-tensor current scaling, scale = amax / max normal (snip_ds's
    convention; Transformer Engine multiplies by max / amax instead, which can differ in the last bit)."""
    dtype = DTYPES[fmt]
    # 0-dim CUDA tensors as divisors: CUDA divides by a Python number through its rounded reciprocal
    scale = a.abs().amax().float() / torch.tensor(torch.finfo(dtype).max, device=a.device)
    return (a.float() / scale).to(dtype), scale


def hw_mm(a: torch.Tensor, fa: str, b: torch.Tensor, fb: str) -> torch.Tensor:
    """``Q(a) @ Q(b)`` on FP8 tensor cores (FP32 output); ``a`` [m, k] row-major, ``b`` [k, n]."""
    qa, sa = to_fp8(a, fa)
    qb, sb = to_fp8(b.t().contiguous(), fb)  # column-major [k, n], as cuBLASLt's FP8 GEMM needs
    return torch._scaled_mm(qa.contiguous(), qb.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)


@pytest.fixture
def operands():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, K, device="cuda", generator=gen)
    x[:, :8] *= 20  # outlier channels, as activations have: the per-tensor scale is set by them
    w = torch.randn(N, K, device="cuda", generator=gen) * 0.02
    g = torch.randn(T, N, device="cuda", generator=gen) * 1e-3
    return x, w, g


@needs_fp8
def test_fp8_gemms_match_tensor_cores(operands):
    x, w, g = operands
    cfg = QuantConfig(fp8_recipe="fp8_hybrid")
    be = get_backend()
    cases = {
        "fprop": (be.fprop(x, w, "fp8", cfg), hw_mm(x, "e4m3", w.t(), "e4m3"), x @ w.t()),
        "dgrad": (be.dgrad(g, w, "fp8", cfg), hw_mm(g, "e5m2", w, "e4m3"), g @ w),
        "wgrad": (be.wgrad(g, x, "fp8", cfg), hw_mm(g.t(), "e5m2", x, "e4m3"), g.t() @ x),
    }
    db = {gemm: (sqnr_db(hardware, emulated), sqnr_db(exact, emulated), sqnr_db(exact, hardware))
          for gemm, (emulated, hardware, exact) in cases.items()}
    for gemm, (agree, lossy, hw_lossy) in db.items():
        # Same quantized operands; only the accumulation differs. Hopper's FP8 tensor cores keep partial sums
        # to about 14 mantissa bits (measured on an H100: 71-80 dB here, vs ~140 dB for two FP32 GEMMs), so
        # the floor is 60 dB, while the quantization itself costs both GEMMs alike, to the hundredth of a dB,
        # against the exact product (E4M3 operands ~29 dB, an E5M2 gradient ~25 dB).
        assert agree > 60, f"{gemm}: emulated vs tensor-core FP8 GEMM only {agree:.1f} dB ({db})"
        assert lossy < 40 and abs(lossy - hw_lossy) < 0.01, f"{gemm}: {db}"


@needs_fp8
def test_fp8_operands_are_the_hardware_casts(operands):
    x, w, _ = operands
    for recipe, fmt in (("fp8_e4m3", "e4m3"), ("fp8_e5m2", "e5m2")):
        q, scale = to_fp8(x, fmt)
        expected = q.float() * scale
        assert torch.equal(fake_quantize(x, recipe), expected), recipe


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_quantizers_bit_exact_cuda_vs_cpu(recipe):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(96, 256, generator=gen) * torch.logspace(-3, 3, 256)  # blocks of very different scales
    x[3, 5] = 0.0
    on_cpu = fake_quantize(x, recipe, axis=-1)
    on_gpu = fake_quantize(x.cuda(), recipe, axis=-1).cpu()
    assert torch.equal(on_cpu, on_gpu), f"{recipe}: {int((on_cpu != on_gpu).sum())} elements differ"


@pytest.mark.parametrize("precision", ["fp8", "fp4"])
def test_statistics_quantize_on_cuda_through_compiled_kernels(precision):
    """The statistics' backend quantizes 2-D CUDA operands with the compiled Triton kernels: every operand
    role, both axes, FP32 and BF16 in, a given amax too, bit for bit the CPU reference's values."""
    from snip_ds.backend import kernels
    from snip_ds.backend.emulated import statistics_backend
    from snip_ds.quant_config import QuantConfig

    assert kernels.available() and not kernels.interpreting()
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(96, 200, generator=gen) * torch.logspace(-3, 3, 200)
    backend, cfg = statistics_backend(), QuantConfig()
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        for role in ("x", "w", "g") if precision == "fp8" else ("x", "w"):  # FP4's G_Y: stochastic, not fused
            for axis in (0, -1):
                for amax in (None, xd.float().abs().amax() * 3):
                    got = backend.quantize(xd.cuda(), precision, role, axis, cfg,
                                           amax=None if amax is None else amax.cuda())
                    want = backend.quantize(xd, precision, role, axis, cfg, amax=amax)
                    assert got.is_cuda and got.dtype == torch.float32
                    assert torch.equal(got.cpu(), want), (dtype, role, axis, amax is None)


def test_stochastic_rounding_unbiased_with_cuda_generator():
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.rand(64, 64, device="cuda", generator=gen) * 6
    draws = torch.stack([fake_quantize(x, "nvfp4", stochastic=True, generator=gen) for _ in range(400)])
    rne = fake_quantize(x, "nvfp4")
    assert not torch.equal(draws[0], draws[1])  # it does draw
    mean_err = (draws.mean(0) - x).abs().mean()
    assert mean_err < 0.2 * (rne - x).abs().mean(), "stochastic rounding on CUDA is biased"


def fit(device: str, precision: str, steps: int = 60, seed: int = 0, backend: str = "auto",
        dtype: torch.dtype = torch.float32):
    """Training losses of a 2-layer SnipLinear MLP fitting a linear teacher (the same data on every device)."""
    torch.manual_seed(3)
    x = torch.randn(256, 64)
    target = x @ (torch.randn(64, 64) / 8)
    cfg = QuantConfig(backend=backend)
    layers = [SnipLinear(64, 128, precision=precision, quant_config=cfg),
              SnipLinear(128, 64, precision=precision, quant_config=cfg)]
    net = torch.nn.Sequential(layers[0], torch.nn.GELU(), layers[1]).to(device=device, dtype=dtype)
    for layer in layers:  # stochastic rounding of FP4 gradients drawn on the device
        layer.generator = torch.Generator(device=device).manual_seed(seed)
    x, target = x.to(device=device, dtype=dtype), target.to(device=device, dtype=dtype)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, eps=1e-4 if dtype == torch.float16 else 1e-8)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(net(x).float(), target.float())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, layers[0], x


def test_snip_linear_trains_on_cuda():
    losses, layer, x = fit("cuda", "fp4")
    cpu_losses, _, _ = fit("cpu", "fp4")
    assert losses[-1] < 0.2 * losses[0], losses
    # stochastic rounding draws differ between the devices' generators, the training does not
    assert abs(losses[-1] - cpu_losses[-1]) < 0.25 * cpu_losses[-1], (losses[-1], cpu_losses[-1])
    # the fprop (no stochastic rounding) matches the same layer on the CPU to FP32 accumulation error
    cpu_layer = SnipLinear(64, 128, precision="fp4")
    with torch.no_grad():
        cpu_layer.weight.copy_(layer.weight.cpu())
        cpu_layer.bias.copy_(layer.bias.cpu())
        assert sqnr_db(cpu_layer(x.cpu()), layer(x).cpu()) > 100


@pytest.mark.parametrize("precision", ["fp8", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_torch_backend_trains_with_compiled_kernels(precision, dtype):
    """The torch backend on CUDA: a SnipLinear MLP in FP32, BF16 and FP16 trains as the emulated backend's
    does, its operands quantized by compiled Triton kernels (never the interpreter)."""
    from snip_ds.backend import kernels, torch_native
    losses, _, _ = fit("cuda", precision, backend="torch", dtype=dtype)
    reference, _, _ = fit("cuda", precision, backend="emulated", dtype=dtype)
    assert all(map(math.isfinite, losses)) and losses[-1] < 0.2 * losses[0], losses
    assert abs(losses[-1] - reference[-1]) < 0.25 * reference[-1], (losses[-1], reference[-1])
    assert torch_native.kernels() is kernels and not kernels.interpreting()
    assert not sys.modules["snip_ds.backend.kernels.quantize"].INTERPRETED
    assert os.environ.get("TRITON_INTERPRET", "0") != "1"


def test_collection_on_tf32_tensor_cores_agrees_with_ieee_fp32():
    """``collect_tf32`` (the default) runs a collection's FP32 products on TF32 tensor cores. On a BF16 model
    the operands that TF32 rounds are the dequantized ones with FP32 tensor scales and FP32 intermediates, by
    at most 2⁻¹¹ relative each (two per product: 2⁻¹⁰), against quantization errors of at least about 2⁻⁵
    relative (FP8 E4M3's rms rounding error) that FLD and BWD square: so each statistic moves by at most
    2·2⁻¹⁰/2⁻⁵ = 2⁻⁴ relative, however the perturbations line up. The same collection in IEEE FP32 must
    agree to that, layer by layer and precision by precision; cuBLAS's flag is restored after each.

    The preconditioner is the first collection's default, ``factored``, set by sums of squares of G_W. The
    element-wise ``grad_sq`` prior divided by |G_W|, so BWD was dominated by the entries where G_W's sum over
    tokens cancels, whose value changes with the order of summation itself (another GEMM kernel), not only
    with rounding: on an H100 the two runs' fp8 BWD of one layer differed by 9.7 % with it. Another order of
    summation alone moves a layer's BWD by up to about 2 % on the CPU, with either prior's P or none
    (tests/test_collect.py): inside the bound."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from snip_ds.stats import CollectSettings, collect_statistics
    from snip_ds.swap import swap_linears

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=257, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256, use_cache=False)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    swap_linears(model, "fp8", seed=3)
    batch = torch.randint(0, 257, (4, 256), generator=torch.Generator().manual_seed(1)).cuda()
    before = torch.backends.cuda.matmul.fp32_precision
    runs = {tf32: collect_statistics(model, [batch], CollectSettings(seed=5, collect_tf32=tf32), lr=1e-3)
            for tf32 in (True, False)}
    assert torch.backends.cuda.matmul.fp32_precision == before
    tf32, ieee = runs[True]["layers"], runs[False]["layers"]
    assert tf32.keys() == ieee.keys() and len(tf32) == 14
    for fqn in ieee:
        for field in ("fld", "bwd"):
            for p, want in ieee[fqn][field].items():
                got = tf32[fqn][field][p]
                assert want > 0 and abs(got - want) <= 2 ** -4 * want, (fqn, field, p, got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_non_finite_guards_max_abs_propagates_nan_and_inf_on_cuda(dtype):
    """The non-finite guard checks each gradient by its largest magnitude (one launch, snip_ds.engine.nonfinite.
    max_abs): on CUDA that reduction must give NaN where any element is NaN, wherever it sits in the tensor (CUDA
    reductions combine partial results across blocks and threads), and Inf where any is infinite."""
    from snip_ds.engine.nonfinite import max_abs
    for n in (1, 37, 4096, 1 << 20):
        for at in sorted({0, n // 2, n - 1}):
            for bad in (float("nan"), float("inf"), -float("inf")):
                t = torch.randn(n, device="cuda").to(dtype)
                t[at] = bad
                got = float(max_abs(t))
                assert (math.isnan(got) if math.isnan(bad) else got == float("inf")), (n, at, bad, got)
        assert math.isfinite(float(max_abs(torch.randn(n, device="cuda").to(dtype))))
