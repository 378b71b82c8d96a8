"""The GEMM backends against the emulated reference: operands, SnipLinear outputs and gradients, stochastic
rounding, the registry and ``auto``."""
import logging
import math
import sys
import types

import pytest
import torch

from snip_ds import backend as backend_pkg
from snip_ds.backend import (BackendError, EmulatedBackend, TorchBackend, check_backend, get_backend,
                             reference_operands, resolve)
from snip_ds.backend import base, torch_native
from snip_ds.backend import cpu as cpu_kernels
from snip_ds.quant_config import QuantConfig
from snip_ds.linear import SnipLinear
from snip_ds.quant import stochastic_moments
from snip_ds.config.settings import ConfigError, parse_snip_section
from tests.quant_inputs import RECIPE_CASES, skip_without_cpu_scaled_mm
from tests.reference_quant import GRIDS, assert_bitwise_equal

BACKENDS_HERE = ["torch"]  # every backend that runs on this machine besides the emulated reference
# (precision, QuantConfig) for each recipe; stochastic rounding off unless a test turns it on
CASES = {**RECIPE_CASES, "bf16": ("bf16", QuantConfig())}
T, K, N = 96, 80, 48  # tokens, in_features, out_features: partial MX blocks along k and n


def _cfg(cfg: QuantConfig, **changes) -> QuantConfig:
    return QuantConfig(**{**cfg.__dict__, **changes})


def _data(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.exp2(torch.randint(-3, 4, (T, 1), generator=gen).float())  # tokens of different magnitudes
    x = (torch.randn(T, K, generator=gen) * rows).to(dtype)
    w = (torch.randn(N, K, generator=gen) / math.sqrt(K)).to(dtype)
    g = (torch.randn(T, N, generator=gen) * 1e-3).to(dtype)
    return x, w, g


def sqnr_db(test: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    noise = (test.double() - ref).pow(2).sum()
    return float("inf") if noise == 0 else 10 * math.log10(ref.pow(2).sum() / noise)


# ----------------------------------------------------------------------------------------------------------
# BF16 holds every quantized operand exactly
# ----------------------------------------------------------------------------------------------------------

def _all_codes(dtype):
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    return values[values.isfinite()]


def test_bf16_holds_every_fp8_value_and_every_fp4_product():
    """Every E4M3 and E5M2 code, every E2M1 x E4M3 product (NVFP4's q * s_b) and every E2M1 x E8M0 product
    an MX block can produce (MXFP4: scales up to 2**(127 - emax) since amax < 2**128) is a BF16 value; so
    is every MXFP8 value with a block scale of at least 2**-124. (Below that, E4M3's subnormals times the
    scale fall under BF16's smallest subnormal 2**-133: blocks whose amax is below 2**-116.)"""
    e4m3, e5m2 = _all_codes(torch.float8_e4m3fn), _all_codes(torch.float8_e5m2)
    assert e4m3.numel() == 254 and e5m2.numel() == 248  # 256 codes less E4M3's 2 NaNs, E5M2's 2 Infs and 6 NaNs
    e5m2_all = torch.arange(256, dtype=torch.uint8).view(torch.float8_e5m2).float()
    assert e5m2_all.isnan().sum() == 6 and e5m2_all.isinf().sum() == 2
    e2m1 = torch.tensor([v for v, _ in GRIDS["e2m1"]], dtype=torch.float64)
    e2m1 = torch.cat([e2m1, -e2m1])
    e8m0 = torch.exp2(torch.arange(-127, 127 - 2 + 1, dtype=torch.float64))  # E2M1's emax is 2
    mx8 = torch.exp2(torch.arange(-124, 127 - 8 + 1, dtype=torch.float64))  # MXFP8 (E4M3, emax 8)
    for values in (e4m3, e5m2, (e2m1[:, None] * e4m3.double()[None, :]).flatten(),
                   (e2m1[:, None] * e8m0[None, :]).flatten(), (e4m3.double()[:, None] * mx8[None, :]).flatten()):
        v = values.double()
        assert v.abs().max() < torch.finfo(torch.float32).max
        assert torch.equal(v.to(torch.bfloat16).double(), v), v[v.to(torch.bfloat16).double() != v][:5]
    assert 2.0 ** -9 * 2.0 ** -125 != torch.tensor(2.0 ** -134, dtype=torch.float64).to(torch.bfloat16).item()


# ----------------------------------------------------------------------------------------------------------
# operands: bit for bit the emulated backend's; GEMMs: the product of those operands
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", BACKENDS_HERE)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
def test_operands_equal_the_emulated_ones(name, case, gemm):
    precision, cfg = CASES[case]
    x, w, g = _data(1)
    a, b = {"fprop": (x, w), "dgrad": (g, w), "wgrad": (g, x)}[gemm]
    got = get_backend(name).quantized_operands(gemm, a, b, precision, cfg)
    ref = reference_operands(gemm, a, b, precision, cfg)
    for p, r in zip(got, ref):
        assert_bitwise_equal(p.values, r.values)
        assert_bitwise_equal(p.tensor_scale, r.tensor_scale)


@pytest.mark.rounding
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
def test_emulated_gemms_multiply_the_reference_operands(case, gemm):
    """The reference operands are what the emulated GEMMs multiply: their FP64 product (values times tensor
    scales) matches the emulated FP32 GEMM. Tolerance: the emulated operands are fl(q * s) (relative error
    2**-24 each) summed in FP32 over at most 96 terms (about 96 * 2**-24 of the sum of |terms|)."""
    precision, cfg = CASES[case]
    x, w, g = _data(2)
    a, b = {"fprop": (x, w), "dgrad": (g, w), "wgrad": (g, x)}[gemm]
    pa, pb = reference_operands(gemm, a, b, precision, cfg)
    da, db = pa.values.double() * pa.tensor_scale.double(), pb.values.double() * pb.tensor_scale.double()
    ref = {"fprop": lambda: da @ db.t(), "dgrad": lambda: da @ db, "wgrad": lambda: da.t() @ db}[gemm]()
    mag = {"fprop": lambda: da.abs() @ db.abs().t(), "dgrad": lambda: da.abs() @ db.abs(),
           "wgrad": lambda: da.abs().t() @ db.abs()}[gemm]()
    be = EmulatedBackend()
    got = {"fprop": lambda: be.fprop(x, w, precision, cfg), "dgrad": lambda: be.dgrad(g, w, precision, cfg),
           "wgrad": lambda: be.wgrad(g, x, precision, cfg)}[gemm]()
    assert ((got.double() - ref).abs() <= mag * 100 * 2.0 ** -24).all()


@pytest.mark.rounding
@pytest.mark.parametrize("name", BACKENDS_HERE)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_gemms_multiply_their_operands(name, case, dtype):
    """Each GEMM of the backend is the product of its quantized operands, in ``out_dtype``. Tolerance: FP32
    accumulation (K <= 96 terms: 96 * 2**-24 of the sum of |terms|) plus, for a BF16 result, two BF16
    roundings (the CPU GEMM's BF16 result, then out_dtype after the tensor scales: 2 * 2**-8 relative)."""
    precision, cfg = CASES[case]
    x, w, g = _data(3, dtype)
    be = get_backend(name)
    for gemm, (a, b) in {"fprop": (x, w), "dgrad": (g, w), "wgrad": (g, x)}.items():
        if precision == "bf16":
            da, db = a.double(), b.double()
        else:
            pa, pb = be.quantized_operands(gemm, a, b, precision, cfg)
            da, db = pa.values.double() * pa.tensor_scale.double(), pb.values.double() * pb.tensor_scale.double()
        prod = {"fprop": lambda u, v: u @ v.t(), "dgrad": lambda u, v: u @ v, "wgrad": lambda u, v: u.t() @ v}[gemm]
        ref, mag = prod(da, db), prod(da.abs(), db.abs())
        got = getattr(be, gemm)(a, b, precision, cfg, out_dtype=dtype)
        assert got.dtype == dtype
        rel = 100 * 2.0 ** -24 + (2 * 2.0 ** -8 if dtype == torch.bfloat16 else 0.0)
        assert ((got.double() - ref).abs() <= mag * rel + ref.abs() * rel).all(), (gemm, case)


@pytest.mark.rounding
def test_fp8_scaled_mm_path(monkeypatch):
    """torch._scaled_mm (E4M3 x E4M3 fprop, E5M2 x E4M3 dgrad and wgrad) with the layouts it needs gives the
    BF16-exact path's result. CPU's _scaled_mm is slow but a real implementation of the same op, so it is
    run here on small shapes. Tolerance: both sum exact products in FP32 (at most 96 terms) in different
    orders and apply the scales differently: each within 100 * 2**-24 of the sum of |terms|."""
    skip_without_cpu_scaled_mm()
    precision, cfg = CASES["fp8_hybrid"]
    x, w, g = _data(4)
    be = TorchBackend()
    exact = {gemm: getattr(be, gemm)(a, b, precision, cfg) for gemm, (a, b) in
             {"fprop": (x, w), "dgrad": (g, w), "wgrad": (g, x)}.items()}
    monkeypatch.setattr(torch_native, "SCALED_MM_DEVICES", ("cpu", "cuda"))
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append((a[0].dtype, a[1].dtype)) or real(*a, **k))
    for gemm, (a, b) in {"fprop": (x, w), "dgrad": (g, w), "wgrad": (g, x)}.items():
        got = getattr(be, gemm)(a, b, precision, cfg)
        pa, pb = be.quantized_operands(gemm, a, b, precision, cfg)
        da = pa.values.double().abs() * pa.tensor_scale.double()
        db = pb.values.double().abs() * pb.tensor_scale.double()
        mag = {"fprop": lambda: da @ db.t(), "dgrad": lambda: da @ db, "wgrad": lambda: da.t() @ db}[gemm]()
        assert ((got.double() - exact[gemm].double()).abs() <= mag * 2 * 100 * 2.0 ** -24).all(), gemm
    assert calls == [(torch.float8_e4m3fn, torch.float8_e4m3fn), (torch.float8_e5m2, torch.float8_e4m3fn),
                     (torch.float8_e5m2, torch.float8_e4m3fn)]


# ----------------------------------------------------------------------------------------------------------
# stochastic rounding: unbiased and reproducible
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.rounding
@pytest.mark.parametrize("name", BACKENDS_HERE)
@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("gemm", ["dgrad", "wgrad"])
def test_stochastic_rounding_unbiased_and_reproducible(name, recipe, gemm):
    """The mean of the stochastically rounded G_Y over 400 draws converges to its exact expectation (the
    input, except where it saturates), within 6 standard errors sqrt(var / 400) per element (var: the
    exact variance from snip_ds.quant.stochastic_moments); the same seed gives the same rounding."""
    cfg = QuantConfig(fp4_recipe=recipe, stochastic_rounding=True)
    x, w, g = _data(5)
    g = g[:64]
    b = w if gemm == "dgrad" else x[:64]
    axis = -1 if gemm == "dgrad" else 0
    be = get_backend(name)
    gen = torch.Generator().manual_seed(11)
    draws = 400
    total = torch.zeros_like(g, dtype=torch.float64)
    for _ in range(draws):
        pg = be.quantized_operands(gemm, g, b, "fp4", cfg, gen)[0]
        total += pg.values.double() * pg.tensor_scale.double()
    mean, var = stochastic_moments(g, recipe, axis=axis)
    err = (total / draws - mean.double()).abs()
    assert (err <= 6 * (var.double() / draws).sqrt() + mean.double().abs() * 2.0 ** -22).all()
    assert (var > 0).float().mean() > 0.5  # most elements really were rounded at random
    run = lambda seed: be.quantized_operands(gemm, g, b, "fp4", cfg, torch.Generator().manual_seed(seed))[0]
    assert torch.equal(run(1).values, run(1).values) and not torch.equal(run(1).values, run(2).values)


# ----------------------------------------------------------------------------------------------------------
# SnipLinear through each backend against the emulated one
# ----------------------------------------------------------------------------------------------------------

def _run_layer(lin, x, g_y, backend, precision, cfg, seed=7):
    layer = SnipLinear.from_linear(lin, precision, _cfg(cfg, backend=backend))
    layer.generator = torch.Generator().manual_seed(seed)
    lin.weight.grad = lin.bias.grad = None
    xr = x.clone().requires_grad_()
    y = layer(xr)
    y.backward(g_y)
    return y.detach(), xr.grad, lin.weight.grad.clone(), lin.bias.grad.clone()


@pytest.mark.rounding
@pytest.mark.parametrize("name", BACKENDS_HERE)
@pytest.mark.parametrize("case", sorted(CASES) + ["nvfp4_sr", "mxfp4_sr_hadamard", "per_gemm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_snip_linear_matches_emulated(name, case, dtype, monkeypatch):
    """Outputs and all gradients within 40 dB SQNR of the emulated backend's (same stochastic-rounding seed).
    With stochastic rounding, the torch backend's CPU path without the fused kernels, which draws from the
    generator as the emulated backend does (the fused kernels draw Philox from a seed: tests/test_cpu_quant.py
    and test_streamed_cpu_gemms_draw_as_the_whole_operands)."""
    if case in ("nvfp4_sr", "mxfp4_sr_hadamard"):
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    if case == "nvfp4_sr":
        precision, cfg = "fp4", QuantConfig(fp4_recipe="nvfp4", stochastic_rounding=True)
    elif case == "mxfp4_sr_hadamard":
        precision, cfg = "fp4", QuantConfig(fp4_recipe="mxfp4", stochastic_rounding=True, hadamard=True)
    elif case == "per_gemm":
        precision, cfg = {"fprop": "fp4", "dgrad": "fp8", "wgrad": "bf16"}, QuantConfig()
    else:
        precision, cfg = CASES[case]
    lin = torch.nn.Linear(K, N, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(_data(6)[1])
    x, _, g = _data(6, dtype)
    x = x.reshape(2, T // 2, K)
    g = (g * 1e3).reshape(2, T // 2, N)
    ref = _run_layer(lin, x, g, "emulated", precision, cfg)
    got = _run_layer(lin, x, g, name, precision, cfg)
    for what, a, b in zip(("y", "grad_x", "grad_w", "grad_b"), got, ref):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape
        assert sqnr_db(a, b) >= 40, (what, sqnr_db(a, b))


def test_resumed_generator_rounds_as_the_uninterrupted_run():
    """The torch backend draws stochastic rounding from the layer's generator: restoring its state (what a
    checkpoint saves) repeats the rounding exactly."""
    cfg = QuantConfig(fp4_recipe="nvfp4", stochastic_rounding=True, hadamard=True, backend="torch")
    lin = torch.nn.Linear(K, N)
    layer = SnipLinear.from_linear(lin, "fp4", cfg)
    layer.generator = torch.Generator().manual_seed(3)
    x, _, g = _data(8)

    def step():
        lin.weight.grad = None
        xr = x.clone().requires_grad_()
        layer(xr).backward(g * 1e3)
        return xr.grad, lin.weight.grad.clone()

    step()
    state = layer.generator.get_state()
    first = step()
    layer.generator.set_state(state)
    again = step()
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(step()[1], first[1])  # the generator moved on


# ----------------------------------------------------------------------------------------------------------
# the setting, the registry, auto, and clear errors
# ----------------------------------------------------------------------------------------------------------

def test_setting_is_validated_and_parsed():
    assert QuantConfig().backend == "auto"
    with pytest.raises(ValueError, match="^backend: unknown backend 'cuda'; valid: auto, emulated, torch, te"):
        QuantConfig(backend="cuda")
    assert parse_snip_section({"quant": {"backend": "torch"}}).quant.backend == "torch"
    with pytest.raises(ConfigError, match="snip.quant.backend: unknown backend 'fast'"):
        parse_snip_section({"quant": {"backend": "fast"}}, "cfg.json")
    layer = SnipLinear.from_linear(torch.nn.Linear(32, 16), precision="fp8",
                                   quant_config=QuantConfig(backend="torch"))
    assert layer(torch.randn(4, 32)).shape == (4, 16)


def test_registry_keeps_the_old_imports():
    from snip_ds.backend import GemmMoments, tensor_amax  # noqa: F401
    assert isinstance(get_backend(), EmulatedBackend) and isinstance(get_backend("torch"), TorchBackend)
    with pytest.raises(ValueError, match="backend: unknown backend 'auto'"):
        get_backend("auto")  # auto is resolved per device and precision, not a backend
    assert backend_pkg.get_backend("emulated").name == "emulated"


def test_te_is_a_clear_error_naming_backend_recipe_and_device():
    with pytest.raises(BackendError, match=r"backend 'te' cannot run nvfp4 \(2-D weight blocks\) on cpu: "
                                           r"Transformer Engine runs on CUDA devices only"):
        resolve("te", "fp4", QuantConfig(backend="te"), "cpu")
    with pytest.raises(BackendError, match="backend 'te'"):
        check_backend(QuantConfig(backend="te"), "cpu")
    layer = SnipLinear.from_linear(torch.nn.Linear(32, 16), "fp8", QuantConfig(backend="te"))
    with pytest.raises(BackendError, match="backend 'te' cannot run fp8_hybrid on cpu"):
        layer(torch.randn(4, 32))


def test_torch_backend_refuses_other_devices():
    with pytest.raises(BackendError, match="backend 'torch': recipe mxfp8 cannot run on device meta"):
        resolve("torch", "fp8", QuantConfig(fp8_recipe="mxfp8"), "meta")
    assert resolve("auto", "fp8", QuantConfig(), "meta").name == "emulated"


def test_auto_is_torch_on_cuda_and_cpu_and_logs_once(monkeypatch, caplog):
    cfg = QuantConfig()
    assert resolve("auto", "fp4", cfg, "cpu").name == "torch"
    assert resolve("auto", "fp8", cfg, "cuda").name == "torch"
    assert resolve("auto", "bf16", cfg, "cpu").name == "emulated"
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)  # a rule of the device, not of the build
    assert resolve("auto", "fp8", cfg, "cpu").name == "torch"
    monkeypatch.setattr(base, "_logged", set())
    with caplog.at_level(logging.INFO, logger="snip_ds.backend"):
        for _ in range(3):
            resolve("auto", "fp4", cfg, "cpu")
            resolve("auto", "fp8", cfg, "cpu")
    lines = [r.getMessage() for r in caplog.records if r.name == "snip_ds.backend"]
    assert lines == ["backend auto: fp4 (nvfp4 (2-D weight blocks)) runs on the 'torch' backend on cpu",
                     "backend auto: fp8 (fp8_hybrid) runs on the 'torch' backend on cpu"]


def test_kernel_dispatch_without_the_kernels_module(monkeypatch):
    """Without snip_ds.backend.kernels (or when it says it is unavailable) quantization is plain torch."""
    monkeypatch.setattr(torch_native, "_kernels_checked", False)
    monkeypatch.setattr(torch_native, "_kernels_module", None)
    k = torch_native.kernels()
    assert k is None or k.available()
    fake = types.ModuleType("snip_ds.backend.kernels")
    fake.available = lambda: False
    monkeypatch.setitem(sys.modules, "snip_ds.backend.kernels", fake)
    monkeypatch.setattr(torch_native, "_kernels_checked", False)
    monkeypatch.setattr(torch_native, "_kernels_module", None)
    assert torch_native.kernels() is None


def test_kernel_dispatch_with_a_kernels_module(monkeypatch):
    """Where kernels are available, every operand goes through kernels.quantize_parts, stochastic rounding
    with a seed drawn from the layer's generator (so a restored generator state repeats it)."""
    from snip_ds.quant import quantize_parts

    calls = []

    def fake_quantize_parts(x, recipe, axis, *, tensor_amax=None, stochastic=False, seed=0, offset=0,
                            out_dtype=torch.float32, transpose=False):
        if isinstance(seed, torch.Tensor):  # a generator on the kernels' device: the seed stays a tensor there
            assert seed.dtype == torch.int64 and seed.numel() == 1 and seed.device == x.device
            seed = int(seed)
        calls.append((recipe, axis, stochastic, seed, offset, transpose))
        gen = torch.Generator().manual_seed(seed) if stochastic else None
        p = quantize_parts(x, recipe, axis=axis, stochastic=stochastic, generator=gen, tensor_amax=tensor_amax)
        values = p.values.to(out_dtype)
        return type(p)(values.t().contiguous() if transpose else values, p.tensor_scale)

    fake = types.ModuleType("snip_ds.backend.kernels")
    fake.available = lambda: True
    fake.quantize_parts = fake_quantize_parts
    monkeypatch.setitem(sys.modules, "snip_ds.backend.kernels", fake)
    monkeypatch.setattr(torch_native, "_kernels_checked", False)
    monkeypatch.setattr(torch_native, "_kernels_module", None)
    monkeypatch.setattr(torch_native, "KERNEL_DEVICES", ("cpu", "cuda"))
    cfg = QuantConfig(fp4_recipe="nvfp4", stochastic_rounding=True, backend="torch")
    x, w, g = _data(9)
    be = TorchBackend()
    gen = torch.Generator().manual_seed(4)
    state = gen.get_state()
    first = be.dgrad(g, w, "fp4", cfg, gen)
    gen.set_state(state)
    assert torch.equal(be.dgrad(g, w, "fp4", cfg, gen), first)
    be.fprop(x, w, "fp4", cfg)
    seed = base.seed_offset(torch.Generator().manual_seed(4))[0]
    # dgrad's W is quantized along axis 0 and written transposed: the contraction axis contiguous
    assert calls[:2] == [("nvfp4", -1, True, seed, 0, False), ("nvfp4_2d", 0, False, 0, 0, True)]
    assert calls[4:] == [("nvfp4", -1, False, 0, 0, False), ("nvfp4_2d", -1, False, 0, 0, False)]


def test_seed_offset_follows_the_generator():
    gen = torch.Generator().manual_seed(5)
    state = gen.get_state()
    first = base.seed_offset(gen)
    gen.set_state(state)
    assert base.seed_offset(gen) == first and base.seed_offset(gen) != first


def test_operand_slices_are_larger_on_cuda(monkeypatch):
    """Operands stream in slices of CHUNK_ELEMENTS on a CPU (or with no device given) and of the larger
    CUDA_CHUNK_ELEMENTS on a CUDA device; both in whole multiples of 32 rows that cover the range once."""
    ops = backend_pkg.operands
    monkeypatch.setattr(ops, "CHUNK_ELEMENTS", 64 * 100)
    monkeypatch.setattr(ops, "CUDA_CHUNK_ELEMENTS", 256 * 100)
    for device, rows in ((None, 64), (torch.device("cpu"), 64), (torch.device("cuda", 1), 256), ("cuda", 256)):
        slices = ops.chunks(1000, 100, device)
        assert [s.start for s in slices] == list(range(0, 1000, rows)) and slices[-1].stop == 1000


@pytest.mark.rounding
@pytest.mark.parametrize("gemm", ["dgrad", "wgrad"])
def test_stochastic_draws_match_the_emulated_gemms(gemm, monkeypatch):
    """The emulated GEMMs draw stochastic rounding slice by slice (here 4 slices of 32 tokens), the torch
    backend without the fused CPU kernels for the whole operand at once: the draws are the same, so with one
    seed both multiply the same operands. Tolerance: FP32 accumulation of at most 100 terms, 100 * 2**-24 of
    the sum of |terms|; with another seed the results differ far beyond it."""
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    monkeypatch.setattr(backend_pkg.operands, "CHUNK_ELEMENTS", 32 * 48)
    assert len(backend_pkg.operands.chunks(100, 48)) == 4
    cfg = QuantConfig(fp4_recipe="nvfp4", stochastic_rounding=True)
    gen = torch.Generator().manual_seed(0)
    g, w, x = torch.randn(100, 48, generator=gen), torch.randn(48, 80, generator=gen), torch.randn(100, 80,
                                                                                                  generator=gen)
    b = w if gemm == "dgrad" else x
    out = getattr(EmulatedBackend(), gemm)(g, b, "fp4", cfg, torch.Generator().manual_seed(3))
    prod = (lambda u, v: u @ v) if gemm == "dgrad" else (lambda u, v: u.t() @ v)
    for seed, same in ((3, True), (4, False)):
        pa, pb = TorchBackend().quantized_operands(gemm, g, b, "fp4", cfg, torch.Generator().manual_seed(seed))
        da, db = pa.values.double() * pa.tensor_scale.double(), pb.values.double() * pb.tensor_scale.double()
        close = ((out.double() - prod(da, db)).abs() <= prod(da.abs(), db.abs()) * 100 * 2.0 ** -24).all()
        assert bool(close) == same


@pytest.mark.rounding
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
def test_streamed_cpu_gemms_draw_as_the_whole_operands(gemm, fused, monkeypatch):
    """On the CPU the torch backend quantizes its streamed operands slice by slice (here 4 slices of 32 rows
    or tokens), with the fused kernels or without them; its GEMMs multiply exactly the operands that
    quantized_operands gives for the whole tensors from the same generator state (stochastic draws
    included: slices draw at their own offsets, or in turn from the generator). Tolerance as above."""
    if fused and not cpu_kernels.available():
        pytest.skip(f"the fused CPU kernels are unavailable: {cpu_kernels.unavailable_reason()}")
    if not fused:
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    monkeypatch.setattr(backend_pkg.operands, "chunks", lambda length, width: [slice(s, min(s + 32, length))
                                                                               for s in range(0, length, 32)])
    cfg = QuantConfig(fp4_recipe="nvfp4", stochastic_rounding=True, hadamard=True)
    gen = torch.Generator().manual_seed(0)
    g, w, x = torch.randn(100, 48, generator=gen), torch.randn(48, 80, generator=gen), torch.randn(100, 80,
                                                                                                  generator=gen)
    a, b = {"fprop": (x, w), "dgrad": (g, w), "wgrad": (g, x)}[gemm]
    prod = {"fprop": lambda u, v: u @ v.t(), "dgrad": lambda u, v: u @ v, "wgrad": lambda u, v: u.t() @ v}[gemm]
    be = TorchBackend()
    gen3 = {} if gemm == "fprop" else {"generator": torch.Generator().manual_seed(3)}
    out = getattr(be, gemm)(a, b, "fp4", cfg, **gen3)
    for seed, same in ((3, True), (4, False)):
        pa, pb = be.quantized_operands(gemm, a, b, "fp4", cfg, torch.Generator().manual_seed(seed))
        da, db = pa.values.double() * pa.tensor_scale.double(), pb.values.double() * pb.tensor_scale.double()
        close = ((out.double() - prod(da, db)).abs() <= prod(da.abs(), db.abs()) * 100 * 2.0 ** -24).all()
        assert bool(close) == (same or gemm == "fprop")  # fprop rounds nothing stochastically


def test_fp8_fallback_is_said_once(monkeypatch, caplog):
    """Where torch._scaled_mm is not a hardware FP8 GEMM (CPU), fp8_hybrid runs the BF16-exact path and says
    so once, not once per GEMM."""
    monkeypatch.setattr(torch_native, "_said", set())
    precision, cfg = CASES["fp8_hybrid"]
    x, w, g = _data(10)
    be = TorchBackend()
    with caplog.at_level(logging.INFO, logger="snip_ds.backend"):
        for _ in range(2):
            be.fprop(x, w, precision, cfg)
            be.dgrad(g, w, precision, cfg)
    lines = [r.getMessage() for r in caplog.records if r.name == "snip_ds.backend"]
    assert lines == ["torch backend: FP8 GEMMs on cpu run as exact BF16 GEMMs (torch._scaled_mm is not a "
                     "hardware FP8 GEMM there)"]


# ----------------------------------------------------------------------------------------------------------
# one resolution of a precision into operands; the registry's lazy entries; layer backends resolved once
# ----------------------------------------------------------------------------------------------------------

def test_gemm_recipe_resolves_every_gemm_once():
    """Each GEMM's operands in the order it multiplies them, along its contraction axis; stochastic rounding on
    G_Y alone; the Hadamard transform on FP4 wgrad alone; bad names are errors naming the field."""
    from snip_ds.backend import gemm_recipe
    cfg = QuantConfig(fp4_recipe="nvfp4", weight_2d=True, stochastic_rounding=True, hadamard=True)
    seen = {}
    for gemm in ("fprop", "dgrad", "wgrad"):
        for precision in ("fp8", "fp4"):
            r = gemm_recipe(gemm, precision, cfg)
            seen[gemm, precision] = [(o.role, o.recipe, o.axis, o.stochastic) for o in r.operands], r.hadamard
    assert seen["fprop", "fp4"] == ([("x", "nvfp4", -1, False), ("w", "nvfp4_2d", -1, False)], False)
    assert seen["dgrad", "fp4"] == ([("g", "nvfp4", -1, True), ("w", "nvfp4_2d", 0, False)], False)
    assert seen["wgrad", "fp4"] == ([("g", "nvfp4", 0, True), ("x", "nvfp4", 0, False)], True)
    assert seen["wgrad", "fp8"] == ([("g", "fp8_e5m2", 0, False), ("x", "fp8_e4m3", 0, False)], False)
    assert gemm_recipe("dgrad", "fp4", cfg) is gemm_recipe("dgrad", "fp4", QuantConfig(**cfg.__dict__))  # cached
    with pytest.raises(ValueError, match="^gemm: unknown GEMM 'xgrad'"):
        gemm_recipe("xgrad", "fp4", cfg)
    with pytest.raises(ValueError, match="^precision: no quantized recipes for 'bf16'"):
        gemm_recipe("fprop", "bf16", cfg)


def test_lazy_backend_is_built_on_first_use_and_refuses_other_devices(monkeypatch):
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    built = []

    def load(prefix):
        built.append(prefix)
        return EmulatedBackend()

    base.register(base.LazyBackend("te", ("cuda",), "it runs on CUDA devices only", load))
    with pytest.raises(BackendError, match="^backend 'te' cannot run nvfp4 .*on cpu: it runs on CUDA devices only; "
                                           "choose backend 'torch', 'emulated' or 'auto'"):
        resolve("te", "fp4", QuantConfig(), "cpu")
    assert built == []  # refused before building anything
    assert isinstance(get_backend("te"), EmulatedBackend) and built == ["backend 'te'"]


def test_layer_backends_resolved_once_until_the_registry_changes(monkeypatch):
    from snip_ds.types import GemmPrecision
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    monkeypatch.setattr(base, "_LAYER_BACKENDS", {})
    prec, cfg = GemmPrecision("fp8", "fp4", "bf16"), QuantConfig(backend="torch")
    first = base.layer_backends(prec, cfg, "cpu")
    assert [b.name for b in first] == ["torch", "torch", "torch"]
    assert base.layer_backends(prec, cfg, torch.device("cpu")) is first
    replacement = TorchBackend()
    base.register(replacement)
    assert base.layer_backends(prec, cfg, "cpu") == (replacement,) * 3
