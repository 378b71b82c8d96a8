"""Writing and restoring a snip_ds checkpoint: :func:`save`, complete or nothing on every rank, and
:func:`load`.

A save writes DeepSpeed's files (through :class:`~snip_ds.engine.checkpoint_io.SafeTorchCheckpointEngine`),
every rank's ``snip_rng_rank<r>.safetensors`` and rank 0's ``snip_state.json``, then the checksums of them all
(:func:`~snip_ds.engine.checkpoint_verify.record_files`) into ``snip_meta.json``, which marks completion, and
last ``latest``. A write that fails on any rank stops every rank with the same
:class:`CheckpointSaveError`, after removing what the save created. What the files are and how a path is
resolved to one: :mod:`snip_ds.engine.checkpoint_layout`; how it is verified before a resume:
:mod:`snip_ds.engine.checkpoint_verify`; another number of ranks: :mod:`snip_ds.engine.universal`.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Mapping

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save as save_bytes

from snip_ds.runtime import distributed as sdist
from snip_ds.runtime import faults
from snip_ds.report.artifacts import STATE_FILE, rng_file
from snip_ds.engine.checkpoint_io import SafeTorchCheckpointEngine, safe_torch_load, write_error
from snip_ds.engine.checkpoint_layout import (FORMAT, LATEST_FILE, META_FILE, CheckpointError, is_universal,
                                              rank_file, read_meta)
from snip_ds.engine.checkpoint_verify import record_files
from snip_ds.runtime.fileio import atomic_write_text


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, a file-size limit, a read-only directory); the same
    message on every rank, naming the file and the cause. ``latest`` still names the previous complete
    checkpoint."""


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(ds_engine, save_dir: Path, tag: str, meta: Mapping[str, Any], rank_tensors: Mapping[str, torch.Tensor],
         snip_state: Mapping[str, Any], fingerprint: str, world_size: int,
         architecture: Mapping[str, Any] | None = None) -> Path:
    """Writes one complete checkpoint; returns its directory. ``latest`` is updated last.

    Every rank writes its ``rank_tensors`` (``snip_rng_rank<r>.safetensors``), rank 0 ``snip_state``
    (``snip_state.json``), both before the checksums are taken; ``snip_meta.json`` (``meta`` and the checksums)
    marks completion.

    Raises:
        CheckpointSaveError: on every rank, with the same message, when any rank failed to write a file
            (DeepSpeed's shards, its per-rank file, the metadata or ``latest``): ``latest`` names the previous
            complete checkpoint, and every rank removes what this save created (see :func:`_remove_partial`)
            unless only ``latest`` failed (the directory itself is complete then).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    tag_dir = save_dir / tag
    problem = None
    # What this rank sees before the save (before the barrier, so before any rank writes): None, no directory.
    before = {p.name for p in tag_dir.iterdir()} if tag_dir.is_dir() else None
    if rank == 0 and (tag_dir / META_FILE).exists():  # re-saving a tag: un-mark it first
        (tag_dir / META_FILE).unlink()
    _barrier()
    engine = ds_engine.checkpoint_engine
    if isinstance(engine, SafeTorchCheckpointEngine):
        engine.failure = None
    ds_engine.save_checkpoint(str(save_dir), tag=tag, save_latest=False)
    faults.pause_point("save", int(meta.get("step", -1)), rank)  # a test's fault injection; else a no-op
    if isinstance(engine, SafeTorchCheckpointEngine):
        problem = engine.failure
    if problem is None:
        target = tag_dir / rng_file(rank)
        tmp = target.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(save_bytes(dict(rank_tensors)))
            os.replace(tmp, target)
        except OSError as err:
            problem = write_error(tmp, err)
            tmp.unlink(missing_ok=True)
    if problem is None and rank == 0:
        try:
            atomic_write_text(tag_dir / STATE_FILE, json.dumps(snip_state, indent=1, sort_keys=True))
        except OSError as err:
            problem = write_error(tag_dir / STATE_FILE, err)
    _raise_if_any(problem, tag_dir, save_dir, before)  # collective: every rank's files are complete after it
    files = record_files(tag_dir)
    if rank == 0:
        full = {"format": FORMAT, "tag": tag, "world_size": world_size, "model_fingerprint": fingerprint,
                "model_architecture": dict(architecture or {}), **meta, "files": files}
        try:
            atomic_write_text(tag_dir / META_FILE, json.dumps(full, indent=2, sort_keys=True))
        except OSError as err:
            problem = write_error(tag_dir / META_FILE, err)
        if problem is None:
            try:
                atomic_write_text(save_dir / LATEST_FILE, tag)
            except OSError as err:
                problem = write_error(save_dir / LATEST_FILE, err)
    _raise_if_any(problem, tag_dir, save_dir, before)
    return tag_dir


def _remove_partial(tag_dir: Path, before: set | None) -> None:
    """Removes what a failed save created, as this rank sees it: the whole ``tag_dir`` when it did not exist
    before the save (``before`` None), else only the entries that were not in it (``before``: their names);
    a previous checkpoint's files are never touched. Best effort (another rank may be removing the same
    files)."""
    if before is None:
        shutil.rmtree(tag_dir, ignore_errors=True)
        return
    for path in sorted(tag_dir.iterdir()) if tag_dir.is_dir() else ():
        if path.name not in before:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def _removal_words(tag_dir: Path, before: set | None) -> str:
    """What :func:`_remove_partial` does, for the error message."""
    if before is None:
        return f"the partial {tag_dir.name} was removed"
    return (f"{tag_dir.name} existed before this save: the files this save created were removed, it has no "
            f"{META_FILE} and is never resumed from")


def _raise_if_any(problem: str | None, tag_dir: Path, save_dir: Path, before: set | None) -> None:
    """Collective: raises :class:`CheckpointSaveError` on every rank, with the same message, if any rank has a
    ``problem`` (the lowest such rank's; what ``latest`` names as rank 0 reads it). Before raising, every rank
    removes what the save created (:func:`_remove_partial`), unless only ``latest`` failed: the checkpoint
    directory is complete then and is kept."""
    rank0_latest = None
    if sdist.rank() == 0:
        try:
            rank0_latest = (save_dir / LATEST_FILE).read_text().strip()
        except OSError:
            rank0_latest = ""
    reports = sdist.all_gather_json({"problem": problem, "latest": rank0_latest,
                                     "removed": _removal_words(tag_dir, before)})
    problem = next((r["problem"] for r in reports if r["problem"]), None)
    if problem is None:
        return
    latest = reports[0]["latest"]
    if problem.startswith(str(save_dir / LATEST_FILE)):
        complete = f"{tag_dir.name} itself is complete"
    else:
        _remove_partial(tag_dir, before)
        complete = reports[0]["removed"]  # every rank words it as rank 0 (whether the directory existed)
    previous = (f"'{LATEST_FILE}' still names {latest}" if latest else
                f"no earlier complete checkpoint (no '{LATEST_FILE}' file)")
    raise CheckpointSaveError(f"checkpoint {tag_dir} not saved: {problem}; {previous} ({complete})")


def load(ds_engine, tag_dir: Path, rank: int) -> Dict[str, torch.Tensor]:
    """Loads DeepSpeed's state (model, optimizer, scheduler); returns this rank's SNIP tensors (generator and
    RNG states, :meth:`snip_ds.engine.state.SnipState.load_rank_tensors` restores them)."""
    meta = read_meta(tag_dir)
    universal = is_universal(meta)
    if universal != bool(ds_engine.load_universal_checkpoint()):
        raise CheckpointError(f"{tag_dir}: " + (
            "a universal checkpoint, but DeepSpeed was initialized without \"checkpoint\": {\"load_universal\": "
            "true} (see with_load_universal)" if universal else
            "not a universal checkpoint, but DeepSpeed was initialized with \"checkpoint\": {\"load_universal\": "
            "true}"))
    with safe_torch_load() if universal else contextlib.nullcontext():
        load_path, _ = ds_engine.load_checkpoint(str(tag_dir.parent), tag=tag_dir.name,
                                                 load_optimizer_states=True, load_lr_scheduler_states=True)
    if load_path is None:
        raise CheckpointError(f"{tag_dir}: DeepSpeed found no checkpoint files there")
    if rank >= meta["world_size"]:  # a rank the saving run did not have: its fresh run's generators stay
        return {}
    path = rank_file(tag_dir, rank)
    try:
        return load_file(str(path))
    except Exception as err:  # noqa: BLE001 -- a damaged file: name it
        raise CheckpointError(f"{path}: cannot be read as safetensors ({err})") from None
