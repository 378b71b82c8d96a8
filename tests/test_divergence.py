"""snip_ds.divergence and tests/reference_divergence.py against closed-form truths (quadratic losses, linear
maps, a softmax head, Adam)."""
import math

import pytest
import torch

from snip_ds import divergence as dv
from tests import reference_divergence as refdiv


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _symmetrised(loss_fn, y, e):
    return (loss_fn(y + e) + loss_fn(y - e) - 2 * loss_fn(y)) / 2


def test_channel_reductions_shapes_and_values():
    t = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)  # [B, L, n] -> rows 6
    # element (b, l, j) is 12b + 4l + j, so channel j holds 4r + j for rows r = 0..5: the sum of squares is
    # 16·Σr² + 8j·Σr + 6j² = 16·55 + 120j + 6j² (closed form, exact in FP32: every term is an integer < 2^24)
    want = torch.tensor([880.0 + 120 * j + 6 * j * j for j in range(4)])
    assert want.tolist() == [880.0, 1006.0, 1144.0, 1294.0]
    assert torch.equal(dv.channel_sq_sum(t), want)
    assert torch.allclose(refdiv.channel_sq_mean(t), want / 6)


def test_fld_exact_on_diagonal_quadratic():
    """ℒ(Y) = (1/N)Σ_t ½ (Y_t - c_t)ᵀ diag(a) (Y_t - c_t): FLD = (1/2N) Σ_t E_tᵀ diag(a) E_t exactly."""
    T, n = 50, 8
    g = _gen(1)
    a = torch.rand(n, generator=g, dtype=torch.float64) + 0.1
    c = torch.randn(T, n, generator=g, dtype=torch.float64)
    y = torch.randn(T, n, generator=g, dtype=torch.float64)
    e = 0.3 * torch.randn(T, n, generator=g, dtype=torch.float64)

    def loss(yy):
        return 0.5 * (((yy - c) ** 2) * a).sum() / T

    truth = _symmetrised(loss, y, e)
    # Fisher probes of a Gaussian per-token loss: g_t = a^½ ξ_t with Rademacher ξ -> mean_t g² = a exactly
    xi = torch.randint(0, 2, (T, n), generator=g).double() * 2 - 1
    probe = a.sqrt() * xi
    est = refdiv.fld_from_tensors(e, probe, T)
    assert est.item() == pytest.approx(truth.item(), rel=1e-5)


def test_fld_linear_map_known_jacobian_mc_probes():
    """Y -> z = Y M, ℒ = (1/2N)Σ_t‖z_t‖²; M Mᵀ diagonal so the per-channel form is exact in expectation."""
    T, n, d = 40, 6, 10
    g = _gen(2)
    r = torch.linalg.qr(torch.randn(d, n, generator=g, dtype=torch.float64))[0].t()  # [n, d], orthonormal rows
    s = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    m = s[:, None] * r
    y = torch.randn(T, n, generator=g, dtype=torch.float64)
    e = 0.1 * torch.randn(T, n, generator=g, dtype=torch.float64)
    truth = _symmetrised(lambda yy: 0.5 * ((yy @ m) ** 2).sum() / T, y, e)

    probes = 2000
    yv = y.clone().requires_grad_(True)
    z = yv @ m
    v = torch.randn(probes, T, d, generator=g, dtype=torch.float64)  # v ~ N(0, I) at z (Hessian there is I)
    (gy,) = torch.autograd.grad(z, yv, grad_outputs=v, is_grads_batched=True)  # [R, T, n]
    acc = (gy ** 2).mean((0, 1))
    est = refdiv.fld_estimate(dv.channel_sq_sum(e).double(), acc, T)
    assert est.item() == pytest.approx(truth.item(), rel=0.05)


def test_mc_fisher_probes_match_exact_softmax_fisher():
    """Softmax head logits = Y Wₕ: the MC Fisher E[g gᵀ] equals Wₕ (diag p - p pᵀ) Wₕᵀ per token."""
    n, V, T = 5, 7, 3
    g = _gen(3)
    wh = torch.randn(n, V, generator=g, dtype=torch.float64)
    y = torch.randn(T, n, generator=g, dtype=torch.float64)
    p = torch.softmax(y @ wh, -1)  # [T, V]
    exact = torch.stack([wh @ (torch.diag(p[t]) - torch.outer(p[t], p[t])) @ wh.t() for t in range(T)])
    probes = 20000
    yv = y.clone().requires_grad_(True)
    logits = yv @ wh
    labels = torch.multinomial(p, probes, replacement=True, generator=g)  # [T, R]
    # per-token-scale gradients of Σ_t CE: g_t = Wₕ (p_t - onehot(ŷ_t)); autograd agrees (checked below)
    onehot = torch.nn.functional.one_hot(labels, V).double()  # [T, R, V]
    grads = torch.einsum("iv,trv->tri", wh, p[:, None, :] - onehot)  # [T, R, n]
    (g0,) = torch.autograd.grad(torch.nn.functional.cross_entropy(logits, labels[:, 0], reduction="sum"), yv)
    assert torch.allclose(g0, grads[:, 0], atol=1e-12)
    mc = torch.einsum("tri,trj->tij", grads, grads) / probes
    rel = (mc - exact).norm() / exact.norm()
    assert rel < 0.05
    # and the per-channel probe statistic converges to the Fisher diagonal
    e = 0.05 * torch.randn(T, n, generator=g, dtype=torch.float64)
    est = refdiv.fld_estimate(dv.channel_sq_sum(e).double(), (grads ** 2).mean((0, 1)), T)
    diag_ref = refdiv.fld_estimate(dv.channel_sq_sum(e).double(), torch.diagonal(exact, dim1=1, dim2=2).mean(0), T)
    assert est.item() == pytest.approx(diag_ref.item(), rel=0.05)


def test_sequence_sq_sum_values_and_checks():
    g = torch.arange(12, dtype=torch.float32).reshape(2, 3, 2)  # [B=2, L=3, n=2]
    e = torch.ones(2, 3, 2)
    # per row: Σ over its 3 tokens and 2 channels of g -> 15 and 51
    assert dv.sequence_sq_sum(g.reshape(6, 2), e.reshape(6, 2), 2).item() == 15.0 ** 2 + 51.0 ** 2
    assert dv.sequence_sq_sum(g.reshape(6, 2), e.reshape(6, 2), 1).item() == 66.0 ** 2
    with pytest.raises(ValueError, match="does not divide"):
        dv.sequence_sq_sum(g.reshape(6, 2), e.reshape(6, 2), 4)
    with pytest.raises(ValueError, match="same shape"):
        dv.sequence_sq_sum(torch.ones(6, 2), torch.ones(6, 3), 1)


def test_sequence_form_is_the_gauss_newton_form_where_the_channel_form_is_not():
    """Tokens mixed causally (z_s = Σ_t A_st Y_t M, as attention and later layers do) under a softmax head,
    a perturbation coherent across tokens and channels (as a weight's rounding error is): the MC-probe
    sequence form converges to the exact Gauss-Newton form ``(1/2N)Σ_s d_sᵀ(diag p_s - p_s p_sᵀ)d_s``,
    ``d = A E M``; the per-channel form, which drops every cross-token and cross-channel pair, does not."""
    B, L, n, V = 3, 6, 4, 9
    g = _gen(7)
    a = torch.tril(torch.rand(L, L, generator=g, dtype=torch.float64) + 0.2)
    a = a / a.sum(1, keepdim=True)  # causal averaging
    m = torch.randn(n, V, generator=g, dtype=torch.float64)
    y = torch.randn(B, L, n, generator=g, dtype=torch.float64)
    e = 0.05 * (torch.randn(n, generator=g, dtype=torch.float64) + 0.05 * torch.randn(B, L, n, generator=g,
                                                                                       dtype=torch.float64))
    z = torch.einsum("st,btn,nv->bsv", a, y, m)
    p = torch.softmax(z, -1)
    d = torch.einsum("st,btn,nv->bsv", a, e, m)
    N = B * L
    gn = 0.5 * ((p * d * d).sum(-1) - (p * d).sum(-1) ** 2).sum() / N
    probes = 4000
    labels = torch.multinomial(p.reshape(-1, V), probes, replacement=True, generator=g)  # [B*L, R]
    r = (p.reshape(-1, 1, V) - torch.nn.functional.one_hot(labels, V).double()).reshape(B, L, probes, V)
    gy = torch.einsum("st,bsrv,nv->rbtn", a, r, m).reshape(probes, N, n)  # ∂Σ_s CE_s/∂Y_t per probe
    seq = sum(dv.sequence_sq_sum(gy[i], e.reshape(N, n), B) for i in range(probes)) / probes / (2 * N)
    chan = refdiv.fld_estimate(dv.channel_sq_sum(e).double(), (gy ** 2).mean((0, 1)), N)
    assert seq.item() == pytest.approx(gn.item(), rel=0.1)
    assert chan.item() < 0.5 * gn.item()  # 0.26-0.39 over four seeds of this set-up


def test_fld_estimate_validates():
    with pytest.raises(ValueError, match="n_tokens"):
        refdiv.fld_estimate(torch.ones(3), torch.ones(3), 0)
    with pytest.raises(ValueError, match="same shape"):
        refdiv.fld_estimate(torch.ones(3), torch.ones(4), 1)


def test_first_order():
    """⟨G_Y, E⟩ is the directional derivative of the loss along E: checked against a central difference of a
    cubic loss, (ℒ(Y+hE) - ℒ(Y-hE))/2h, whose truncation error is h²/6·|∂³ℒ[E,E,E]|."""
    g = _gen(4)
    c = torch.randn(4, 3, generator=g, dtype=torch.float64)
    y = torch.randn(4, 3, generator=g, dtype=torch.float64)
    e = torch.randn(4, 3, generator=_gen(5), dtype=torch.float64)

    def loss(yy):
        return ((yy - c) ** 3).sum() / 3 + (yy * c).sum()

    yv = y.clone().requires_grad_(True)
    (gy,) = torch.autograd.grad(loss(yv), yv)
    h = 1e-4
    central = ((loss(y + h * e) - loss(y - h * e)) / (2 * h)).item()
    # FP32 products and a 12-term sum: rel 1e-5 ≫ 12·2^-24; the central difference's h²·Σ|E|³/3 ~ 1e-8
    assert refdiv.first_order(gy, e).item() == pytest.approx(central, rel=1e-5, abs=1e-6)


def test_isotropic_alpha_quadratic_ratio_and_fld():
    alpha_true, d = 0.37, 12
    g = _gen(6)
    z = torch.randn(d, generator=g, dtype=torch.float64)
    b = torch.randn(d, generator=g, dtype=torch.float64)
    v = torch.randn(d, generator=g, dtype=torch.float64)

    def loss(zz):
        return float(0.5 * alpha_true * (zz ** 2).sum() + (b * zz).sum())

    delta = 0.01
    l0, lp, lm, l2 = loss(z), loss(z + delta * v), loss(z - delta * v), loss(z + 2 * delta * v)
    assert dv.isotropic_alpha(l0, lp, lm, delta, float((v ** 2).sum())) == pytest.approx(alpha_true, rel=1e-6)
    assert dv.quadratic_ratio(l0, lp, l2, lm) == pytest.approx(4.0, rel=1e-6)
    # the layer output is z itself (J = I): probes u = v back-propagated -> mean u² = 1
    e = 0.2 * torch.randn(3, d, generator=g, dtype=torch.float64)
    est = refdiv.fld_isotropic(dv.channel_sq_sum(e).double(), torch.ones(d, dtype=torch.float64), alpha_true)
    truth = sum(_symmetrised(lambda zz: loss(zz), z, e[t]) for t in range(3))
    assert est.item() == pytest.approx(truth, rel=1e-6)
    with pytest.raises(ValueError):
        dv.isotropic_alpha(l0, lp, lm, 0.0, 1.0)


def _adam_update_ratio(grads, beta2, eps, lr=1e-2):
    """torch.optim.Adam with β₁ = 0 (so m̂ = g): the last update is -lr·g·P; returns (P, exp_avg_sq, step)."""
    w = torch.nn.Parameter(torch.zeros_like(grads[0]))
    opt = torch.optim.Adam([w], lr=lr, betas=(0.0, beta2), eps=eps)
    for gr in grads:
        before = w.detach().clone()
        w.grad = gr.clone()
        opt.step()
    st = opt.state[w]
    return -(w.detach() - before) / (lr * grads[-1]), st["exp_avg_sq"], int(st["step"])


def test_adam_preconditioner_and_step_scale():
    v = torch.tensor([4.0, 0.25, 0.0])
    p = dv.adam_preconditioner(v, step=1, beta2=0.5, eps=1e-3)
    # by hand: v̂ = v/(1 - 0.5) = [8, 0.5, 0], sqrt = [2√2, 1/√2, 0]
    assert torch.allclose(p, torch.tensor([1 / (2 * math.sqrt(2) + 1e-3), 1 / (math.sqrt(0.5) + 1e-3), 1e3]))
    # against torch's own Adam: with β₁ = 0 the update is -lr·g/(sqrt(v̂) + eps), so P = -Δw/(lr·g)
    g = _gen(11)
    grads = [torch.randn(20, generator=g, dtype=torch.float64) * (1 + i) for i in range(5)]
    want, exp_avg_sq, step = _adam_update_ratio(grads, beta2=0.9, eps=1e-3)
    # FP32 P against FP64 Adam: a few FP32 round-offs of a value ~1: rel 1e-5 ≫ 2^-24
    assert torch.allclose(dv.adam_preconditioner(exp_avg_sq, step, 0.9, eps=1e-3).double(), want, rtol=1e-5)
    assert dv.adam_step_scale(0, 0.9) == pytest.approx(1.0)
    assert dv.adam_step_scale(1000, 0.9) == pytest.approx(0.1)
    assert dv.adam_step_scale(1, 0.9) == pytest.approx(0.1 / 0.19)
    with pytest.raises(ValueError, match="step"):
        dv.adam_preconditioner(v, 0, 0.999)


def test_factored_second_moment_is_rank_one_on_adams_scale():
    """v̂ = R Cᵀ / S: the same total as G_W² (Adam's first-step scale), equal to G_W² wherever G_W² is itself
    rank one, zero on rows and columns without gradient, and a tensor-parallel shard that completes its partial
    sums over the group gets exactly its part of the whole layer's v̂."""
    g = torch.Generator().manual_seed(0)
    gw = torch.randn(6, 5, generator=g, dtype=torch.float64)
    v = dv.factored_second_moment(gw)
    assert v.dtype == torch.float32 and torch.allclose(v.double().sum(), (gw ** 2).sum(), rtol=1e-6)
    by_hand = torch.tensor([[(gw[i] ** 2).sum() * (gw[:, j] ** 2).sum() / (gw ** 2).sum() for j in range(5)]
                            for i in range(6)], dtype=torch.float64)
    assert torch.allclose(v.double(), by_hand, rtol=1e-6)  # FP32 sums of 6 terms: a few 2^-24
    outer = torch.outer(torch.tensor([1.0, -2.0, 0.5]), torch.tensor([3.0, 0.25]))  # G² rank one: v̂ = G²
    assert torch.allclose(dv.factored_second_moment(outer), outer ** 2, rtol=1e-6)
    holes = gw.clone().float()
    holes[2], holes[:, 4] = 0.0, 0.0
    v = dv.factored_second_moment(holes)
    assert v[2].abs().max() == 0 and v[:, 4].abs().max() == 0 and (v[:2, :4] > 0).all()
    assert torch.equal(dv.factored_second_moment(torch.zeros(3, 2)), torch.zeros(3, 2))
    full = dv.factored_second_moment(gw)
    col_shards, row_shards = gw.split(3, 0), gw.split([2, 3], 1)  # column-parallel: rows; row-parallel: columns
    for k, shard in enumerate(col_shards):
        total = lambda t: sum(s_.float().square().sum(0) for s_ in col_shards)  # noqa: E731 (the group's sum)
        assert torch.allclose(dv.factored_second_moment(shard, col_sum=total), full[3 * k:3 * k + 3], rtol=1e-6)
    for k, shard in enumerate(row_shards):
        total = lambda t: sum(s_.float().square().sum(1) for s_ in row_shards)  # noqa: E731
        got = dv.factored_second_moment(shard, row_sum=total)
        assert torch.allclose(got, full[:, [0, 1] if k == 0 else [2, 3, 4]], rtol=1e-6)


def test_factored_prior_does_not_follow_an_element_that_cancels():
    """The default fallback's P is set by sums of squares: an element of G_W near zero (a sum over tokens that
    cancels, whose value the order of summation decides) moves grad_sq's P by orders of magnitude and the
    factored P by no more than its own square's share of the sums."""
    gw = torch.tensor([[1.0, -2.0, 0.5], [0.75, 1e-7, -1.5]])
    moved = gw.clone()
    moved[1, 1] = -3e-7  # another order of summation: the same cancelling sum, another round-off
    ratio = {}
    for mode in ("factored", "grad_sq"):
        p0, p1 = (dv.fallback_preconditioner(t, t.shape, mode)[0] for t in (gw, moved))
        ratio[mode] = float((p1 / p0).max() / (p1 / p0).min())
    assert ratio["grad_sq"] > 2.5  # 1/|1e-7| against 1/|3e-7|
    assert ratio["factored"] < 1 + 1e-6  # (3e-7)² against row sums ~3: below FP32's resolution


def test_fallback_preconditioner():
    p, src = dv.fallback_preconditioner(torch.tensor([[3.0, 4.0]]), (1, 2), eps=0.0)
    assert src == "factored" and torch.allclose(p, torch.tensor([[1 / 3.0, 1 / 4.0]]))  # one row: v̂ = G²
    gw = torch.tensor([[2.0, -0.5]])
    p, src = dv.fallback_preconditioner(gw, gw.shape, "grad_sq", eps=1e-3)
    # Adam's first step (v̂₁ = g₁²) from torch's Adam: P = -Δw/(lr·g), whatever β₂
    want, _, _ = _adam_update_ratio([gw.double()], beta2=0.99, eps=1e-3)
    assert src == "grad_sq" and torch.allclose(p.double(), want, rtol=1e-6)  # FP32 vs FP64: rel 2^-24 ≪ 1e-6
    assert torch.allclose(p, torch.tensor([[1 / 2.001, 1 / 0.501]]))  # by hand
    p, src = dv.fallback_preconditioner(None, (2, 3), "ones")
    assert src == "ones" and torch.equal(p, torch.ones(2, 3))
    with pytest.raises(ValueError, match="valid: factored, grad_sq, ones"):
        dv.fallback_preconditioner(gw, gw.shape, "identity")


def test_bwd_direct_matches_one_adam_step():
    """η·c·ΔG⊙P is the first-order change of one torch Adam update (v ≫ g² and t ≫ 1, so v̂ barely moves)."""
    g = _gen(7)
    w0 = torch.randn(6, 5, generator=g, dtype=torch.float64)
    lr, betas, eps = 1e-2, (0.9, 0.999), 1e-8
    state_grads = [torch.randn(6, 5, generator=g, dtype=torch.float64) for _ in range(100)]
    grad = 0.05 * torch.randn(6, 5, generator=g, dtype=torch.float64)
    delta = 1e-4 * torch.randn(6, 5, generator=g, dtype=torch.float64)

    def step_with(gr):
        w = torch.nn.Parameter(w0.clone())
        opt = torch.optim.Adam([w], lr=lr, betas=betas, eps=eps)
        for sg in state_grads:
            w.grad = sg.clone()
            opt.step()
        st = opt.state[w]
        pre = dv.adam_preconditioner(st["exp_avg_sq"], int(st["step"]), betas[1], eps).double()
        c = dv.adam_step_scale(int(st["step"]), betas[0])
        w.grad = gr.clone()
        before = w.detach().clone()
        opt.step()
        return w.detach() - before, pre, c

    d_ref, pre, c = step_with(grad)
    d_q, _, _ = step_with(grad + delta)
    truth = ((d_q - d_ref) ** 2).sum().item()
    assert refdiv.bwd_direct(delta, pre, lr, c).item() == pytest.approx(truth, rel=0.03)
    assert refdiv.bwd_direct(delta, pre, lr).item() == pytest.approx(truth / c ** 2, rel=0.03)


def test_bwd_fisher_single_probe_exact_and_mc_expectation():
    g = _gen(8)
    dgw, pre = torch.randn(4, 3, generator=g), torch.rand(4, 3, generator=g) + 0.5
    pg = torch.randn(4, 3, generator=g)
    lr, n = 0.1, 10
    # one probe is the rank-one Fisher F = vec(pg) vec(pg)ᵀ: the price of the drift d = lr·ΔG⊙P is ½dᵀFd/N,
    # here as an explicit matrix-vector form in FP64 (vs the reference's FP32 inner product: rel 1e-5 ≫ 12·2^-24)
    fisher = torch.outer(pg.double().flatten(), pg.double().flatten())
    dvec = (lr * dgw.double() * pre.double()).flatten()
    want = (dvec @ fisher @ dvec) / (2 * n)
    assert refdiv.bwd_fisher([pg], dgw, pre, lr, n).item() == pytest.approx(want.item(), rel=1e-5)
    # probes with independent entries of variance s²: E⟨G, d⟩² = Σ s² d²
    s = torch.rand(4, 3, generator=g) + 0.2
    probes = [s * torch.randn(4, 3, generator=g) for _ in range(20000)]
    d = lr * dgw * pre
    expect = (s ** 2 * d ** 2).sum() / (2 * n)
    assert refdiv.bwd_fisher(probes, dgw, pre, lr, n).item() == pytest.approx(expect.item(), rel=0.05)
    with pytest.raises(ValueError, match="probe"):
        refdiv.bwd_fisher([], dgw, pre, lr, n)


def test_bwd_channel_exact_on_diagonal_quadratic():
    """Y = X Wᵀ, ℒ = (1/2N)Σ_t Σ_j a_j Y_tj²: perturbing W by D costs (1/2N)Σ_t Σ_j a_j (x_t·D_j)² (even part)."""
    T, k, n = 30, 5, 4
    g = _gen(9)
    x = torch.randn(T, k, generator=g, dtype=torch.float64)
    w = torch.randn(n, k, generator=g, dtype=torch.float64)
    a = torch.rand(n, generator=g, dtype=torch.float64) + 0.1
    dmat = 0.01 * torch.randn(n, k, generator=g, dtype=torch.float64)

    def loss(ww):
        return 0.5 * ((x @ ww.t()) ** 2 * a).sum() / T

    truth = (loss(w + dmat) + loss(w - dmat) - 2 * loss(w)) / 2
    assert refdiv.bwd_channel(x, dmat, a, T).item() == pytest.approx(truth.item(), rel=1e-6)


def test_bwd_propagated_formula():
    assert refdiv.bwd_propagated(2.0, 3.0, 4.0, lr=0.1, step_scale=0.5) == pytest.approx(0.05 ** 2 * 2 * 3 / 4)
    assert refdiv.bwd_propagated(2.0, 3.0, 0.0, lr=0.1) == 0.0
    assert math.isfinite(refdiv.bwd_propagated(0.0, 0.0, 1.0, lr=1.0))


@pytest.mark.rounding
def test_projected_sq_sum_gram_equals_direct_product():
    """Σ_t (x_t·d_j)² through the shared Gram matrix equals the direct product (FP64 reference)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(96, 12, generator=gen) + 2.0  # a shared mean component: an ill-conditioned Gram
    d = torch.randn(7, 12, generator=gen)
    ref = ((x.double() @ d.double().t()) ** 2).sum(0)
    direct = dv.projected_sq_sum(x, d)
    via_gram = dv.projected_sq_sum(x, d, x.t() @ x)
    assert direct.shape == via_gram.shape == (7,)
    # FP32 vs FP64: the direct product sums 12 then 96 non-negative terms (108·2^-24 = 6e-6 worst case);
    # the Gram route cancels: condition Σ‖x_t‖²‖d‖²/Σ(x_t·d)² is 5-53 here, times sqrt(96)·2^-24 (random-
    # sign round-off of the 96-deep Gram): ≤ 3e-5. Measured 6.7e-8 and 2.6e-7
    assert torch.allclose(direct.double(), ref, rtol=1e-5)
    assert torch.allclose(via_gram.double(), ref, rtol=1e-4)


def test_gram_pays_compares_multiply_adds():
    # T*k^2 + rows*k^2 < rows*T*k, i.e. T*k + rows*k < rows*T
    assert dv.gram_pays(tokens=1024, k=384, rows=2 * 1024)  # gate_proj, 2 precisions: 393k + 786k < 2.1M
    assert not dv.gram_pays(tokens=1024, k=1024, rows=2 * 384)  # down_proj: 1.05M + 786k > 786k
    assert not dv.gram_pays(tokens=16, k=64, rows=2 * 64)  # few tokens: the direct product is cheaper
    assert not dv.gram_pays(tokens=1024, k=384, rows=2 * 128)  # k_proj alone: 393k + 98k > 262k
    assert dv.gram_pays(tokens=1024, k=384, rows=2 * (384 + 128 + 128))  # q, k, v sharing one input


def test_next_token_kl_matches_torch_and_skips_ignored_positions():
    g = _gen(7)
    ref = torch.randn(2, 6, 11, generator=g)
    cur = ref + 0.3 * torch.randn(2, 6, 11, generator=g)
    labels = torch.randint(0, 11, (2, 6), generator=g)
    labels[0, 3] = labels[1, 5] = -100  # positions 2 of row 0 and 4 of row 1 predict ignored tokens
    total, n = dv.next_token_kl(ref, cur, labels, chunk=3)  # chunks of 3 positions: 8 kept -> 3 chunks
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[0, 2] = keep[1, 4] = False
    lp, lq = ref[:, :-1][keep].double().log_softmax(-1), cur[:, :-1][keep].double().log_softmax(-1)
    expected = torch.nn.functional.kl_div(lq, lp, log_target=True, reduction="sum")  # KL(p ‖ q)
    assert n == 8
    assert float(total) == pytest.approx(float(expected), rel=1e-12)  # both FP64 sums of the same 88 terms
    assert float(dv.next_token_kl(ref, ref.clone(), labels)[0]) == 0.0


def test_next_token_kl_is_the_gauss_newton_form_to_second_order():
    """KL(p ‖ softmax(z + δ)) = ½ δᵀ(diag p - p pᵀ)δ + O(|δ|³): the form the MC-Fisher FLD estimates. With
    δ ~ N(0, (1e-3)²) the cubic term is at most ~max|δ| ≈ 4e-3 of the quadratic one: tolerance 1e-2."""
    g = _gen(8)
    z = torch.randn(1, 40, 17, generator=g, dtype=torch.float64)
    delta = 1e-3 * torch.randn(1, 40, 17, generator=g, dtype=torch.float64)
    labels = torch.zeros(1, 40, dtype=torch.long)
    total, n = dv.next_token_kl(z, z + delta, labels)
    p = z[0, :-1].softmax(-1)
    d = delta[0, :-1]
    quad = 0.5 * ((d * d * p).sum(-1) - (d * p).sum(-1) ** 2).sum()
    assert n == 39 and float(total) == pytest.approx(float(quad), rel=1e-2)
