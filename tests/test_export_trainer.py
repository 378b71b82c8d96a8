"""``snip-ds export`` of a Hugging Face Trainer's MoE run (``snip_ds.hf.add_snip``): transformers 5 saves a
Mixtral's experts in the family's original layout, one tensor per expert and projection
(``block_sparse_moe.experts.N.w1.weight``), where the model holds them fused (``mlp.experts.gate_up_proj``); the
export reads them back through transformers' own conversion, to the trained weights exactly. A directory that
``save_pretrained`` wrote, without snip_ds's state, is refused with one line saying what to export instead."""
import json

import pytest
import torch

from snip_ds.cli import main
from test_export import _error_line
from train_utils import TINY_MIXTRAL


@pytest.mark.slow
def test_a_trainer_moe_run_exports_its_per_expert_save_and_a_bare_save_pretrained_is_refused(tmp_path, capsys):
    pytest.importorskip("compressed_tensors")
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from snip_ds.run.model import build_model
    from test_export_serve import _eval_batches, _planned_logits, _served, trainer_run

    model = trainer_run(tmp_path, TINY_MIXTRAL)
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.save_pretrained(str(tmp_path / "saved"))
    ckpt = tmp_path / "run" / "checkpoint-1"
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in f.keys()
    assert "model.layers.0.mlp.experts.gate_up_proj" in trained

    # --format hf: written by save_pretrained too (the same per-expert layout), and loaded by transformers the
    # trained parameters exactly (an FP32 run: the saved weights are them)
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    record = json.loads((tmp_path / "hf" / "snip_export.json").read_text())
    assert record["weights"] == ("the Trainer's model.safetensors (converted from the family's saved layout by "
                                 "transformers)")
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).state_dict()
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)

    # --format compressed-tensors: each (expert, projection) pair of the plan unquantized on request, the rest at
    # the plan's precision; transformers' forward follows snip_ds's planned forward of those weights
    out = tmp_path / "served"
    assert main(["export", str(ckpt), str(out), "--format", "compressed-tensors", "--fallback", "bf16",
                 "--calibration-batches", "2"]) == 0
    record = json.loads((out / "snip_export.json").read_text())
    plan = json.loads((ckpt / "snip_state.json").read_text())["plan"]["assignment"]
    pairs = [f for f in plan if ".experts." in f]
    assert len(pairs) == 16 and record["schemes"]["bf16"] == len(pairs) and set(pairs) <= set(record["fallback"])
    masters = build_model(None, dict(TINY_MIXTRAL), vocab_size=model.config.vocab_size, seed=0,
                          block_size=64).eval()
    masters.load_state_dict(trained)
    ids = _eval_batches()[0][0]["input_ids"]  # the run's validation split: inputs like the calibration's
    fallback = {f: ("bf16" if f in pairs else p) for f, p in plan.items()}
    planned = _planned_logits(masters, fallback, ids)
    with torch.no_grad():
        effect = (planned - masters(input_ids=ids).logits).abs().max()
        assert (_served(out, torch.float32)(input_ids=ids).logits - planned).abs().max() < effect

    capsys.readouterr()
    assert main(["export", str(tmp_path / "saved"), str(tmp_path / "o")]) == 2
    assert (f"{tmp_path / 'saved'}: a Hugging Face model as save_pretrained writes it (config.json and its weights), "
            f"without snip_ds's state") in _error_line(capsys)
    assert not (tmp_path / "o").exists()
