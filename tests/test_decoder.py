"""snip_ds.decoder on tiny models of each supported family (built from transformers' config classes, nothing
downloaded): which linears are quantized, their kinds and order, which read one input, what is left out (MoE
routers, snip.exclude) and what is refused (MoE experts, models without decoder linears)."""
import math

import pytest
import torch
from torch import nn

from snip_ds.cli import render_plan
from snip_ds.decoder import UnsupportedModelError, decoder_linears, input_groups
from snip_ds.swap import layer_infos
from snip_ds.run.model import build_model
from snip_ds.plan import Plan
from snip_ds.swap import snip_layers, swap_linears
from snip_ds.report.tensorboard import precision_map_figure
from snip_ds.types import LLAMA_KINDS, block_index, display_kinds, expert_pair, kind_labels, layer_kinds

DENSE = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
PHI3 = {**DENSE, "model_type": "phi3", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
GPT_NEOX = {"model_type": "gpt_neox", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64}
# MLA attention; first_k_dense_replace >= num_hidden_layers: every block has a dense MLP, no experts
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
               "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8,
               "qk_nope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
               "n_group": 1, "topk_group": 1, "first_k_dense_replace": 2, "max_position_embeddings": 64}
MIXTRAL = {**DENSE, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
QWEN2_MOE = {**DENSE, "model_type": "qwen2_moe", "num_experts": 4, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 64}

# family: (config, block prefix, kinds in module order, each block's input groups in running order)
FAMILIES = {
    "phi3": (PHI3, "model.layers", ("self_attn.o_proj", "self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"),
             [("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",)]),
    "gpt_neox": (GPT_NEOX, "gpt_neox.layers",
                 ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
                 [("attention.query_key_value",), ("attention.dense",), ("mlp.dense_h_to_4h",),
                  ("mlp.dense_4h_to_h",)]),
    "deepseek_v3": (DEEPSEEK_V3, "model.layers",
                    ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
                     "self_attn.kv_b_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
                    [("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"), ("self_attn.q_b_proj",),
                     ("self_attn.kv_b_proj",), ("self_attn.o_proj",), ("mlp.gate_proj", "mlp.up_proj"),
                     ("mlp.down_proj",)]),
}
LLAMA_GROUPS = [("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
                ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)]


def _in_block(groups, prefix, block):
    """The groups of one block, as paths inside it."""
    head = f"{prefix}.{block}."
    return [tuple(f[len(head):] for f in g) for g in groups if g[0].startswith(head)]


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_llama_family_kinds_order_and_groups_unchanged(model_type):
    model = build_model(model_config={"model_type": model_type, **DENSE})
    names = decoder_linears(model)
    assert names == [f"model.layers.{b}.{k}" for b in range(2) for k in LLAMA_KINDS]
    assert layer_kinds(names) == LLAMA_KINDS == display_kinds(sorted(names))
    assert list(kind_labels(LLAMA_KINDS).values()) == ["q", "k", "v", "o", "gate", "up", "down"]
    groups = input_groups(model)
    assert [_in_block(groups, "model.layers", b) for b in range(2)] == [LLAMA_GROUPS, LLAMA_GROUPS]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_quantizes_every_block_linear_with_its_own_kinds(family):
    config, prefix, kinds, groups = FAMILIES[family]
    model = build_model(model_config=config)
    names = decoder_linears(model)
    assert names == [f"{prefix}.{b}.{k}" for b in range(2) for k in kinds]
    assert layer_kinds(names) == kinds
    every = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert every - set(names) == {"lm_head"}  # only the head stays
    found = input_groups(model)
    assert [_in_block(found, prefix, b) for b in range(2)] == [groups, groups]
    assert sorted(f for g in found for f in g) == sorted(names)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_swapped_family_model_is_the_same_model_in_bf16_and_trains_in_fp4(family):
    config, prefix, kinds, _ = FAMILIES[family]
    model = build_model(model_config=config, seed=1)
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    infos = swap_linears(model, "bf16")
    assert [i.kind for i in infos.values()] == [k for _ in range(2) for k in kinds]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref)
    swap_linears(model, "fp4", seed=3)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert abs(loss.item() - math.log(64)) < 1.0  # near-uniform predictions at init
    assert all(m.weight.grad is not None and torch.isfinite(m.weight.grad).all() for m in snip_layers(model).values())


def test_exclude_globs_match_fully_qualified_names():
    model = build_model(model_config=PHI3)
    names = decoder_linears(model, ["*.mlp.down_proj", "model.layers.0.self_attn.*"])
    assert names == ["model.layers.0.mlp.gate_up_proj", "model.layers.1.self_attn.o_proj",
                     "model.layers.1.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj"]
    infos = swap_linears(model, "fp8", exclude=["*.down_proj"])
    assert not any(f.endswith("down_proj") for f in infos)
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear  # left as it was
    with pytest.raises(ValueError, match=r"^snip.exclude: pattern '\*.q_proj' matches no decoder linear of "
                                         r"Phi3ForCausalLM \(e.g. model.layers.0.self_attn.o_proj\)"):
        decoder_linears(model, ["*.q_proj"])
    with pytest.raises(UnsupportedModelError, match=r"^Phi3ForCausalLM: no quantizable linears found: .* every "
                                                    r"one is excluded by snip.exclude"):
        decoder_linears(model, ["*"])


class _ExpertMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)


class _Block(nn.Module):
    def __init__(self, experts: bool):
        super().__init__()
        self.attn = nn.Linear(32, 32)
        self.mlp = nn.Module()
        self.mlp.gate = nn.Linear(32, 4)  # four outputs: a router only where it has four experts to score
        if experts:
            self.mlp.experts = nn.ModuleList(_ExpertMLP() for _ in range(4))  # a list of expert MLPs
            self.mlp.shared_expert_gate = nn.Linear(32, 1)  # a shared expert's scalar gate


class _Toy(nn.Module):
    def __init__(self, experts=False):
        super().__init__()
        self.layers = nn.ModuleList(_Block(experts) for _ in range(2))


def test_routers_are_found_by_what_they_score_not_by_their_names():
    """A linear beside experts whose output width is their count (or 1) is a router and stays as it is where the
    MoE block cannot run alone to prove otherwise (this one has no forward); the same linear with no experts
    beside it is an ordinary projection; a list of expert MLPs is planned expert by
    expert (each of its linears a layer of its own)."""
    assert decoder_linears(_Toy()) == [f"layers.{b}.{k}" for b in range(2) for k in ("attn", "mlp.gate")]
    names = decoder_linears(_Toy(experts=True))
    assert names == [f"layers.{b}.{k}" for b in range(2) for k in
                     ["attn"] + [f"mlp.experts.{e}.{fc}" for e in range(4) for fc in ("fc1", "fc2")]]
    assert {expert_pair(n) for n in names if "experts" in n} == {
        (f"layers.{b}.mlp.experts", e, fc) for b in range(2) for e in range(4) for fc in ("fc1", "fc2")}
    llama = build_model(model_config=DENSE)
    assert "model.layers.0.mlp.gate_proj" in decoder_linears(llama)  # a SwiGLU's gate: no experts beside it



E = 4  # experts; every MoE block below also holds non-routers of this output width


class _SparseBlock(nn.Module):
    """A Mixtral-style MoE block over a list of expert MLPs (each H -> E -> H: its linears are as wide as the
    router) beside a shared path through ``mix``, a linear of width E whose output is only values (softmaxed,
    then projected back), and a scalar gate."""

    def __init__(self, hidden=32):
        super().__init__()
        self.mix, self.back = nn.Linear(hidden, E), nn.Linear(E, hidden)
        self.scorer = nn.Linear(hidden, E)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(hidden, E), nn.SiLU(), nn.Linear(E, hidden))
                                     for _ in range(E))
        self.shared_gate = nn.Linear(hidden, 1)

    def scores(self, x):
        return self.scorer(x)

    def values(self, x):
        return self.mix(x)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(torch.softmax(self.scores(flat), dim=-1), 2, dim=-1)
        out = torch.zeros_like(flat)
        mask = nn.functional.one_hot(chosen, E).permute(2, 1, 0)
        for e in range(E):
            slot, token = torch.where(mask[e])
            out.index_add_(0, token, self.experts[e](flat[token]) * weights[token, slot, None])
        shared = self.back(torch.softmax(self.values(flat), dim=-1)) * torch.sigmoid(self.shared_gate(flat))
        return (out + shared).reshape(x.shape)


class _SwappedRoles(_SparseBlock):
    """The same linears, the roles swapped: ``mix`` ranks the experts and ``scorer`` feeds the values."""

    def scores(self, x):
        return self.mix(x)

    def values(self, x):
        return self.scorer(x)


def _moe(block_cls):
    model = nn.Module()
    model.layers = nn.ModuleList(nn.ModuleDict({"attn": nn.Linear(32, 32), "mlp": block_cls()}) for _ in range(2))
    return model


@pytest.mark.parametrize("block_cls, router, values", [(_SparseBlock, "scorer", "mix"),
                                                       (_SwappedRoles, "mix", "scorer")])
def test_a_router_is_proved_by_what_consumes_its_output(block_cls, router, values):
    """Of the linears of an MoE block whose output width is the experts' count, only the one whose output is
    ranked and whose ranks choose the experts' tokens is a router (left out); one whose output is only values
    (softmaxed, projected back) and the experts' own E-wide projections are planned, whatever their names."""
    model = _moe(block_cls)
    before, rng = {n: p.clone() for n, p in model.state_dict().items()}, torch.random.get_rng_state()
    names = decoder_linears(model)
    assert torch.equal(torch.random.get_rng_state(), rng)
    mlp = [n[len("layers.0.mlp."):] for n in names if n.startswith("layers.0.mlp.")]
    assert router not in mlp and "shared_gate" not in mlp
    assert sorted(mlp) == sorted([values, "back"] + [f"experts.{e}.{i}" for e in range(E) for i in (0, 2)])
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())  # the probe changed nothing
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(type(e).forward is nn.Sequential.forward and "forward" not in vars(e)
               for e in model.layers[0].mlp.experts)


def test_a_stacked_experts_family_keeps_its_linear_router_out():
    """A family whose router is a plain linear beside transformers-5 stacked experts (Hunyuan-MoE's
    ``gate.wg``) keeps it out; its shared MLP's linears are planned."""
    from snip_ds.families.build import build_tiny
    model = build_tiny("hunyuan_v1_moe").model
    names = decoder_linears(model)
    assert not any(n.endswith("gate.wg") for n in names)
    assert any(n.endswith("shared_mlp.gate_proj") for n in names)


@pytest.mark.parametrize("config, module, cls", [
    (MIXTRAL, "model.layers.0.mlp.experts", "MixtralExperts"),
    (QWEN2_MOE, "model.layers.0.mlp.experts", "Qwen2MoeExperts"),
    ({**DEEPSEEK_V3, "first_k_dense_replace": 1}, "model.layers.1.mlp.experts", "DeepseekV3Experts"),
    ({**MIXTRAL, "model_type": "olmoe", "num_experts": 4}, "model.layers.0.mlp.experts", "OlmoeExperts"),
])
def test_experts_modules_are_planned_per_pair(config, module, cls):
    """Experts modules: their linears are the attention's (and a shared expert's), no router, and every
    (expert, projection) pair is a planned layer."""
    model = build_model(model_config=config)
    names = decoder_linears(model)
    assert not any(".experts." in n or n.endswith((".gate", "_gate")) for n in names)
    infos = layer_infos(model)
    assert [n for n in infos if n in names] == names
    paths = [n for n, m in model.named_modules() if type(m).__name__ == cls]
    assert module in paths
    assert sorted(n for n in infos if n not in names) == sorted(
        f"{path}.{e}.{p}" for path in paths for e in range(4) for p in ("gate_up_proj", "down_proj"))
    assert type(model.get_submodule(module)).__name__ == cls  # layer_infos changed nothing


def test_a_three_dimensional_parameter_that_is_no_expert_is_not_refused():
    """A convolution's kernel, or a stack of per-head weights no router scores, makes no experts module: the
    block's linears are planned and the module stays as it is."""
    conv = _Toy()
    conv.layers[0].conv = nn.Conv1d(32, 32, 3)
    conv.layers[0].heads = nn.Module()
    conv.layers[0].heads.w = nn.Parameter(torch.zeros(3, 32, 32))
    conv.layers[0].heads.v = nn.Parameter(torch.zeros(3, 32, 32))
    assert len(decoder_linears(conv)) == 4


def test_displays_take_their_columns_from_the_kinds():
    """snip-ds show and the TensorBoard map: one column per kind, labelled by its short name."""
    model = build_model(model_config=PHI3)
    names = decoder_linears(model)
    plan = Plan.fixed({n: ("fp4" if "mlp" in n else "fp8") for n in names})
    text = render_plan(plan).splitlines()
    assert text[1].split() == ["block", "o", "qkv", "down", "gate_up"]  # attention's first, without the model
    assert text[2].split() == ["0", "8", "8", "4", "4"]
    fig = precision_map_figure(plan.assignment, block_index, kinds=layer_kinds(names))
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["o", "qkv", "gate_up", "down"]
    assert fig.axes[0].get_xlabel() == "self_attn (o qkv)  |  mlp (gate_up down)"
    neox = build_model(model_config=GPT_NEOX)
    fig = precision_map_figure(Plan.fixed({n: "fp8" for n in decoder_linears(neox)}).assignment, block_index)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == [
        "dense", "query_key_value", "dense_4h_to_h", "dense_h_to_4h"]



@pytest.mark.parametrize("family, field, other", [("gpt_neox", "use_parallel_residual", False),
                                                  ("deepseek_v3", "rope_interleave", False),
                                                  ("gpt_neox", "layer_norm_eps", 1e-3)])
def test_a_resume_check_sees_family_fields_that_shapes_miss(family, field, other):
    """Fields that change a family's arithmetic but not its tensors' names and shapes are in the architecture a
    checkpoint records, so a resume with another value is refused (engine.checkpoint_verify.validate compares them)."""
    from snip_ds.engine.checkpoint_layout import model_architecture, model_fingerprint
    config = FAMILIES[family][0]
    a, b = build_model(model_config=config), build_model(model_config={**config, field: other})
    assert getattr(a.config, field) != other and getattr(b.config, field) == other
    assert model_fingerprint(a) == model_fingerprint(b)  # the shapes do not tell them apart
    assert model_architecture(a)[field] != model_architecture(b)[field]
