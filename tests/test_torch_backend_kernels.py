"""The ``torch`` backend on the path it takes where the Triton kernels quantize, against the emulated reference.

On a CUDA GPU this is the backend as users run it: compiled Triton kernels writing BF16 values (operands
quantized along axis 0 written transposed), ``torch._scaled_mm`` for per-tensor FP8 where every dimension is
a multiple of 16, BF16 GEMMs with FP32 output for the other recipes. Without a GPU the same code path runs on
CPU tensors, the kernels under Triton's interpreter (``tests/triton_mode.py``), the GEMMs in FP32: everything
but the CUDA GEMMs is exercised here on every machine.

Every recipe x fprop/dgrad/wgrad x FP32/BF16/FP16 operands x shapes with K or N not a multiple of 16.
Stochastic rounding is off where results are compared with the emulated backend (its draws come from torch's
generator, the kernels' from Philox); it is checked for bias separately.

Tolerances, from the round-off each comparison must absorb (|t| the sum of |terms| of an output element):
* both results sum the same exact products of grid values in FP32, in different orders, the emulated one
  with the scales multiplied into the operands: each within ``K * 2**-24 * |t|``, so the difference within
  ``2 * K * 2**-24 * |t|`` (K <= 256 terms here);
* on CUDA, a BF16 tensor-core GEMM with FP32 accumulation is held to the same bound; the FP8 GEMM
  (``torch._scaled_mm``) accumulates in the tensor cores at reduced precision between its FP32 promotions,
  each promotion interval (128 terms at most) within ``2**-13 * |t|`` per term added: ``K * 2**-13 * |t|``
  elementwise, and the whole result within 60 dB of the reference (measured 71-80 dB on an H100);
* a BF16 or FP16 result is rounded once on each side: ``2 * 2**-8`` (BF16) or ``2 * 2**-11`` (FP16) of the
  result, plus FP16's subnormal spacing 2**-24.
"""
import math

import pytest
import torch

from snip_ds.backend import EmulatedBackend, TorchBackend, torch_native
from snip_ds.backend import kernels
from snip_ds.quant_config import QuantConfig
from snip_ds.quant import stochastic_moments
from quant_inputs import RECIPE_CASES, skip_without_cpu_scaled_mm
from triton_mode import DEVICE, SKIP_REASON, interpreter_on, through_kernels  # noqa: F401 (fixtures)

if SKIP_REASON:
    pytest.skip(SKIP_REASON, allow_module_level=True)

pytestmark = pytest.mark.rounding

CASES = {**RECIPE_CASES,
         "mxfp4_hadamard": ("fp4", QuantConfig(fp4_recipe="mxfp4", stochastic_rounding=False, hadamard=True))}
# (tokens T, in_features K, out_features N): all multiples of 16 (the FP8 GEMM's case), then K and N not
SHAPES = [(64, 96, 80), (48, 100, 72), (33, 70, 45)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OUT_ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2 * 2.0 ** -8, torch.float16: 2 * 2.0 ** -11}


def _data(shape, dtype, seed):
    t, k, n = shape
    gen = torch.Generator().manual_seed(seed)
    rows = torch.exp2(torch.randint(-3, 4, (t, 1), generator=gen).float())  # tokens of different magnitudes
    x = torch.randn(t, k, generator=gen) * rows
    w = torch.randn(n, k, generator=gen) / math.sqrt(k)
    g = torch.randn(t, n, generator=gen) * 1e-2
    return [v.to(dtype=dtype, device=DEVICE) for v in (x, w, g)]


def _capture_kept(monkeypatch, kept: list) -> None:
    """Records what each backward of a quantized layer receives as kept (X, W): through the backend's
    ``backward_gemms`` (:class:`~snip_ds.linear.QuantizedLinearFn`) and through a decided step's own backward
    (:class:`~snip_ds.linear.DecidedStepFn`, which calls no backend method)."""
    from snip_ds.backend import block_step, fp8_step
    from snip_ds.backend.base import WithAmax

    backward = TorchBackend.backward_gemms

    def recording(self, g, xk, wk, *args):
        if not isinstance(wk, WithAmax):  # (a decided step's backward, which this one calls, records its own)
            kept.append((xk, wk))
        return backward(self, g, xk, wk, *args)

    monkeypatch.setattr(TorchBackend, "backward_gemms", recording)
    for cls in (fp8_step.Fp8Step, block_step.BlockStep):
        monkeypatch.setattr(cls, "backward", lambda self, g, xk, wk, *a, _b=cls.backward:
                            kept.append((xk, wk)) or _b(self, g, xk, wk, *a))


def _per_gemm_backend(monkeypatch) -> None:
    """The torch backend without its sharing: no decided step, every operand quantized in every GEMM."""
    from snip_ds.backend import layer_step
    from snip_ds.backend.base import GemmBackend

    monkeypatch.setattr(layer_step, "decided_step", lambda *a: None)
    for name in ("fprop_and_keep", "backward_gemms", "prepare_grad"):
        monkeypatch.setattr(TorchBackend, name, getattr(GemmBackend, name))


def _abs_product(gemm, a, b):
    a, b = a.double().abs(), b.double().abs()
    return {"fprop": lambda: a @ b.t(), "dgrad": lambda: a @ b, "wgrad": lambda: a.t() @ b}[gemm]()


def _scaled_mm_runs(case, shape) -> bool:
    return (DEVICE == "cuda" and case == "fp8_hybrid" and torch.cuda.get_device_capability() >= (8, 9)
            and all(d % 16 == 0 for d in shape))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_gemms_match_the_emulated_backend(through_kernels, case, dtype, shape):
    precision, cfg = CASES[case]
    x, w, g = _data(shape, dtype, seed=sum(shape))
    emulated = EmulatedBackend()
    k_terms = max(shape)
    fp8_gemm = _scaled_mm_runs(case, shape)
    for gemm, (a, b) in {"fprop": (x, w), "dgrad": (g, w), "wgrad": (g, x)}.items():
        gens = [torch.Generator(device=DEVICE).manual_seed(5) for _ in range(2)]  # the same Hadamard signs
        kwargs = [{} if gemm == "fprop" else {"generator": gen} for gen in gens]
        got = getattr(through_kernels, gemm)(a, b, precision, cfg, out_dtype=dtype, **kwargs[0])
        ref = getattr(emulated, gemm)(a, b, precision, cfg, out_dtype=dtype, **kwargs[1])
        assert got.dtype == dtype and got.shape == ref.shape and got.device == ref.device
        terms = _abs_product(gemm, a, b)
        acc = (k_terms * 2.0 ** -13) if fp8_gemm else 2 * k_terms * 2.0 ** -24
        bound = terms * acc + ref.double().abs() * OUT_ROUNDING[dtype] + (2.0 ** -24 if dtype == torch.float16 else 0)
        diff = (got.double() - ref.double()).abs()
        assert torch.isfinite(got).all(), (gemm, case)
        worst = (diff - bound).max().item()
        assert worst <= 0, f"{gemm} {case}: exceeds its bound by {worst:.3g} (max diff {diff.max().item():.3g})"
        if fp8_gemm:
            noise = (got.double() - ref.double()).pow(2).sum()
            assert noise == 0 or 10 * math.log10(ref.double().pow(2).sum() / noise) > 60, (gemm, case)


@pytest.mark.parametrize("case", ["fp8_hybrid", "nvfp4_2d"])
def test_bias_and_layer_dtypes(through_kernels, case):
    """fprop with a bias in the operands' dtype, as nn.Linear holds it: the emulated backend's result."""
    precision, cfg = CASES[case]
    for dtype in DTYPES:
        x, w, _ = _data((64, 96, 80), dtype, seed=1)
        bias = torch.linspace(-1, 1, 80, device=DEVICE).to(dtype)
        got = through_kernels.fprop(x, w, precision, cfg, bias=bias, out_dtype=dtype)
        ref = EmulatedBackend().fprop(x, w, precision, cfg, bias=bias, out_dtype=dtype)
        bound = (_abs_product("fprop", x, w) * 96 * 2.0 ** -13 + ref.double().abs() * OUT_ROUNDING[dtype]
                 + 2.0 ** -24 * 4)
        assert ((got.double() - ref.double()).abs() <= bound).all(), (case, dtype)


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_stochastic_rounding_unbiased_from_every_dtype(through_kernels, recipe, dtype):
    """The dgrad operand G_Y rounded stochastically (seeds from a generator on DEVICE, read by the kernel):
    the mean over 200 draws is its exact expectation within 6 standard errors; the draws differ."""
    cfg = QuantConfig(fp4_recipe=recipe, stochastic_rounding=True)
    _, w, g = _data((32, 64, 48), dtype, seed=2)
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    total = torch.zeros(g.shape, dtype=torch.float64)
    first = None
    draws = 200
    for _ in range(draws):
        pg, _ = through_kernels.quantized_operands("dgrad", g, w, "fp4", cfg, gen)
        value = pg.values.double().cpu() * pg.tensor_scale.double().cpu()
        first = value if first is None else first
        total += value
    assert not torch.equal(first, value)
    mean, var = stochastic_moments(g.float().cpu(), recipe, axis=-1)
    err = (total / draws - mean.double()).abs()
    assert (err <= 6 * (var.double() / draws).sqrt() + mean.double().abs() * 2.0 ** -22).all()


def test_gemm_operands_are_written_for_the_gemm(through_kernels):
    """The GEMMs' operand values are BF16 where the kernels quantize, and an operand quantized along axis 0
    comes back column-major (contraction axis contiguous): what the FP8 GEMM reads without a copy."""
    x, w, g = _data((64, 96, 80), torch.float32, seed=3)
    precision, cfg = CASES["fp8_hybrid"]
    pg, pw = through_kernels.quantized_operands("dgrad", g, w, precision, cfg, values_dtype=torch.bfloat16)
    assert pg.values.dtype == pw.values.dtype == torch.bfloat16
    assert pg.values.is_contiguous() and pw.values.t().is_contiguous()
    pg, px = through_kernels.quantized_operands("wgrad", g, x, precision, cfg, values_dtype=torch.bfloat16)
    assert pg.values.t().is_contiguous() and px.values.t().is_contiguous()
    ref = EmulatedBackend().quantized_operands("wgrad", g, x, precision, cfg)
    assert torch.equal(px.values.float().cpu(), ref[1].values.cpu())


@pytest.mark.parametrize("scaled_mm", [False, True], ids=["bf16_gemms", "scaled_mm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(64, 96, 80), (48, 100, 72)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("precision", ["fp8", {"fprop": "fp8", "dgrad": "fp8", "wgrad": "fp4"}], ids=["fp8", "mixed"])
def test_fp8_operands_quantized_once_give_the_same_layer(through_kernels, monkeypatch, precision, shape, dtype,
                                                        scaled_mm):
    """Per-tensor FP8 fprop and wgrad quantize X to the same codes, dgrad and wgrad G_Y, fprop and dgrad W
    with the same scale: the torch backend makes X's and G_Y's codes once, in both layouts (X's E4M3 codes
    kept from the forward, one byte per element, instead of X), and quantizes W for dgrad from the forward's
    amax (snip_ds.backend.fp8_step). A SnipLinear's output and gradients are bit for bit those of the layer
    that quantizes every operand in every GEMM (the backend without its sharing methods), through the BF16
    GEMMs and through ``torch._scaled_mm`` (allowed on the CPU here: a slow but exact FP8 GEMM), and with a
    per-GEMM plan where wgrad is FP4 nothing is shared."""
    from snip_ds.backend.base import WithAmax
    from snip_ds.linear import SnipLinear
    from snip_ds.quant import QuantParts

    if scaled_mm and DEVICE == "cpu":
        skip_without_cpu_scaled_mm()
        monkeypatch.setattr(torch_native, "SCALED_MM_DEVICES", ("cpu", "cuda"))
    x, w, g = _data(shape, dtype, seed=7)
    layer = SnipLinear(shape[1], shape[2], bias=True, device=DEVICE, dtype=dtype, precision=precision,
                       quant_config=QuantConfig(backend="torch", stochastic_rounding=False))
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(torch.linspace(-1, 1, shape[2], device=DEVICE))

    def run():
        saved = []
        xi = x.clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
            y = layer(xi)
        y.backward(g)
        grads = (y.detach(), xi.grad, layer.weight.grad.clone(), layer.bias.grad.clone())
        layer.weight.grad = layer.bias.grad = None
        return grads, saved

    kept = []
    _capture_kept(monkeypatch, kept)
    shared, saved = run()
    (x_keep, w_keep), = kept
    if precision == "fp8":
        assert isinstance(x_keep, QuantParts) and x_keep.values.dtype == torch.float8_e4m3fn
        assert x_keep.values.t().is_contiguous()  # stored transposed: wgrad's column-major operand, no copy
        assert isinstance(w_keep, WithAmax)
    else:
        assert x_keep is not None and not isinstance(x_keep, QuantParts) and not isinstance(w_keep, WithAmax)
    _per_gemm_backend(monkeypatch)
    each, saved_each = run()
    for a, b in zip(shared, each):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert saved_each[0] == dtype  # X itself, as nn.Linear keeps it
    assert saved[0] == (torch.float8_e4m3fn if precision == "fp8" else dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(64, 96, 80), (48, 100, 72)], ids=lambda s: "x".join(map(str, s)))
def test_fp8_gemms_read_the_codes_the_kernels_write(through_kernels, monkeypatch, shape, dtype):
    """Where ``torch._scaled_mm`` multiplies a per-tensor FP8 GEMM, the kernels write the operands' E4M3 /
    E5M2 codes themselves (no cast between them and the GEMM) and every GEMM is still the emulated
    reference's within the FP32 bound of the first test (here the CPU's ``_scaled_mm``, which sums in FP32,
    is allowed: on a CPU it is exact but slow, so the backend does not use it by itself)."""
    if DEVICE == "cpu":
        skip_without_cpu_scaled_mm()
        monkeypatch.setattr(torch_native, "SCALED_MM_DEVICES", ("cpu", "cuda"))
    seen = []
    mm = TorchBackend._mm
    monkeypatch.setattr(TorchBackend, "_mm", lambda self, gemm, a, b, *rest: seen.append((gemm, a.dtype, b.dtype))
                        or mm(self, gemm, a, b, *rest))
    precision, cfg = CASES["fp8_hybrid"]
    x, w, g = _data(shape, dtype, seed=9)
    for gemm, (a, b) in {"fprop": (x, w), "dgrad": (g, w), "wgrad": (g, x)}.items():
        got = getattr(through_kernels, gemm)(a, b, precision, cfg, out_dtype=dtype)
        ref = getattr(EmulatedBackend(), gemm)(a, b, precision, cfg, out_dtype=dtype)
        acc = max(shape) * 2.0 ** -13 if _scaled_mm_runs("fp8_hybrid", shape) else 2 * max(shape) * 2.0 ** -24
        bound = (_abs_product(gemm, a, b) * acc + ref.double().abs() * OUT_ROUNDING[dtype]
                 + (2.0 ** -24 if dtype == torch.float16 else 0))
        assert ((got.double() - ref.double()).abs() <= bound).all(), (gemm, dtype)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    if DEVICE == "cpu" or _scaled_mm_runs("fp8_hybrid", shape):
        assert seen == [("fprop", e4m3, e4m3), ("dgrad", e5m2, e4m3), ("wgrad", e5m2, e4m3)]
    else:  # no FP8 GEMM for this shape on this GPU: BF16 values for the BF16 GEMM
        assert {dt for _, *dts in seen for dt in dts} == {torch.bfloat16}


BLOCK_CASES = {"mxfp8": ("fp8", {"fp8_recipe": "mxfp8"}), "nvfp4_2d": ("fp4", {}),
               "nvfp4": ("fp4", {"weight_2d": False}), "mxfp4": ("fp4", {"fp4_recipe": "mxfp4"})}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(64, 96, 80), (33, 70, 45)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", BLOCK_CASES)
def test_block_operands_quantized_once_give_the_same_layer(through_kernels, monkeypatch, case, shape, dtype):
    """A layer whose three GEMMs are one block recipe (snip_ds.backend.block_step) takes each operand's amax
    once, quantizes X and G_Y in both of their layouts in one launch each (G_Y's rounded stochastically from
    the seeds the per-GEMM path draws, in its order), W for dgrad from the forward's amax, and multiplies the
    GEMMs by the products of tensor scales the kernels wrote: its output and gradients are bit for bit those of
    the layer that quantizes every operand in every GEMM (the backend without its sharing methods), also where
    only one of G_X and G_W is wanted, and under a shared amax (tensor parallelism)."""
    from snip_ds.backend.base import WithAmax
    from snip_ds.backend.operands import shared_amax
    from snip_ds.linear import SnipLinear
    from snip_ds.quant import QuantParts

    precision, fields = BLOCK_CASES[case]
    x, w, g = _data(shape, dtype, seed=13)
    layer = SnipLinear(shape[1], shape[2], bias=True, device=DEVICE, dtype=dtype, precision=precision,
                       quant_config=QuantConfig(backend="torch", **fields))
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(torch.linspace(-1, 1, shape[2], device=DEVICE))

    def run(need_x=True, need_w=True, reduce=None):
        layer.generator = torch.Generator(device=DEVICE).manual_seed(5)
        layer.weight.requires_grad_(need_w)
        xi = x.clone().requires_grad_(need_x)
        with shared_amax(reduce):
            y = layer(xi)
            y.backward(g)
        grads = (y.detach(), xi.grad, None if layer.weight.grad is None else layer.weight.grad.clone(),
                 layer.bias.grad.clone())
        layer.weight.grad = layer.bias.grad = None
        return grads

    kept = []
    _capture_kept(monkeypatch, kept)
    doubled = lambda amax: amax * 2  # noqa: E731 (a reduction whose amax is not the shard's own)
    variants = [dict(), dict(need_x=False), dict(need_w=False), dict(reduce=doubled)]
    shared = [run(**v) for v in variants]
    assert len(kept) == len(variants)
    for x_keep, w_keep in kept:
        assert isinstance(x_keep, QuantParts) and x_keep.values.dtype == torch.bfloat16
        assert x_keep.values.t().is_contiguous() and isinstance(w_keep, WithAmax)
    _per_gemm_backend(monkeypatch)
    for variant, got in zip(variants, shared):
        for a, b in zip(got, run(**variant)):
            assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), (variant, case)
