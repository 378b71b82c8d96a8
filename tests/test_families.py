"""The families survey (snip_ds/families): tiny configs keep every layer kind and stay small, experts are found by
structure, the probe tells a refusal from a crash, the sweep survives children that hang or die, and
``snip-ds families`` writes the table of a few families end to end."""
import json
import os
import signal
import time

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")  # transformers' Trainer needs it

from snip_ds.cli import main  # noqa: E402
from snip_ds.families import report  # noqa: E402
from snip_ds.families.shrink import HEAD_DIM, HIDDEN, VOCAB, _Shrinker  # noqa: E402
from snip_ds.families.structure import find_experts  # noqa: E402

MAX_PARAMETERS = 1_500_000  # the largest tiny model of these families has ~0.95M (Gemma-3n's per-layer inputs)


def _default(model_type):
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]()


def _tiny(model_type):
    from snip_ds.families.build import build_tiny

    return build_tiny(model_type)


# ------------------------------------------------------------------------------------------------ shrinking
@pytest.mark.parametrize("model_type", ["llama", "mixtral", "deepseek_v3", "qwen3_next", "mamba2", "gemma4_text",
                                        "gemma3n_text", "jamba", "gpt2"])
def test_tiny_model_is_small_and_trains_a_plain_step(model_type):
    from snip_ds.families.build import plain_step

    tiny = _tiny(model_type)
    assert tiny.parameters() < MAX_PARAMETERS
    config = tiny.model.config.get_text_config()
    assert getattr(config, "hidden_size") == HIDDEN
    assert getattr(config, "vocab_size") <= VOCAB
    loss = plain_step(tiny)
    assert torch.isfinite(torch.tensor(loss))
    assert all(p.grad is None for p in tiny.model.parameters())  # the step leaves no gradient behind


@pytest.mark.parametrize("model_type, field", [("qwen3_next", "layer_types"), ("jamba", "layers_block_type"),
                                               ("gemma3n_text", "layer_types"), ("deepseek_v32", "mlp_layer_types"),
                                               ("gemma4_text", "layer_types")])
def test_per_layer_lists_keep_every_distinct_kind(model_type, field):
    default, tiny = _default(model_type), _tiny(model_type).tiny.config
    kinds = getattr(default, field)
    assert len(getattr(tiny, field)) == tiny.num_hidden_layers < default.num_hidden_layers
    assert set(getattr(tiny, field)) == set(kinds)


def test_counts_of_leading_and_trailing_layers_keep_both_sides():
    # DeepSeek-V3: the first 3 layers dense, the rest MoE; Gemma-3n: the last 15 layers share the KV cache
    deepseek = _tiny("deepseek_v3")
    experts = {e.path.split(".mlp")[0] for e in find_experts(deepseek.model)}
    layers = [f"model.layers.{i}" for i in range(deepseek.model.config.num_hidden_layers)]
    assert deepseek.model.config.first_k_dense_replace == 1 and set(layers) - experts == {"model.layers.0"}
    gemma = _tiny("gemma3n_text").tiny.config
    n, shared = gemma.num_hidden_layers, gemma.num_kv_shared_layers
    assert 0 < shared < n
    assert set(gemma.layer_types[:n - shared]) == set(gemma.layer_types[n - shared:]) == set(_default(
        "gemma3n_text").layer_types)


def test_head_dimensions_scale_together():
    deepseek = _tiny("deepseek_v3").tiny.config  # MLA: qk_head_dim = nope + rope, and head_dim = rope
    assert deepseek.qk_head_dim == deepseek.qk_nope_head_dim + deepseek.qk_rope_head_dim
    assert deepseek.head_dim == deepseek.qk_rope_head_dim
    mamba = _tiny("mamba2").tiny.config  # state-space heads: heads * head_dim = expand * hidden
    assert mamba.num_heads * mamba.head_dim == mamba.expand * mamba.hidden_size
    gemma = _tiny("gemma4_text").tiny.config.to_dict()  # a per-layer head_dim twice the global one stays so
    assert gemma["head_dim"] == HEAD_DIM
    overrides = gemma["per_layer_config"]
    assert overrides and {v["head_dim"] for v in overrides.values()} == {2 * HEAD_DIM}


def test_special_token_ids_map_below_the_vocabulary_and_inputs_avoid_them():
    tiny = _tiny("llama4").tiny  # Llama-4: image ids 200080, 200081, 200092 of a vocabulary of 202048
    config = tiny.config
    ids = [config.image_token_index, config.boi_token_index, config.eoi_token_index,
           config.text_config.bos_token_id, config.text_config.eos_token_id]
    assert all(0 <= i < tiny.vocab_size == config.text_config.vocab_size for i in ids) and len(set(ids)) == 5
    assert not set(ids) & set(tiny.token_range())
    samples = _tiny("llama4").samples(4)
    assert all(t in set(tiny.token_range()) for s in samples for t in s["input_ids"])


def test_cut_depth_on_a_plain_dictionary():
    """12 layers: every third a full-attention one, the first two dense, a per-layer override of layer 5."""
    d = {"num_hidden_layers": 12, "hidden_size": 1024, "num_attention_heads": 16,
         "layer_types": ["linear", "linear", "full"] * 4, "mlp_only_layers": [0, 1],
         "no_rope_layers": [1] * 12, "per_layer_config": {"05": {"num_attention_heads": 8}}}
    _Shrinker().shrink(d, None)
    # kept, the first of each kind: 0 (linear, dense), 2 (full), 3 (linear), 5 (full, with the override)
    assert d["num_hidden_layers"] == 4
    assert d["layer_types"] == ["linear", "full", "linear", "full"]
    assert d["mlp_only_layers"] == [0] and d["no_rope_layers"] == [1] * 4
    assert d["per_layer_config"] == {"3": {"num_attention_heads": 2}}  # 8 of 16 heads -> 2 of 4
    assert d["hidden_size"] == HIDDEN and d["num_attention_heads"] == 4


# ------------------------------------------------------------------------------------------------ structure
class _Router(nn.Module):
    def __init__(self, experts, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden))


class _Stacked(nn.Module):
    def __init__(self, experts, hidden, inter):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.zeros(experts, hidden, inter))


class _Mlp(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.up, self.down = nn.Linear(hidden, inter), nn.Linear(inter, hidden)


def test_experts_are_found_by_layout_beside_a_router():
    block = nn.Module()
    block.gate, block.experts = _Router(4, 64), _Stacked(4, 64, 32)
    listed = nn.Module()
    listed.gate, listed.experts = nn.Linear(64, 4), nn.ModuleList(_Mlp(64, 32) for _ in range(4))
    flat = nn.Module()  # DBRX: each projection of all experts as one [E * I, H] matrix, the router a level up
    flat.router = nn.Module()
    flat.router.layer = nn.Linear(64, 4)
    flat.experts = nn.Module()
    flat.experts.mlp = nn.Module()
    for name in ("w1", "v1", "w2"):
        flat.experts.mlp.register_parameter(name, nn.Parameter(torch.zeros(4 * 32, 64)))
    model = nn.ModuleDict({"a": block, "b": listed, "c": flat})
    found = {(e.path, e.layout, e.experts) for e in find_experts(model)}
    assert found == {("a.experts", "stacked", 4), ("b.experts", "listed", 4), ("c.experts.mlp", "flattened", 4)}


def test_look_alikes_are_not_experts():
    no_router = nn.Module()  # per-head block-diagonal weights (RecurrentGemma's RG-LRU): no router beside them
    no_router.heads, no_router.proj = _Stacked(4, 64, 32), nn.Linear(64, 64)
    conv = nn.Module()  # a convolution's 3-D weight, next to a linear with a small side
    conv.conv, conv.gate = nn.Conv1d(4, 4, 3), nn.Linear(64, 4)
    blocks = nn.Module()  # a stack of decoder blocks (they hold norms) beside a small linear
    layer = nn.Module()
    layer.mlp, layer.norm = _Mlp(64, 32), nn.LayerNorm(64)
    blocks.layers, blocks.gate = nn.ModuleList([layer, layer]), nn.Linear(64, 2)
    model = nn.ModuleDict({"a": no_router, "b": conv, "c": blocks})
    assert find_experts(model) == []


@pytest.mark.parametrize("model_type, moe", [("mixtral", True), ("olmoe", True), ("dbrx", True), ("llama", False),
                                             ("recurrent_gemma", False), ("rwkv", False)])
def test_families_are_moe_by_structure(model_type, moe):
    assert bool(find_experts(_tiny(model_type).model)) is moe


# ------------------------------------------------------------------------------------------------ the probe
class _NoLinears(nn.Module):
    """A causal LM without a single linear layer: logits are the hidden states times the embedding."""

    def __init__(self, vocab=32, hidden=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)

    def forward(self, input_ids, labels=None, **_):
        logits = self.embed(input_ids) @ self.embed.weight.t()
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return {"loss": loss, "logits": logits}


class _Breaks(nn.Module):
    """A model with a block of linears whose forward fails inside the step."""

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.ModuleDict({"mlp": _Mlp(16, 32), "norm": nn.LayerNorm(16)})])
        self.embed = nn.Embedding(32, 16)

    def forward(self, input_ids, labels=None, **_):
        raise RuntimeError("the model's own forward failed")


def _samples():
    return [{"input_ids": list(range(8)), "labels": list(range(8))} for _ in range(4)]


def test_probe_records_a_refusal_with_snip_ds_message(tmp_path):
    from snip_ds.families.probe import run_plan

    out = run_plan(_NoLinears(), _samples(), "fp8", str(tmp_path))
    assert out.result == "refused" and out.stage == "setup"
    assert out.where.startswith("snip_ds/") and "\n" not in out.error and out.error


def test_probe_records_a_crash_with_its_frame(tmp_path):
    from snip_ds.families.probe import run_plan

    out = run_plan(_Breaks(), _samples(), "fp8", str(tmp_path))
    assert out.result == "crash" and out.error == "RuntimeError: the model's own forward failed"
    assert "test_families.py" in out.where and "forward" in out.where


# ------------------------------------------------------------------------------------------------ the report
def _row(model_type, plans, **extra):
    return {"model_type": model_type, "class": "X", "buildable": True, "moe": False, "plans": plans, **extra}


def _ok(plan, linears=4, pairs=0, **extra):
    return {"plan": plan, "result": "ok", "error": "", "where": "", "snip_frame": "", "loss": 1.0,
            "quantized_linears": linears, "expert_pairs": pairs, "unrun": [],
            "fp4_share": 0.75 if plan == "adaptive" else None, **extra}


def test_status_is_the_most_severe_problem_and_the_note_names_every_one():
    good = {p: _ok(p) for p in ("bf16", "fp8", "fp4", "adaptive")}
    assert report.classify(_row("a", good)) == ("trains", "adaptive FP4 share 0.75")
    unrun = dict(good, fp4=_ok("fp4", unrun=["model.layers.3.mixer.dt_proj", "model.layers.12.mixer.dt_proj"]))
    assert report.classify(_row("b", unrun)) == (
        "fails checks", "planned but never run quantized: model.layers.N.mixer.dt_proj")
    crash = dict(unrun, adaptive=_ok("adaptive", result="crash", error="KeyError: 'x'", fp4_share=None,
                                     snip_frame="snip_ds/stats/collector.py:260 f"))
    status, note = report.classify(_row("c", crash))
    assert status == "crashes" and note.startswith("adaptive: KeyError: 'x' at snip_ds/stats/collector.py:260")
    assert "dt_proj" in note
    unsolved = dict(good, adaptive=_ok("adaptive", fp4_share=None))
    assert report.classify(_row("d", unsolved)) == ("fails checks", "adaptive: no plan solved")
    assert report.classify({"model_type": "e", "buildable": False, "build_error": "ImportError: needs timm"}
                           )[0] == "not buildable"


def test_causes_group_families_across_their_names():
    refusal = "UnsupportedModelError: {}: module 'model.layers.{}.mlp.experts' ({}Experts) is not known"
    rows = report.annotate([
        _row("olmoe", {"fp8": _ok("fp8", result="refused", error=refusal.format("OlmoeForCausalLM", 0, "Olmoe"))},
             moe=True),
        _row("jamba", {"fp8": _ok("fp8", result="refused", error=refusal.format("JambaForCausalLM", 1, "Jamba"))},
             moe=True),
        _row("rwkv", {"fp8": _ok("fp8", result="refused", error=refusal.format("RwkvForCausalLM", 0, "RwkvSelf"))}),
    ])
    (group, members), (other, alone) = report.groups(rows)["refused"].items()
    assert members == ["olmoe", "jamba"] and group.endswith("[MoE by structure]")
    assert alone == ["rwkv"] and other.endswith("[no experts by structure]")


# ------------------------------------------------------------------------------------------------ the sweep
def _hangs(model_type, plans=()):
    time.sleep(60)


def _dies(model_type, plans=()):
    os.kill(os.getpid(), signal.SIGKILL)


def test_sweep_turns_a_hang_and_a_death_into_rows(monkeypatch):
    from snip_ds.families import sweep

    monkeypatch.setattr(sweep, "survey_family", _hangs)
    start = time.monotonic()
    (row,) = sweep.sweep(["llama"], timeout=1.0)
    assert row["timed_out"] and time.monotonic() - start < 30  # (killed at 1 s; imports before it)
    assert report.classify(row)[0] == "timeout"
    monkeypatch.setattr(sweep, "survey_family", _dies)
    (row,) = sweep.sweep(["llama"], timeout=30.0)
    assert row["died"] and "signal 9" in row["error"] and report.classify(row)[0] == "crashes"


# ------------------------------------------------------------------------------------------------ the command
@pytest.mark.parametrize("argv, match", [
    (["--only", "lama"], "'lama' is not a causal-LM model type .* did you mean llama"),
    (["--plans", "fp8,fp5"], "unknown plan 'fp5'"),
    (["--jobs", "0"], "--jobs: must be >= 1"),
    (["--timeout", "0"], "--timeout: must be > 0"),
])
def test_bad_input_is_one_line(tmp_path, capsys, argv, match):
    import re

    assert main(["families", *argv, "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("snip-ds: error: ") and err.count("\n") == 1 and re.search(match, err)
    assert not (tmp_path / "families.md").exists()


def test_unwritable_output_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["families", "--only", "llama", "--output", str(blocker)]) == 2
    assert "--output" in capsys.readouterr().err
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert main(["families", "--only", "llama", "--output", str(locked)]) == 2
        assert "not writable" in capsys.readouterr().err


def test_command_surveys_three_families_end_to_end(tmp_path, capsys):
    assert main(["families", "--only", "llama,gpt_neox,mixtral", "--output", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "families.json").read_text())
    assert data["format"] == report.FORMAT and data["meta"]["plans"] == ["bf16", "fp8", "fp4", "adaptive"]
    rows = {r["model_type"]: r for r in data["rows"]}
    assert list(rows) == ["llama", "gpt_neox", "mixtral"]
    # 2 blocks each: Llama's q, k, v, o, gate, up, down; GPT-NeoX's query_key_value, dense, dense_h_to_4h,
    # dense_4h_to_h; Mixtral's q, k, v, o and 4 experts x (gate_up_proj, down_proj)
    expected = {"llama": (14, 0, False), "gpt_neox": (8, 0, False), "mixtral": (8, 16, True)}
    for name, (linears, pairs, moe) in expected.items():
        row = rows[name]
        assert row["status"] == "trains", row["note"]
        assert (row["quantized_linears"], row["expert_pairs"], row["moe"], row["per_expert"]) == (
            linears, pairs, moe, moe)
        assert all(p["result"] == "ok" and not p["unrun"] for p in row["plans"].values())
        assert row["plans"]["adaptive"]["fp4_share"] >= 0.75 - 1e-12  # efficiency_saving's default
    assert data["summary"]["all"]["trains"] == 3 and data["summary"]["moe"]["per_expert"] == 1
    table = (tmp_path / "families.md").read_text()
    assert "| mixtral | MixtralForCausalLM | per expert | trains | 8 | 16 |" in table
    assert "snip-ds families --only llama,gpt_neox,mixtral" in table
    assert capsys.readouterr().out.count("trains") == 3
