"""Tensor parallelism under the Hugging Face Trainer (``tensor_parallel.autotp_size`` N above 1): what is checked
before the Trainer starts DeepSpeed (:func:`check_config`, :func:`check_swapped_model`), and DeepSpeed's AutoTP
shards of the swapped layers made quantized once it has (:func:`quantize_shards`). The work itself is
:mod:`snip_ds.engine.tensor_parallel`'s, shared with :func:`snip_ds.initialize`; accelerate hands a
tensor-parallel group the same batches, and SNIP's private streams are split over the data-parallel ranks alike
(:class:`snip_ds.hf.loop.TrainerLoop`).
"""
from __future__ import annotations

from typing import Any, Dict, Mapping

from torch import nn

from snip_ds.runtime import distributed as sdist
from snip_ds.config.settings import ConfigError, SnipSettings


def check_config(config: Mapping[str, Any], source: str, tp: int) -> None:
    """Before the swap: DeepSpeed's version has AutoTP as :mod:`snip_ds.engine.tensor_parallel` follows it, and
    ``train_batch_size`` is left to the Trainer (``"auto"``: transformers fills it counting every rank, as
    DeepSpeed's check then reads it).

    Raises:
        ConfigError: naming ``source`` and the field.
    """
    import deepspeed

    from snip_ds.engine.tensor_parallel import check_deepspeed_version

    check_deepspeed_version(deepspeed.__version__)
    if config.get("train_batch_size", "auto") != "auto":
        raise ConfigError(f"{source}: train_batch_size is {config['train_batch_size']!r}; under "
                          f"the Hugging Face Trainer with tensor_parallel.autotp_size {tp} set it to "
                          f"\"auto\" or remove it (transformers fills it counting every rank, as "
                          f"DeepSpeed's check then reads it; the batch is the TrainingArguments')")


def check_swapped_model(model: nn.Module, infos: Mapping[str, Any], settings: SnipSettings, tp: int) -> Dict[str, Any]:
    """After the swap: the model splits over ``tp`` ranks (heads, widths); returns its
    :class:`~snip_ds.linear.SnipLinear` layers, which AutoTP rebuilds as its own shards in
    ``deepspeed.initialize`` and :func:`quantize_shards` makes quantized again."""
    from snip_ds.engine.tensor_parallel import check_model
    from snip_ds.swap import snip_layers

    check_model(infos, settings, getattr(model, "config", None), tp, model)
    return snip_layers(model)


def quantize_shards(model: nn.Module, originals: Mapping[str, Any], settings: SnipSettings, tp: int) -> None:
    """Once DeepSpeed is started: AutoTP's shards of the swapped layers (``originals``:
    :func:`check_swapped_model`'s), at the plan's precision from here on."""
    from snip_ds.engine import tensor_parallel as tpar

    tpar.check_groups(tp, sdist.rank(), sdist.world_size())
    tpar.quantize_tp_layers(model, originals, settings.quant)
