"""snip_ds.layouts: decoder blocks found by structure, linear GEMMs proved by behaviour (GPT-2's Conv1D stored
transposed; a linear subclass whose forward is something else left alone), experts layouts proved by
equivalence (a look-alike whose forward differs refused, naming what differs), and the statistics of a layer
that runs twice per forward or never."""
import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, MixtralConfig, OPTConfig, OPTForCausalLM
from transformers.integrations.moe import use_experts_implementation
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.pytorch_utils import Conv1D

from snip_ds.decoder import UnsupportedModelError, decoder_blocks, decoder_linears
from snip_ds.experts.module import SnipExperts
from snip_ds.layouts import linears
from snip_ds.layouts.experts import ExpertsLayout, ExpertsLayoutError, recognize
from snip_ds.linear import SnipLinear
from snip_ds.planner import solve_baseline
from snip_ds.quant_config import QuantConfig
from snip_ds.stats import CollectSettings, collect_statistics
from snip_ds.swap import swap_linears, swap_model
from snip_ds.types import block_index, layer_kind

V, H = 61, 32


def _gpt2(layers=2, seed=0):
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=H, n_head=2, vocab_size=V, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _ids(seed=1, rows=2, length=12):
    return torch.randint(0, V, (rows, length), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------------
# blocks
# ------------------------------------------------------------------------------------------------------

def test_blocks_are_the_numbered_entries_of_the_block_list_whatever_it_is_called():
    gpt2 = _gpt2()
    assert [n for n, _ in decoder_blocks(gpt2)] == ["transformer.h.0", "transformer.h.1"]
    opt = OPTForCausalLM(OPTConfig(vocab_size=V, hidden_size=H, num_hidden_layers=2, ffn_dim=64,
                                   num_attention_heads=2, word_embed_proj_dim=H, max_position_embeddings=32))
    assert [n for n, _ in decoder_blocks(opt)] == ["model.decoder.layers.0", "model.decoder.layers.1"]
    names = decoder_linears(opt)
    assert {layer_kind(n) for n in names} == {"self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj",
                                              "self_attn.out_proj", "fc1", "fc2"}
    assert [block_index(n) for n in names] == [0] * 6 + [1] * 6


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(H, H)


class _Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Layer() for _ in range(2))
        self.mix = nn.Linear(H, H)


class _Staged(nn.Module):
    """Stages of layers: where containers nest, the model's declared repeated block decides the level."""
    _no_split_modules = ["_Layer"]

    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList(_Stage() for _ in range(2))


def test_nested_containers_use_the_declared_block_and_the_outermost_entries_elsewhere():
    model = _Staged()
    assert [n for n, _ in decoder_blocks(model)] == [f"stages.{s}.blocks.{b}" for s in range(2) for b in range(2)]
    assert "stages.0.mix" not in decoder_linears(model)  # not inside a declared block
    type(model)._no_split_modules = []
    try:
        assert [n for n, _ in decoder_blocks(model)] == ["stages.0", "stages.1"]  # undeclared: the outermost
        assert "stages.0.mix" in decoder_linears(model)
    finally:
        type(model)._no_split_modules = ["_Layer"]


# ------------------------------------------------------------------------------------------------------
# linear GEMMs
# ------------------------------------------------------------------------------------------------------

class _TernaryLinear(nn.Linear):
    """A linear subclass whose forward is no x·Wᵀ + b (BitNet-style ternary weights)."""

    def forward(self, x):
        return F.linear(x, torch.sign(self.weight), self.bias)


class _PlainSubclass(nn.Linear):
    pass


def test_linear_forms_are_proved_by_behaviour():
    assert linears.linear_form(nn.Linear(4, 3)) == linears.LINEAR
    assert linears.linear_form(_PlainSubclass(4, 3)) == linears.LINEAR
    assert linears.linear_form(Conv1D(3, 4)) == linears.TRANSPOSED  # GPT-2's: weight [in, out]
    assert linears.linear_form(_TernaryLinear(4, 3)) is None  # another computation: left alone
    assert linears.linear_form(nn.Embedding(5, 4)) is None  # a 2-D weight, but no GEMM of a float input
    assert linears.linear_form(nn.LayerNorm(4)) is None


def test_a_block_of_linears_whose_forward_differs_is_left_alone():
    model = _Staged()
    model.stages[0].blocks[0].proj = _TernaryLinear(H, H)
    names = decoder_linears(model)
    assert "stages.0.blocks.0.proj" not in names and "stages.0.blocks.1.proj" in names


def test_gpt2_swapped_at_bf16_is_the_model_bit_for_bit_and_keeps_its_checkpoint_layout():
    """Conv1D layers become SnipLinear layers over the same [in, out] Parameters: the state_dict is unchanged,
    and at bf16 the loss and every gradient are the original model's."""
    ref, model = _gpt2(), _gpt2()
    infos = swap_linears(model, "bf16")
    assert list(infos) == [f"transformer.h.{b}.{k}" for b in range(2)
                           for k in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    c_attn = model.transformer.h[0].attn.c_attn
    assert isinstance(c_attn, SnipLinear) and c_attn.transposed
    assert (c_attn.in_features, c_attn.out_features) == (H, 3 * H) == (infos["transformer.h.0.attn.c_attn"].in_features,
                                                                     infos["transformer.h.0.attn.c_attn"].out_features)
    assert model.state_dict().keys() == ref.state_dict().keys()
    assert all(model.state_dict()[k].shape == v.shape for k, v in ref.state_dict().items())
    ids = _ids()
    a, b = ref(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
    a.loss.backward()
    b.loss.backward()
    assert torch.equal(a.logits, b.logits)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_a_transposed_layer_measures_as_the_same_layer_stored_as_nn_linear():
    """The statistics of GPT-2's Conv1D layers against the same model whose layers are nn.Linear with the
    transposed weights: the same numbers (the same products in the same order)."""
    conv = _gpt2()
    lin = copy.deepcopy(conv)
    for block in lin.transformer.h:
        for parent, name in ((block.attn, "c_attn"), (block.attn, "c_proj"), (block.mlp, "c_fc"),
                             (block.mlp, "c_proj")):
            old = getattr(parent, name)
            new = nn.Linear(*old.weight.shape)
            with torch.no_grad():
                new.weight.copy_(old.weight.t())
                new.bias.copy_(old.bias)
            setattr(parent, name, new)
    swap_linears(conv, "fp8")
    swap_linears(lin, "fp8")
    settings = CollectSettings(precond_fallback="ones", lam=1.0)
    a = collect_statistics(conv, [_ids()], settings, lr=1e-3)
    b = collect_statistics(lin, [_ids()], settings, lr=1e-3)
    for fqn, rec in a["layers"].items():
        assert rec["flops"] == b["layers"][fqn]["flops"]
        for field in ("fld", "bwd"):
            for p in ("fp8", "fp4"):
                assert rec[field][p] == pytest.approx(b["layers"][fqn][field][p], rel=1e-5), (fqn, field, p)


# ------------------------------------------------------------------------------------------------------
# experts
# ------------------------------------------------------------------------------------------------------

def _mixtral_experts(cls=MixtralExperts):
    cfg = MixtralConfig(hidden_size=H, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
    cfg._experts_implementation = "eager"
    return cls(cfg)


@use_experts_implementation
class LookAlikeExperts(MixtralExperts.__mro__[1]):
    """Mixtral's layout and interface flags, but its forward drops the routing weights."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_local_experts
        self.gate_up_proj = nn.Parameter(torch.randn(self.num_experts, 2 * 48, H))
        self.down_proj = nn.Parameter(torch.randn(self.num_experts, H, 48))
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            gate, up = F.linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            out.index_add_(0, token, F.linear(self.act_fn(gate) * up, self.down_proj[e]))
        return out


class PlainExperts(nn.Module):
    """No interface: experts recognised from their Parameters' shapes ([E, in, out] here) and proved."""

    def __init__(self):
        super().__init__()
        self.num_experts = 4
        self.w_in = nn.Parameter(torch.randn(4, H, 2 * 24) / 6)
        self.w_out = nn.Parameter(torch.randn(4, 24, H) / 5)
        self.act_fn = nn.GELU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            gate, up = (hidden_states[token] @ self.w_in[e]).chunk(2, dim=-1)
            y = (self.act_fn(gate) * up) @ self.w_out[e]
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out


def test_a_look_alike_experts_module_whose_forward_differs_is_refused_naming_what_differs():
    with pytest.raises(ExpertsLayoutError, match=r"experts module 'model\.layers\.0\.mlp\.experts' \(.*LookAlikeExperts"
                                                 r"\) is not one snip_ds can quantize per expert: its forward and "
                                                 r"snip_ds's \(gated .*\) differ on a random routing: output differs"):
        recognize(_mixtral_experts(LookAlikeExperts), "model.layers.0.mlp.experts", SnipExperts.unquantized)


def test_experts_without_the_interface_are_read_from_their_shapes_and_proved():
    module = PlainExperts()
    layout = recognize(module, "layers.0.mlp.experts", SnipExperts.unquantized)
    assert layout == ExpertsLayout(("w_in", "w_out"), transposed=True, bias=False, gated=True)
    snip = SnipExperts.from_family(module, "layers.0.mlp.experts", "bf16")
    h = torch.randn(7, H)
    index = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 3], [3, 1], [1, 0], [2, 3]])
    w = torch.rand(7, 2)
    assert torch.allclose(snip(h, index, w), module(h, index, w), rtol=1e-5, atol=1e-6)
    assert snip.layers()["layers.0.mlp.experts.3.w_out"].in_features == 24


class _MoeBlock(nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.router = nn.Linear(H, 4, bias=False)
        self.experts = experts

    def forward(self, x):
        flat = x.reshape(-1, H)
        weights, index = torch.topk(torch.softmax(self.router(flat), -1), 2)
        return self.experts(flat, index, weights).reshape(x.shape)


class _MoeLM(nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.layers = nn.ModuleList([_MoeBlock(experts)])
        self.head = nn.Linear(H, V)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        for block in self.layers:
            h = h + block(h)
        return type("Out", (), {"logits": self.head(h)})()


def test_an_unproved_experts_module_is_refused_before_anything_is_swapped():
    model = _MoeLM(_mixtral_experts(LookAlikeExperts))
    with pytest.raises(UnsupportedModelError, match=r"^_MoeLM: experts module 'layers\.0\.experts' .* differ on a "
                                                    r"random routing"):
        swap_model(model)
    assert isinstance(model.layers[0].experts, LookAlikeExperts)
    plain = _MoeLM(PlainExperts())
    infos = swap_model(plain, "fp8")
    assert "layers.0.router" not in infos  # scores the four experts: a router
    assert sorted(infos) == sorted(f"layers.0.experts.{e}.{p}" for e in range(4) for p in ("w_in", "w_out"))


# ------------------------------------------------------------------------------------------------------
# a layer that runs twice per forward, a layer that never runs
# ------------------------------------------------------------------------------------------------------

class _Shared(nn.Module):
    """One block whose ``shared`` linear runs twice per forward (``"twice"``), or once on both inputs stacked
    (``"sequence"``: along each sequence, so a sequence's tokens of both inputs are one row of the FLD's
    sequence form; ``"batch"``: along the batch, the rows in the order the collector stacks two calls). All
    three compute the same products and loss; ``idle`` is a linear the forward never calls."""

    def __init__(self, mode: str):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.mode = mode
        self.embed = nn.Embedding(V, H)
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].shared = nn.Linear(H, H)
        self.layers[0].other = nn.Linear(H, H)
        self.layers[0].idle = nn.Linear(H, H)
        self.head = nn.Linear(H, V)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        block = self.layers[0]
        u = torch.tanh(block.other(h))
        if self.mode == "twice":
            a, b = block.shared(h), block.shared(u)
        elif self.mode == "sequence":
            a, b = block.shared(torch.cat([h, u], dim=1)).split(h.shape[1], dim=1)
        else:
            a, b = block.shared(torch.cat([h, u], dim=0)).split(h.shape[0], dim=0)
        return type("Out", (), {"logits": self.head(a * b)})()


def _shared_stats(mode: str, quant: QuantConfig):
    model = _Shared(mode)
    swap_linears(model, "fp8", quant, exclude=["*.idle"])
    settings = CollectSettings(precond_fallback="ones", lam=1.0, num_probes=2)
    return collect_statistics(model, [_ids(rows=3, length=8)], settings, lr=1e-3)["layers"]


def test_a_layer_run_twice_per_forward_measures_its_calls_together():
    """No crash where a planned layer runs twice per forward; its FLOPs are twice a single call's; its FLD sums
    both calls' errors within each sequence before squaring (the one-call model stacked along the sequence,
    with recipes that scale each token's row alone so that stacking changes no quantization), and its BWD is
    that of one GEMM over both calls' rows (the one-call model stacked along the batch: the same rows)."""
    # Tolerance: the same products; GEMM rows and per-row sums grouped otherwise (FP32, reductions of at most
    # 2·24 tokens · 32 channels: 1536·2^-24 = 1e-4 relative worst case) -> 1e-4.
    mx = QuantConfig(fp8_recipe="mxfp8", fp4_recipe="mxfp4", stochastic_rounding=False, backend="emulated")
    twice, seq = _shared_stats("twice", mx), _shared_stats("sequence", mx)
    assert twice["layers.0.shared"]["flops"] == seq["layers.0.shared"]["flops"] == 2 * twice["layers.0.other"]["flops"]
    for p in ("fp8", "fp4"):
        assert twice["layers.0.shared"]["fld"][p] == pytest.approx(seq["layers.0.shared"]["fld"][p], rel=1e-4), p
    default = QuantConfig(backend="emulated")
    twice, batch = _shared_stats("twice", default), _shared_stats("batch", default)
    for fqn in ("layers.0.shared", "layers.0.other"):
        for p in ("fp8", "fp4"):
            assert twice[fqn]["bwd"][p] == pytest.approx(batch[fqn]["bwd"][p], rel=1e-4), (fqn, p)


def test_a_planned_layer_that_never_runs_is_flagged_and_left_out_of_the_plan():
    model = _Shared("twice")
    infos = swap_linears(model, "fp8")
    assert "layers.0.idle" in infos  # planned: it is a linear of the block
    stats = collect_statistics(model, [_ids()], CollectSettings(lam=1.0), lr=1e-3)
    idle = stats["layers"]["layers.0.idle"]
    assert idle["no_calls"] is True and idle["flops"] == 0.0 and idle["fld"] == {"fp8": 0.0, "fp4": 0.0}
    assert "no_calls" not in stats["layers"]["layers.0.shared"]
    plan = solve_baseline("best", stats, 0.5)[0]
    assert plan.assignment["layers.0.idle"] == "bf16"  # no FP4 label on a layer that runs nowhere
    assert plan.fp4_share >= 0.5


def test_a_fixed_plan_run_names_its_never_run_layers_once_and_leaves_them_out_of_the_share(tmp_path, capsys):
    """Mamba's dt_proj is a linear of every block that transformers never calls (the mixer multiplies its
    weight itself). Under the Trainer with a fixed plan, the first step's calls show it: named once, no FLOPs,
    so the FP4 share logged is the share that runs."""
    from transformers import MambaConfig, MambaForCausalLM, Trainer, TrainingArguments, default_data_collator

    from snip_ds.run.data import BlockDataset
    from snip_ds.hf import add_snip

    torch.manual_seed(0)
    model = MambaForCausalLM(MambaConfig(vocab_size=V, hidden_size=H, state_size=8, num_hidden_layers=2, expand=2,
                                         conv_kernel=4, time_step_rank=4, use_cache=False))
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps({f"backbone.layers.{b}.mixer.{k}": ("fp4" if k == "dt_proj" else "fp8")
                                     for b in range(2) for k in ("in_proj", "x_proj", "dt_proj", "out_proj")}))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=3,
                             report_to="none", use_cpu=True, save_strategy="no")
    data = BlockDataset(torch.randint(0, V, (8, 16), generator=torch.Generator().manual_seed(0)).int())
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator)
    callback = add_snip(trainer, {"plan": str(plan_file)})
    trainer.train()
    state = callback.state
    assert state.unrun == ["backbone.layers.0.mixer.dt_proj", "backbone.layers.1.mixer.dt_proj"]
    assert state.flops["backbone.layers.0.mixer.dt_proj"] == 0.0 and state.flops["backbone.layers.0.mixer.in_proj"] > 0
    assert state.plan_fp4_share() == 0.0  # the FP4 layers run nowhere
    out = capsys.readouterr().out
    assert out.count("planned layer(s) received no call") == 1


def test_llama4s_batched_experts_are_proved_and_planned_per_expert_over_every_token():
    """Llama 4's experts take one input of E equal parts (the MoE block scales every token for every expert):
    recognised from their shapes with that calling convention, bit for bit at bf16, and each expert's FLOPs are
    all of the tokens."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    cfg = Llama4TextConfig(vocab_size=V, hidden_size=H, intermediate_size=16, intermediate_size_mlp=H,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           num_local_experts=4, num_experts_per_tok=1, max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    ref = Llama4ForCausalLM(cfg)
    model = copy.deepcopy(ref)
    infos = swap_model(model, "bf16")
    experts = model.model.layers[0].feed_forward.experts
    assert isinstance(experts, SnipExperts) and experts.layout.convention == "batched"
    assert sorted(n for n in infos if ".experts." in n) == sorted(
        f"model.layers.{b}.feed_forward.experts.{e}.{p}" for b in range(2) for e in range(4)
        for p in ("gate_up_proj", "down_proj"))
    ids = _ids(length=8)
    a, b = ref(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
    a.loss.backward()
    b.loss.backward()
    assert torch.equal(a.logits, b.logits)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), name
    stats = collect_statistics(model, [ids], CollectSettings(lam=1.0), lr=1e-3)["layers"]
    assert stats["model.layers.0.feed_forward.experts.3.down_proj"]["routed_tokens"] == ids.numel()


class _Mixer(nn.Module):
    """An attention-like module called with three inputs (not a routing) beside an MoE block's router."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(H, 4 * H)
        self.heads = nn.Linear(H, 4)  # as many outputs as the router has experts

    def forward(self, hidden_states, cache=None, attention_mask=None):
        return self.proj(hidden_states)[..., :H] + self.heads(hidden_states).sum(-1, keepdim=True)


def test_a_module_called_with_three_inputs_that_are_no_routing_is_no_experts_module():
    model = _MoeLM(PlainExperts())
    model.layers[0].mixer = _Mixer()
    model.config = type("Config", (), {"num_experts": 4})()
    infos = swap_model(model, "fp8")
    assert "layers.0.mixer.proj" in infos  # an ordinary linear of the block
    assert not isinstance(model.layers[0].mixer, SnipExperts)


@pytest.mark.parametrize("model_type, layout", [
    ("mixtral", dict(gated=True, transposed=False, bias=False, convention="routed")),
    ("nemotron_h", dict(gated=False, transposed=False, bias=False, convention="routed")),  # up_proj, relu²
    ("gpt_oss", dict(gated=True, transposed=True, bias=True, convention="routed")),  # interleaved, clamped
    ("olmoe", dict(gated=True, transposed=False, bias=False, convention="routed")),
    ("llama4_text", dict(gated=True, transposed=True, bias=False, convention="batched")),
])
def test_each_experts_layout_family_swapped_at_bf16_trains_as_the_family_model(model_type, layout):
    """One model of each experts layout transformers ships (built tiny by the families survey's shrinker):
    its layout as proved, and the swapped model's loss and every gradient at bf16 those of the family's own
    (the same products; the experts' sums grouped as the family groups them)."""
    from snip_ds.families.build import build_tiny

    ref = build_tiny(model_type).model
    model = copy.deepcopy(ref)
    swap_model(model, "bf16")
    experts = [m for m in model.modules() if isinstance(m, SnipExperts)]
    assert experts and all(getattr(experts[0].layout, k) == v for k, v in layout.items())
    ids = _ids(length=8) % ref.config.get_text_config().vocab_size
    a, b = ref(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
    a.loss.backward()
    b.loss.backward()
    # Tolerance: FP32, the same products summed in another grouping: reductions of at most a few hundred terms
    # (n·u = 256·6e-8 = 1.5e-5 relative worst case) -> 1e-4; any wrong layout is off by far more
    assert b.loss.item() == pytest.approx(a.loss.item(), rel=1e-6)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        if p.grad is not None:
            assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name
