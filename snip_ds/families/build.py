"""A family's tiny causal LM, its random token batch, and the plain training step that makes it "buildable".

:func:`build_tiny` builds ``AutoModelForCausalLM.from_config`` of the family's tiny config
(:func:`snip_ds.families.shrink.tiny_config`) in FP32 on the CPU, with the KV cache off (``use_cache=False``
in the config and its sub-configs: a training step has no use for it). :func:`plain_step` is one forward with
labels and one backward, without snip_ds: a family whose tiny model does not get through it is "not
buildable", and the reason is its error.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

import torch

from snip_ds.families.shrink import TinyConfig, tiny_config

BATCH = 2
SEQUENCE = 32


@dataclass
class TinyModel:
    """A built tiny model with its config and the batch it trains on."""

    model_type: str
    model: Any
    tiny: TinyConfig

    @property
    def class_name(self) -> str:
        return type(self.model).__name__

    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def samples(self, count: int, seed: int = 0) -> List[Dict[str, List[int]]]:
        """``count`` training samples of :data:`SEQUENCE` random tokens (``input_ids`` = ``labels``)."""
        return random_samples(self.tiny, count, seed)


def random_samples(tiny: TinyConfig, count: int, seed: int = 0) -> List[Dict[str, List[int]]]:
    allowed = torch.tensor(tiny.token_range())
    gen = torch.Generator().manual_seed(seed)
    rows = allowed[torch.randint(0, len(allowed), (count, SEQUENCE), generator=gen)].tolist()
    return [{"input_ids": r, "labels": list(r)} for r in rows]


def _no_cache(config) -> None:
    """``use_cache=False`` on ``config`` and every sub-config."""
    from transformers import PretrainedConfig

    if "use_cache" in vars(config) or hasattr(type(config), "use_cache"):
        config.use_cache = False
    for value in list(vars(config).values()):
        if isinstance(value, PretrainedConfig):
            _no_cache(value)


def build_tiny(model_type: str, seed: int = 0) -> TinyModel:
    """The tiny model of ``model_type`` (FP32, CPU, training mode, seeded)."""
    from transformers import AutoModelForCausalLM

    from snip_ds.families.overrides import after_build, base_type, config_path

    tiny = tiny_config(model_type)
    _no_cache(tiny.config)
    torch.manual_seed(seed)
    part = config_path(model_type)
    if part:  # the class takes a part of the composite config
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[base_type(model_type)])
        model = model_class._from_config(getattr(tiny.config, part), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(tiny.config, dtype=torch.float32)
    for method, args in after_build(model_type).items():
        getattr(model, method)(*args)
    model.train()
    return TinyModel(model_type, model, tiny)


def plain_step(tiny: TinyModel) -> float:
    """One forward with labels and one backward of ``tiny``'s model on a batch of :data:`BATCH` samples,
    without snip_ds; returns the loss. Gradients are zeroed afterwards."""
    samples = tiny.samples(BATCH)
    ids = torch.tensor([s["input_ids"] for s in samples])
    out = tiny.model(input_ids=ids, labels=ids.clone(), use_cache=False)
    loss = out.loss
    if loss is None:
        raise ValueError("the model returned no loss for labels")
    loss.backward()
    tiny.model.zero_grad(set_to_none=True)
    return float(loss.detach())


__all__ = ["BATCH", "SEQUENCE", "TinyModel", "build_tiny", "plain_step", "random_samples"]
