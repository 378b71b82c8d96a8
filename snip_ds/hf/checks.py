"""What the Hugging Face Trainer's arguments must agree with before SNIP trains under it, checked once, in one place:
:func:`check_trainer` reads ``TrainingArguments`` (the DeepSpeed config it trains with, ``TrainingArguments.deepspeed``
or accelerate's DeepSpeed plugin, read once; its ``"snip"`` section or the settings given to the callback; the
batch geometry; the tensor-parallel degree; the launched ranks) and returns a frozen :class:`TrainerChecks`, which
:class:`snip_ds.hf.SnipCallback` and its hooks (:mod:`snip_ds.hf.checkpoint`, :mod:`snip_ds.hf.tp`) read from then
on, never the arguments again. Each mistake is one :class:`~snip_ds.config.settings.ConfigError` naming the field and
file.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from snip_ds.runtime import distributed as sdist
from snip_ds.hf import tp as hf_tp
from snip_ds.config.deepspeed_config import refuse_module_replacement, tensor_parallel_degree
from snip_ds.config.settings import ConfigError, SnipSettings, load_ds_config, parse_snip_section, with_overrides


@dataclass(frozen=True)
class TrainerChecks:
    """What :func:`check_trainer` checked and resolved, once per :class:`~snip_ds.hf.SnipCallback`; read by the
    callback and its hooks instead of the ``TrainingArguments``."""

    settings: SnipSettings
    """The validated ``"snip"`` section, ``TrainingArguments.seed`` as ``train.seed``."""
    source: str
    """Where the settings came from: the DeepSpeed config file, or ``SnipCallback(settings=...)``."""
    ds_config: Optional[Mapping[str, Any]]
    """The DeepSpeed config the Trainer trains with; None without DeepSpeed."""
    ds_source: Optional[str]
    """Where :attr:`ds_config` was read (a file, ``TrainingArguments.deepspeed`` or accelerate's plugin)."""
    world: int
    """The number of ranks the launcher started (:func:`launched_world`)."""
    tp: int
    """The tensor-parallel degree (``tensor_parallel.autotp_size``; 1 without)."""

    @property
    def deepspeed(self) -> bool:
        """Whether the Trainer trains with DeepSpeed."""
        return self.ds_config is not None or self.ds_source is not None


def check_trainer(args, given: Optional[Mapping[str, Any] | SnipSettings]) -> TrainerChecks:
    """Every check of the Trainer's arguments SNIP makes, in this order: the DeepSpeed config (read once) and the
    settings (``given``: ``SnipCallback(settings=...)``, or None for the config's ``"snip"`` section), DeepSpeed's
    layer replacement, the tensor-parallel degree, the batch geometry, the CPU ranks accelerate knows of.

    Raises:
        ConfigError: naming the field and the file.
    """
    config, ds_source, parsed = deepspeed_config(args)
    settings, source = settings_from(config, ds_source, given, parsed)
    world, tp = launched_world(args), 1
    if config is not None:  # AutoEP would replace the layers SNIP swaps with unquantized ones
        refuse_module_replacement(config, ds_source)
        tp = tensor_parallel_degree(config, ds_source, world)
        if tp > 1:
            hf_tp.check_config(config, ds_source, tp)
    check_against_trainer(args, config, source)
    check_cpu_ranks(args)
    return TrainerChecks(with_overrides(settings, seed=args.seed), source, config, ds_source, world, tp)


def deepspeed_config(args) -> tuple[Optional[dict], Optional[str], Optional[SnipSettings]]:
    """The DeepSpeed config the Trainer trains with, as ``(config, where, parsed)``, ``parsed`` its ``"snip"``
    section validated where the config was read from a file (else None); ``(None, None, None)`` without DeepSpeed.

    ``TrainingArguments.deepspeed`` (a path or a dict) first; else, under ``accelerate launch`` with a DeepSpeed
    plugin, the plugin's config (``TrainingArguments.deepspeed_plugin``, which transformers builds from
    ``ACCELERATE_USE_DEEPSPEED``): read from its file, ``ACCELERATE_DEEPSPEED_CONFIG_FILE``, when there is one
    (so errors name the file), else the dict accelerate holds. File errors name the file.
    """
    ds = getattr(args, "deepspeed", None)
    if isinstance(ds, (str, os.PathLike)):
        return _read_config(ds)
    if isinstance(ds, dict):
        return ds, "TrainingArguments.deepspeed", None
    plugin = getattr(args, "deepspeed_plugin", None)
    if plugin is None:
        return None, None, None
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if path != "none":
        return _read_config(path)
    config = getattr(getattr(plugin, "hf_ds_config", None), "config", None) or getattr(plugin, "deepspeed_config", None)
    return ((dict(config) if isinstance(config, Mapping) else None), "accelerate's DeepSpeed plugin (deepspeed_config)",
            None)


def _read_config(path) -> tuple[dict, str, SnipSettings]:
    """The DeepSpeed config file at ``path`` as ``(config, path, its "snip" section validated)``; its errors (file
    missing, not JSON, not an object; the section's) name the file."""
    _, parsed = load_ds_config(path)
    config = json.loads(Path(path).read_text())  # with its "snip" section, which load_ds_config took out
    return config, str(path), parsed


def settings_from(config: Optional[Mapping[str, Any]], source: Optional[str], settings,
                  parsed: Optional[SnipSettings] = None) -> tuple[SnipSettings, str]:
    """The validated settings and where they came from: ``settings`` given to the callback, or the ``"snip"``
    section of the DeepSpeed ``config`` read from ``source`` (``parsed``: that section validated already, when
    :func:`deepspeed_config` read it from a file); errors name the field and the file."""
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
    return (parsed if parsed is not None else parse_snip_section(section, source)), source


def check_against_trainer(args, cfg: Optional[Mapping[str, Any]], source: str) -> None:
    """The DeepSpeed config ``cfg``'s batch geometry must be the Trainer's (or "auto")."""
    if cfg is None:
        return
    for key, arg in (("gradient_accumulation_steps", "gradient_accumulation_steps"),
                     ("train_micro_batch_size_per_gpu", "per_device_train_batch_size")):
        value = cfg.get(key, "auto")
        if value != "auto" and value != getattr(args, arg):
            raise ConfigError(f"{source}: {key} is {value!r} but TrainingArguments.{arg} is "
                              f"{getattr(args, arg)!r}; make them equal or set {key} to \"auto\"")


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
    """Raises :class:`~snip_ds.config.settings.ConfigError` where several CPU ranks were launched with DeepSpeed but
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
