"""Tests for snip_ds.run.model: default config, builders, errors, and the decoder-linear inventory."""

import json
import math

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from snip_ds.run.model import (
    build_model,
    count_parameters,
    decoder_linear_names,
    default_model_config,
    pad_vocab_size,
)

TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
PROJ = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def _state_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_default_config_shape():
    cfg = default_model_config(vocab_size=257, block_size=512)
    assert isinstance(cfg, LlamaConfig)
    assert cfg.vocab_size == 264 and cfg.max_position_embeddings >= 512
    assert not cfg.tie_word_embeddings and cfg.model_type == "llama"
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    for width in (cfg.hidden_size, cfg.intermediate_size, head_dim * cfg.num_key_value_heads):
        assert width % 32 == 0  # every GEMM contraction fits MX (32) and NVFP4 (16) blocks
    assert pad_vocab_size(256) == 256 and pad_vocab_size(1) == 8


def test_default_model_size_deterministic_and_rng_neutral():
    rng = torch.get_rng_state()
    a = build_model(seed=0)
    assert torch.equal(torch.get_rng_state(), rng)  # init does not disturb the caller's RNG
    b, c = build_model(seed=0), build_model(seed=1)
    n = count_parameters(a)
    assert 9_000_000 < n < 12_000_000, n
    assert _state_equal(a, b) and not _state_equal(a, c)
    assert a.training and isinstance(a, LlamaForCausalLM)
    x = torch.randint(0, 257, (1, 32))
    with torch.no_grad():
        loss = a(input_ids=x, labels=x).loss
    assert abs(loss.item() - math.log(264)) < 0.3  # near-uniform predictions at init


def test_decoder_linear_names_order_and_purity():
    model = build_model(model_config=TINY)
    names = decoder_linear_names(model)
    assert names == [f"model.layers.{i}.{p}" for i in range(2) for p in PROJ]
    modules = dict(model.named_modules())
    assert all(isinstance(modules[n], nn.Linear) for n in names) and "lm_head" not in names
    before = {k: v.clone() for k, v in model.state_dict().items()}
    decoder_linear_names(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_swapped_linear_subclass_still_listed():
    class MyLinear(nn.Linear):
        pass

    model = build_model(model_config=TINY)
    old = model.model.layers[1].mlp.up_proj
    model.model.layers[1].mlp.up_proj = MyLinear(old.in_features, old.out_features, bias=False)
    assert "model.layers.1.mlp.up_proj" in decoder_linear_names(model)


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_llama_family_variants(model_type):
    model = build_model(model_config={"model_type": model_type, **TINY})
    assert model.config.model_type == model_type
    assert len(decoder_linear_names(model)) == 14


def test_json_config_file(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(TINY))
    model = build_model(model_config=path, vocab_size=60, seed=3, dtype=torch.bfloat16)
    assert model.config.hidden_size == 32 and model.config.vocab_size == 64
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    again = build_model(model_config=str(path), seed=3, dtype=torch.bfloat16)
    assert _state_equal(model, again)


def test_default_config_json_round_trip(tmp_path):
    path = tmp_path / "default.json"
    path.write_text(default_model_config().to_json_string())
    assert _state_equal(build_model(seed=2), build_model(model_config=path, seed=2))


def test_local_pretrained_directory_round_trip(tmp_path):
    src = build_model(model_config=TINY, seed=7)
    src.save_pretrained(tmp_path / "m")
    loaded = build_model(tmp_path / "m")
    assert _state_equal(src, loaded)


def test_config_and_path_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{\"hidden_size\": 32,")
    with pytest.raises(ValueError, match="bad.json: malformed JSON config"):
        build_model(model_config=bad)
    arr = tmp_path / "arr.json"
    arr.write_text("[1]")
    with pytest.raises(ValueError, match="arr.json: a model config must be a JSON object"):
        build_model(model_config=arr)
    with pytest.raises(ValueError, match="unknown model_type 'no-such-model'; expected a decoder-only"):
        build_model(model_config={"model_type": "no-such-model"})
    with pytest.raises(ValueError, match=r"invalid config \(Validation error for field 'initializer_range': "
                                         r"ValueError: Value must be greater or equal to 0\.0"):
        build_model(model_config={**TINY, "initializer_range": 1e12})  # one line, not the library's traceback
    with pytest.raises(ValueError, match="model_type 'vit' has no causal-LM class"):
        build_model(model_config={"model_type": "vit", "hidden_size": 32, "num_hidden_layers": 1})
    with pytest.raises(FileNotFoundError, match="nope.json"):
        build_model(model_config=tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_model(tmp_path / "missing_dir")
    with pytest.raises(ValueError, match="is not a directory"):
        build_model(bad)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        build_model(tmp_path / "empty")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match="config.json: malformed JSON"):
        build_model(tmp_path / "broken")
    with pytest.raises(ValueError, match="not both"):
        build_model(tmp_path, model_config=TINY)


def test_gpt2_builds_with_its_transposed_conv1d_layers_found():
    """GPT-2 keeps its blocks in transformer.h and its projections in Conv1D modules (weights stored [in, out])."""
    gpt2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 32}
    names = decoder_linear_names(build_model(model_config=gpt2))
    assert names == [f"transformer.h.{b}.{k}" for b in range(2)
                     for k in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]


def test_vocab_smaller_than_tokenizer():
    with pytest.raises(ValueError, match="model vocab_size 64 is smaller than the tokenizer's 257"):
        build_model(model_config=TINY, vocab_size=257)
    assert build_model(vocab_size=1000).config.vocab_size == 1000
