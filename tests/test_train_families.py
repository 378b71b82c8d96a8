"""launch/train.py on other families than Llama: fused projections (Phi-3's qkv_proj and gate_up_proj, GPT-NeoX's
query_key_value) trained adaptively on 2 ranks under ZeRO-3, re-planned to the FP4 share asked for, resumed bit
for bit, and exported to a model that family's from_pretrained loads."""
import json

import pytest
import torch

from snip_ds.cli import main
from snip_ds.export.weights import master_weights
from snip_ds.types import layer_kind
from train_utils import TINY_GPT_NEOX, TINY_PHI3, launch, scalars, write_configs

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

RHO = 0.5


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _config(tmp_path, model):
    """4 steps, re-planned at steps 0 and 2, the plan's forward divergence measured after each re-plan and at
    steps 1 and 3, checkpoints at steps 2 and 4."""
    cfg = write_configs(tmp_path, stage=3, plan="adaptive", model=model, max_steps=4, save_steps=2, eval_steps=2)
    data = json.loads(cfg.read_text())
    data["snip"].update(replan_every=2, efficiency_saving=RHO, additional_bf16_fwd_every_n_steps=2)
    cfg.write_text(json.dumps(data))
    return cfg


def _exports_what_was_trained(ckpt, out, cls):
    """``snip-ds export`` writes a model ``cls.from_pretrained`` loads, holding the checkpoint's master weights."""
    assert main(["export", str(ckpt), str(out)]) == 0
    model = cls.from_pretrained(str(out), dtype=torch.float32, local_files_only=True)
    masters = master_weights(ckpt)
    state = model.state_dict()
    assert set(state) == set(masters)
    assert all(torch.equal(state[k], masters[k]) for k in masters)


def _resumes_bit_for_bit(cfg, tmp_path, logged, plan):
    """Resumed from the step-2 checkpoint: steps 3-4 again, bit for bit, and the same re-plan (the step-2
    collection again: the planner's state and every layer's rounding generator came back)."""
    out = tmp_path / "out"
    resumed = _ok(launch(["--deepspeed", str(cfg), "--resume_from_checkpoint", str(out / "checkpoints" / "step_2"),
                          "--output_dir", str(tmp_path / "resumed")], num_ranks=2))
    assert "resumed from" in resumed.stdout
    again = scalars(tmp_path / "resumed" / "tensorboard")
    for step in (3, 4):
        assert again["train/loss"][step] == logged["train/loss"][step], step
    replanned = json.loads((tmp_path / "resumed" / "plan.json").read_text())
    assert replanned["assignment"] == plan["assignment"] and replanned["fp4_share"] == plan["fp4_share"]


@pytest.mark.parametrize("family, model, kinds, cls", [
    ("phi3", TINY_PHI3, {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"},
     "Phi3ForCausalLM"),
    ("gpt_neox", TINY_GPT_NEOX,
     {"attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"},
     "GPTNeoXForCausalLM"),
])
def test_family_trains_adaptively_on_two_ranks_and_exports(family, model, kinds, cls, tmp_path):
    import transformers

    cfg = _config(tmp_path, model)
    run = _ok(launch(["--deepspeed", str(cfg)], num_ranks=2))
    assert "8 quantizable linears, 2 rank(s)" in run.stdout
    out = tmp_path / "out"
    logged = scalars(out / "tensorboard")
    assert sorted(logged["snip/solve_time_s"]) == [0, 2]
    # measured after the re-plans at steps 0 and 2 and before every 2nd optimizer step (at steps 1 and 3)
    assert sorted(logged["snip/measured_fld"]) == [0, 1, 2, 3] and all(v > 0 for v in logged["snip/measured_fld"].values())
    assert all(RHO <= v <= 1.0 for v in logged["plan/fp4_share"].values())
    assert logged["train/loss"][4] < logged["train/loss"][1]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["fp4_share"] >= RHO and {layer_kind(f) for f in plan["assignment"]} == kinds
    stats = json.loads((out / "stats.json").read_text())
    assert set(stats["layers"]) == set(plan["assignment"])
    _exports_what_was_trained(out / "checkpoints" / "step_4", tmp_path / "hf", getattr(transformers, cls))
    _resumes_bit_for_bit(cfg, tmp_path, logged, plan)
