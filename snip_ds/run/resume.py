"""What a resumed training run takes over from its checkpoint: the learning-rate schedule and the plan.

:mod:`snip_ds.run.trainer` calls these after :func:`snip_ds.engine.checkpoint_verify.check_resumable` has verified the
checkpoint and before DeepSpeed starts, so a mismatch is reported as one line naming the checkpoint's file.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Dict, Optional

from snip_ds.config.deepspeed_config import resolve_ds_config
from snip_ds.config.settings import SnipSettings


def schedule_words(scheduler: Optional[Dict[str, Any]]) -> str:
    if not scheduler:
        return "none (the optimizer's constant lr)"
    params = scheduler.get("params") or {}
    return f"{scheduler.get('type')} " + " ".join(f"{k}={v}" for k, v in sorted(params.items()))


def checkpoint_schedule(meta: Dict[str, Any], raw_cfg: Dict[str, Any], args: argparse.Namespace, on_gpu: bool,
                        world: int) -> Optional[Dict[str, Any]]:
    """The resolved scheduler section a checkpoint was trained with. Checkpoints written before it was
    recorded (no ``lr_schedule``) get this run's config resolved with the checkpoint's ``max_steps``."""
    if "lr_schedule" in meta:
        return meta["lr_schedule"]
    max_steps = ((meta.get("settings") or {}).get("train") or {}).get("max_steps")
    if not isinstance(max_steps, int):
        return None
    return resolve_ds_config(raw_cfg, max_steps=max_steps, on_gpu=on_gpu, source=args.deepspeed,
                             micro_batch_size=args.per_device_train_batch_size,
                             gradient_accumulation_steps=args.gradient_accumulation_steps,
                             learning_rate=args.learning_rate, world_size=world).get("scheduler")


def resume_schedule(ds_cfg: Dict[str, Any], saved: Optional[Dict[str, Any]],
                    reset: bool) -> tuple[Dict[str, Any], str]:
    """The config a resumed run trains with, and the line saying which learning-rate schedule it follows.

    DeepSpeed's schedulers restore only their position (``last_batch_iteration``) from a checkpoint; their
    shape (``total_num_steps``, warm-up, ...) comes from the config, which ``"auto"`` resolves from this run's
    ``max_steps``. So unless ``reset``, the checkpoint's scheduler section replaces this run's.
    """
    current = ds_cfg.get("scheduler")
    if reset:
        return ds_cfg, (f"snip_ds: lr schedule: this run's, {schedule_words(current)} (--reset_lr_schedule; the "
                        f"checkpoint's was {schedule_words(saved)})")
    if saved == current:
        return ds_cfg, f"snip_ds: lr schedule: the checkpoint's, {schedule_words(saved)} (the same as this run's)"
    cfg = dict(ds_cfg)
    if saved is None:
        cfg.pop("scheduler", None)
    else:
        cfg["scheduler"] = saved
    return cfg, (f"snip_ds: lr schedule: the checkpoint's, {schedule_words(saved)} (this run's config would give "
                 f"{schedule_words(current)}; pass --reset_lr_schedule to follow it)")


def check_resumed_plan(tag_dir: Path, meta: Dict[str, Any], plan, settings: SnipSettings) -> None:
    """A fixed-plan run (uniform precision or plan file) resumes only a checkpoint trained on that plan; an
    adaptive run takes over the checkpoint's plan (and re-plans). The checkpoint's plan is read from its
    ``snip_state.json``, or from ``snip_meta.json`` in a checkpoint of an older snip_ds."""
    from snip_ds.engine.checkpoint_layout import CheckpointError, read_snip_state
    from snip_ds.plan import Plan

    if settings.is_adaptive:
        return
    state, path = read_snip_state(tag_dir, meta)
    if not state.get("plan"):
        return
    try:
        saved = Plan.from_dict(state["plan"], source=path)
    except (ValueError, TypeError, KeyError) as err:
        raise CheckpointError(f"{path}: field 'plan' is not a plan ({err})") from None
    if saved.digest() != plan.digest():
        trained = (state.get("settings") or meta.get("settings") or {}).get("plan", saved.method)
        raise CheckpointError(f"{path}: the checkpoint was trained on another plan (snip.plan {trained!r}, "
                              f"method {saved.method}) than this run's snip.plan {settings.plan!r}; resume with "
                              f"the checkpoint's plan, or with snip.plan 'adaptive'")
