"""How a snip_ds checkpoint is verified: the checksums a save records and a resume (or an export, or a
universal conversion) checks, and the checks before a resume that the checkpoint fits this model, number of
ranks and tensor-parallel degree.

``snip_meta.json`` records ``files``: the size and sha256 of every other file of the checkpoint (DeepSpeed's
shards of every rank and ours), taken by :func:`record_files` after every rank has written (collective: the
hashing is split over the ranks). :func:`check_resumable` resolves a path to a checkpoint, :func:`validate` checks
its metadata against this run and :func:`verify_files` its files (this rank's share of the hashing).
What the files are: :mod:`snip_ds.engine.checkpoint_layout`.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, Mapping

from snip_ds.runtime import distributed as sdist
from snip_ds.engine.checkpoint_layout import (META_FILE, CheckpointError, check_universal_field, is_universal,
                                              rank_file, read_meta, resolve)


_CHUNK = 1 << 20  # files are hashed as a stream, 1 MiB at a time: shards can be far larger than memory allows


def file_digest(path: Path) -> Dict[str, Any]:
    """``{"size": bytes, "sha256": hex}`` of the file at ``path``."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def checkpoint_files(tag_dir: Path) -> list:
    """The checkpoint's files below ``tag_dir`` (relative POSIX paths), without the metadata and temporaries."""
    return sorted(p.relative_to(tag_dir).as_posix() for p in tag_dir.rglob("*")
                  if p.is_file() and p.name != META_FILE and not p.name.endswith(".tmp"))


def record_files(tag_dir: Path) -> Dict[str, Dict[str, Any]]:
    """Collective: :func:`file_digest` of every file of the checkpoint, on every rank.

    Each rank lists what it sees (every rank's shards on a shared filesystem, its own on a node-local one);
    each file is hashed by one of the ranks that see it (round-robin, so a shared filesystem spreads the work)
    and the digests are all-gathered as JSON.
    """
    seen: Dict[str, list] = {}
    for r, names in enumerate(sdist.all_gather_json(checkpoint_files(tag_dir))):
        for name in names:
            seen.setdefault(name, []).append(r)
    me = sdist.rank()
    mine = {name: file_digest(tag_dir / name) for i, name in enumerate(sorted(seen))
            if seen[name][i % len(seen[name])] == me}
    files: Dict[str, Dict[str, Any]] = {}
    for part in sdist.all_gather_json(mine):
        files.update(part)
    return dict(sorted(files.items()))


def verify_files(tag_dir: Path, files: Mapping[str, Mapping[str, Any]], rank: int = 0, world: int = 1) -> None:
    """Checks the files ``snip_meta.json`` recorded: each exists with its size (every rank checks all, which
    is cheap), and the sha256 of every ``world``-th one from the ``rank``-th (the hashing is split).

    Raises:
        CheckpointError: naming the first file that is missing, of another size or of another content.
    """
    names = sorted(files)
    for name in names:
        path, want = tag_dir / name, files[name]["size"]
        if not path.is_file():
            raise CheckpointError(f"{path}: missing; {META_FILE} records it ({want} bytes), the checkpoint "
                                  f"is incomplete")
        size = path.stat().st_size
        if size != want:
            what = "truncated" if size < want else "longer than written"
            raise CheckpointError(f"{path}: {size} bytes, but {META_FILE} records {want}: the file is {what}")
    for name in names[rank::world]:
        path = tag_dir / name
        try:
            digest = file_digest(path)["sha256"]
        except OSError as err:
            raise CheckpointError(f"{path}: unreadable ({err.strerror})") from None
        if digest != files[name]["sha256"]:
            raise CheckpointError(f"{path}: sha256 differs from the one {META_FILE} records: the file is "
                                  f"damaged or was changed after the save")


def validate(tag_dir: Path, fingerprint: str, world_size: int,
             architecture: Mapping[str, Any] | None = None, tensor_parallel: int = 1) -> Dict[str, Any]:
    """Checks, before anything is loaded, that the checkpoint fits this model, world size and tensor-parallel
    degree (``tensor_parallel``; a checkpoint that records none was saved without tensor parallelism).

    ``architecture`` (:func:`model_architecture`) is compared field by field with the one the checkpoint
    recorded, where both have the field; checkpoints written before it was recorded are checked by the
    fingerprint alone.
    """
    meta = read_meta(tag_dir)
    path = tag_dir / META_FILE
    missing = [k for k in ("tag", "world_size", "model_fingerprint") if k not in meta]
    if missing:
        raise CheckpointError(f"{path}: field(s) {', '.join(repr(k) for k in missing)} missing")
    saved = meta.get("model_architecture") or {}
    differ = sorted(k for k in set(saved) & set(architecture or {}) if saved[k] != architecture[k])
    if differ:
        raise CheckpointError(f"{path}: the checkpoint was saved from a different model: " + "; ".join(
            f"model_architecture.{k} is {json.dumps(saved[k])} there and {json.dumps(architecture[k])} here"
            for k in differ))
    if meta.get("model_fingerprint") != fingerprint:
        raise CheckpointError(f"{path}: model_fingerprint differs: the checkpoint was saved from a different "
                              f"model (parameter names or shapes differ)")
    if is_universal(meta):
        check_universal_field(meta, path)
    elif meta.get("tensor_parallel", 1) != tensor_parallel:
        raise CheckpointError(f"{path}: tensor_parallel is {meta.get('tensor_parallel', 1)}, but this run's "
                              f"tensor_parallel.autotp_size is {tensor_parallel}; resume with the same, or at "
                              f"another shape convert it first: snip-ds universal {tag_dir} OUT_DIR")
    elif meta.get("world_size") != world_size:
        raise CheckpointError(f"{path}: world_size is {meta.get('world_size')}, but this run has "
                              f"{world_size} ranks; resume with the same number of ranks, or at another number "
                              f"convert it first: snip-ds universal {tag_dir} OUT_DIR")
    for r in range(min(world_size, meta["world_size"])):  # a universal checkpoint's new ranks start fresh RNGs
        if not rank_file(tag_dir, r).is_file():
            raise CheckpointError(f"{rank_file(tag_dir, r)}: missing; the checkpoint is incomplete")
    return meta


def check_resumable(path: Path, fingerprint: str, world_size: int, rank: int,
                    architecture: Mapping[str, Any] | None = None,
                    tensor_parallel: int = 1) -> tuple[Path, Dict[str, Any]]:
    """:func:`resolve`, :func:`validate` and :func:`verify_files` (this rank's share of the hashing): the
    checkpoint ``path`` names and its metadata, once nothing in it is found wrong. Not collective: a caller
    with several ranks agrees on the outcome (:func:`snip_ds.runtime.distributed.first_error`) before going on.

    A checkpoint written before checksums were recorded (no ``files``) is checked without them.
    """
    tag_dir = resolve(path)
    meta = validate(tag_dir, fingerprint, world_size, architecture, tensor_parallel)
    if "files" in meta:
        verify_files(tag_dir, meta["files"], rank, world_size)
    return tag_dir, meta
