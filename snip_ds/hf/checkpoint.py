"""SNIP's state in a Hugging Face Trainer's ``checkpoint-N``: written at each save (:func:`save_state`), checked
before the Trainer loads a checkpoint (:func:`check_resume_shape`) and restored once it has
(:func:`restore_state`).

The files are :class:`snip_ds.engine.state.SnipState`'s, the ones ``launch/train.py``'s checkpoints hold too:
``snip_state.json`` (rank 0) and one ``snip_rng_rank<r>.safetensors`` per rank, each written atomically.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from snip_ds.runtime import distributed as sdist
from snip_ds.report.artifacts import STATE_FILE, rng_file
from snip_ds.hf.checks import TrainerChecks
from snip_ds.config.settings import ConfigError


def save_state(state, output_dir: str | os.PathLike, step: int) -> None:
    """Writes ``state``'s files (:class:`~snip_ds.engine.state.SnipState`) into the Trainer's ``checkpoint-<step>``
    under ``output_dir``: this rank's generator states, and on rank 0 ``snip_state.json``."""
    from safetensors.torch import save_file

    folder = Path(output_dir) / f"checkpoint-{step}"
    folder.mkdir(parents=True, exist_ok=True)
    tensors = state.rank_tensors()
    _atomic(folder / rng_file(sdist.rank()), lambda tmp: save_file(tensors, str(tmp)))
    if sdist.rank() == 0:
        payload = json.dumps(state.state_dict())
        _atomic(folder / STATE_FILE, lambda tmp: tmp.write_text(payload))


def check_resume_shape(checks: TrainerChecks, output_dir: str | os.PathLike, given: Any) -> None:
    """Before the Trainer loads a checkpoint, the one check of its shape: one saved at another tensor-parallel
    degree is refused naming its ``snip_state.json``, and under DeepSpeed so is one saved by another number of
    ranks (DeepSpeed would stop on a missing key; without DeepSpeed the Trainer's own files load at any number).
    ``checks`` is what :func:`snip_ds.hf.checks.check_trainer` resolved for this run (DeepSpeed or not, the
    launched ranks, the tensor-parallel degree); ``given`` is ``trainer.train``'s ``resume_from_checkpoint`` (a
    folder, or True for the last checkpoint in ``output_dir``).

    Raises:
        ConfigError: naming the file and both shapes.
    """
    if given is None or given is False:
        return
    if given is True:
        from transformers.trainer_utils import get_last_checkpoint
        given = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    where = Path(given) / STATE_FILE if given is not None else None
    if where is None or not where.is_file():
        return  # the Trainer reports a missing folder; restore_state one without SNIP's state
    try:
        meta = json.loads(where.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{where}: cannot be read ({err})") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{where}: not a JSON object")
    world, tp = checks.world, checks.tp
    saved = (meta.get("tensor_parallel", 1), meta.get("world_size", world))
    if checks.deepspeed and saved != (tp, world):
        raise ConfigError(f"{where}: saved by {saved[1]} rank(s) at tensor_parallel.autotp_size {saved[0]}, "
                          f"this run has {world} rank(s) at {tp}: the Trainer resumes a DeepSpeed "
                          f"checkpoint at the shape it was saved at")
    if saved[0] != tp:
        raise ConfigError(f"{where}: saved at tensor_parallel.autotp_size {saved[0]}, this run has {tp}: the "
                          f"Trainer resumes a checkpoint at the tensor-parallel degree it was saved at")


def restore_state(state, args, step: int, resumed_from: Optional[Any]) -> None:
    """Restores ``state`` (plan, planner, streams, rounding generators) from the checkpoint the Trainer resumed
    at ``step``: ``resumed_from`` (``trainer.train``'s argument), ``TrainingArguments.resume_from_checkpoint``
    or the output directory's ``checkpoint-<step>``, whichever holds ``snip_state.json`` first. Its shape was
    checked before the Trainer loaded it (:func:`check_resume_shape`).

    Raises:
        ConfigError: no such folder, or its files do not fit this run (the message names the file).
    """
    from safetensors.torch import load_file

    given = (resumed_from, getattr(args, "resume_from_checkpoint", None))
    candidates = [Path(p) for p in given if isinstance(p, (str, os.PathLike))]
    candidates.append(Path(args.output_dir) / f"checkpoint-{step}")
    folder = next((c for c in candidates if (c / STATE_FILE).is_file()), None)
    if folder is None:
        raise ConfigError(f"SnipCallback: resumed at step {step} but none of {[str(c) for c in candidates]} "
                          f"holds {STATE_FILE}; set TrainingArguments.resume_from_checkpoint to the folder")
    where = folder / STATE_FILE
    try:
        meta = json.loads(where.read_text())
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
        if meta.get("step") != step:
            raise ValueError(f"it is from step {meta.get('step')}, the Trainer resumed at step {step}")
        tensors = load_file(str(folder / rng_file(sdist.rank())))
        state.load_rank_tensors(tensors, global_rngs=False)  # the Trainer restores its own
        state.load_state_dict(meta, str(where))
    except (OSError, KeyError, ValueError, TypeError) as err:
        raise ConfigError(f"{where}: cannot be restored ({err})") from None
    if sdist.rank() == 0:
        print(f"snip_ds: restored the plan and planner state from {folder} at step {step}", flush=True)


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)
