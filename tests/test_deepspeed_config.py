"""``"auto"`` in the shipped DeepSpeed JSONs: resolved by launch/train.py to the embedded run's values."""
import json

import pytest

from snip_ds.config.deepspeed_config import resolve_ds_config
from snip_ds.config.settings import ConfigError
from train_utils import REPO

# The values the configs held before they became "auto" (the embedded default run's hyper-parameters).
EMBEDDED = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.002, "betas": [0.9, 0.95], "eps": 1e-08,
                                                      "weight_decay": 0.1}}}


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "zero3_offload"])
def test_shipped_auto_resolves_to_embedded_values(name):
    raw = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
    raw.pop("snip")
    assert raw["optimizer"]["params"]["lr"] == "auto"  # the Trainer fills it from its learning_rate
    cfg = resolve_ds_config(raw, max_steps=120, on_gpu=False, source=name)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping", "optimizer"):
        assert cfg[key] == EMBEDDED[key], key
    assert cfg["scheduler"]["params"]["total_num_steps"] == 120
    assert cfg["scheduler"]["params"]["warmup_num_steps"] == 12


def test_flags_win_over_auto():
    raw = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    raw.pop("snip")
    cfg = resolve_ds_config(raw, max_steps=10, on_gpu=False, source="x", micro_batch_size=2,
                            gradient_accumulation_steps=3, learning_rate=1e-3)
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (2, 3)
    assert cfg["optimizer"]["params"]["lr"] == 1e-3


def test_unknown_auto_is_named():
    with pytest.raises(ConfigError, match=r"x: cannot resolve \"auto\" for zero_optimization.stage"):
        resolve_ds_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": "auto"}},
                          max_steps=1, on_gpu=False, source="x")


def test_layer_replacing_parallelism_is_refused():
    """DeepSpeed's AutoEP would swap snip_ds's quantized experts for its own unquantized ones: refused with the
    field named; a degree of 1 (or 0, DeepSpeed's default) replaces nothing and passes."""
    base = {"train_micro_batch_size_per_gpu": 1}
    with pytest.raises(ConfigError, match=r"^x: expert_parallel\.autoep_size: 2: .*snip_ds does not quantize yet"):
        resolve_ds_config({**base, "expert_parallel": {"autoep_size": 2}}, max_steps=1, on_gpu=False, source="x")
    for degree in (0, 1):
        resolve_ds_config({**base, "expert_parallel": {"autoep_size": degree}}, max_steps=1, on_gpu=False,
                          source="x")


def test_tensor_parallel_batch_counts_data_parallel_ranks():
    """With ``autotp_size`` N the ranks of a tensor-parallel group share their batches: ``train_batch_size`` is
    micro x accumulation x (world / N), checked and then left for DeepSpeed to derive (its own two checks count
    the ranks differently); a degree that does not divide the world, or is not an integer, is named."""
    base = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "tensor_parallel": {"autotp_size": 2}}
    out = resolve_ds_config({**base, "train_batch_size": 12}, max_steps=1, on_gpu=False, source="x", world_size=4)
    assert "train_batch_size" not in out and out["tensor_parallel"] == {"autotp_size": 2}
    with pytest.raises(ConfigError, match=r"^x: train_batch_size 24 != micro batch 2 x gradient_accumulation_steps 3 "
                                          r"x data-parallel ranks 2 \(world size 4 / tensor_parallel.autotp_size 2\)"):
        resolve_ds_config({**base, "train_batch_size": 24}, max_steps=1, on_gpu=False, source="x", world_size=4)
    with pytest.raises(ConfigError, match=r"^x: tensor_parallel.autotp_size 2 does not divide the world size 3"):
        resolve_ds_config(base, max_steps=1, on_gpu=False, source="x", world_size=3)
    for bad in ("auto", -1, 1.5, True):
        with pytest.raises(ConfigError, match=r"^x: tensor_parallel.autotp_size must be a positive integer"):
            resolve_ds_config({**base, "tensor_parallel": {"autotp_size": bad}}, max_steps=1, on_gpu=False,
                              source="x")
    for degree in (0, 1):  # no tensor parallelism: train_batch_size counts every rank, and stays
        out = resolve_ds_config({**base, "train_batch_size": 18, "tensor_parallel": {"autotp_size": degree}},
                                max_steps=1, on_gpu=False, source="x", world_size=3)
        assert out["train_batch_size"] == 18
