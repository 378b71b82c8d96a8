"""snip_ds.stats on MoE experts: each (expert, projection) pair's FLD and BWD against an independent reference
from whole tensors, against the same expert computed by SnipLinear layers on its routed tokens, an expert that
no token reaches, the reduction over ranks, and the optimizer-state slices of a 3-D Parameter."""
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GptOssConfig, MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from snip_ds import divergence as dv
from snip_ds.backend import get_backend
from snip_ds.engine import adam_state
from snip_ds.engine.adam_state import layer_preconditioner
from snip_ds.engine.expert_state import expert_preconditioner
from snip_ds.experts.module import SnipExperts
from snip_ds.experts.model import expert_parameters, expert_points, swap_experts
from snip_ds.linear import SnipLinear
from snip_ds.planner import CostSettings, SolverSettings, costs_from_stats, solve_baseline
from snip_ds.stats import STUDY_FIELDS, CollectSettings, adam_precond, collect_statistics
from snip_ds.stats_file import carry_unrouted, load_stats, save_stats, validate_stats
from snip_ds.stats.precond import with_experts
from tests import reference_divergence as refdiv

E, H, I, V, K = 4, 32, 48, 61, 2  # experts, hidden, expert intermediate, vocabulary, experts per token
UNUSED = 3  # the router never picks this expert
ALL = tuple(STUDY_FIELDS)


def _experts_module(family: str) -> nn.Module:
    if family == "mixtral":  # weights [E, out, in]
        module = MixtralExperts(MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                                              num_experts_per_tok=K))
    else:  # GPT-OSS: weights stored [E, in, out], biases, interleaved gate and up
        module = GptOssExperts(GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                                            num_experts_per_tok=K, swiglu_limit=1.0))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return module


class ToyMoeLM(nn.Module):
    """Embedding, one routed-experts block with a residual, LM head: the smallest model whose statistics
    collection meets an experts module; ``unused`` experts are never routed to (with ``unused_if_even``: only in
    a batch whose first token id is even)."""

    def __init__(self, family: str = "mixtral", unused=(UNUSED,), unused_if_even: bool = False) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.embed = nn.Embedding(V, H)
        self.router = nn.Linear(H, E, bias=False)
        self.experts = _experts_module(family)
        self.head = nn.Linear(H, V, bias=False)
        with torch.no_grad():
            for p in (self.embed.weight, self.router.weight, self.head.weight):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        self.unused, self.unused_if_even, self._masked = list(unused), unused_if_even, True

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def route(self, flat: torch.Tensor):
        scores = self.router(flat)
        if self.unused and self._masked:
            scores = scores.index_fill(1, torch.tensor(self.unused), float("-inf"))
        weights, index = torch.topk(scores.softmax(-1), K, dim=-1)
        return index, weights / weights.sum(-1, keepdim=True)

    def moe(self, flat: torch.Tensor) -> torch.Tensor:
        index, weights = self.route(flat)
        return self.experts(flat, index, weights)

    def forward(self, input_ids: torch.Tensor, attention_mask=None) -> SimpleNamespace:
        self._masked = not self.unused_if_even or int(input_ids[0, 0]) % 2 == 0
        h = self.embed(input_ids)  # [B, L, H]
        flat = h.reshape(-1, H)  # [B·L, H], as the families' MoE blocks see it
        out = flat + self.moe(flat)
        return SimpleNamespace(logits=self.head(out).view(*input_ids.shape, V))


def _model(family: str = "mixtral", implementation: str = "eager", unused=(UNUSED,), **kw) -> ToyMoeLM:
    model = ToyMoeLM(family, unused, **kw)
    model.experts.config._experts_implementation = implementation
    swap_experts(model, "fp8", seed=3)
    return model


def _batch(rows: int = 2, length: int = 16, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, V, (rows, length), generator=torch.Generator().manual_seed(seed))


def _reference(model: nn.Module, batch: torch.Tensor, expert: int, projection: int, precision: str,
               path: str = "experts"):
    """X, G_Y (the gradient of the mean loss w.r.t. the pair's own output), the sequences of its tokens, E and
    ΔG_W of one pair of the experts module at ``path`` from a plain forward/backward with every pair at bf16
    (no collector, no ExpertPoint)."""
    snip: SnipExperts = model.get_submodule(path)
    saved = {}
    family_project = SnipExperts._project

    def project(x, e, j, bias_rows=None, tokens=None):
        y = family_project(snip, x, e, j, bias_rows, tokens)
        if (e, j) == (expert, projection):
            y.retain_grad()
            saved.update(x=x.detach().float(), y=y, tokens=tokens)
        return y

    before = snip.precisions()
    snip.set_precision("bf16")
    snip._project = project
    try:
        logits = model(input_ids=batch).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), batch[:, 1:].reshape(-1))
        loss.backward()
    finally:
        del snip._project
        snip.set_precisions(before)
        model.zero_grad(set_to_none=True)
    gy, x = saved["y"].grad.float(), saved["x"]
    w = snip.weight(expert, projection).detach().float()
    cfg = replace(snip.quant_config, stochastic_rounding=False)
    be = get_backend()
    e = be.fprop(x, w, precision, cfg) - x @ w.t()
    dgw = be.wgrad(gy, x, precision, cfg) - gy.t() @ x
    return dict(gy=gy, x=x, e=e, dgw=dgw, seq=saved["tokens"] // batch.shape[1], n=batch[:, 1:].numel())


@pytest.mark.rounding
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_expert_statistics_match_independent_reference(family, implementation):
    """Every statistic of two pairs against whole-tensor formulas, with each token's sequence for the sequence
    form and the expert's own tokens for the per-channel means."""
    model = _model(family, implementation)
    batch = _batch()
    points = expert_points(model)
    gen = torch.Generator().manual_seed(7)
    pre = {f: torch.rand(p.weight.shape, generator=gen) + 0.5 for f, p in points.items()}
    lr = 3e-3
    stats = collect_statistics(model, [batch], CollectSettings(estimator="empirical", bwd_rounding="nearest",
                                                               study_fields=ALL), lr=lr, precond=pre)
    # Tolerances: the reference sees bitwise the same X, G_Y and quantized operands (same forward values, same
    # backend), so only the order of FP32 sums differs: a sum of m terms errs by at most m·u relative
    # (u = 2^-24), here m <= t_e·n <= 32·96 -> 1.8e-4 worst case, about sqrt(m)·u = 3e-6 in practice: 1e-4 for
    # the sums of squares; the first-order term is a signed sum that cancels: 1e-3 relative, 1e-12 absolute.
    for expert, projection in ((0, 0), (1, 1)):
        name = model.experts.layer_name(expert, projection)
        rec = stats["layers"][name]
        for p in ("fp8", "fp4"):
            ref = _reference(model, batch, expert, projection, p)
            t_e, n = ref["x"].shape[0], ref["n"]
            assert rec["routed_tokens"] == t_e and not rec["no_tokens"]
            assert rec["flops"] == 6.0 * t_e * ref["x"].shape[1] * ref["gy"].shape[1]
            g = ref["gy"] * n  # the per-token-scale sensitivity (the empirical estimator's probe)
            # the tokens come from both sequences, in routing order: grouped by sequence, not by position
            assert set(ref["seq"].tolist()) == {0, 1}
            per_seq = torch.zeros(2).index_add_(0, ref["seq"], (g * ref["e"]).sum(1))
            assert rec["fld_sequence"][p] == pytest.approx((per_seq ** 2).sum().item() / (2 * n), rel=1e-4, abs=0)
            assert rec["fld"][p] == rec["fld_sequence"][p]
            fld_ch = refdiv.fld_from_tensors(ref["e"], g, n)  # mean_t g² over the expert's t_e tokens
            assert rec["fld_channel"][p] == pytest.approx(fld_ch.item(), rel=1e-4, abs=0)
            assert rec["first_order"][p] == pytest.approx((ref["gy"] * ref["e"]).sum().item(), rel=1e-3,
                                                          abs=1e-12)
            assert rec["bwd_drift"][p] == pytest.approx(refdiv.bwd_direct(ref["dgw"], pre[name], lr).item(),
                                                        rel=1e-4, abs=0)
            bwd = refdiv.bwd_channel(ref["x"], lr * ref["dgw"] * pre[name], refdiv.channel_sq_mean(g), n)
            assert rec["bwd"][p] == pytest.approx(bwd.item(), rel=1e-4, abs=0)
            assert rec["fld"][p] > 0 and rec["bwd"][p] > 0


@pytest.mark.rounding
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_expert_sequences_in_a_family_model(family):
    """In a transformers model (its own sparse MoE block, router and, Qwen2-MoE, shared expert): a pair's
    sequence-form FLD against the whole-tensor reference, tokens grouped by their sequence."""
    common = dict(hidden_size=H, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                  num_experts_per_tok=K)
    if family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=I, num_local_experts=E, **common))
    else:
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(moe_intermediate_size=I, shared_expert_intermediate_size=I,
                                                   num_experts=E, **common))
    swap_experts(model, "fp8", seed=3)
    path = "model.layers.0.mlp.experts"
    batch = _batch(rows=3, length=12)
    stats = collect_statistics(model, [batch], CollectSettings(estimator="empirical", bwd_rounding="nearest",
                                                               precond_fallback="ones"), lr=1e-3)
    assert {n for n in stats["layers"]} == set(expert_points(model))  # its linears are not SnipLinear here
    for p in ("fp8", "fp4"):
        ref = _reference(model, batch, 0, 1, p, path)
        assert len(set(ref["seq"].tolist())) == 3
        g = ref["gy"] * ref["n"]
        per_seq = torch.zeros(3).index_add_(0, ref["seq"], (g * ref["e"]).sum(1))
        rec = stats["layers"][f"{path}.0.down_proj"]
        # the tolerance of test_expert_statistics_match_independent_reference
        assert rec["fld"][p] == pytest.approx((per_seq ** 2).sum().item() / (2 * ref["n"]), rel=1e-4, abs=0)
        assert rec["routed_tokens"] == ref["x"].shape[0]


class DenseExpertLM(ToyMoeLM):
    """The toy model with expert ``expert``'s two GEMMs done by two SnipLinear layers on its gathered tokens
    (the family's eager loop written out by hand; the other experts run as the family runs them)."""

    def __init__(self, expert: int) -> None:
        super().__init__("mixtral")
        self.expert = expert
        family = self.experts
        self.gate_up = SnipLinear(H, 2 * I, bias=False, precision="fp8")
        self.down = SnipLinear(I, H, bias=False, precision="fp8")
        with torch.no_grad():
            self.gate_up.weight.copy_(family.gate_up_proj[expert])
            self.down.weight.copy_(family.down_proj[expert])
            family.gate_up_proj[expert].zero_()  # the family module contributes nothing for this expert
            family.down_proj[expert].zero_()

    def moe(self, flat: torch.Tensor) -> torch.Tensor:
        index, weights = self.route(flat)
        out = torch.zeros_like(flat)
        for e in torch.unique(index).tolist():  # ascending, as the eager loop adds the experts
            top_k_pos, token_idx = torch.where((index == e).t())
            x = flat[token_idx]
            if e == self.expert:
                gate, up = self.gate_up(x).chunk(2, dim=-1)
                y = self.down(self.experts.act_fn(gate) * up)
            else:
                y = self.experts(x, torch.full((x.shape[0], 1), e), torch.ones(x.shape[0], 1))
            out.index_add_(0, token_idx, y * weights[token_idx, top_k_pos, None])
        return out


@pytest.mark.rounding
def test_expert_statistics_equal_snip_linear_on_its_routed_tokens():
    """The same expert measured as two ordinary SnipLinear layers on its routed tokens (one sequence, so that
    the linears' one row is the expert's one sequence) with Monte-Carlo probes: the same numbers. A linear, like
    an expert, is measured over the tokens its calls saw: its per-channel terms are priced with the probes'
    mean over those t_e tokens, and its FLOPs follow them (not the batch's T)."""
    expert = 1
    moe, dense = _model(), DenseExpertLM(expert)
    batch = _batch(rows=1, length=24)
    moe.experts.set_precision("bf16")
    dense.gate_up.precision = dense.down.precision = "bf16"
    assert torch.equal(moe(batch).logits, dense(batch).logits)  # the same model, bit for bit
    moe.experts.set_precision("fp8")
    dense.gate_up.precision = dense.down.precision = "fp8"
    settings = CollectSettings(study_fields=ALL, precond_fallback="ones")
    a = collect_statistics(moe, [batch], settings, lr=1e-3)
    b = collect_statistics(dense, [batch], settings, lr=1e-3)
    T = batch.numel()
    # Tolerance: both see bitwise the same X, probes (same logits, same seed) and gradients, and run the same
    # estimator code; only the per-row sum of the sequence form runs over tokens·channels in another order
    # (at most t_e·k < 24·48 terms, m·u = 6.9e-5 worst case, ~2e-6 typical): 1e-4 relative; first_order is a
    # signed sum: 1e-3 relative, 1e-12 absolute.
    for proj, linear in (("gate_up_proj", "gate_up"), ("down_proj", "down")):
        ra, rb = a["layers"][f"experts.{expert}.{proj}"], b["layers"][linear]
        t_e = ra["routed_tokens"]
        assert 0 < t_e < T
        assert ra["flops"] == pytest.approx(rb["flops"], rel=1e-12)
        for p in ("fp8", "fp4"):
            for field in ("fld", "fld_sequence", "bwd_drift", "bwd_drift_bias", "quant_err", "rel_quant_err",
                          "fld_channel", "bwd", "bwd_bias"):
                assert ra[field][p] == pytest.approx(rb[field][p], rel=1e-4, abs=0), (proj, field, p)
            assert ra["first_order"][p] == pytest.approx(rb["first_order"][p], rel=1e-3, abs=1e-12)


def test_expert_without_tokens_gets_zeros_and_a_flag(tmp_path):
    """An expert no token is routed to: FLD and BWD exactly 0, no FLOPs, ``no_tokens`` (its weight's own
    quantization error is still measured); the planner reads it."""
    model = _model()
    stats = collect_statistics(model, [_batch()], CollectSettings(study_fields=ALL), lr=1e-3)
    for proj in ("gate_up_proj", "down_proj"):
        rec = stats["layers"][f"experts.{UNUSED}.{proj}"]
        assert rec["no_tokens"] and rec["routed_tokens"] == 0 and rec["flops"] == 0 and not rec["nonfinite"]
        for field in ("fld", "fld_sequence", "fld_channel", "bwd", "bwd_drift", "bwd_bias", "first_order",
                      "quant_err_x", "quant_err_g"):
            assert rec[field] == {"fp8": 0.0, "fp4": 0.0}, field
        assert rec["quant_err"] == rec["quant_err_w"] and rec["quant_err_w"]["fp4"] > 0  # the weight's own
        used = stats["layers"][f"experts.0.{proj}"]
        assert not used["no_tokens"] and used["fld"]["fp4"] > 0 and used["bwd"]["fp4"] > 0
    save_stats(stats, str(tmp_path / "stats.json"))
    stats = load_stats(str(tmp_path / "stats.json"))  # the artifact's reader takes the experts' fields
    assert stats["layers"][f"experts.{UNUSED}.down_proj"]["no_tokens"] is True
    costs = costs_from_stats(stats, lam=100.0)  # finite numbers the planner takes as they are, not pinned
    name = f"experts.{UNUSED}.down_proj"
    assert costs.flops[name] == 0 and costs.costs[name] == {"bf16": 0.0, "fp8": 0.0, "fp4": 0.0}
    assert not costs.pinned
    (plan,) = solve_baseline("best", stats, 0.5, CostSettings(lam=100.0))  # and solves a plan with it
    assert set(plan.assignment) == set(stats["layers"])


def test_ranks_reduce_the_same_sums_whichever_experts_their_tokens_chose():
    """Expert 3 gets tokens from batch b0 but none from b1. Two simulated ranks (b0 on rank 0, b1 on rank 1)
    all-reduce vectors of the same layout, and give the statistics of one rank with both batches (as
    test_collect's dense layers do)."""
    model = _model(unused_if_even=True)
    b0, b1 = _batch(seed=5), _batch(seed=6)
    b0[0, 0], b1[0, 0] = 1, 2  # odd: expert 3 routed to; even: not
    settings = CollectSettings(estimator="empirical", precond_fallback="ones", study_fields=ALL)
    name = f"experts.{UNUSED}.down_proj"
    captured = {}

    def capture(t):
        captured["rank1"] = t.clone()
        return t

    alone1 = collect_statistics(model, [b1], settings, lr=1e-3, reduce=capture)
    assert alone1["layers"][name]["no_tokens"]
    sizes = []

    def reduce(t):
        sizes.append(t.numel())
        return t + captured["rank1"]

    two = collect_statistics(model, [b0], settings, lr=1e-3, reduce=reduce, world_size=2)
    one = collect_statistics(model, [b0, b1], settings, lr=1e-3)
    assert sizes == [captured["rank1"].numel()]
    # the same per-batch sums added in another order (one addition each): 1e-5 >> 2^-24
    for fqn in (name, "experts.0.down_proj", "experts.2.gate_up_proj"):
        r2, r1 = two["layers"][fqn], one["layers"][fqn]
        assert r2["routed_tokens"] == 2 * r1["routed_tokens"] > 0  # per step: two ranks' tokens, or one's
        assert r2["flops"] == pytest.approx(2 * r1["flops"]) and not r2["no_tokens"]
        for p in ("fp8", "fp4"):
            assert r2["fld"][p] == pytest.approx(r1["fld"][p], rel=1e-5) and r2["fld"][p] > 0
            assert r2["bwd_drift"][p] == pytest.approx(r1["bwd_drift"][p] / 2, rel=1e-5)
            assert r2["bwd"][p] == pytest.approx(r1["bwd"][p] / 2, rel=1e-5)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_adam_precond_slices_each_experts_state(family):
    """An expert's preconditioner is its [out, in] part of its 3-D Parameter's Adam state (expert e of
    [E, out, in], transposed where the family stores [E, in, out]); the same through a partitioned state's
    callable split over two simulated ranks at a boundary inside an expert (with_experts)."""
    model = _model(family)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _batch()
    loss = F.cross_entropy(model(input_ids=batch).logits[:, :-1].reshape(-1, V), batch[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    pc = adam_precond(model, opt)
    points = expert_points(model)
    assert set(pc.precond) == set(points) and pc.step == 1
    beta2, eps = opt.param_groups[0]["betas"][1], opt.param_groups[0]["eps"]
    for name, point in points.items():
        v = opt.state[point.parameter]["exp_avg_sq"][point.expert]
        v = v.t() if family == "gpt_oss" else v
        assert torch.equal(pc.precond[name], dv.adam_preconditioner(v, 1, beta2, eps))
        assert pc.precond[name].shape == point.weight.shape
    # a partitioned state: each simulated rank owns a contiguous part of each flattened Parameter
    params = expert_parameters(model)
    assert set(params) == {f"experts.{p}" for p in ("gate_up_proj", "down_proj")}

    def owner(rank):
        def fn(pname, t):
            flat_p = dv.adam_preconditioner(opt.state[params[pname]]["exp_avg_sq"], 1, beta2, eps).reshape(-1)
            cut = flat_p.numel() // 2 + 7  # not at an expert's boundary
            part = slice(0, cut) if rank == 0 else slice(cut, None)
            return ((t.reshape(-1)[part] * flat_p[part]) ** 2).sum()
        return fn

    # ... and the engine's own callable at ZeRO stage 0 (the optimizer holds each Parameter's full state)
    stage0, source = layer_preconditioner(opt, params, step=1)
    assert source == "adam"
    gen = torch.Generator().manual_seed(3)
    for name, point in points.items():
        t = torch.randn(point.weight.shape, generator=gen)
        want = ((t * pc.precond[name]) ** 2).sum().item()
        # the same products summed in another order (the zeros add nothing): 1e-5 >> log2(m)·u
        total = sum(with_experts(owner(r), points)(name, t) for r in (0, 1))
        assert total.item() == pytest.approx(want, rel=1e-5)
        assert with_experts(stage0, points)(name, t).item() == pytest.approx(want, rel=1e-5)


def test_collection_leaves_the_experts_as_they_were():
    """Precisions, the points' modes, the routed token counts and the model's outputs are those before the
    collection."""
    model = _model()
    model.experts.set_precision("fp4", expert=1, projection="down_proj")
    before = model.experts.precisions()
    batch = _batch()
    model.experts.set_precision("bf16")
    ref = model(batch).logits
    model.experts.set_precisions(before)
    model.experts.take_routed_tokens()
    model(batch)  # a training step's forward: counted
    one_forward = model.experts.take_routed_tokens()
    model(batch)
    collect_statistics(model, [batch], CollectSettings(), lr=1e-3)
    assert torch.equal(model.experts.take_routed_tokens(), one_forward)  # the collection's passes are not counted
    assert model.experts.precisions() == before
    assert not any(p.input_grad_only or p.input_grad_observer or p.token_index is not None
                   for p in expert_points(model).values())
    model.experts.set_precision("bf16")
    assert torch.equal(model(batch).logits, ref)
    assert list(dict(model.named_modules())) == ["", "embed", "router", "experts", "experts.act_fn", "head"]


def test_ablations_that_do_not_measure_experts_are_refused():
    model = _model()
    for kw in ({"forward_drift": True}, {"bwd_propagated": True}):
        with pytest.raises(ValueError, match="does not support MoE experts yet"):
            collect_statistics(model, [_batch()], CollectSettings(**kw), lr=1e-3)


def _trained(family: str):
    model = _model(family)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    batch = _batch()
    loss = F.cross_entropy(model(input_ids=batch).logits[:, :-1].reshape(-1, V), batch[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    return model, opt


def _zero12(params, opt, world):
    """A ZeRO 1-2 optimizer's layout (the attributes adam_state reads): the Parameters packed into one flat
    bit16 group cut into ``world`` parts (the cuts inside experts), each rank's FP32 part and its state."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    off = 0
    for p in params:
        p.data = flat[off:off + p.numel()].view_as(p)
        off += p.numel()
    v = torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for p in params])
    bounds = [r * flat.numel() // world + 7 * (0 < r < world) for r in range(world + 1)]  # not at experts' edges
    parts = [flat[bounds[r]:bounds[r + 1]] for r in range(world)]
    fp32 = [torch.zeros(part.numel()) for part in parts]
    state = {f: {"exp_avg_sq": v[bounds[r]:bounds[r + 1]]} for r, f in enumerate(fp32)}
    inner = SimpleNamespace(state=state, param_groups=opt.param_groups)
    return lambda r: SimpleNamespace(optimizer=inner, bit16_groups=[params], bit16_groups_flat=[flat],
                                     parallel_partitioned_bit16_groups=[parts],
                                     single_partition_of_fp32_groups=[fp32[r]], partition_gradients=True)


def _zero3(params, opt, world):
    """A ZeRO-3 optimizer's layout: each Parameter cut into ``world`` parts of ``ds_numel`` (padded), each rank's
    parts packed in one flat group, its FP32 copy and state."""
    fp32, flats = [], []
    for r in range(world):
        chunks = []
        for p in params:
            pn = -(-p.numel() // world)
            v = opt.state[p]["exp_avg_sq"].reshape(-1)[r * pn:(r + 1) * pn]
            chunks.append(torch.cat([v, v.new_zeros(pn - v.numel())]))
        fp32.append(torch.cat(chunks))
        flats.append(torch.zeros_like(fp32[-1]))
    state = {f: {"exp_avg_sq": f.clone()} for f in fp32}
    inner = SimpleNamespace(state=state, param_groups=opt.param_groups)

    def rank(r):
        off = 0
        for p in params:  # ds_tensor: the Parameter's part in this rank's flat group
            pn = -(-p.numel() // world)
            p.ds_tensor = flats[r][off:off + pn]
            p.ds_tensor.ds_numel = pn
            p.ds_numel = p.numel()
            off += pn
        return SimpleNamespace(optimizer=inner, fp16_groups=[params], fp16_partitioned_groups_flat=[flats[r]],
                               fp32_partitioned_groups_flat=[fp32[r]])
    return rank


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_expert_preconditioner_sums_each_ranks_part_of_the_expert(family, stage, monkeypatch):
    """expert_preconditioner over the ZeRO layouts (simulated with the attributes adam_state reads; three ranks,
    so that rank boundaries fall inside experts) sums, over the ranks, to Σ (t ⊙ P)² with the expert's own
    Adam state."""
    model, opt = _trained(family)
    points = expert_points(model)
    pc = adam_precond(model, opt)
    params = list(expert_parameters(model).values())
    world = 1 if stage == 0 else 3
    layout = {0: lambda r: opt, 2: _zero12(params, opt, world) if stage == 2 else None,
              3: _zero3(params, opt, world) if stage == 3 else None}[stage]
    gen = torch.Generator().manual_seed(3)
    tensors = {name: torch.randn(point.weight.shape, generator=gen) for name, point in points.items()}
    totals, owners = dict.fromkeys(points, 0.0), dict.fromkeys(points, 0)
    for r in range(world):
        monkeypatch.setattr(adam_state, "_rank_world", lambda group=None, r=r: (r, world))
        fn, source = expert_preconditioner(layout(r), points, step=1, dense=lambda f, t: None)
        assert source == {0: "adam", 2: "zero2", 3: "zero3"}[stage]
        for name in points:
            part = fn(name, tensors[name]).item()
            totals[name] += part
            owners[name] += part > 0
    assert max(owners.values()) == min(world, 2)  # some expert's state is split between two ranks
    for name in points:
        # the same products summed in parts: 1e-5 >> log2(m)·u
        assert totals[name] == pytest.approx(((tensors[name] * pc.precond[name]) ** 2).sum().item(), rel=1e-5)
    assert expert_preconditioner(opt, points, step=0) == (None, "none (no optimizer step yet)")


@pytest.mark.slow
@pytest.mark.parametrize("stage,ranks", [(0, 1), (3, 1), (2, 2), (3, 2)])
def test_expert_preconditioner_and_collection_under_deepspeed(stage, ranks, tmp_path):
    """A real DeepSpeed run (tests/dist_scripts/experts_state_probe.py: a tiny Mixtral with 3 experts trained 3
    steps; two ranks through the launcher (tests/launch_ranks.py), where a rank boundary falls inside an expert):
    expert_preconditioner's sum over the ranks equals the one from the full Adam state DeepSpeed gathers for
    the expert, and a collection of the experts (ZeRO-3: its Parameters partitioned, released between passes)
    gives finite statistics for every pair, the routed tokens adding up to the batch's token-expert pairs."""
    import json
    import subprocess
    import sys

    from train_utils import REPO, env, ranks_cmd, run_ranks

    out = tmp_path / "probe.json"
    script = str(REPO / "tests" / "dist_scripts" / "experts_state_probe.py")
    args = ["--stage", str(stage), "--out", str(out)]
    if ranks == 1:
        proc = subprocess.run([sys.executable, script, *args], cwd=REPO, env=env(), capture_output=True, text=True,
                              timeout=600)
    else:
        proc = run_ranks(lambda: ranks_cmd(script, args, ranks), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["source"] == {0: "adam", 2: "zero2", 3: "zero3"}[stage] and result["precond"] == "callable"
    assert len(result["pairs"]) == 6  # 3 experts x 2 projections
    for name, pair in result["pairs"].items():
        # every element owned by one rank: the same products, summed in another order (1e-5 >> log2(m)·u)
        assert pair["owned"] == pytest.approx(pair["full"], rel=1e-5), name
    stats = result["stats"]
    for proj in ("gate_up_proj", "down_proj"):  # per rank 2 sequences x 16 tokens x 2 experts per token
        assert sum(r["routed_tokens"] for n, r in stats.items() if n.endswith(proj)) == 64 * ranks
    for name, rec in stats.items():
        assert not rec["nonfinite"], name
        if not rec["no_tokens"]:
            assert rec["fld"]["fp4"] > 0 and rec["bwd"]["fp4"] > 0, name


def _record(fld, bwd, flops, routed, **extra):
    return {"flops": flops, "fld": {"fp8": fld[0], "fp4": fld[1]}, "bwd": {"fp8": bwd[0], "fp4": bwd[1]},
            "nonfinite": False, "routed_tokens": routed, "no_tokens": routed == 0, **extra}


def test_an_expert_without_tokens_keeps_its_last_statistics_and_plans_at_fp8():
    """carry_unrouted: a pair no token reached keeps its last collection's FLD and BWD (marked with the step they
    were measured at, also when carried again), its FLOPs stay 0; a pair that never saw a token keeps zeros. The
    planner then keeps the carried pair out of FP4 (it would add harm and no share), where with zeros it was
    indifferent."""
    dense = _record((1e-4, 1e-3), (1e-5, 1e-4), 6.0e6, 1)
    del dense["routed_tokens"], dense["no_tokens"]
    first = {"format": "snip_ds.stats/1", "step": 16, "lambda": 1.0, "layers": {
        "d": dense, "e.0.w": _record((2e-4, 5e-3), (1e-5, 2e-3), 3.0e6, 10), "e.1.w": _record((0, 0), (0, 0), 0.0, 0),
        "e.2.w": _record((1e-4, 2e-4), (1e-5, 1e-5), 3.0e6, 10)}}
    second = {"format": "snip_ds.stats/1", "step": 32, "lambda": 1.0, "layers": {
        "d": dense, "e.0.w": _record((0, 0), (0, 0), 0.0, 0), "e.1.w": _record((0, 0), (0, 0), 0.0, 0),
        "e.2.w": _record((1e-4, 3e-4), (1e-5, 1e-5), 6.0e6, 20)}}
    carried = carry_unrouted(second, first)
    rec = carried["layers"]["e.0.w"]
    assert rec["fld"] == first["layers"]["e.0.w"]["fld"] and rec["bwd"] == first["layers"]["e.0.w"]["bwd"]
    assert (rec["flops"], rec["routed_tokens"], rec["no_tokens"], rec["carried_from_step"]) == (0.0, 0, True, 16)
    assert carried["layers"]["e.1.w"] == second["layers"]["e.1.w"]  # never saw a token
    assert carried["layers"]["e.2.w"] == second["layers"]["e.2.w"] and carried["layers"]["d"] == dense
    assert second["layers"]["e.0.w"]["fld"] == {"fp8": 0, "fp4": 0}  # the input is not changed
    third = {**second, "step": 64}
    assert carry_unrouted(third, carried)["layers"]["e.0.w"]["carried_from_step"] == 16  # carried again
    assert carry_unrouted(second, None) == second
    validate_stats(carried)
    plan = solve_baseline("best", carried, 0.3, CostSettings(), SolverSettings(), seed=0)[0]
    assert plan.assignment["e.0.w"] == "fp8"
