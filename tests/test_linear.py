"""SnipLinear against nn.Linear (exact at bf16) and against the slow reference quantizers (quantized GEMMs)."""
import pytest
import torch
from torch import nn

from reference_quant import assert_bitwise_equal, ref_mx_rows, ref_nvfp4_2d, ref_nvfp4_rows, ref_per_tensor
from snip_ds import backend, quant
from snip_ds.quant_config import QuantConfig
from snip_ds.linear import SnipLinear

T, K, N = 48, 32, 64  # tokens, in, out: multiples of 16 but not of 32 along T, so MX blocks are partial


def sqnr_db(ref: torch.Tensor, actual: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - actual).pow(2).sum()))


def _run(layer: nn.Module, x: torch.Tensor, g: torch.Tensor):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, layer.weight.grad, (layer.bias.grad if layer.bias is not None else None)


@pytest.fixture
def data():
    gen = torch.Generator().manual_seed(0)
    lin = nn.Linear(K, N)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=gen) * 0.1)
        lin.bias.copy_(torch.randn(N, generator=gen))
    x = torch.randn(T, K, generator=gen)
    g = torch.randn(T, N, generator=gen)
    return lin, x, g


def test_from_linear_reuses_parameters(data):
    lin, _, _ = data
    snip = SnipLinear.from_linear(lin, "fp4")
    assert snip.weight is lin.weight and snip.bias is lin.bias
    assert isinstance(snip, nn.Linear) and snip.precision == "fp4"
    assert (snip.in_features, snip.out_features) == (K, N)


@pytest.mark.parametrize("shape", [(T, K), (3, 16, K)])
def test_bf16_is_bit_identical_to_nn_linear(data, shape):
    lin, _, _ = data
    x = torch.randn(*shape)
    g = torch.randn(*shape[:-1], N)
    ref = _run(lin, x, g)
    lin.weight.grad = lin.bias.grad = None
    got = _run(SnipLinear.from_linear(lin, "bf16"), x, g)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shape", [(T, K), (3, 16, K)])
def test_input_grad_only_gives_nn_linear_output_and_input_grad_and_no_weight_grad(data, shape):
    """The statistics passes' mode: same Y and G_X as nn.Linear (the same kernels), no weight/bias gradient."""
    lin, _, _ = data
    x = torch.randn(*shape)
    g = torch.randn(*shape[:-1], N)
    y_ref, gx_ref, _, _ = _run(lin, x, g)
    lin.weight.grad = lin.bias.grad = None
    snip = SnipLinear.from_linear(lin, "bf16")
    snip.input_grad_only = True
    y, gx, gw, gb = _run(snip, x, g)
    assert torch.equal(y, y_ref)
    assert torch.allclose(gx, gx_ref, rtol=1e-6, atol=1e-6)
    assert gw is None and gb is None


@pytest.mark.rounding
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_input_grad_observer_sees_the_output_grad_and_the_layers_own_input_grad(data, dtype):
    """The observer gets G_Y and this layer's G_Y·W in FP32, and what propagates is that product in the input's
    dtype: for FP32 the same G_X as without an observer; for BF16 its one rounding of the FP32 product."""
    lin, x, g = data
    snip = SnipLinear.from_linear(lin, "bf16").to(dtype)
    snip.input_grad_only = True
    x, g = x.to(dtype), g.to(dtype)
    _, gx_plain, _, _ = _run(snip, x, g)
    seen = []
    snip.input_grad_observer = lambda gy, gx: seen.append((gy, gx))
    _, gx, gw, _ = _run(snip, x, g)
    (gy_seen, gx_seen), = seen
    assert gw is None and torch.equal(gy_seen, g)
    assert gx_seen.dtype == torch.float32 and torch.equal(gx, gx_seen.to(dtype))
    ref = g.double() @ snip.weight.detach().double()  # the FP32 product of the same operands: K-term sums
    bound = N * 2.0 ** -24 * (g.double().abs() @ snip.weight.detach().double().abs())  # |error| <= n·u·Σ|g||w|
    assert ((gx_seen.double() - ref).abs() <= bound).all()
    if dtype == torch.float32:
        assert torch.equal(gx, gx_plain)
    else:  # BF16 (8 significant bits): one rounding, at most 2^-8 relative, of the FP32 product
        assert ((gx.double() - ref).abs() <= 2.0 ** -8 * (ref.abs() + bound) + bound).all()


def test_input_grad_only_applies_to_bf16_only(data):
    """A quantized layer keeps its full backward whatever the flag says (training never sets it)."""
    lin, x, g = data
    snip = SnipLinear.from_linear(lin, "fp8")
    snip.input_grad_only = True
    _, _, gw, gb = _run(snip, x, g)
    assert gw is not None and gb is not None


def _reference_gemms(x, w, b, g, q_x_k, q_w_k, q_g_n, q_w_n, q_g_t, q_x_t):
    """Y, G_X, G_W, G_b from reference quantizers (each quantizes along the rows it is given)."""
    y = q_x_k(x) @ q_w_k(w).t() + b
    g_x = q_g_n(g) @ q_w_n(w.t().contiguous()).t()
    g_w = q_g_t(g.t().contiguous()) @ q_x_t(x.t().contiguous()).t()
    return y, g_x, g_w, g.sum(0)


RECIPE_REFS = {
    # name: (QuantConfig, precision, row quantizers for X, W, G)
    "fp8_hybrid": (QuantConfig(fp8_recipe="fp8_hybrid"), "fp8",
                   lambda t: ref_per_tensor(t, "e4m3"), lambda t: ref_per_tensor(t, "e4m3"),
                   lambda t: ref_per_tensor(t, "e5m2"), False),
    "mxfp8": (QuantConfig(fp8_recipe="mxfp8"), "fp8",
              lambda t: ref_mx_rows(t, "e4m3", 8), lambda t: ref_mx_rows(t, "e4m3", 8),
              lambda t: ref_mx_rows(t, "e4m3", 8), False),
    "nvfp4_1d": (QuantConfig(fp4_recipe="nvfp4", weight_2d=False, stochastic_rounding=False), "fp4",
                 ref_nvfp4_rows, ref_nvfp4_rows, ref_nvfp4_rows, False),
    "nvfp4_2d": (QuantConfig(fp4_recipe="nvfp4", weight_2d=True, stochastic_rounding=False), "fp4",
                 ref_nvfp4_rows, ref_nvfp4_2d, ref_nvfp4_rows, True),
    "mxfp4": (QuantConfig(fp4_recipe="mxfp4", stochastic_rounding=False), "fp4",
              lambda t: ref_mx_rows(t, "e2m1", 2), lambda t: ref_mx_rows(t, "e2m1", 2),
              lambda t: ref_mx_rows(t, "e2m1", 2), False),
}


@pytest.mark.rounding
@pytest.mark.parametrize("chunk_elements", [None, 16 * 64])
@pytest.mark.parametrize("recipe", sorted(RECIPE_REFS))
def test_quantized_gemms_match_reference(data, recipe, chunk_elements, monkeypatch):
    """Each GEMM quantizes the right operands along the right axis (docs/method.md's recipe table), also when
    the backend streams operands in 32-row slices (chunk_elements small enough to split T=48 in two)."""
    if chunk_elements:
        monkeypatch.setattr(backend.operands, "CHUNK_ELEMENTS", chunk_elements)
        assert len(backend.chunks(T, N)) == 2
    lin, x, g = data
    cfg, precision, q_x, q_w, q_g, w_2d = RECIPE_REFS[recipe]
    w = lin.weight.detach()
    # 2-D weight blocks serve both fprop and dgrad: the same quantized W, transposed.
    q_w_n = (lambda wt: ref_nvfp4_2d(wt.t().contiguous()).t()) if w_2d else q_w
    expected = _reference_gemms(x, w, lin.bias.detach(), g, q_x, q_w, q_g, q_w_n, q_g, q_x)
    got = _run(SnipLinear.from_linear(lin, precision, cfg), x, g)
    # the same quantized operands (inputs are data, so none can round differently) in FP32 GEMMs of depth
    # ≤ 64: if the blocking differed, round-off ~sqrt(depth)·2^-24·|value| ≤ 8·6e-8·27 = 1.3e-5, under
    # atol + rtol·|value| = 1e-5 + 2.7e-4; measured 0 (the same kernels), natively and under AVX2
    for name, a, b in zip(("y", "grad_x", "grad_w", "grad_b"), expected, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"{recipe}: {name}")


# fp8: E4M3 (~31 dB) for X and W, E5M2 (~25 dB) for G_Y; fp4: NVFP4 (~20 dB RNE, ~17 dB SR) per operand.
@pytest.mark.rounding
@pytest.mark.parametrize("precision,floor_db", [("fp8", 22.0), ("fp4", 13.0)])
def test_sqnr_floors(data, precision, floor_db):
    lin, x, g = data
    ref = _run(lin, x, g)
    lin.weight.grad = lin.bias.grad = None
    snip = SnipLinear.from_linear(lin, precision)
    snip.generator = torch.Generator().manual_seed(1)
    got = _run(snip, x, g)
    for name, a, b in zip(("y", "grad_x", "grad_w"), ref[:3], got[:3]):
        assert sqnr_db(a, b) > floor_db, name


@pytest.mark.rounding
def test_per_gemm_precision(data):
    lin, x, g = data
    ref_bf16 = _run(lin, x, g)
    lin.weight.grad = lin.bias.grad = None
    cfg = QuantConfig(stochastic_rounding=False)
    snip = SnipLinear.from_linear(lin, {"fprop": "fp4", "dgrad": "bf16", "wgrad": "bf16"}, cfg)
    assert snip.precision == {"fprop": "fp4", "dgrad": "bf16", "wgrad": "bf16"}
    y, gx, gw, _ = _run(snip, x, g)
    fp4_y = _run(SnipLinear.from_linear(nn.Linear(K, N), "fp4", cfg), x, g)  # shape only
    assert fp4_y[0].shape == y.shape
    # same operands, another GEMM blocking: see test_quantized_gemms_match_reference
    torch.testing.assert_close(y, ref_nvfp4_rows(x) @ ref_nvfp4_2d(lin.weight.detach()).t() + lin.bias.detach(),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, ref_bf16[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, ref_bf16[2], rtol=1e-5, atol=1e-6)
    snip.precision = "fp8"
    assert snip.precision == "fp8"


def test_saves_only_what_nn_linear_saves(data):
    lin, x, g = data

    def saved(layer):
        packed = []

        def pack(t):
            packed.append((t.data_ptr(), t.numel(), t.dtype))
            return t
        xx = x.clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(xx)
        return sorted(packed), xx

    reference, x_ref = saved(lin)
    # nn.Linear saves the input and (a view of) the weight: the same storages, no copies.
    assert sorted(p[0] for p in reference) == sorted([x_ref.data_ptr(), lin.weight.data_ptr()])
    for precision in ("fp8", "fp4"):
        got, x_got = saved(SnipLinear.from_linear(lin, precision))
        assert sorted(p[0] for p in got) == sorted([x_got.data_ptr(), lin.weight.data_ptr()])
        assert sorted(p[1:] for p in got) == sorted(p[1:] for p in reference)


def test_stochastic_rounding_of_fp4_gradients(data):
    lin, x, g = data
    snip = SnipLinear.from_linear(lin, "fp4")
    assert snip.quant_config.stochastic_rounding  # on by default

    def grads(seed):
        snip.generator = torch.Generator().manual_seed(seed)
        lin.weight.grad = lin.bias.grad = None
        return _run(snip, x, g)[1:3]

    a, b, c = grads(0), grads(0), grads(1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # reproducible from the generator
    assert not torch.equal(a[0], c[0])  # and actually random
    # Unbiased: averaging many stochastic dgrads approaches the exact-G_Y product better than one draw.
    exact = g @ ref_nvfp4_2d(lin.weight.detach())
    draws = torch.stack([grads(s)[0] for s in range(32)])
    assert sqnr_db(exact, draws.mean(0)) > sqnr_db(exact, draws[0]) + 6.0


@pytest.mark.rounding
@pytest.mark.slow
def test_gemm_moments_match_many_stochastic_gradients(data):
    """The backend's expectation and variance of the wgrad and dgrad GEMMs over G_Y's stochastic rounding
    (what the statistics price) against the mean and variance of many stochastic GEMMs."""
    lin, x, g = data
    cfg = QuantConfig()
    be = backend.get_backend()
    w = lin.weight.detach()
    draws = 1000
    gws = torch.stack([be.wgrad(g, x, "fp4", cfg, torch.Generator().manual_seed(s)) for s in range(draws)])
    gxs = torch.stack([be.dgrad(g, w, "fp4", cfg, torch.Generator().manual_seed(s)) for s in range(draws)])
    wm = be.wgrad_moments(g, x, "fp4", cfg, price_tokens=torch.arange(T))
    dm = be.dgrad_moments(g, w, "fp4", cfg)
    # sampling tolerances (FP32 round-off, ~1e-7 relative, is far below them): a mean of 1000 draws is within
    # a few standard errors; a variance estimated from 1000 draws has relative SE sqrt(2/999) = 4.5% per
    # element, so the sum over many elements within 7% and one channel's price within 15% (~3 SE)
    for got, mom in ((gws.double(), wm), (gxs.double(), dm)):
        se = (mom.var.double() / draws).sqrt().clamp_min(1e-12)
        z = (got.mean(0) - mom.mean.double()) / se
        assert z.abs().mean() < 1.0 and z.abs().max() < 6.0  # each mean within its standard error
        ratio = got.var(0).sum() / mom.var.double().sum()
        assert 0.93 < ratio < 1.07
    # the noise's loss-unit price: E Σ_t (x_t·N_j)² per output channel j, N = G_W - E[G_W]
    noise = gws.double() - wm.mean.double()
    priced = ((x.double() @ noise.transpose(1, 2)) ** 2).sum(1).mean(0)  # [N]
    torch.testing.assert_close(priced, wm.projected.double(), rtol=0.15, atol=0)
    assert priced.sum().item() == pytest.approx(wm.projected.double().sum().item(), rel=0.05)
    # from a sample of the tokens: unbiased (the mean over many samples is the all-token price)
    gen = torch.Generator().manual_seed(4)
    sampled = torch.stack([be.wgrad_moments(g, x, "fp4", cfg, price_tokens=torch.randperm(T, generator=gen)[:12])
                           .projected for _ in range(400)]).double()
    torch.testing.assert_close(sampled.mean(0).sum(), wm.projected.double().sum(), rtol=0.03, atol=0)
    assert torch.equal(be.wgrad_moments(g, x, "fp4", cfg, price_tokens=torch.arange(5)).mean, wm.mean)
    with pytest.raises(ValueError, match="does not round G_Y stochastically"):
        be.wgrad_moments(g, x, "fp8", cfg)


@pytest.mark.rounding
def test_noise_price_through_the_gram_matrix_is_the_direct_one(data):
    """``gram = XᵀX`` prices each sampled token as Q(X)_s XᵀX Q(X)_sᵀ instead of ‖X Q(X)_sᵀ‖²: the same number
    in exact arithmetic, so the two prices differ by no more than both FP32 computations can err (bounds from
    the operands' magnitudes, in FP64); the mean and variance are untouched. Ignored with the Hadamard
    transform, whose operands are rotated."""
    lin, x, g = data
    be = backend.get_backend()
    cfg = QuantConfig()
    sample = torch.arange(0, T, 3)
    direct = be.wgrad_moments(g, x, "fp4", cfg, price_tokens=sample)
    via = be.wgrad_moments(g, x, "fp4", cfg, price_tokens=sample, gram=x.t() @ x)
    assert torch.equal(via.mean, direct.mean) and torch.equal(via.var, direct.var)
    u = 2.0 ** -24
    x64 = x.double()
    q = be.quantize(x, "fp4", "x", 0, cfg).double()[sample]  # [|S|, K]
    d, a = x64 @ q.t(), x64.abs() @ q.abs().t()  # [T, |S|]: x_t·q_s and Σ|x_t||q_s|
    h = (d * d).sum(0)
    err_direct = (2 * d.abs() * K * u * a + (K * u * a) ** 2).sum(0) + T * u * h
    err_gram = (T * u * ((q.abs() @ (x64.abs().t() @ x64.abs())) * q.abs()).sum(1)
                + 2 * K * u * ((q.abs() @ (x64.t() @ x64).abs()) * q.abs()).sum(1))
    # each channel's price is a sum of non-negative terms Var·h_s: its relative error is the worst h_s's
    rel = float(((err_direct + err_gram) / h).max()) + 2 * len(sample) * u
    assert rel < 1e-3  # the bound is tight enough to mean something
    diff = (via.projected.double() - direct.projected.double()).abs()
    assert (diff <= rel * direct.projected.double()).all()
    had = QuantConfig(hadamard=True)
    assert torch.equal(be.wgrad_moments(g, x, "fp4", had, torch.Generator().manual_seed(2), sample,
                                        gram=x.t() @ x).projected,
                       be.wgrad_moments(g, x, "fp4", had, torch.Generator().manual_seed(2), sample).projected)


def test_gemm_moments_with_hadamard_are_those_of_the_transformed_operands(data):
    """With the Hadamard transform the moments are those of the transformed operands, whose signs come from
    the generator exactly as :meth:`wgrad` draws them."""
    lin, x, g = data
    be = backend.get_backend()
    had = be.wgrad_moments(g, x, "fp4", QuantConfig(hadamard=True), torch.Generator().manual_seed(7))
    signs = quant.random_signs(T, generator=torch.Generator().manual_seed(7))
    gt, xt = (quant.hadamard_transform(t, axis=0, signs=signs) for t in (g, x))
    plain = be.wgrad_moments(gt, xt, "fp4", QuantConfig())
    assert torch.equal(had.mean, plain.mean) and torch.equal(had.var, plain.var)
    assert not torch.equal(had.var, be.wgrad_moments(g, x, "fp4", QuantConfig()).var)


@pytest.mark.rounding
def test_hadamard_on_wgrad_keeps_the_product(data):
    lin, x, g = data
    ref_gw = g.t() @ x
    plain = SnipLinear.from_linear(lin, "fp4", QuantConfig(stochastic_rounding=False))
    rht = SnipLinear.from_linear(lin, "fp4", QuantConfig(stochastic_rounding=False, hadamard=True))
    rht.generator = torch.Generator().manual_seed(3)
    gw_plain = _run(plain, x, g)[2].clone()
    lin.weight.grad = lin.bias.grad = None
    gw_rht = _run(rht, x, g)[2]
    assert not torch.equal(gw_plain, gw_rht)
    assert sqnr_db(ref_gw, gw_rht) > 10.0


@pytest.mark.parametrize("bad", ["fp16", "int4", {"fprop": "fp8"}, {"fprop": "fp8", "dgrad": "fp8", "wgrad": "x"}])
def test_bad_precision_is_a_clear_error(data, bad):
    lin, _, _ = data
    with pytest.raises(ValueError, match="bf16, fp8, fp4|fprop, dgrad, wgrad"):
        SnipLinear.from_linear(lin, bad)


def test_bad_recipe_is_a_clear_error():
    with pytest.raises(ValueError, match="fp4_recipe.*nvfp4, mxfp4"):
        QuantConfig(fp4_recipe="fp3")


def test_bf16_model_dtype_round_trips(data):
    lin, x, g = data
    snip = SnipLinear.from_linear(nn.Linear(K, N).to(torch.bfloat16), "fp4")
    xb = x.to(torch.bfloat16).requires_grad_(True)
    y = snip(xb)
    y.backward(g.to(torch.bfloat16))
    assert y.dtype == xb.grad.dtype == snip.weight.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("chunk_elements", [None, 16 * 64])
@pytest.mark.parametrize("fp8_recipe,fp4_recipe,hadamard", [("fp8_hybrid", "nvfp4", False),
                                                            ("mxfp8", "mxfp4", True)])
def test_layer_equals_its_three_separate_gemms(data, chunk_elements, fp8_recipe, fp4_recipe, hadamard,
                                               monkeypatch):
    """A layer gives the bits of its three separate backend calls, generator draws included (dgrad's first),
    at every precision mix."""
    lin, x, g = data
    if chunk_elements is not None:
        monkeypatch.setattr(backend.operands, "CHUNK_ELEMENTS", chunk_elements)
    be = backend.get_backend("emulated")
    cfg = QuantConfig(backend="emulated", fp8_recipe=fp8_recipe, fp4_recipe=fp4_recipe, hadamard=hadamard)
    w, b = lin.weight.detach(), lin.bias.detach()
    for precision in ("fp8", "fp4", {"fprop": "fp8", "dgrad": "fp8", "wgrad": "bf16"},
                      {"fprop": "bf16", "dgrad": "fp8", "wgrad": "fp8"}, {"fprop": "fp8", "dgrad": "bf16",
                                                                          "wgrad": "fp8"}):
        snip = SnipLinear.from_linear(lin, precision, cfg)
        snip.generator = torch.Generator().manual_seed(3)
        lin.weight.grad = lin.bias.grad = None
        y, gx, gw, _ = _run(snip, x, g)
        p, gen = snip.gemm_precision, torch.Generator().manual_seed(3)
        assert_bitwise_equal(y, be.fprop(x, w, p.fprop, cfg, bias=b))
        assert_bitwise_equal(gx, be.dgrad(g, w, p.dgrad, cfg, gen))
        assert_bitwise_equal(gw, be.wgrad(g, x, p.wgrad, cfg, gen))


@pytest.mark.parametrize("precision", ["fp8", "fp4", {"fprop": "fp4", "dgrad": "fp8", "wgrad": "bf16"}])
def test_the_output_may_be_modified_in_place_as_nn_linears_can(precision):
    """Models add into a linear's output in place (Llama 4's MoE block: ``out.add_(...)``); autograd forbids
    that on a view made inside a custom Function, so the quantized output is a tensor of its own. The gradient
    is the one the same sum out of place gives."""
    torch.manual_seed(0)
    layer = SnipLinear(32, 16, precision=precision)
    x = torch.randn(2, 8, 32)
    grads = []
    for in_place in (True, False):
        layer.generator = torch.Generator().manual_seed(1)  # the same stochastic rounding both times
        xx = x.clone().requires_grad_(True)
        y = layer(xx)
        y = y.add_(1.0) if in_place else y + 1.0
        y.square().sum().backward()
        grads.append(xx.grad)
    assert torch.equal(grads[0], grads[1])
