"""launch/train.py on Mixture-of-Experts models: every (expert, projection) pair of Mixtral, Qwen2-MoE (with a
shared expert) and DeepSeek-V3 (a dense first block, a shared expert) planned as a layer of its own, trained
adaptively on 2 ranks under ZeRO-3, re-planned to the FP4 share asked for, resumed bit for bit, and exported
to a model that family's from_pretrained loads; Mixtral also under ZeRO-0 and ZeRO-2 with per-GEMM plans."""
import json

import pytest
import transformers

from snip_ds.types import layer_kind
from test_train_families import _config, _exports_what_was_trained, _ok, _resumes_bit_for_bit, RHO
from train_utils import TINY_DEEPSEEK_V3, TINY_MIXTRAL, TINY_QWEN2_MOE, launch, scalars

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

PAIRS = {f"mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_up_proj", "down_proj")}


@pytest.mark.parametrize("family, model, linears, experts_blocks, cls", [
    ("mixtral", TINY_MIXTRAL, 8, (0, 1), "MixtralForCausalLM"),
    # the shared expert's gate/up/down are linears; its scalar gate (shared_expert_gate) is a router, kept
    ("qwen2_moe", TINY_QWEN2_MOE, 14, (0, 1), "Qwen2MoeForCausalLM"),
    # MLA's 5 linears per block, block 0's dense MLP, block 1's shared expert
    ("deepseek_v3", TINY_DEEPSEEK_V3, 16, (1,), "DeepseekV3ForCausalLM"),
])
def test_moe_trains_adaptively_on_two_ranks_and_exports(family, model, linears, experts_blocks, cls, tmp_path):
    cfg = _config(tmp_path, model)
    if family == "qwen2_moe":  # every expert's down projection held at fp8 by a glob, one overridden by name
        data = json.loads(cfg.read_text())
        data["snip"]["pinned"] = {"model.layers.*.mlp.experts.*.down_proj": "fp8",
                                  "model.layers.1.mlp.experts.2.down_proj": "fp4"}
        cfg.write_text(json.dumps(data))
    run = _ok(launch(["--deepspeed", str(cfg)], num_ranks=2))
    pairs = 8 * len(experts_blocks)
    assert f"{linears} quantizable linears and {pairs} (expert, projection) pairs, 2 rank(s)" in run.stdout
    out = tmp_path / "out"
    logged = scalars(out / "tensorboard")
    assert sorted(logged["snip/solve_time_s"]) == [0, 2]
    # measured after the re-plans at steps 0 and 2 and before every 2nd optimizer step (at steps 1 and 3)
    assert sorted(logged["snip/measured_fld"]) == [0, 1, 2, 3] and all(v > 0 for v in logged["snip/measured_fld"].values())
    assert all(RHO <= v <= 1.0 for v in logged["plan/fp4_share"].values())
    assert logged["train/loss"][4] < logged["train/loss"][1]
    plan = json.loads((out / "plan.json").read_text())
    experts = {f for f in plan["assignment"] if ".experts." in f}
    assert experts == {f"model.layers.{b}.{k}" for b in experts_blocks for k in PAIRS}
    assert len(plan["assignment"]) == linears + pairs and plan["fp4_share"] >= RHO
    assert not any(layer_kind(f).endswith(("gate", "router")) for f in plan["assignment"])  # routers kept
    if family == "qwen2_moe":
        downs = {f: p for f, p in plan["assignment"].items() if ".experts." in f and f.endswith(".down_proj")}
        assert len(downs) == 8 and downs.pop("model.layers.1.mlp.experts.2.down_proj") == "fp4"
        assert set(downs.values()) == {"fp8"}
    stats = json.loads((out / "stats.json").read_text())
    assert set(stats["layers"]) == set(plan["assignment"])
    for fqn in experts:  # FLOPs follow the tokens routed to the expert
        rec = stats["layers"][fqn]
        per_token = rec["flops"] / rec["routed_tokens"] if rec["routed_tokens"] else 0.0
        assert rec["no_tokens"] == (rec["routed_tokens"] == 0)
        if rec["routed_tokens"]:
            up = fqn.endswith("gate_up_proj")
            k, n = (64, 2 * 32 if family != "mixtral" else 2 * 128) if up else (32 if family != "mixtral" else 128, 64)
            assert per_token == 6.0 * k * n, fqn
    for b in experts_blocks:  # every token goes to 2 of the 4 experts: each projection sees 2x the tokens
        routed = [stats["layers"][f"model.layers.{b}.mlp.experts.{e}.down_proj"]["routed_tokens"] for e in range(4)]
        dense = stats["layers"][f"model.layers.{b}.self_attn.o_proj"]["flops"] / (6.0 * 64 * 64)  # its tokens
        assert sum(routed) == 2 * dense
    _exports_what_was_trained(out / "checkpoints" / "step_4", tmp_path / "hf", getattr(transformers, cls))
    _resumes_bit_for_bit(cfg, tmp_path, logged, plan)  # every pair's rounding generator came back too


@pytest.mark.parametrize("stage, ranks, per_gemm, pretrained", [
    (0, 1, False, True),   # a model directory, as --model_name_or_path reads it
    (2, 2, True, False),   # per-GEMM plans: an expert's fprop, dgrad and wgrad chosen apart (ZeRO-1: the same
])                         # partition code as ZeRO-2, snip_ds.engine.adam_state)
def test_mixtral_under_other_zero_stages_per_gemm_plans_and_a_model_directory(stage, ranks, per_gemm, pretrained,
                                                                              tmp_path):
    cfg = _config(tmp_path, TINY_MIXTRAL)
    data = json.loads(cfg.read_text())
    data["zero_optimization"] = {"stage": stage}
    data["snip"]["per_gemm"] = per_gemm
    args = []
    if pretrained:
        from snip_ds.run.model import build_model
        build_model(None, dict(TINY_MIXTRAL), seed=3).save_pretrained(tmp_path / "mixtral")
        del data["snip"]["train"]["model_config"]
        args = ["--model_name_or_path", str(tmp_path / "mixtral")]
    cfg.write_text(json.dumps(data))
    _ok(launch(["--deepspeed", str(cfg), *args], num_ranks=ranks))
    out = tmp_path / "out"
    logged = scalars(out / "tensorboard")
    assert sorted(logged["snip/solve_time_s"]) == [0, 2]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["fp4_share"] >= RHO and len([f for f in plan["assignment"] if ".experts." in f]) == 16
    stats = json.loads((out / "stats.json").read_text())
    assert stats["layers"]["model.layers.1.mlp.experts.0.down_proj"]["bwd"]["fp4"] > 0  # Adam's state was read
    per_gemm_cells = [v for v in plan["assignment"].values() if isinstance(v, dict)]
    assert bool(per_gemm_cells) == per_gemm  # at ρ = 0.5 some layer's GEMMs split in a per-GEMM plan
