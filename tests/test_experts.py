"""SnipExperts against the transformers families' own experts modules (exact at bf16) and against SnipLinear on
one expert's routed tokens and 2-D weight slice (quantized); routed token counts, layer names, precisions, the
swap and its refusals."""
import pytest
import torch
from torch import nn
from transformers import (DeepseekV3Config, GptOssConfig, MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig,
                          Qwen3MoeConfig)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts, DeepseekV3MoE
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssMLP
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts, Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeSparseMoeBlock

from snip_ds import swap
from snip_ds.layouts.experts import ExpertsLayout, recognize
from snip_ds.experts.module import SnipExperts
from snip_ds.experts.model import expert_layers, find_experts_modules, set_expert_precisions, swap_experts, take_routed_tokens
from snip_ds.types import layer_seed
from snip_ds.experts.points import routed_flops
from snip_ds.linear import SnipLinear

E, H, I = 4, 32, 48  # experts, hidden size, expert intermediate size
PATH = "model.layers.3.mlp.experts"

# Uneven routing of 13 tokens with top-2: expert 0 gets 12 pairs, expert 1 10, expert 2 4, expert 3 none; some
# tokens list their experts in the other order.
ROUTING = torch.tensor([[0, 1]] * 6 + [[1, 0]] * 3 + [[2, 0]] * 3 + [[1, 2]])


def _config(family: str, implementation: str):
    if family == "mixtral":
        cfg = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2)
    elif family == "qwen2_moe":
        cfg = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=I, shared_expert_intermediate_size=I,
                             num_experts=E, num_experts_per_tok=2)
    elif family == "qwen3_moe":
        cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=2)
    elif family == "gpt_oss":  # weights stored [E, in, out], biases, interleaved gate and up, clamped SwiGLU
        cfg = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2,
                           swiglu_limit=1.0)  # a limit the test values reach, so the clamps act
    else:
        cfg = DeepseekV3Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=2,
                               n_group=1, topk_group=1, n_shared_experts=1)
    cfg._experts_implementation = implementation
    return cfg


EXPERTS = {"mixtral": MixtralExperts, "qwen2_moe": Qwen2MoeExperts, "qwen3_moe": Qwen3MoeExperts,
           "deepseek_v3": DeepseekV3Experts, "gpt_oss": GptOssExperts}
BLOCKS = {"mixtral": MixtralSparseMoeBlock, "qwen2_moe": Qwen2MoeSparseMoeBlock, "qwen3_moe": Qwen3MoeSparseMoeBlock,
          "deepseek_v3": DeepseekV3MoE, "gpt_oss": GptOssMLP}
FAMILIES = list(EXPERTS)


@pytest.mark.parametrize("family, layout", [
    ("mixtral", ExpertsLayout(("gate_up_proj", "down_proj"), transposed=False, bias=False, gated=True)),
    ("qwen2_moe", ExpertsLayout(("gate_up_proj", "down_proj"), transposed=False, bias=False, gated=True)),
    ("qwen3_moe", ExpertsLayout(("gate_up_proj", "down_proj"), transposed=False, bias=False, gated=True)),
    ("deepseek_v3", ExpertsLayout(("gate_up_proj", "down_proj"), transposed=False, bias=False, gated=True)),
    ("gpt_oss", ExpertsLayout(("gate_up_proj", "down_proj"), transposed=True, bias=True, gated=True)),
])
def test_each_familys_layout_is_read_from_its_interface_and_proved(family, layout):
    assert recognize(_experts(family), PATH, SnipExperts.unquantized) == layout


def _randomize(module: nn.Module, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return module.to(dtype)


def _experts(family: str, implementation: str = "eager", dtype=torch.float32) -> nn.Module:
    return _randomize(EXPERTS[family](_config(family, implementation)), dtype)


def _inputs(dtype, routing=ROUTING, seed=1):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(routing.shape[0], H, generator=gen).to(dtype)
    w = torch.rand(routing.shape, generator=gen)  # FP32, as Mixtral's and DeepSeek-V3's routers give them
    g = torch.randn(routing.shape[0], H, generator=gen).to(dtype)
    return h, w, g


def _run(module: nn.Module, h, routing, w, g):
    """Output and the gradients of the input, the routing weights and every Parameter."""
    for p in module.parameters():
        p.grad = None
    h = h.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    out = module(h, routing, w)
    out.backward(g)
    return [out.detach(), h.grad, w.grad] + [p.grad for p in module.parameters()]


def _assert_all_equal(ref, got):
    assert len(ref) == len(got)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"tensor {i} differs"


# ------------------------------------------------------------------------------------------------------
# bf16: the family's own module, bit for bit
# ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", None])  # None: never set; the eager loop runs
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_equals_family_module_bit_for_bit(family, implementation, dtype):
    family_module = _experts(family, implementation, dtype)
    h, w, g = _inputs(dtype)
    ref = _run(family_module, h, ROUTING, w, g)
    snip = SnipExperts.from_family(family_module, PATH, "bf16")
    got = _run(snip, h, ROUTING, w, g)
    _assert_all_equal(ref, got)
    assert family_module.down_proj.grad[3].abs().max() == 0  # expert 3 had no tokens (the routing is uneven)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family, implementation", [("mixtral", "eager"), ("mixtral", "grouped_mm"),
                                                    ("gpt_oss", "grouped_mm")])  # GPT-OSS's eager loop has none
def test_bf16_with_expert_parallel_placeholders_equals_family_module(family, implementation, dtype):
    """Under expert parallelism a routed slot may hold the placeholder index ``num_experts``: it contributes
    nothing, to the output or to the routing weight's gradient."""
    routing = ROUTING.clone()
    routing[2, 1] = routing[7, 0] = E
    family_module = _experts(family, implementation, dtype)
    family_module._is_expert_parallel = True
    h, w, g = _inputs(dtype)
    ref = _run(family_module, h, routing, w, g)
    _assert_all_equal(ref, _run(SnipExperts.from_family(family_module, PATH, "bf16"), h, routing, w, g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_block_with_its_router_equals_family_block(family, implementation, dtype):
    """The whole sparse MoE block (router, routing weights in the family's dtype, shared experts: the input's
    gradient sums the experts' with theirs) with its experts swapped, against the unswapped block."""
    block = _randomize(BLOCKS[family](_config(family, implementation)), dtype, seed=2)
    x = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(3)).to(dtype)
    g = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(4)).to(dtype)

    def run():
        block.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        out = block(xx)
        out = out[0] if isinstance(out, tuple) else out  # GPT-OSS's block also returns its router scores
        out.backward(g)
        return [out.detach(), xx.grad] + [p.grad for p in block.parameters()]

    ref = run()
    replaced = swap_experts(block, "bf16")
    assert list(replaced) == ["experts"] and isinstance(block.experts, SnipExperts)
    _assert_all_equal(ref, run())


def test_from_family_reuses_parameters_and_attributes():
    family_module = _experts("mixtral")
    snip = SnipExperts.from_family(family_module, PATH)
    assert snip.gate_up_proj is family_module.gate_up_proj and snip.down_proj is family_module.down_proj
    assert snip.state_dict().keys() == family_module.state_dict().keys()  # checkpoints load either way
    assert snip.act_fn is family_module.act_fn and snip.config is family_module.config
    assert snip.num_experts == E and snip.precision_of(0, "gate_up_proj") == "fp8"


# ------------------------------------------------------------------------------------------------------
# quantized experts: SnipLinear on the expert's tokens and weight slice
# ------------------------------------------------------------------------------------------------------

def _snip_linear_chain(snip: SnipExperts, expert: int, precisions, x, weights, g):
    """Expert ``expert`` computed with two SnipLinear layers on copies of its 2-D weight slices (generators
    seeded as the expert's), for its routed tokens ``x``: output, and gradients of x and both weights."""
    layers = []
    for j, proj in enumerate(snip.layout.projections):
        w = snip.weight(expert, j).detach().clone()  # [out, in]
        linear = nn.Linear(w.shape[1], w.shape[0], bias=snip.layout.bias, dtype=w.dtype)
        linear.weight = nn.Parameter(w)
        if snip.layout.bias:
            linear.bias = nn.Parameter(getattr(snip, f"{proj}_bias")[expert].detach().clone())
        layer = SnipLinear.from_linear(linear, precisions[j], snip.quant_config)
        layer.generator = torch.Generator().manual_seed(layer_seed(0, snip.layer_name(expert, j), 0))
        layers.append(layer)
    x = x.clone().requires_grad_(True)
    y = (layers[1](snip.layout.between(snip, layers[0](x))) * weights[:, None]).to(x.dtype)
    y.backward(g)
    return y.detach(), x.grad, layers[0].weight.grad, layers[1].weight.grad, layers[0].bias, layers[1].bias


QUANTIZED = [("mixtral", ("fp8", "fp8")), ("mixtral", ("fp4", "fp4")), ("mixtral", ("fp4", "bf16")),
             ("mixtral", ("bf16", "fp8")), ("mixtral", ({"fprop": "fp4", "dgrad": "fp8", "wgrad": "bf16"}, "fp4")),
             # transposed weights (SnipLinear gets the [out, in] view) and biases; not bf16, which runs
             # GPT-OSS's own x @ W + b where SnipLinear runs F.linear
             ("gpt_oss", ("fp8", "fp4")), ("gpt_oss", ("fp4", "fp8"))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("family, precisions", QUANTIZED)
def test_quantized_expert_equals_snip_linear_on_its_tokens(family, precisions, implementation, dtype):
    """Top-1 routing, so a token's output is its one expert's output times its weight (exactly: the other
    terms of the sum are zero); expert 1 at ``precisions``, the others at fp8; SR generators seeded alike.
    grouped_mm applies the element-wise gate to all routed pairs at once, which may round a few elements
    differently from the same function on expert 1's rows alone, so there every token goes to expert 1."""
    routing = torch.tensor([[1], [0], [1], [2], [1], [1], [0], [1], [2], [1], [1]])
    if implementation == "grouped_mm":
        routing = torch.ones_like(routing)
    h, w, g = _inputs(dtype, routing)
    snip = SnipExperts.from_family(_experts(family, implementation, dtype), PATH, "fp8")
    snip.set_precision(precisions[0], expert=1, projection="gate_up_proj")
    snip.set_precision(precisions[1], expert=1, projection="down_proj")
    got = _run(snip, h, routing, w, g)
    out, g_h, grads = got[0], got[1], dict(zip([n for n, _ in snip.named_parameters()], got[3:]))

    rows = (routing[:, 0] == 1).nonzero().flatten()
    y, g_x, g_w0, g_w1, b0, b1 = _snip_linear_chain(snip, 1, precisions, h[rows], w[rows, 0], g[rows])
    assert torch.equal(out[rows], y)
    assert torch.equal(g_h[rows], g_x)
    transpose = (lambda t: t.t()) if snip.layout.transposed else (lambda t: t)
    assert torch.equal(transpose(grads["gate_up_proj"][1]), g_w0)
    assert torch.equal(transpose(grads["down_proj"][1]), g_w1)
    if snip.layout.bias:
        assert torch.equal(grads["gate_up_proj_bias"][1], b0.grad)
        assert torch.equal(grads["down_proj_bias"][1], b1.grad)


def test_one_experts_precision_changes_only_its_tokens():
    h, w, g = _inputs(torch.float32)
    family_module = _experts("qwen2_moe")
    snip = SnipExperts.from_family(family_module, PATH, "bf16")
    ref = _run(snip, h, ROUTING, w, g)
    snip.set_precision("fp4", expert=2)
    got = _run(snip, h, ROUTING, w, g)
    out_ref, out = ref[0], got[0]
    touches_2 = (ROUTING == 2).any(dim=1)
    assert torch.equal(out[~touches_2], out_ref[~touches_2])
    assert (out[touches_2] != out_ref[touches_2]).any(dim=1).all()
    g_gate_up_ref, g_down_ref = ref[3], ref[4]
    g_gate_up, g_down = got[3], got[4]
    for e in (0, 1, 3):  # the other experts' inputs and output gradients are unchanged
        assert torch.equal(g_gate_up[e], g_gate_up_ref[e]) and torch.equal(g_down[e], g_down_ref[e])
    assert not torch.equal(g_down[2], g_down_ref[2])
    assert torch.equal(got[1][~touches_2], ref[1][~touches_2])


def test_generators_are_seeded_per_expert_and_projection_like_linear_layers():
    snip = SnipExperts.from_family(_experts("deepseek_v3"), PATH, seed=7, rank=3)
    generators = snip.named_generators()
    assert generators.keys() == snip.layers().keys()
    for name, info in snip.layers().items():
        j = snip.layout.projections.index(info.kind)
        assert generators[name] is snip.generators[info.expert][j]
        assert generators[name].initial_seed() == layer_seed(7, name, 3)
    assert len({g.initial_seed() for g in generators.values()}) == 2 * E


# ------------------------------------------------------------------------------------------------------
# routed tokens, layers, precisions
# ------------------------------------------------------------------------------------------------------

def test_routed_tokens_accumulate_until_taken():
    snip = SnipExperts.from_family(_experts("mixtral"), PATH, "bf16")
    h, w, _ = _inputs(torch.float32)
    assert snip.take_routed_tokens().tolist() == [0] * E
    snip(h, ROUTING, w)
    snip(h[:4], ROUTING[:4], w[:4])  # 4 tokens of [0, 1]
    with_sentinel = torch.tensor([[0, E], [E, 1]])  # expert parallelism's placeholder index counts for nobody
    snip(h[:2], with_sentinel, w[:2])
    assert snip.take_routed_tokens().tolist() == [12 + 4 + 1, 10 + 4 + 1, 4, 0]
    assert snip.take_routed_tokens().tolist() == [0] * E


def test_routed_tokens_are_not_counted_again_by_activation_checkpointing():
    model = _tiny_mixtral()
    swap_experts(model, "bf16")
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))
    model.train()
    model(ids, labels=ids)
    once = take_routed_tokens(model)
    model.activation_checkpointing_enable()
    model(ids, labels=ids).loss.backward()  # each block's forward runs again inside the backward
    assert take_routed_tokens(model) == once and sum(once.values()) == 2 * 2 * (2 * 9 * 2)


def test_layers_name_every_expert_and_projection():
    snip = SnipExperts.from_family(_experts("mixtral"), PATH)
    layers = snip.layers()
    assert list(layers)[:3] == [f"{PATH}.0.gate_up_proj", f"{PATH}.0.down_proj", f"{PATH}.1.gate_up_proj"]
    assert len(layers) == 2 * E
    gate_up, down = layers[f"{PATH}.2.gate_up_proj"], layers[f"{PATH}.2.down_proj"]
    assert (gate_up.block, gate_up.expert, gate_up.kind) == (3, 2, "gate_up_proj")
    assert (gate_up.in_features, gate_up.out_features) == (H, 2 * I)
    assert (down.in_features, down.out_features) == (I, H)
    assert down.routed_share == pytest.approx(2 / E)  # the tiny Mixtral routes each token to 2 of E experts
    assert down.flops(10) == pytest.approx(6.0 * 10 * (2 / E) * I * H)
    assert routed_flops(down, 7) == 6.0 * 7 * I * H


def test_set_precisions_by_layer_name():
    snip = SnipExperts.from_family(_experts("mixtral"), PATH, "fp8")
    per_gemm = {"fprop": "fp4", "dgrad": "fp8", "wgrad": "fp8"}
    snip.set_precisions({f"{PATH}.1.down_proj": "fp4", f"{PATH}.3.gate_up_proj": per_gemm})
    assert snip.precision_of(1, "down_proj") == "fp4" and snip.precision_of(3, "gate_up_proj") == per_gemm
    assert snip.precision_of(1, "gate_up_proj") == "fp8"
    before = snip.precisions()
    with pytest.raises(ValueError, match=r"no layer 'model\.layers\.3\.mlp\.experts\.4\.down_proj'"):
        snip.set_precisions({f"{PATH}.0.down_proj": "bf16", f"{PATH}.4.down_proj": "fp4"})
    with pytest.raises(ValueError, match="unknown precision 'fp2'"):
        snip.set_precisions({f"{PATH}.0.down_proj": "fp2"})
    assert snip.precisions() == before  # a refused plan changes nothing
    with pytest.raises(ValueError, match="unknown projection 'up_proj'"):
        snip.set_precision("fp4", projection="up_proj")
    with pytest.raises(ValueError, match="expert 4 out of range"):
        snip.set_precision("fp4", expert=4)


# ------------------------------------------------------------------------------------------------------
# the swap
# ------------------------------------------------------------------------------------------------------

def _tiny_mixtral(layers: int = 2) -> MixtralForCausalLM:
    cfg = MixtralConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=layers, num_attention_heads=4,
                        num_key_value_heads=2, num_local_experts=E, num_experts_per_tok=2, vocab_size=64)
    torch.manual_seed(0)
    return MixtralForCausalLM(cfg)


def test_swap_experts_replaces_every_experts_module_and_keeps_the_model_bit_for_bit():
    model = _tiny_mixtral()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))
    ref = model(ids).logits
    originals = {n: m for n, m in model.named_modules() if isinstance(m, MixtralExperts)}
    replaced = swap_experts(model, "bf16", seed=1)
    assert replaced == originals and list(replaced) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for path, old in replaced.items():
        new = model.get_submodule(path)
        assert isinstance(new, SnipExperts) and new.fqn == path and new.gate_up_proj is old.gate_up_proj
    assert torch.equal(model(ids).logits, ref)
    again = swap_experts(model, "fp8")  # already swapped: the same modules, given the new precision
    assert all(isinstance(m, SnipExperts) and m.precision_of(0, "down_proj") == "fp8" for m in again.values())
    assert list(find_experts_modules(model)) == list(replaced)


class ToyExperts(nn.Module):
    """An experts module of a layout snip_ds does not know (3-D weights, another forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(E, H, H))


def test_unknown_experts_layout_is_refused_naming_path_and_class():
    model = _tiny_mixtral()
    model.model.layers[1].mlp.experts = ToyExperts()
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.experts' \(test_experts\.ToyExperts\): "
                                         r"its experts' weights \(w \[4, 32, 32\]\) fit no layout"):
        swap_experts(model)
    assert isinstance(model.model.layers[0].mlp.experts, MixtralExperts)  # nothing was replaced


def test_known_class_with_other_flags_is_refused():
    model = _tiny_mixtral(layers=1)
    model.model.layers[0].mlp.experts.has_bias = True
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts' \(.*MixtralExperts\) is not one "
                                         r"snip_ds can quantize per expert: no Parameter 'gate_up_proj_bias'"):
        swap_experts(model)


# ------------------------------------------------------------------------------------------------------
# ZeRO-3
# ------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_zero3_partitioned_experts_train_as_the_family_module(tmp_path):
    """tests/dist_scripts/experts_zero3.py: a tiny Mixtral built under zero.Init (the 3-D Parameters partitioned
    before the swap) and trained one SGD step under ZeRO-3 with the family's experts, SnipExperts at bf16 and at
    fp8. bf16 gives the family's loss and parameters bit for bit; fp8 trains (finite, other values)."""
    import json
    import socket
    import subprocess
    import sys

    from safetensors.torch import load_file
    from train_utils import REPO, env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_env = {**env(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "dist_scripts" / "experts_zero3.py"),
                           "--out", str(tmp_path)], cwd=REPO, env=run_env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "swap.json").read_text())
    for precision in ("bf16", "fp8"):
        seen = report[precision]
        assert seen["replaced"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        assert seen["same_parameters"] and seen["partitioned_numel"] == 0
        assert seen["layers"] == {path: 2 * 4 for path in seen["replaced"]} and seen["down_proj_shape"] == [32, 48]
    family, bf16, fp8 = (load_file(str(tmp_path / f"{name}.safetensors")) for name in ("family", "bf16", "fp8"))
    assert family.keys() == bf16.keys() == fp8.keys()
    for name in family:
        assert torch.equal(family[name], bf16[name]), name
    assert torch.isfinite(fp8["loss"]).all() and not torch.equal(fp8["loss"], family["loss"])
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        assert torch.isfinite(fp8[name]).all() and not torch.equal(fp8[name], family[name])


def test_model_wide_layers_token_counts_and_precisions():
    model = _tiny_mixtral()
    swap_experts(model, "fp8")
    layers = expert_layers(model)
    assert len(layers) == 2 * 2 * E and list(layers)[0] == "model.layers.0.mlp.experts.0.gate_up_proj"
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))
    model(ids)
    tokens = take_routed_tokens(model)
    assert tokens.keys() == layers.keys()
    for block in range(2):  # every token-expert pair counted once, for both of the expert's projections
        per_expert = [tokens[f"model.layers.{block}.mlp.experts.{e}.down_proj"] for e in range(E)]
        assert sum(per_expert) == 2 * 9 * 2
        assert per_expert == [tokens[f"model.layers.{block}.mlp.experts.{e}.gate_up_proj"] for e in range(E)]
    assert set(take_routed_tokens(model).values()) == {0}

    plan = {"model.layers.1.mlp.experts.2.down_proj": "fp4", "model.layers.0.self_attn.q_proj": "fp4",
            "model.layers.1.mlp.experts.02.down_proj": "fp4", "model.layers.1.mlp.experts.4.down_proj": "fp4"}
    rest = set_expert_precisions(model, plan)
    assert rest == {name: "fp4" for name in list(plan)[1:]}  # not a pair: the caller's to apply or refuse
    experts = model.get_submodule("model.layers.1.mlp.experts")
    assert experts.precision_of(2, "down_proj") == "fp4" and experts.precision_of(2, "gate_up_proj") == "fp8"
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.0\.down_proj: unknown precision"):
        set_expert_precisions(model, {"model.layers.1.mlp.experts.3.down_proj": "fp4",
                                      "model.layers.0.mlp.experts.0.down_proj": "int8"})
    assert experts.precision_of(3, "down_proj") == "fp8"  # nothing set
