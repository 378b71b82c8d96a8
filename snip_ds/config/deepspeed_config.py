"""Resolving a DeepSpeed JSON for one run: command-line overrides and ``"auto"`` values.

Command-line flags win over the JSON. ``"auto"`` values are filled in as Hugging Face's DeepSpeed
integration does, from ``launch/train.py``'s flags where given, else from :data:`AUTO_DEFAULTS` (the embedded
run's values, which ``launch/train_hf.py`` also uses as its ``TrainingArguments`` defaults): ``bf16.enabled``
is true on a GPU and false on a CPU (where FP32 is ~3x faster), the scheduler's ``total_num_steps`` is
``max_steps`` and ``warmup_num_steps`` a tenth of it, ``warmup_max_lr`` the optimizer's lr. So one JSON serves
both ``launch/train.py`` and the Hugging Face Trainer.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Mapping, Optional

from snip_ds.config.settings import ConfigError


# What "auto" means to launch/train.py when no flag sets it (Hugging Face TrainingArguments name in brackets).
AUTO_DEFAULTS: Dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 4,  # per_device_train_batch_size
    "gradient_accumulation_steps": 1,  # gradient_accumulation_steps
    "gradient_clipping": 1.0,  # max_grad_norm
    "optimizer.params.lr": 2e-3,  # learning_rate
    "optimizer.params.betas": [0.9, 0.95],  # adam_beta1, adam_beta2
    "optimizer.params.eps": 1e-8,  # adam_epsilon
    "optimizer.params.weight_decay": 0.1,  # weight_decay
}


def _set_auto(d: Dict[str, Any], key: str, value: Any) -> None:
    if d.get(key) == "auto":
        d[key] = value


def resolve_ds_config(config: Mapping[str, Any], *, max_steps: int, on_gpu: bool, source: str,
                      micro_batch_size: Optional[int] = None, gradient_accumulation_steps: Optional[int] = None,
                      learning_rate: Optional[float] = None, world_size: int = 1) -> Dict[str, Any]:
    """A copy of ``config`` with overrides applied and every ``"auto"`` resolved.

    Raises:
        ConfigError: naming ``source`` and the field, for values DeepSpeed would reject later and less clearly.
    """
    cfg = copy.deepcopy(dict(config))
    refuse_module_replacement(cfg, source)
    tp = tensor_parallel_degree(cfg, source, world_size)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
        _set_auto(cfg, key, AUTO_DEFAULTS[key])
    if cfg.get("train_batch_size") == "auto":
        cfg.pop("train_batch_size")  # DeepSpeed derives it from the micro batch, accumulation and world size
    if micro_batch_size is not None:
        cfg["train_micro_batch_size_per_gpu"] = micro_batch_size
    if gradient_accumulation_steps is not None:
        cfg["gradient_accumulation_steps"] = gradient_accumulation_steps
    cfg.setdefault("gradient_accumulation_steps", 1)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        value = cfg.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
    if (micro_batch_size is not None or gradient_accumulation_steps is not None) and "train_batch_size" in cfg:
        cfg.pop("train_batch_size")  # recomputed by DeepSpeed from the two overridden values
    per_rank = cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"]
    expected = per_rank * (world_size // tp)
    if cfg.get("train_batch_size", expected) != expected:
        ranks = f"world size {world_size}" if tp == 1 else \
            f"data-parallel ranks {world_size // tp} (world size {world_size} / tensor_parallel.autotp_size {tp})"
        raise ConfigError(f"{source}: train_batch_size {cfg['train_batch_size']} != micro batch "
                          f"{cfg['train_micro_batch_size_per_gpu']} x gradient_accumulation_steps "
                          f"{cfg['gradient_accumulation_steps']} x {ranks}")
    if tp > 1:  # checked above against the data-parallel ranks, which share no batch; DeepSpeed's own checks
        # disagree on what it counts (the engine's every rank, ZeRO-3's re-read of the config only data-parallel
        # ranks), and each derives it consistently when it is absent
        cfg.pop("train_batch_size", None)
    opt = cfg.get("optimizer")
    if opt is not None:
        if not isinstance(opt, dict) or not isinstance(opt.get("params", {}), dict):
            raise ConfigError(f"{source}: optimizer must be an object with a 'params' object")
        params = opt.setdefault("params", {})
        for key in ("lr", "betas", "eps", "weight_decay"):
            _set_auto(params, key, copy.deepcopy(AUTO_DEFAULTS[f"optimizer.params.{key}"]))
        if learning_rate is not None:
            params["lr"] = learning_rate
        if not isinstance(params.get("lr"), (int, float)) or params["lr"] <= 0:
            raise ConfigError(f"{source}: optimizer.params.lr must be a positive number, got {params.get('lr')!r}")
    elif learning_rate is not None:
        raise ConfigError(f"{source}: --learning_rate given but the config has no 'optimizer' section")
    sched = cfg.get("scheduler")
    if isinstance(sched, dict) and isinstance(sched.get("params"), dict):
        _set_auto(sched["params"], "total_num_steps", max_steps)
        _set_auto(sched["params"], "warmup_num_steps", max(1, max_steps // 10))
        _set_auto(sched["params"], "warmup_max_lr", (opt or {}).get("params", {}).get("lr"))
    for section in ("bf16", "fp16"):
        if isinstance(cfg.get(section), dict):
            _set_auto(cfg[section], "enabled", on_gpu and section == "bf16")
    leftover = _find_auto(cfg)
    if leftover:
        raise ConfigError(f"{source}: cannot resolve \"auto\" for {leftover}")
    return cfg


# DeepSpeed features that replace the model's modules inside deepspeed.initialize: (section, key, what it does).
# snip_ds's quantized layers would be swapped for DeepSpeed's own, which train unquantized while the plan and
# the logs say otherwise, so a config that turns one on is refused until snip_ds quantizes those layers.
# (Tensor parallelism, whose sharded linears snip_ds runs quantized, is read by tensor_parallel_degree.)
_REPLACING = (("expert_parallel", "autoep_size", "expert parallelism (AutoEP) replaces the experts modules with "
               "its own"),)


def tensor_parallel_degree(config: Mapping[str, Any], source: str, world_size: int) -> int:
    """The tensor-parallel degree ``tensor_parallel.autotp_size`` asks for (1 without the section, and for
    DeepSpeed's default 0).

    Raises:
        ConfigError: naming ``source`` and the field: not a positive integer, or not a divisor of the world
            size (each tensor-parallel group needs that many ranks).
    """
    part = config.get("tensor_parallel")
    if part is None:
        return 1
    if not isinstance(part, Mapping):
        raise ConfigError(f"{source}: tensor_parallel must be an object, got {part!r}")
    value = part.get("autotp_size", 1)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{source}: tensor_parallel.autotp_size must be a positive integer, got {value!r}")
    value = max(value, 1)  # 0 is DeepSpeed's default: no tensor parallelism
    if world_size % value:
        raise ConfigError(f"{source}: tensor_parallel.autotp_size {value} does not divide the world size "
                          f"{world_size}: every tensor-parallel group needs {value} ranks")
    return value


def refuse_module_replacement(config: Mapping[str, Any], source: str) -> None:
    """Raises :class:`ConfigError` naming the field when ``config`` asks DeepSpeed to replace the model's layers
    with ones snip_ds does not run quantized (``expert_parallel.autoep_size`` above 1), which would otherwise
    train unquantized under a plan that says FP8/FP4."""
    for section, key, what in _REPLACING:
        part = config.get(section)
        value = part.get(key) if isinstance(part, Mapping) else None
        if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool)
                                                 and value <= 1):
            continue
        raise ConfigError(f"{source}: {section}.{key}: {value!r}: {what}, which snip_ds does not quantize yet "
                          f"(they would train unquantized); remove {section!r} or set {key} to 1")


def _find_auto(obj: Any, path: str = "") -> Optional[str]:
    if obj == "auto":
        return path or "<root>"
    if isinstance(obj, dict):
        for key, value in obj.items():
            found = _find_auto(value, f"{path}.{key}" if path else key)
            if found:
                return found
    return None


# pydantic model behind each DeepSpeed section, so that errors name the JSON field, not the class.
_SECTIONS = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedBF16Config": "bf16",
             "DeepSpeedFP16Config": "fp16", "DeepSpeedActivationCheckpointingConfig": "activation_checkpointing",
             "DeepSpeedFlopsProfilerConfig": "flops_profiler", "DeepSpeedCommsConfig": "comms_logger",
             "DeepSpeedMonitorConfig": "monitor"}


def validate_with_deepspeed(config: Mapping[str, Any], source: str) -> None:
    """Parses a resolved config with DeepSpeed's own ``DeepSpeedConfig`` (torch.distributed must be initialised).

    Run before anything is written, so that a value DeepSpeed rejects (an unknown ZeRO stage, a misspelt key
    inside ``zero_optimization``, an unknown optimizer or scheduler) stops the run with one line naming the
    field, instead of a traceback from inside ``deepspeed.initialize``. Imports DeepSpeed.

    Raises:
        ConfigError: naming ``source`` and the field.
    """
    import pydantic
    import torch
    from deepspeed.runtime import lr_schedules
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS, DeepSpeedConfig

    try:
        parsed = DeepSpeedConfig(copy.deepcopy(dict(config)))
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        field = ".".join([_SECTIONS.get(err.title, err.title), *map(str, first["loc"])])
        raise ConfigError(f"{source}: {field}: {first['msg']} (got {first.get('input')!r})") from None
    except (AssertionError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{source}: DeepSpeed rejects the config: {' '.join(str(err).split())}") from None
    opt = parsed.optimizer_name
    if opt is not None and opt not in DEEPSPEED_OPTIMIZERS and getattr(torch.optim, opt, None) is None:
        raise ConfigError(f"{source}: optimizer.type: unknown optimizer {opt!r}; valid: "
                          f"{', '.join(DEEPSPEED_OPTIMIZERS)} or a torch.optim class name")
    sched = parsed.scheduler_name
    if sched is not None and not hasattr(lr_schedules, sched) and not hasattr(torch.optim.lr_scheduler, sched):
        raise ConfigError(f"{source}: scheduler.type: unknown scheduler {sched!r}; valid: "
                          f"{', '.join(lr_schedules.VALID_LR_SCHEDULES)} or a torch.optim.lr_scheduler class name")
