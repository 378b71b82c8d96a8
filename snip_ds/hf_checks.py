"""What the Hugging Face Trainer's arguments must agree with before SNIP trains under it, read from
``TrainingArguments``: the DeepSpeed config it trains with (``TrainingArguments.deepspeed``, or accelerate's
DeepSpeed plugin) and its ``"snip"`` section or the settings given to the callback (:func:`settings_from`), the
batch geometry (:func:`check_against_trainer`), the launched ranks (:func:`launched_world`,
:func:`check_cpu_ranks`), and DeepSpeed's fused Adam built before the Trainer starts DeepSpeed
(:func:`prepare_fused_adam`). Each mistake is one :class:`~snip_ds.settings.ConfigError` naming the field and file.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping, Optional

import torch

from snip_ds import distributed as sdist
from snip_ds.settings import ConfigError, SnipSettings, load_ds_config, parse_snip_section


def deepspeed_config(args) -> tuple[Optional[dict], Optional[str]]:
    """The DeepSpeed config the Trainer trains with, as ``(config, where)``; ``(None, None)`` without DeepSpeed.

    ``TrainingArguments.deepspeed`` (a path or a dict) first; else, under ``accelerate launch`` with a DeepSpeed
    plugin, the plugin's config (``TrainingArguments.deepspeed_plugin``, which transformers builds from
    ``ACCELERATE_USE_DEEPSPEED``): read from its file, ``ACCELERATE_DEEPSPEED_CONFIG_FILE``, when there is one
    (so errors name the file), else the dict accelerate holds. File errors name the file.
    """
    ds = getattr(args, "deepspeed", None)
    if isinstance(ds, (str, os.PathLike)):
        return _read_config(ds), str(ds)
    if isinstance(ds, dict):
        return ds, "TrainingArguments.deepspeed"
    plugin = getattr(args, "deepspeed_plugin", None)
    if plugin is None:
        return None, None
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if path != "none":
        return _read_config(path), path
    config = getattr(getattr(plugin, "hf_ds_config", None), "config", None) or getattr(plugin, "deepspeed_config", None)
    return (dict(config) if isinstance(config, Mapping) else None), "accelerate's DeepSpeed plugin (deepspeed_config)"


def _read_config(path) -> dict:
    """The DeepSpeed config file at ``path`` as a dict; its errors name the file."""
    load_ds_config(path)  # file errors (missing, not JSON, not an object) and the section's, named by path
    return json.loads(Path(path).read_text())


def settings_from(args, settings) -> tuple[SnipSettings, str]:
    """The validated settings and where they came from; errors name the field and the file."""
    config, source = deepspeed_config(args)
    section = None if config is None else config.get("snip")
    if settings is not None:
        if section is not None:
            raise ConfigError(f"{source}: has a 'snip' section and SnipCallback was given settings too; "
                              "give them in one place")
        if isinstance(settings, SnipSettings):
            return settings, "SnipCallback(settings=...)"
        if not isinstance(settings, Mapping):
            raise ConfigError(f"SnipCallback(settings=...): expected a mapping like the 'snip' section, got "
                              f"{type(settings).__name__}")
        return parse_snip_section(dict(settings), "SnipCallback(settings=...)"), "SnipCallback(settings=...)"
    if section is None:
        raise ConfigError(f"{source or 'TrainingArguments'}: no 'snip' section; name a DeepSpeed config with one "
                          "(TrainingArguments(deepspeed=...), or deepspeed_config_file in accelerate's config) or "
                          "pass SnipCallback(settings={...})")
    return parse_snip_section(section, source), source


def check_against_trainer(args, source: str) -> None:
    """The DeepSpeed config's batch geometry must be the Trainer's (or "auto")."""
    cfg, _ = deepspeed_config(args)
    if cfg is None:
        return
    for key, arg in (("gradient_accumulation_steps", "gradient_accumulation_steps"),
                     ("train_micro_batch_size_per_gpu", "per_device_train_batch_size")):
        value = cfg.get(key, "auto")
        if value != "auto" and value != getattr(args, arg):
            raise ConfigError(f"{source}: {key} is {value!r} but TrainingArguments.{arg} is "
                              f"{getattr(args, arg)!r}; make them equal or set {key} to \"auto\"")


def prepare_fused_adam(args) -> None:
    """DeepSpeed's fused Adam, built before the Trainer starts DeepSpeed (so a ``TORCH_CUDA_ARCH_LIST`` such as
    ``9.0a`` does not stop its build), or torch's AdamW in the configs the Trainer will hand DeepSpeed, with a
    warning, where it cannot be built (:mod:`snip_ds.engine.optimizer`)."""
    from snip_ds.engine.optimizer import prepare_adam_in_place

    plugin = getattr(args, "deepspeed_plugin", None)
    prepare_adam_in_place([getattr(getattr(args, "hf_deepspeed_config", None), "config", None),
                           getattr(getattr(plugin, "hf_ds_config", None), "config", None),
                           getattr(plugin, "deepspeed_config", None)])


def launched_world(args) -> int:
    """The number of ranks the launcher started (accelerate's count on GPUs)."""
    if sdist.is_initialized():
        return sdist.world_size()
    return max(int(os.environ.get("WORLD_SIZE", "1")), int(getattr(args, "world_size", 1) or 1))


def uses_deepspeed(args) -> bool:
    """Whether the Trainer trains with DeepSpeed (a config in ``TrainingArguments`` or accelerate's plugin)."""
    return bool(getattr(args, "deepspeed", None)) or getattr(args, "deepspeed_plugin", None) is not None


def cpu_ranks_unshared(args) -> bool:
    """DeepSpeed on CPUs with several launched ranks, but accelerate's state counting one process."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    return (uses_deepspeed(args) and not torch.cuda.is_available() and launched > 1
            and int(args.distributed_state.num_processes) != launched)


def check_cpu_ranks(args) -> None:
    """Raises :class:`~snip_ds.settings.ConfigError` where several CPU ranks were launched with DeepSpeed but
    accelerate counts one process (:func:`cpu_ranks_unshared`): every rank would read the same batches. The same
    on every rank: each first unlinks its DeepSpeed buffer."""
    if not cpu_ranks_unshared(args):
        return
    if sdist.is_initialized():
        from snip_ds.engine.core import release_shm_buffer
        release_shm_buffer()
    raise ConfigError(f"{os.environ.get('WORLD_SIZE')} ranks were launched with DeepSpeed on CPUs, but "
                      f"accelerate counts {args.distributed_state.num_processes} process: every rank would "
                      f"read the same batches; call snip_ds.hf.share_cpu_ranks_with_accelerate(args) right "
                      f"after building TrainingArguments, before the Trainer")
