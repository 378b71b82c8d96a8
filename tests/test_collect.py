"""snip_ds.stats (the collector) on a tiny Llama: no trace left, independent per-layer references, reduction,
artifact."""
import json
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from snip_ds import divergence as dv
from snip_ds.backend import get_backend
from snip_ds.experiments.first_plan import SplitK, round_to_tf32 as _round_to_tf32
from snip_ds.planner import CostSettings, costs_from_stats, solve_baseline
from snip_ds.stats import STUDY_FIELDS, CollectSettings, adam_precond, collect_statistics
from snip_ds.stats_file import load_stats, save_stats
from snip_ds.swap import snip_layers, swap_linears
from tests import reference_divergence as refdiv

LAYER = "model.layers.1.mlp.down_proj"
ALL = tuple(STUDY_FIELDS)


def _full(**kw):
    """Collection settings that record every study field too (most tests below read some of them)."""
    return CollectSettings(study_fields=ALL, **kw)


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    m = LlamaForCausalLM(cfg)
    swap_linears(m, "fp8", seed=3)
    return m


def _batches(n=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 257, (2, 32), generator=g) for _ in range(n)]


@pytest.fixture(scope="module")
def model():
    return _model()


def _reference(model, batch, fqn, precision, precond):
    """G_Y, X, E, ΔG_W of one layer from a plain BF16 forward/backward with retain_grad (no collector)."""
    mod = model.get_submodule(fqn)
    saved = {}

    def hook(m, inp, out):
        saved["x"] = inp[0].detach().reshape(-1, inp[0].shape[-1]).float()
        out.retain_grad()
        saved["y"] = out

    prec = {f: m.precision for f, m in snip_layers(model).items()}
    for m in snip_layers(model).values():
        m.precision = "bf16"
    h = mod.register_forward_hook(hook)
    try:
        logits = model(input_ids=batch).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
    finally:
        h.remove()
        for f, m in snip_layers(model).items():
            m.precision = prec[f]
        model.zero_grad(set_to_none=True)
    gy = saved["y"].grad.reshape(-1, mod.out_features).float()
    x, w = saved["x"], mod.weight.detach().float()
    cfg = replace(mod.quant_config, stochastic_rounding=False)
    be = get_backend()
    e = be.fprop(x, w, precision, cfg) - x @ w.t()
    dgw = be.wgrad(gy, x, precision, cfg) - gy.t() @ x
    n = batch[:, 1:].numel()
    return dict(gy=gy, x=x, e=e, dgw=dgw, n=n, loss=loss.item())


def test_leaves_no_trace(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _batches(1)[0]
    logits = model(input_ids=batch).logits
    F.cross_entropy(logits[:, :-1].reshape(-1, 257), batch[:, 1:].reshape(-1)).backward()
    opt.step()  # optimizer state exists, and .grad stays populated
    layers = snip_layers(model)
    layers[LAYER].precision = {"fprop": "fp4", "dgrad": "fp8", "wgrad": "bf16"}
    layers["model.layers.0.self_attn.q_proj"].precision = "fp4"
    model.eval()
    before = dict(
        params={k: v.detach().clone() for k, v in model.named_parameters()},
        grads={k: v.grad.clone() for k, v in model.named_parameters()},
        opt=json.dumps({k: v for k, v in opt.state_dict().items() if k != "state"}),
        opt_state={(i, k): t.clone() for i, s in opt.state_dict()["state"].items() for k, t in s.items()},
        prec={k: m.precision for k, m in layers.items()},
        gens={k: m.generator.get_state() for k, m in layers.items()},
        rng=torch.get_rng_state())
    pc = adam_precond(model, opt)
    for est in ("mc_fisher", "isotropic"):
        collect_statistics(model, _batches(2), _full(estimator=est, bwd_propagated=True), lr=1e-3,
                           precond=pc.precond)
    for k, v in model.named_parameters():
        assert torch.equal(v, before["params"][k]), k
        assert torch.equal(v.grad, before["grads"][k]), k
    assert json.dumps({k: v for k, v in opt.state_dict().items() if k != "state"}) == before["opt"]
    for (i, k), t in before["opt_state"].items():
        assert torch.equal(opt.state_dict()["state"][i][k], t)
    assert {k: m.precision for k, m in layers.items()} == before["prec"]
    assert not any(m.input_grad_only for m in layers.values())
    assert all(torch.equal(m.generator.get_state(), before["gens"][k]) for k, m in layers.items())
    assert torch.equal(torch.get_rng_state(), before["rng"])
    assert not model.training
    model.train()
    for m in layers.values():
        m.precision = "fp8"
    model.zero_grad(set_to_none=True)


@pytest.mark.rounding
@pytest.mark.parametrize("gram", [False, True], ids=["direct", "gram"])
@pytest.mark.parametrize("layer", [LAYER, "model.layers.1.self_attn.k_proj"], ids=["down", "k"])
def test_layer_statistics_match_independent_reference(model, gram, layer, monkeypatch):
    """Every statistic of one layer against a reference built from whole tensors; the drift's loss price
    both through the direct product and through the Gram matrix (forced either way), which k_proj shares with
    q_proj and v_proj (one input)."""
    monkeypatch.setattr(dv, "gram_pays", lambda *a: gram)
    batch = _batches(1)[0]
    pre = {f: torch.rand(m.weight.shape, generator=torch.Generator().manual_seed(5)) + 0.5
           for f, m in snip_layers(model).items()}
    lr = 3e-3
    stats = collect_statistics(model, [batch], _full(estimator="empirical", bwd_rounding="nearest"), lr=lr,
                               precond=pre)
    rec = stats["layers"][layer]
    # Tolerances: the reference sees bitwise the same X, G_Y and quantized operands (same forward, same
    # backend), so no element can round differently; only the order of the FP32 sums differs. A K-deep
    # product and a sum of n terms err by at most K·u and n·u relative (u = 2^-24): K = 128 and n = 62·64
    # tokens × channels give 7.6e-6 and 2.4e-4 worst case, about sqrt(n)·u = 4e-6 in practice, so 1e-4 for
    # the sums of squares and 1e-5 for the loss and the per-operand errors (one elementwise square, then a
    # sum). The first-order term is a signed sum that cancels: 1e-3 relative, 1e-9 absolute.
    for p in ("fp8", "fp4"):
        ref = _reference(model, batch, layer, p, pre[layer])
        assert stats["tokens"] == ref["n"] and stats["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert rec["first_order"][p] == pytest.approx((ref["gy"] * ref["e"]).sum().item(), rel=1e-3, abs=1e-9)
        # abs=0: these numbers are far below pytest.approx's default absolute tolerance (1e-12)
        assert rec["bwd_drift"][p] == pytest.approx(refdiv.bwd_direct(ref["dgw"], pre[layer], lr).item(), rel=1e-4,
                                                    abs=0)
        fld = refdiv.fld_from_tensors(ref["e"], ref["gy"] * ref["n"], ref["n"])
        assert rec["fld_channel"][p] == pytest.approx(fld.item(), rel=1e-4, abs=0)
        # sequence form (the default): Σ over the batch's rows of (Σ_t g_t·E_t)², g on the per-token scale
        per_row = ((ref["gy"] * ref["n"]) * ref["e"]).sum(1).reshape(batch.shape[0], -1).sum(1)
        fld_seq = (per_row ** 2).sum() / (2 * ref["n"])
        assert rec["fld_sequence"][p] == pytest.approx(fld_seq.item(), rel=1e-4, abs=0)
        assert rec["fld"][p] == rec["fld_sequence"][p]
        bwd = refdiv.bwd_channel(ref["x"], lr * ref["dgw"] * pre[layer], refdiv.channel_sq_mean(ref["gy"] * ref["n"]),
                             ref["n"])
        assert rec["bwd"][p] == pytest.approx(bwd.item(), rel=1e-4, abs=0)
        assert rec["bwd_bias"][p] == rec["bwd"][p] and rec["bwd_drift_bias"][p] == rec["bwd_drift"][p]
        # per-operand quantization errors (per-GEMM quant_err plans): X, W and the reference's own G_Y (the
        # gradient of the mean loss, as training quantizes it) against the backend's quantizer (test_quant
        # checks that one against the table-driven reference), each along its rows, round to nearest
        cfg = replace(snip_layers(model)[layer].quant_config, stochastic_rounding=False)
        for o, t in (("x", ref["x"]), ("w", snip_layers(model)[layer].weight.detach().float()), ("g", ref["gy"])):
            err = ((get_backend().quantize(t, p, o, -1, cfg) - t) ** 2).sum().item()
            assert err > 0, (o, p)  # the operand is not already on the grid: the check below can fail
            assert rec[f"quant_err_{o}"][p] == pytest.approx(err, rel=1e-5)
            assert rec[f"rel_quant_err_{o}"][p] == pytest.approx(err / (t * t).sum().item(), rel=1e-5)
        for field in ("quant_err", "rel_quant_err"):
            assert rec[field][p] == pytest.approx(sum(rec[f"{field}_{o}"][p] for o in "xwg"), rel=1e-12)
    assert rec["fld_channel"]["fp4"] > rec["fld_channel"]["fp8"] > 0
    assert rec["rel_quant_err"]["fp4"] > rec["rel_quant_err"]["fp8"] > 0
    assert 1e-3 < rec["rel_quant_err"]["fp4"] / 3 < 0.1  # three operands at NVFP4 RNE (~1e-2 each)


@pytest.mark.rounding
@pytest.mark.parametrize("row_constant", [True, False], ids=["P-per-row", "P-general"])
def test_recipe_rounding_is_the_exact_expectation_over_stochastic_rounding(model, row_constant):
    """``bwd_rounding="recipe"``: FP4 rounds G_Y stochastically in training, so the drift statistics are the
    expectation over that rounding, against a reference from each G_Y element's grid neighbours
    (tests/reference_quant.py): the systematic part ``E[ΔG_W]`` and the noise ``Σ P²·Var[G_W]``. The loss
    price of the noise is exact when P is constant within an output row (the collector then prices
    ``Σ_t (x_t·N_j)²`` exactly); with a general P it uses P² averaged over the row, so within 10 %."""
    from tests.reference_quant import ref_nvfp4_rows, ref_sr_moments_rows
    batch = _batches(1)[0]
    gen = torch.Generator().manual_seed(5)
    pre = {f: (torch.rand(m.weight.shape[0], 1, generator=gen) + 0.5).expand(m.weight.shape).contiguous()
           if row_constant else torch.rand(m.weight.shape, generator=gen) + 0.5
           for f, m in snip_layers(model).items()}
    lr = 3e-3
    stats = collect_statistics(model, [batch], _full(estimator="empirical"), lr=lr, precond=pre)
    assert stats["bwd_rounding"] == "recipe"
    rec = stats["layers"][LAYER]
    ref = _reference(model, batch, LAYER, "fp4", pre[LAYER])
    p_mat = pre[LAYER].double()
    g_mean, g_var = ref_sr_moments_rows(ref["gy"].t(), "nvfp4")  # [n, T]: G_Y along tokens
    xq = ref_nvfp4_rows(ref["x"].t()).double()  # [k, T]: X along tokens, round to nearest
    gy, x = ref["gy"].double(), ref["x"].double()
    bias = g_mean @ xq.t() - gy.t() @ x  # E[ΔG_W], [n, k]
    var = g_var @ (xq * xq).t()  # Var[G_W], [n, k]
    drift_bias = lr ** 2 * ((bias * p_mat) ** 2).sum()
    drift_noise = lr ** 2 * (var * p_mat ** 2).sum()
    assert rec["bwd_drift_bias"]["fp4"] == pytest.approx(drift_bias.item(), rel=1e-4, abs=0)
    assert rec["bwd_drift"]["fp4"] == pytest.approx((drift_bias + drift_noise).item(), rel=1e-4, abs=0)
    # loss units: Σ_j m_j E[Σ_t (x_t·D_j)²] / 2N with D = lr·ΔG_W⊙P and m_j = mean_t g_tj²
    m = refdiv.channel_sq_mean(ref["gy"] * ref["n"]).double()
    noise_ch = torch.stack([(g_var[j] * ((x @ (p_mat[j] * xq.t()).t()) ** 2).sum(0)).sum()
                            for j in range(bias.shape[0])])  # Σ_s Var[G_Y]_sj Σ_t (x_t·(P_j⊙Q(X)_s))²
    bias_ch = ((x @ (bias * p_mat).t()) ** 2).sum(0)
    bwd_bias = lr ** 2 * (m * bias_ch).sum() / (2 * ref["n"])
    bwd = bwd_bias + lr ** 2 * (m * noise_ch).sum() / (2 * ref["n"])
    # 1e-4: the same operands, FP32 vs FP64 sums of ≤ 62·128 terms (n·u ≤ 5e-4 worst, ~sqrt(n)·u = 5e-6)
    assert rec["bwd_bias"]["fp4"] == pytest.approx(bwd_bias.item(), rel=1e-4, abs=0)
    assert rec["bwd"]["fp4"] == pytest.approx(bwd.item(), rel=1e-4 if row_constant else 0.1, abs=0)
    assert rec["bwd"]["fp4"] > 1.2 * rec["bwd_bias"]["fp4"]  # the rounding noise is a real part of it
    # FP8 rounds to nearest (no stochastic rounding): the expected drift is the whole drift
    assert rec["bwd"]["fp8"] == rec["bwd_bias"]["fp8"] > 0


@pytest.mark.rounding
@pytest.mark.slow
def test_mc_fisher_sequence_form_matches_exact_gauss_newton(model):
    """Many probes: the sequence-form FLD of the tiny Llama's layers against the exact Gauss-Newton form of
    the same perturbation E, ``(1/2N)Σ_s d_sᵀ(diag p_s - p_s p_sᵀ)d_s`` with ``d = J E`` the logits' change,
    from a central difference on an FP64 copy (E from the same FP32 operands as the collector's)."""
    import copy
    batch = _batches(1, seed=4)[0]
    probes = 96
    stats = collect_statistics(model, [batch], _full(num_probes=probes, seed=3), lr=1e-3)
    m64 = copy.deepcopy(model).double()
    for m in snip_layers(m64).values():
        m.precision = "bf16"
    be = get_backend()
    for fqn in ("model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj", "model.layers.0.mlp.up_proj"):
        mod = model.get_submodule(fqn)
        cfg = replace(mod.quant_config, stochastic_rounding=False)
        w = mod.weight.detach().float()
        zs = {}
        for sign in (1.0, -1.0):
            def hook(m, inp, y, sign=sign):
                x = inp[0].reshape(-1, inp[0].shape[-1]).float()
                e = (be.fprop(x, w, "fp4", cfg) - x @ w.t()).double()
                return y + 1e-3 * sign * e.reshape(y.shape)
            h = m64.get_submodule(fqn).register_forward_hook(hook)
            with torch.no_grad():
                zs[sign] = m64(input_ids=batch).logits[:, :-1].reshape(-1, 257)
            h.remove()
        with torch.no_grad():
            p = torch.softmax(m64(input_ids=batch).logits[:, :-1].reshape(-1, 257), -1)
        d = (zs[1.0] - zs[-1.0]) / 2e-3
        gn = 0.5 * ((p * d * d).sum(-1) - (p * d).sum(-1) ** 2).mean().item()
        rec = stats["layers"][fqn]
        # 96 probes x 2 rows: relative standard error ~ sqrt(2/192) = 0.1
        assert rec["fld"]["fp4"] == pytest.approx(gn, rel=0.4), fqn


@pytest.mark.slow
def test_mc_fisher_is_seeded_and_close_to_empirical(model):
    b = _batches(2)
    s1 = collect_statistics(model, b, _full(seed=0), lr=1e-3)
    s2 = collect_statistics(model, b, _full(seed=0), lr=1e-3)
    s3 = collect_statistics(model, b, _full(seed=1), lr=1e-3)
    emp = collect_statistics(model, b, _full(estimator="empirical"), lr=1e-3)
    assert s1 == s2 and s1["layers"][LAYER]["fld"] != s3["layers"][LAYER]["fld"]
    # at initialisation the model's labels are as uncertain as the data: both Fisher forms agree within 3x
    # (per channel: the sequence form of 4 rows is a sum of 4 squares, too noisy for a 3x band)
    for fqn, rec in s1["layers"].items():
        ratio = rec["fld_channel"]["fp4"] / emp["layers"][fqn]["fld_channel"]["fp4"]
        assert 1 / 3 < ratio < 3, fqn


@pytest.mark.rounding
def test_reduce_over_simulated_ranks_matches_pooled_single_rank(model):
    b0, b1 = _batches(2)
    captured = {}

    def capture(t):
        captured["rank1"] = t.clone()
        return t

    alone1 = collect_statistics(model, [b1], _full(estimator="empirical", precond_fallback="ones",
                                                   bwd_propagated=True), lr=1e-3, reduce=capture)
    alone0 = collect_statistics(model, [b0], _full(estimator="empirical", precond_fallback="ones",
                                                   bwd_propagated=True), lr=1e-3)
    calls = []

    def reduce(t):
        calls.append(1)
        return t + captured["rank1"]

    two = collect_statistics(model, [b0], _full(estimator="empirical", precond_fallback="ones", bwd_propagated=True),
                             lr=1e-3, reduce=reduce, world_size=2)
    one = collect_statistics(model, [b0, b1], _full(estimator="empirical", precond_fallback="ones", bwd_propagated=True),
                             lr=1e-3)
    assert calls == [1] and two["tokens"] == one["tokens"]
    # the same per-batch sums added in another order (one addition each): 1e-5 ≫ 2^-24; first_order is
    # signed and cancels, so 1e-4 relative plus 1e-12 absolute
    for fqn in one["layers"]:
        r2, r1 = two["layers"][fqn], one["layers"][fqn]
        assert r2["flops"] == pytest.approx(2 * r1["flops"])  # tokens per step double with two ranks
        for p in ("fp8", "fp4"):
            assert r2["fld"][p] == pytest.approx(r1["fld"][p], rel=1e-5)
            assert r2["first_order"][p] == pytest.approx(r1["first_order"][p], rel=1e-4, abs=1e-12)
            # the averaged gradient's (independent) error has 1/W of one rank's squared norm
            assert r2["bwd_drift"][p] == pytest.approx(r1["bwd_drift"][p] / 2, rel=1e-5)
            assert r2["bwd"][p] == pytest.approx(r1["bwd"][p] / 2, rel=1e-5)
            # per-batch means of squared errors (the same two batches, summed in another order: 1e-5): the
            # quantization errors the baselines price, and the dgrad error of the propagated estimate
            for key in ("quant_err", "rel_quant_err", "quant_err_x", "quant_err_g", "dgrad_err"):
                assert r2[key][p] == pytest.approx(r1[key][p], rel=1e-5), (fqn, key, p)
            # ... and a per-batch mean: that of the two batches' own values (each one checked against whole
            # tensors in test_layer_statistics_match_independent_reference)
            for key in ("quant_err", "quant_err_w", "quant_err_g", "dgrad_err"):
                mean = (alone0["layers"][fqn][key][p] + alone1["layers"][fqn][key][p]) / 2
                assert r1[key][p] == pytest.approx(mean, rel=1e-5), (fqn, key, p)


@pytest.mark.rounding
def test_callable_precond_matches_tensor(model):
    b = _batches(1)
    pre = {f: torch.full(m.weight.shape, 2.0) for f, m in snip_layers(model).items()}
    calls = []

    def partial_sum(fqn, t):
        calls.append(fqn)
        return ((t * pre[fqn]) ** 2).sum()

    a = collect_statistics(model, b, _full(estimator="empirical"), lr=1e-3, precond=pre)
    c = collect_statistics(model, b, _full(estimator="empirical"), lr=1e-3, precond=partial_sum)
    # per layer: fp8's drift, fp4's systematic part and fp4's stochastic-rounding noise
    assert c["precond"] == "callable" and a["precond"] == "tensor" and len(calls) == 3 * len(pre)
    # the same products, summed per layer by the callable instead of inside the collector: 1e-5 ≫ log2(n)·u
    for fqn in a["layers"]:
        for key in ("bwd_drift", "bwd", "bwd_drift_bias", "bwd_bias"):
            for p in ("fp8", "fp4"):
                assert c["layers"][fqn][key][p] == pytest.approx(a["layers"][fqn][key][p], rel=1e-5)


def test_artifact_loads_in_planner_and_flags_nonfinite(model, tmp_path):
    pre = {f: torch.ones(m.weight.shape) for f, m in snip_layers(model).items()}
    pre[LAYER] = torch.full_like(pre[LAYER], float("inf"))
    stats = collect_statistics(model, _batches(1), _full(lam=100.0, bwd_propagated=True), lr=1e-3,
                               precond=pre, step=7)
    path = tmp_path / "stats.json"
    save_stats(stats, str(path))
    loaded = load_stats(str(path))
    assert loaded["step"] == 7 and loaded["lambda"] == 100.0 and loaded["format"] == "snip_ds.stats/1"
    assert loaded["layers"][LAYER]["nonfinite"] is True and loaded["layers"][LAYER]["bwd"]["fp4"] is None
    others = [r for f, r in loaded["layers"].items() if f != LAYER]
    assert all(not r["nonfinite"] for r in others)
    with pytest.warns(RuntimeWarning, match="pinned"):
        sc = costs_from_stats(loaded)
    assert sc.pinned == {LAYER: "fp8"} and set(sc.costs) == set(stats["layers"])
    # the propagated ablation: the first layer has nothing upstream, later ones add to the direct term
    first = loaded["layers"]["model.layers.0.self_attn.q_proj"]
    assert first["bwd_drift_propagated"]["fp4"] == 0.0
    down = loaded["layers"]["model.layers.1.mlp.up_proj"]
    assert down["bwd_propagated"]["fp4"] > down["bwd"]["fp4"] and down["dgrad_err"]["fp4"] > 0


def test_adam_precond_is_the_optimizers_own_update_ratio():
    """adam_precond's P against torch's AdamW itself: with β₁ = 0 and no weight decay an update is
    -lr·g/(sqrt(v̂) + eps), so after a step P = -Δw/(lr·g) (elements with |g| > 1e-3, where FP32's rounding of
    w - Δw, ~2^-24·|w|/|Δw| ≤ 1e-5 relative, cannot blur the ratio)."""
    model = _model(seed=2)
    layers = snip_layers(model)
    lr = 1e-2
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.0, 0.95), eps=1e-8, weight_decay=0.0)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        grads = {n: torch.randn(p.shape, generator=gen) * 0.1 for n, p in model.named_parameters()}
        before = {f: m.weight.detach().clone() for f, m in layers.items()}
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
    pc = adam_precond(model, opt)
    assert pc.step == 3 and pc.lr == lr and set(pc.precond) == set(layers)
    for fqn, m in layers.items():
        g = grads[fqn + ".weight"]
        keep = g.abs() > 1e-3
        want = (-(m.weight.detach() - before[fqn]) / (lr * g))[keep]
        torch.testing.assert_close(pc.precond[fqn][keep], want, rtol=1e-4, atol=0)
    model.zero_grad(set_to_none=True)


def test_adam_precond_read_when_used_gives_what_a_dict_of_tensors_gives():
    """adam_precond computes each layer's P when the collection reads it (no copy of the optimizer state is
    kept): the artifact equals the one from the same P materialised as a dict of tensors up front."""
    model = _model(seed=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for batch in _batches(2):
        model(batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    pc = adam_precond(model, opt)
    eager = {fqn: pc.precond[fqn].clone() for fqn in pc.precond}
    assert not isinstance(pc.precond, dict) and set(eager) == set(snip_layers(model))
    how = CollectSettings(study_fields=tuple(STUDY_FIELDS))
    lazy_stats = collect_statistics(model, _batches(1), how, lr=1e-3, precond=pc.precond, step=pc.step)
    assert lazy_stats == collect_statistics(model, _batches(1), how, lr=1e-3, precond=eager, step=pc.step)
    assert lazy_stats["precond"] == "tensor"


def test_empty_precond_mapping_means_no_optimizer_state(model):
    """adam_precond before the first optimizer step gives {}: the fallback is used, and the artifact says so."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pc = adam_precond(model, opt)
    assert pc.precond == {} and pc.step == 0
    s = collect_statistics(model, _batches(1), lr=1e-3, precond=pc.precond)
    assert s["precond"] == "factored"
    assert s == collect_statistics(model, _batches(1), lr=1e-3, precond=None)


@pytest.mark.rounding
def test_isotropic_alpha_is_the_curvature_along_its_direction():
    """α (the isotropic ablation) is a central second difference of the FP32 mean loss along v at the last
    block's output z; against the exact directional curvature vᵀ(∂²ℒ/∂z²)v / ‖v‖², a Hessian-vector product
    (double backward through the final norm, lm_head and the loss), v being the collector's own draw (its
    generator gives the probe u, then v). The model's weights are drawn 25x wider than the fixture's: at
    Llama's default 0.02 the difference of the four losses, ~1e-6, is below their FP32 rounding and α comes out
    0 or off by 70 % (seeds 7-9), so this check needs logits whose curvature the passes can resolve."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
                      initializer_range=0.5)
    model = LlamaForCausalLM(cfg)
    swap_linears(model, "fp8", seed=3)
    batch, seed = _batches(1, seed=4)[0], 8
    s = collect_statistics(model, [batch], CollectSettings(estimator="isotropic", seed=seed), lr=1e-3)
    layers = snip_layers(model)
    leaf = {}

    def hook(mod, inp, out):
        z = out[0] if isinstance(out, tuple) else out
        leaf["z"] = z.detach().requires_grad_(True)
        return (leaf["z"], *out[1:]) if isinstance(out, tuple) else leaf["z"]

    for m in layers.values():
        m.precision = "bf16"  # the collection's passes are unquantized
    h = model.model.layers[-1].register_forward_hook(hook)
    logits = model(input_ids=batch).logits
    h.remove()
    z = leaf["z"]
    gen = torch.Generator().manual_seed(seed)
    torch.randn(z.shape, generator=gen, dtype=z.dtype)  # the probe u
    v = torch.randn(z.shape, generator=gen, dtype=z.dtype)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, 257), batch[:, 1:].reshape(-1))
    (gz,) = torch.autograd.grad(loss, z, create_graph=True)
    (hv,) = torch.autograd.grad((gz * v).sum(), z)
    v64 = v.double()
    curvature = float((v64 * hv.double()).sum() / (v64 * v64).sum())
    # Tolerance: each of the four losses is an FP32 mean of N = 62 cross-entropies, wrong by at most
    # ~(N + 4)·u·ℒ (u = 2^-24); the second difference combines them with weights 1, 1, 2 and divides by
    # δ²‖v‖², δ = 0.02·rms(z). (Truncation, δ²-relative, is far smaller at this δ: 1 % is left for it.)
    n, u = batch[:, 1:].numel(), 2.0 ** -24
    delta = 0.02 * float(z.detach().pow(2).mean().sqrt())
    bound = 4 * (n + 4) * u * float(loss.detach()) / (delta ** 2 * float((v64 * v64).sum()))
    assert abs(curvature) > 3 * bound  # resolvable: the comparison below can fail
    assert s["alpha"] == pytest.approx(curvature, rel=1e-2, abs=bound)
    assert 2.0 < s["quadratic_ratio"] < 6.0  # 4 in the quadratic regime
    # every FLD is α times a sum of squares
    assert all(math.copysign(1.0, r["fld"][p]) == math.copysign(1.0, s["alpha"])
               for r in s["layers"].values() for p in ("fp8", "fp4"))


def test_bad_arguments(model):
    b = _batches(1)
    with pytest.raises(ValueError, match="valid: mc_fisher, empirical, isotropic"):
        collect_statistics(model, b, _full(estimator="hessian"), lr=1e-3)
    with pytest.raises(ValueError, match="fld_form: unknown value 'token'; valid: sequence, channel"):
        collect_statistics(model, b, _full(fld_form="token"), lr=1e-3)
    with pytest.raises(ValueError, match="not SnipLinear"):
        collect_statistics(model, b, lr=1e-3, layers=["model.lm_head"])
    with pytest.raises(ValueError, match="shape"):
        collect_statistics(model, b, lr=1e-3, precond={f: torch.ones(3) for f in snip_layers(model)})
    with pytest.raises(ValueError, match="empty"):
        collect_statistics(model, [], lr=1e-3)
    with pytest.raises(ValueError, match="precisions"):
        collect_statistics(model, b, _full(precisions=("bf16",)), lr=1e-3)
    with pytest.raises(ValueError, match="input_ids"):
        collect_statistics(model, [[1, 2, 3]], lr=1e-3)
    with pytest.raises(ValueError, match="SnipLinear"):
        collect_statistics(torch.nn.Linear(2, 2), b, lr=1e-3)


@pytest.mark.rounding
def test_dgrad_estimate_matches_an_independent_reference(model):
    """bwd_drift_propagated of down_proj = lr²·mean_b‖e_b‖²·Σ_b Σ_upstream m ‖G_W,m⊙P_m‖² / Σ_b ‖G_X,b‖², with e the
    fp4 dgrad error and G_X the gradient at down_proj's input, from plain BF16 forward/backward passes with
    retain_grad over 3 batches (input groups are per forward: they were once keyed by recycled tensor ids,
    which mixed groups up across batches)."""
    batches = _batches(3, seed=5)
    layers = snip_layers(model)
    gen = torch.Generator().manual_seed(11)
    pre = {f: torch.rand(m.weight.shape, generator=gen) + 0.5 for f, m in layers.items()}
    stats = collect_statistics(model, batches, _full(bwd_propagated=True, bwd_rounding="nearest"), lr=1e-3,
                               precond=pre)
    names = list(layers)
    upstream = names[:names.index(LAYER)]  # every layer before down_proj (none shares its input)
    e_sq, up, gx_sq = 0.0, {m: 0.0 for m in upstream}, 0.0
    for batch in batches:
        e, up_b, gx = _dgrad_reference(model, layers, batch, pre, upstream)
        e_sq, gx_sq = e_sq + e / 3, gx_sq + gx
        up = {m: up[m] + up_b[m] for m in upstream}
    got = stats["layers"][LAYER]
    # 1e-4: the same operands (plain forward/backward), sums of ≤ 3·62·128 terms in another order (~sqrt(n)·u)
    assert got["bwd_drift_propagated"]["fp4"] == pytest.approx(1e-6 * e_sq * sum(up.values()) / gx_sq, rel=1e-4)
    # bwd_dgrad: the same drift, each upstream layer's part priced at that layer's own bwd / bwd_drift
    parts = {m: 1e-6 * e_sq * up[m] / gx_sq for m in upstream}
    assert sum(parts.values()) == pytest.approx(got["bwd_drift_propagated"]["fp4"], rel=1e-4)
    price = {m: stats["layers"][m]["bwd"]["fp4"] / stats["layers"][m]["bwd_drift"]["fp4"] for m in upstream}
    assert got["bwd_dgrad"]["fp4"] == pytest.approx(sum(parts[m] * price[m] for m in upstream), rel=1e-4)
    assert 0 < got["bwd_dgrad"]["fp8"] < got["bwd_dgrad"]["fp4"]
    first = stats["layers"]["model.layers.0.self_attn.q_proj"]
    assert first["bwd_drift_propagated"]["fp4"] == first["bwd_dgrad"]["fp4"] == 0.0  # nothing upstream


def _dgrad_reference(model, layers, batch, pre, upstream):
    """(‖e‖², {upstream m: ‖G_W,m⊙P_m‖²}, ‖G_X‖²) of down_proj on one batch."""
    saved = {}

    def hook(fqn):
        def f(m, inp, out):
            inp[0].retain_grad()
            out.retain_grad()
            saved[fqn] = (inp[0], out)
        return f

    prec = {f: m.precision for f, m in layers.items()}
    for m in layers.values():
        m.precision = "bf16"
    handles = [m.register_forward_hook(hook(f)) for f, m in layers.items()]
    try:
        logits = model(input_ids=batch).logits
        F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).backward()
    finally:
        for h in handles:
            h.remove()
        for f, m in layers.items():
            m.precision = prec[f]
        model.zero_grad(set_to_none=True)

    def flat(t):
        return t.detach().reshape(-1, t.shape[-1]).float()

    mod = layers[LAYER]
    x_in, y = saved[LAYER]
    g = flat(y.grad)
    cfg = replace(mod.quant_config, stochastic_rounding=False)
    w = mod.weight.detach().float()
    e = get_backend().dgrad(g, w, "fp4", cfg, torch.Generator()) - g @ w
    up = {m: float(((flat(saved[m][1].grad).t() @ flat(saved[m][0])) * pre[m]).pow(2).sum()) for m in upstream}
    return float(e.pow(2).sum()), up, float(flat(x_in.grad).pow(2).sum())


def test_input_groups_are_the_layers_that_share_an_input():
    """q/k/v share one input, gate/up another; o_proj and down_proj have their own. Groups are found by the
    input tensor's id within a forward, so no input may be freed (and its id recycled) before the forward ends:
    on this 4-block model that once merged two blocks' groups."""
    from snip_ds.stats.collector import Collector
    from snip_ds.stats.preserve import preserved
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=257, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    model = LlamaForCausalLM(cfg)
    swap_linears(model, "fp8", seed=3)
    layers = snip_layers(model)
    col = Collector(model, layers, _full(bwd_propagated=True), None)
    g = torch.Generator().manual_seed(1)
    with preserved(model, layers), col.hooks():
        for _ in range(3):
            col.run_batch(torch.randint(0, 257, (2, 64), generator=g), 1)
    groups = {}
    for fqn, gid in col.groups.group.items():
        groups.setdefault(gid, []).append(fqn)
    expected = []
    for b in range(4):
        p = f"model.layers.{b}."
        expected += [[p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"],
                     [p + "self_attn.o_proj"], [p + "mlp.gate_proj", p + "mlp.up_proj"], [p + "mlp.down_proj"]]
    assert sorted(sorted(g) for g in groups.values()) == sorted(sorted(g) for g in expected)


@pytest.mark.rounding
def test_forward_drift_matches_a_brute_force_linear_response(model):
    """``fwd``: (lr²/2N)·⟨G^probe ⊙ P, ΔG⟩² for one probe, against ΔG measured directly: the planned weights'
    training gradient with layer ℓ's output shifted by ±t·E_ℓ(p), a central difference on an FP64 copy (the
    collector gets ⟨·, ΔG⟩ the other way round, from output gradients at W ± ε·P⊙G^probe). t = 0.01: Llama's
    RMSNorm computes in FP32 even in an FP64 model, so a smaller shift drowns in its rounding."""
    import copy
    batch = _batches(1, seed=6)[0]
    gen = torch.Generator().manual_seed(11)
    layers = snip_layers(model)
    pre = {f: torch.rand(m.weight.shape, generator=gen) + 0.5 for f, m in layers.items()}
    lr, seed = 1e-2, 5
    stats = collect_statistics(model, [batch], _full(num_probes=1, seed=seed, forward_drift=True), lr=lr,
                               precond=pre)
    assert stats["forward_drift"] is True
    fqns = sorted(layers)
    saved = {f: m.precision for f, m in layers.items()}
    for m in layers.values():
        m.precision = "bf16"
    try:  # the probe the collector drew: labels from the model's softmax with its seeded generator
        logits = model(input_ids=batch).logits[:, :-1].reshape(-1, 257).float()
        y_hat = torch.multinomial(torch.softmax(logits.detach(), -1), 1,
                                  generator=torch.Generator().manual_seed(seed)).squeeze(1)
        probe = torch.autograd.grad(F.cross_entropy(logits, y_hat, reduction="sum"),
                                    [layers[f].weight for f in fqns])
    finally:
        for f, m in layers.items():
            m.precision = saved[f]
    v = [(g * pre[f]).double() for g, f in zip(probe, fqns)]
    m64 = copy.deepcopy(model).double()
    l64 = snip_layers(m64)
    for m in l64.values():
        m.precision = "bf16"
    be = get_backend()
    n = batch[:, 1:].numel()
    checked = 0
    for fqn in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj", "model.layers.1.self_attn.o_proj",
                "model.layers.1.mlp.down_proj"):
        mod = layers[fqn]
        cfg = replace(mod.quant_config, stochastic_rounding=False)
        w = mod.weight.detach().float()
        for p in ("fp8", "fp4"):
            grads = {}
            for sign in (1.0, -1.0):
                def hook(m, inp, y, sign=sign):
                    x = inp[0].reshape(-1, inp[0].shape[-1]).float()
                    e = (be.fprop(x.detach(), w, p, cfg) - x.detach() @ w.t()).double()
                    return y + 1e-2 * sign * e.reshape(y.shape)
                h = l64[fqn].register_forward_hook(hook)
                lg = m64(input_ids=batch).logits[:, :-1].reshape(-1, 257)
                grads[sign] = torch.autograd.grad(F.cross_entropy(lg, batch[:, 1:].reshape(-1)),
                                                  [l64[f].weight for f in fqns])
                h.remove()
            a = sum((vi * (gp - gm)).sum() for vi, gp, gm in zip(v, grads[1.0], grads[-1.0])).item() / 2e-2
            expected = lr ** 2 * a * a / (2 * n)
            # 5%: the central difference's truncation O(t²) and the FP32 RMSNorm's rounding over the 2t = 0.02
            # shift (docstring) in the reference, not the collector's round-off (~1e-6)
            assert stats["layers"][fqn]["fwd"][p] == pytest.approx(expected, rel=0.05), (fqn, p)
            checked += 1
    assert checked == 8
    # and the planner prices it on the fprop GEMM at λ: per layer FLD + λ·(FWD + BWD)
    lam = 7.0
    with_fwd = costs_from_stats(stats, lam, forward_drift=True).costs[LAYER]["fp4"]
    rec = stats["layers"][LAYER]
    assert with_fwd == pytest.approx(rec["fld"]["fp4"] + lam * (rec["fwd"]["fp4"] + rec["bwd"]["fp4"]))
    per_gemm = costs_from_stats(stats, lam, forward_drift=True, per_gemm=True).costs[LAYER]["fp4"]
    assert per_gemm["fprop"] == pytest.approx(rec["fld"]["fp4"] + lam * rec["fwd"]["fp4"])
    assert per_gemm["wgrad"] == pytest.approx(0.5 * lam * rec["bwd"]["fp4"])
    # FWD at its own weight μ instead of λ
    mu = 0.25
    own = costs_from_stats(stats, lam, forward_drift=True, fwd_lambda=mu).costs[LAYER]["fp4"]
    assert own == pytest.approx(rec["fld"]["fp4"] + mu * rec["fwd"]["fp4"] + lam * rec["bwd"]["fp4"])


def test_forward_drift_bad_settings(model):
    b = _batches(1)
    with pytest.raises(ValueError, match="forward_drift needs estimator='mc_fisher'"):
        collect_statistics(model, b, _full(estimator="empirical", forward_drift=True), lr=1e-3)
    with pytest.raises(ValueError, match="forward_drift needs weight-shaped preconditioners"):
        collect_statistics(model, b, _full(forward_drift=True), lr=1e-3,
                           precond=lambda fqn, t: (t * t).sum())
    stats = collect_statistics(model, b, lr=1e-3)
    assert stats["forward_drift"] is False and "fwd" not in stats["layers"][LAYER]
    with pytest.raises(ValueError, match="lack field 'fwd': forward_drift needs statistics collected with"):
        costs_from_stats(stats, 2.0, forward_drift=True)
    with pytest.raises(ValueError, match="fwd_lambda weighs FWD: it needs forward_drift=True"):
        costs_from_stats(stats, 2.0, fwd_lambda=0.1)


@pytest.mark.parametrize("how", [
    {},  # the training default: mc_fisher, sequence form, the recipe's rounding
    {"fld_form": "channel"},
    {"estimator": "empirical"},
    {"estimator": "empirical", "fld_form": "channel", "bwd_propagated": True},
    {"bwd_rounding": "nearest", "forward_drift": True},
], ids=["default", "channel", "empirical", "empirical-channel-propagated", "nearest-forward-drift"])
def test_study_fields_change_nothing_else(model, how):
    """A collection without study fields records every other field exactly as one with all of them does
    (the same sums from the same passes and generators: equal bit for bit), and no study field; each group
    asked alone adds exactly its fields."""
    b = _batches(1)
    pre = {f: torch.rand(m.weight.shape, generator=torch.Generator().manual_seed(7)) + 0.5
           for f, m in snip_layers(model).items()}
    full = collect_statistics(model, b, _full(**how), lr=1e-3, precond=pre)
    lean = collect_statistics(model, b, CollectSettings(**how), lr=1e-3, precond=pre)
    assert full["study_fields"] == sorted(STUDY_FIELDS) and lean["study_fields"] == []
    assert {k: v for k, v in lean.items() if k not in ("layers", "study_fields")} == \
        {k: v for k, v in full.items() if k not in ("layers", "study_fields")}
    study = {f for fields in STUDY_FIELDS.values() for f in fields}
    for fqn, rec in full["layers"].items():
        assert lean["layers"][fqn] == {k: v for k, v in rec.items() if k not in study}, fqn
    assert {"fld", "bwd", "flops", "nonfinite"} <= set(lean["layers"][LAYER])
    for group, fields in STUDY_FIELDS.items():
        one = collect_statistics(model, b, CollectSettings(**how, study_fields=[group]), lr=1e-3, precond=pre)
        assert one["study_fields"] == [group]
        for fqn, rec in full["layers"].items():
            assert one["layers"][fqn] == {k: v for k, v in rec.items() if k not in study or k in fields}, fqn


def test_study_fields_setting_and_plan_needs():
    from snip_ds.planner.costs import costs_from_stats, plan_study_fields, quant_err_costs
    from snip_ds.config.settings import ConfigError, parse_snip_section
    assert CollectSettings(study_fields=["quant_err", "fld_forms", "quant_err"]).study_fields == \
        ("fld_forms", "quant_err")
    with pytest.raises(ValueError, match="study_fields: unknown group\\(s\\) 'fld'; valid: fld_forms"):
        CollectSettings(study_fields=["fld"])
    with pytest.raises(ValueError, match="study_fields: expected a list of group names"):
        CollectSettings(study_fields="quant_err")
    assert plan_study_fields("best") == () and plan_study_fields("random") == ()
    assert plan_study_fields("best", "bwd_bias") == ("bwd_bias",)
    assert plan_study_fields("rel_quant_err") == ("quant_err",)
    s = parse_snip_section({"research": {"bwd_estimate": "systematic", "study_fields": ["first_order"]}})
    assert s.collect_study_fields == ("bwd_bias", "first_order")
    assert parse_snip_section({"method": "quant_err"}).collect_study_fields == ("quant_err",)
    assert parse_snip_section({}).collect_study_fields == ()
    with pytest.raises(ConfigError, match="snip.research.study_fields: unknown group\\(s\\) 'x'"):
        parse_snip_section({"research": {"study_fields": ["x"]}})
    with pytest.raises(ConfigError, match="snip.research.study_fields: expected a list of strings"):
        parse_snip_section({"research": {"study_fields": "quant_err"}})
    # a training run's statistics lack the baselines' fields: solving one of them says why
    lean = {"format": "snip_ds.stats/1", "study_fields": [], "lambda": 1.0,
            "layers": {"a": {"flops": 1.0, "fld": {"fp8": 1.0, "fp4": 2.0}, "bwd": {"fp8": 1.0, "fp4": 2.0}}}}
    with pytest.raises(ValueError, match="lack field 'quant_err' .*without study field group 'quant_err'"):
        quant_err_costs(lean)
    with pytest.raises(ValueError, match="lack field 'bwd_bias' .*snip.research.study_fields"):
        costs_from_stats(lean, bwd_key="bwd_bias")
    assert costs_from_stats(lean).costs["a"]["fp4"] == 4.0


@pytest.mark.rounding
def test_sequence_fld_from_the_layers_input_gradient_matches_fp64():
    """The probe's sequence-form FLD, ``Σ_rows (Σ_t g_t·E_t)²`` with ``E = Q(X)Q(W)ᵀ - XWᵀ``: from the layer's
    own input gradient ``gW`` (what the probe's backward hands over) and, without it, from XWᵀ itself; both
    against the same sums in FP64 on the same quantized operands. Tolerance: each row's sum in FP32 errs by
    at most γ·Σ|terms| (γ = (n + L·k + 4)·u: an n-deep product, then L·k summed terms), bounded from the
    operands' magnitudes; FLD is a sum of squares of these sums."""
    from snip_ds.backend import statistics_backend
    from snip_ds.linear import SnipLinear
    from snip_ds.stats.common import Shared, Sums
    from snip_ds.stats.fld import FldEstimator
    gen = torch.Generator().manual_seed(3)
    rows, L, k, n = 3, 8, 16, 16  # small sums: the worst-case bound stays far below the FLD it checks
    layer = SnipLinear(k, n, precision="bf16")
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=gen) * 0.2)
    x = torch.randn(rows, L, k, generator=gen)
    g = torch.randn(rows * L, n, generator=gen)
    w = layer.weight.detach()
    be = statistics_backend()
    cfg = replace(layer.quant_config, stochastic_rounding=False)
    u = 2.0 ** -24
    got = {}
    for with_dx in (True, False):
        shared = Shared(Sums(), be, ("fp8", "fp4"))
        FldEstimator(shared, CollectSettings()).on_probe("l", layer, x, g, rows, g @ w if with_dx else None)
        got[with_dx] = {p: float(shared.stats.get("l", f"fld_seq.{p}")[0]) for p in ("fp8", "fp4")}
    x2 = x.reshape(-1, k)
    for p in ("fp8", "fp4"):
        xq, wq = be.quantize(x2, p, "x", -1, cfg).double(), be.quantize(w, p, "w", -1, cfg).double()
        g64, x64, w64 = g.double(), x2.double(), w.double()
        s = (g64 * (xq @ wq.t() - x64 @ w64.t())).sum(1).reshape(rows, -1).sum(1)
        mag = ((g64.abs() @ wq.abs()) * xq.abs() + (g64.abs() @ w64.abs()) * x64.abs()).sum(1)
        err = (n + L * k + 4) * u * mag.reshape(rows, -1).sum(1)  # |δs| per row, both forms
        assert float(err.max()) < 0.05 * float(s.abs().min())  # the bound is small against what it checks
        ref = float((s * s).sum())
        tol = float((2 * s.abs() * err + err * err).sum())
        for with_dx in (True, False):
            assert abs(got[with_dx][p] - ref) <= tol, (p, with_dx)


def test_fp32_matmuls_sets_tf32_on_cuda_only_and_restores_the_flag():
    """The collection's TF32 switch flips cuBLAS's flag for a CUDA device only, and restores what it found,
    also when the block raises; after it, the older ``allow_tf32`` flag still reads (torch refuses to read it
    while the two APIs disagree)."""
    from snip_ds.stats.common import fp32_matmuls

    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    try:
        for legacy in (False, True):  # a user's setting through the older flag
            matmul.allow_tf32 = legacy
            found = matmul.fp32_precision
            with fp32_matmuls(torch.device("cuda", 0), True):
                assert matmul.fp32_precision == "tf32"
            assert matmul.fp32_precision == found
            assert matmul.allow_tf32 == legacy
            for device, tf32 in ((torch.device("cuda"), False), (torch.device("cpu"), True)):
                with fp32_matmuls(device, tf32):
                    assert matmul.fp32_precision == found
            matmul.fp32_precision = "ieee"
            with pytest.raises(KeyError):
                with fp32_matmuls("cuda", True):
                    raise KeyError("inside")
            assert matmul.fp32_precision == "ieee"
    finally:
        matmul.fp32_precision = saved



def _first_collection_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=257, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, use_cache=False)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    swap_linears(model, "fp8", seed=3)
    batch = torch.randint(0, 257, (4, 128), generator=torch.Generator().manual_seed(1))
    return model, batch


@pytest.mark.rounding
def test_first_collection_does_not_follow_the_order_of_summation():
    """The first collection (no optimizer state: the default ``factored`` prior) under another order of
    summation of its FP32 products (every reduction split in two halves added in FP32, as another GEMM kernel
    sums; a BF16 model's own products, and so G_Y and X, unchanged). BWD itself follows such a reordering a
    little: the drift ΔG_W is a small difference of two products of T terms (FP8's systematic part cancels the
    most), so with ``P = 1`` (the ``ones`` prior: no prior at all) a layer's BWD moves by up to ~2 % here. The
    prior must not amplify that: P comes from sums of squares, which a reordering moves by far less, so BWD under
    it moves by a P²-weighted mean of the same element-wise changes, about as much as without a prior. The test
    allows 4× the prior-free change (P² concentrated on a few rows can weigh their changes more), and the plan
    must not change. The element-wise ``grad_sq`` prior, whose largest P are the elements whose sum over tokens
    cancels, moves this model's BWD about 300× as much as ``ones`` (the default model's up to 196-fold, changing
    the first plan in 7 of 8 seeds:
    docs/experiments.md)."""
    model, batch = _first_collection_model()
    change, plans = {}, {}
    for prior in ("ones", "factored"):
        how = CollectSettings(seed=5, precond_fallback=prior)
        exact = collect_statistics(model, [batch], how, lr=1e-3)
        with SplitK(fp32_only=True):
            moved = collect_statistics(model, [batch], how, lr=1e-3)
        assert exact["precond"] == moved["precond"] == prior
        change[prior] = max(abs(moved["layers"][f]["bwd"][p] - b) / b
                            for f, want in exact["layers"].items() for p, b in want["bwd"].items())
        plans[prior] = [solve_baseline("best", s, 0.75, CostSettings(lam=2.0))[0].assignment
                        for s in (exact, moved)]
    assert CollectSettings().precond_fallback == "factored"
    assert 0 < change["ones"] < 0.25  # the reordering reaches the statistics, and only as round-off
    assert change["factored"] <= 4 * change["ones"], change
    assert plans["factored"][0] == plans["factored"][1]


def test_tf32_operand_rounding_moves_the_statistics_within_its_bound():
    """What ``collect_tf32`` changes, emulated on the CPU: every FP32 matrix product of a collection (aten's
    mm, bmm and addmm, wherever they run: hooks, autograd, the backends) gets its operands rounded to TF32
    (2⁻¹¹ relative at most). On a BF16 model's collection, FLD and BWD must move by at most the bound that
    tests/test_gpu.py derives for TF32 tensor cores, 2⁻⁴ relative, and must move at all (the rounding
    reaches them). Sum order, which tensor cores also change, is not emulated here."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    both, first_two = (aten.mm.default, aten.bmm.default), (aten.addmm.default, aten.addmm_.default)
    rounded = []

    class TF32Operands(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in both:
                args = tuple(_round_to_tf32(a) for a in args)
            elif func in first_two:
                args = (args[0], _round_to_tf32(args[1]), _round_to_tf32(args[2])) + tuple(args[3:])
            rounded.append(func in both + first_two)
            return func(*args, **(kwargs or {}))

    x = torch.tensor([1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, 1.0 + 2 ** -12, -3.0 - 2 ** -9 - 2 ** -12])
    assert _round_to_tf32(x).tolist() == [1.0, 1.0 + 4 * 2 ** -11, 1.0, -3.0 - 2 ** -9]  # ties to even
    model, batch = _first_collection_model()
    how = CollectSettings(seed=5, precond_fallback="ones")
    exact = collect_statistics(model, [batch], how, lr=1e-3)["layers"]
    with TF32Operands():
        tf32 = collect_statistics(model, [batch], how, lr=1e-3)["layers"]
    assert sum(rounded) > 50
    moved = 0.0
    for fqn in exact:
        for field in ("fld", "bwd"):
            for p, want in exact[fqn][field].items():
                got = tf32[fqn][field][p]
                assert want > 0 and abs(got - want) <= 2 ** -4 * want, (fqn, field, p, got, want)
                moved = max(moved, abs(got - want) / want)
    assert moved > 0, moved
