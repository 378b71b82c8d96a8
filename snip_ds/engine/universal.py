"""Universal checkpoints: a snip_ds checkpoint that any number of ranks resumes.

:func:`convert_to_universal` (``snip-ds universal``) turns a checkpoint into DeepSpeed's ``ds_to_universal``
layout (``zero/<param>/*.pt``: ZeRO partitions and tensor-parallel shards merged into whole parameters) plus our
files, its ``snip_meta.json`` marked ``universal``. A run resumes it with DeepSpeed initialized with
:func:`with_load_universal`'s config, at the global batch and ZeRO stage it was saved with
(:func:`check_universal_batch`); DeepSpeed's own ``torch.load`` calls then run under
:func:`~snip_ds.engine.checkpoint_io.safe_torch_load`.

It converts the checkpoints of ``launch/train.py`` and :func:`snip_ds.initialize`. A Hugging Face Trainer's
``checkpoint-N`` is refused up front, saying what works instead (the Trainer resumes its own at the saved
shape); one that even DeepSpeed's converter cannot merge, a tensor-parallel run of a model built under
``deepspeed.zero.Init``, says so (:func:`unmergeable_shards`, from what ``snip_state.json`` records).
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any, Dict, Mapping

import torch

from snip_ds.report.artifacts import STATE_FILE, checkpoint_meta, trainer_checkpoint
from snip_ds.engine.checkpoint_io import safe_torch_load
from snip_ds.engine.checkpoint_layout import (LATEST_FILE, META_FILE, UNIVERSAL_FIELD, CheckpointError,
                                              is_universal, rank_file, read_meta, resolve)
from snip_ds.engine.checkpoint_verify import checkpoint_files, file_digest, verify_files
from snip_ds.runtime.fileio import atomic_write_text


def unmergeable_shards(state: Mapping[str, Any]) -> str | None:
    """Why DeepSpeed's ``ds_to_universal`` cannot merge the checkpoint whose ``snip_state.json`` is ``state``, or
    None: a tensor-parallel run whose model ``deepspeed.zero.Init`` partitioned as it was built (what
    :class:`snip_ds.engine.state.SnipState` records as ``zero_init``; ZeRO-3, as zero.Init is). zero.Init cut every
    parameter over all the ranks before the tensor-parallel groups existed, so the saved partitions are not the
    shards the converter expects: DeepSpeed 0.19.8 stops with "start (0) + length (...) exceeds dimension size
    (...)"."""
    tp = state.get("tensor_parallel", 1)
    if state.get("zero_init") is True and isinstance(tp, int) and tp > 1:
        return (f"its model was built under deepspeed.zero.Init (ZeRO-3) and trained at tensor_parallel.autotp_size "
                f"{tp}: zero.Init partitioned the parameters over all {state.get('world_size', '?')} ranks before the "
                f"tensor-parallel groups existed, and DeepSpeed's ds_to_universal cannot merge such shards (it stops "
                f"with \"start (0) + length (...) exceeds dimension size (...)\")")
    return None


def _refuse_trainer_checkpoint(folder: Path) -> None:
    """Raises CheckpointError for a Hugging Face Trainer ``checkpoint-N``, naming why and what works instead."""
    try:
        state = checkpoint_meta(folder)
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    tp, world = state.get("tensor_parallel", 1), state.get("world_size", "?")
    instead = (f"resume it with the Trainer on {world} rank(s) at tensor_parallel.autotp_size {tp}, the shape it was "
               f"saved at, and 'snip-ds export {folder} OUT_DIR' writes its model")
    why = unmergeable_shards(state)
    if why is not None:
        raise CheckpointError(f"{folder}: a Hugging Face Trainer checkpoint that cannot be converted: {why}; "
                              f"{instead} (from the gathered model.safetensors the ZeRO-3 configs save)")
    raise CheckpointError(f"{folder}: a Hugging Face Trainer checkpoint; 'snip-ds universal' converts the checkpoints "
                          f"of launch/train.py and snip_ds.initialize, and the Trainer resumes its own only at the "
                          f"shape it was saved at: {instead}")


def with_load_universal(ds_config: Mapping[str, Any], meta: Mapping[str, Any]) -> Dict[str, Any]:
    """``ds_config`` as ``deepspeed.initialize`` must get it to resume the checkpoint ``meta`` describes:
    with ``"checkpoint": {"load_universal": true}`` for a universal one (DeepSpeed reads it at initialize)."""
    cfg = dict(ds_config)
    if is_universal(meta):
        cfg["checkpoint"] = {**(cfg.get("checkpoint") or {}), "load_universal": True}
    return cfg


def check_universal_batch(tag_dir: Path, meta: Mapping[str, Any], train_batch_size: int, micro: int, ga: int,
                          world: int, zero_stage: int) -> None:
    """A universal checkpoint resumes with the global batch it was trained with (micro-batch x gradient
    accumulation x data-parallel ranks: ``world`` here) and the ZeRO stage it was saved with.

    Raises:
        CheckpointError: naming ``snip_meta.json`` and the fields.
    """
    if not is_universal(meta):
        return
    u, path = meta[UNIVERSAL_FIELD], tag_dir / META_FILE
    if u["train_batch_size"] != train_batch_size:
        raise CheckpointError(
            f"{path}: universal.train_batch_size is {u['train_batch_size']}, but this run's is {train_batch_size} "
            f"(train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps {ga} x {world} data-parallel "
            f"ranks); keep the global batch: set --gradient_accumulation_steps and --per_device_train_batch_size so "
            f"that their product x data-parallel ranks is {u['train_batch_size']}")
    if u["zero_stage"] != zero_stage:
        raise CheckpointError(f"{path}: universal.zero_stage is {u['zero_stage']}, but this run's "
                              f"zero_optimization.stage is {zero_stage}; resume with the stage it was saved with")


def _read_torch(path: Path) -> Any:
    with safe_torch_load():
        return torch.load(str(path), map_location="cpu")


def run_ds_to_universal(tag_dir: Path, out: Path) -> None:
    """DeepSpeed's ``ds_to_universal`` of the DeepSpeed checkpoint folder ``tag_dir`` (a ``global_stepN`` or
    ``step_N``) into ``out``: ZeRO partitions and tensor-parallel shards merged into whole parameters
    (``out/zero/<name>/fp32.pt``). In this process, every ``torch.load`` with ``weights_only=True`` (DeepSpeed's
    worker processes would load with its own ``weights_only=False``); its progress output is printed.

    Raises:
        CheckpointError: DeepSpeed's converter refused the checkpoint (its first line, naming ``tag_dir``).
    """
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(tag_dir), output_folder=str(out), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    with safe_torch_load():
        try:
            ds_to_universal.main(args)
        except CheckpointError:
            raise
        except Exception as err:  # noqa: BLE001 -- DeepSpeed's converter refused the checkpoint: say so
            first = str(err).splitlines()[0] if str(err) else ""
            raise CheckpointError(f"{tag_dir}: DeepSpeed's ds_to_universal failed ({type(err).__name__}: "
                                  f"{first}); nothing was kept of {out}") from None


def convert_to_universal(src: Path, dest: Path, log=print) -> Path:
    """Converts the snip_ds checkpoint ``src`` names (see :func:`resolve`) into a universal one under ``dest``
    (``dest/<tag>``, with ``latest``) that a run of any number of ranks resumes; returns its directory.

    Verifies ``src`` (all checksums), runs DeepSpeed's ``ds_to_universal`` on it (every ``torch.load`` of it
    with ``weights_only=True``, in this process), copies ``snip_state.json`` and every rank's RNG file, and
    writes ``snip_meta.json`` (the source's, marked ``universal``, with the new folder's checksums) last,
    atomically, then ``latest``: a conversion that stopped half-way has no ``snip_meta.json`` and is never
    resumed from.

    Raises:
        CheckpointError: ``src`` is damaged or not convertible (no ZeRO, another format, a Hugging Face Trainer's
            checkpoint: :func:`unmergeable_shards` says when even DeepSpeed's converter cannot take one), or
            ``dest/<tag>`` exists; the message names the file or folder and what works instead.
    """
    try:
        trainer_dir = trainer_checkpoint(Path(src))
    except ValueError as err:  # a Trainer checkpoint without SnipCallback's state
        raise CheckpointError(str(err)) from None
    if trainer_dir is not None:
        _refuse_trainer_checkpoint(trainer_dir)
    tag_dir = resolve(Path(src))
    meta = read_meta(tag_dir)
    if is_universal(meta):
        raise CheckpointError(f"{tag_dir}: already a universal checkpoint")
    for field in ("tag", "world_size", "model_fingerprint", "files"):
        if field not in meta:
            raise CheckpointError(f"{tag_dir / META_FILE}: field '{field}' missing (a checkpoint of an older "
                                  f"snip_ds: resume it on its own number of ranks and save again)")
    verify_files(tag_dir, meta["files"])
    optim = sorted(tag_dir.glob("*zero_pp_rank_*_optim_states.pt"))
    model_states = sorted(tag_dir.glob("*mp_rank_00_model_states.pt"))
    if not optim or not model_states:
        raise CheckpointError(f"{tag_dir}: no ZeRO optimizer shards (zero_pp_rank_*_optim_states.pt): a ZeRO "
                              f"stage 0 checkpoint; DeepSpeed's ds_to_universal converts ZeRO stages 1-3 only")
    states = _read_torch(model_states[0])
    ds_cfg = states.get("ds_config") or {}
    zero_stage = int((ds_cfg.get("zero_optimization") or {}).get("stage", 0))
    if zero_stage not in (1, 2, 3):
        raise CheckpointError(f"{model_states[0]}: ds_config.zero_optimization.stage is {zero_stage}; DeepSpeed's "
                              f"ds_to_universal converts ZeRO stages 1-3 only")
    micro, ga = ds_cfg.get("train_micro_batch_size_per_gpu"), ds_cfg.get("gradient_accumulation_steps")
    if not isinstance(micro, int) or not isinstance(ga, int):
        raise CheckpointError(f"{model_states[0]}: ds_config lacks train_micro_batch_size_per_gpu or "
                              f"gradient_accumulation_steps as integers")
    out = Path(dest) / meta["tag"]
    if out.exists():
        what = "a finished conversion" if (out / META_FILE).is_file() else "an unfinished conversion: remove it"
        raise CheckpointError(f"{out}: already exists ({what})")
    # snip_ds's files first: a folder that has them but no snip_meta.json is an unfinished conversion (resolve)
    out.mkdir(parents=True)
    try:
        for name in [STATE_FILE] + [rank_file(tag_dir, r).name for r in range(meta["world_size"])]:
            if (tag_dir / name).is_file():  # a checkpoint of an older snip_ds keeps SNIP's state in snip_meta.json
                shutil.copy2(tag_dir / name, out / name)
        log(f"snip-ds: converting {tag_dir} (ZeRO-{zero_stage}, {meta['world_size']} rank(s)) with DeepSpeed's "
            f"ds_to_universal into {out}")
        run_ds_to_universal(tag_dir, out)
        full = {**meta, UNIVERSAL_FIELD: {"zero_stage": zero_stage, "source": str(tag_dir.resolve()),
                                          "train_batch_size": micro * ga * int(meta["world_size"])
                                          // int(meta.get("tensor_parallel", 1)),  # data-parallel ranks
                                          "source_sha256": file_digest(tag_dir / META_FILE)["sha256"]},
                "files": {name: file_digest(out / name) for name in checkpoint_files(out)}}
        atomic_write_text(out / META_FILE, json.dumps(full, indent=2, sort_keys=True))
    except BaseException:  # a failed conversion (a full disk, Ctrl-C, DeepSpeed's refusal) leaves nothing behind
        shutil.rmtree(out, ignore_errors=True)
        raise
    atomic_write_text(out.parent / LATEST_FILE, out.name)
    return out
