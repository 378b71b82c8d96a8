"""swap_linears on a real (tiny) Hugging Face Llama."""
import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from snip_ds.linear import SnipLinear
from snip_ds.swap import check_still_swapped, find_decoder_linears, snip_layers, swap_linears
from snip_ds.types import LLAMA_KINDS, block_index


def tiny_llama(layers=3, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg).eval()


def test_swaps_the_seven_linears_of_every_block():
    model = tiny_llama()
    params_before = {n: p for n, p in model.named_parameters()}
    ids = torch.randint(0, 64, (2, 16))
    ref = model(ids).logits
    infos = swap_linears(model, "bf16")
    expected = [f"model.layers.{b}.{k}" for b in range(3) for k in LLAMA_KINDS]
    assert list(infos) == expected
    assert list(snip_layers(model)) == expected
    assert not isinstance(model.lm_head, SnipLinear)
    for n, p in model.named_parameters():  # the very same Parameter objects
        assert p is params_before[n]
    assert torch.equal(model(ids).logits, ref)  # bf16 plan: bit-identical model
    q, k, down = infos[expected[0]], infos[expected[1]], infos[expected[6]]
    assert (q.in_features, q.out_features, k.out_features, down.in_features) == (32, 32, 16, 48)
    assert q.flops(1000) == 6 * 1000 * 32 * 32
    assert q.block == 0 and infos[expected[-1]].block == 2
    assert [infos[f].kind for f in expected[:7]] == list(LLAMA_KINDS)  # the path inside the block


def test_precision_applies_and_generators_differ_per_layer_and_rank():
    model = tiny_llama()
    infos = swap_linears(model, "fp4", seed=1, rank=0)
    layers = snip_layers(model)
    assert all(l.precision == "fp4" for l in layers.values())
    states = [l.generator.get_state() for l in layers.values()]
    assert not torch.equal(states[0], states[1])
    other = tiny_llama()
    swap_linears(other, "fp4", seed=1, rank=1)
    assert not torch.equal(next(iter(snip_layers(other).values())).generator.get_state(), states[0])
    assert len(infos) == 21


def test_block_index_and_errors():
    assert block_index("model.layers.12.mlp.up_proj") == 12
    with pytest.raises(ValueError, match="no decoder block index"):
        block_index("lm_head")
    with pytest.raises(ValueError, match=r"^Sequential: no quantizable linears found: .* it has no decoder "
                                         r"blocks \(numbered entries of a block list"):
        find_decoder_linears(nn.Sequential(nn.Linear(2, 2)))
    model = tiny_llama(layers=2)
    model.model.layers[0].mlp.up_proj = nn.Identity()  # blocks need not be alike: what each holds is swapped
    infos = swap_linears(model)
    assert "model.layers.0.mlp.up_proj" not in infos and "model.layers.1.mlp.up_proj" in infos
    assert len(infos) == 13


def test_a_layer_replaced_after_the_swap_is_an_error_naming_it():
    """What deepspeed.initialize's AutoTP does to a model: a swapped layer replaced by another module (or
    removed) is found, named, and is an error instead of an unquantized run."""
    model = tiny_llama(layers=2)
    infos = swap_linears(model, "fp8")
    check_still_swapped(model, infos, "deepspeed.initialize")  # untouched: passes
    attn = model.model.layers[1].self_attn
    attn.o_proj = nn.Linear(32, 32, bias=False)
    with pytest.raises(RuntimeError, match=r"^layer model\.layers\.1\.self_attn\.o_proj: deepspeed\.initialize "
                                           r"replaced by torch\.nn\.modules\.linear\.Linear snip_ds's quantized"):
        check_still_swapped(model, infos, "deepspeed.initialize")
    model = tiny_llama(layers=2)
    infos = swap_linears(model, "fp8")
    del model.model.layers[1].mlp.down_proj
    with pytest.raises(RuntimeError, match=r"down_proj: deepspeed\.initialize removed snip_ds's quantized layer"):
        check_still_swapped(model, infos, "deepspeed.initialize")
