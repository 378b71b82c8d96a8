"""Checkpoints: DeepSpeed's own files plus our plan, settings, data position and RNG states.

Layout, under ``save_dir``::

    latest                           # tag of the newest *complete* checkpoint (written last)
    step_120/                        # DeepSpeed's files for that tag, and ours:
        snip_rng_rank0.safetensors   # per rank: stochastic-rounding generator states, torch RNG state
        snip_state.json              # rank 0: SNIP's state (plan, planner, streams, skipped steps, settings)
        snip_meta.json               # rank 0, written after every rank has finished: marks completion

``snip_state.json`` and ``snip_rng_rank<r>.safetensors`` are :class:`snip_ds.state.SnipState`'s, the same
files a Hugging Face Trainer's ``checkpoint-N`` holds. A checkpoint without ``snip_meta.json`` is incomplete
and is never resumed from. ``snip_meta.json`` records the size and sha256 of every other file of the
checkpoint (key ``files``: DeepSpeed's shards of every rank and ours), the model, the data stream's position,
the lr schedule and the tokenizer; a resume verifies the files before anything is restored
(:func:`verify_files`). Checkpoints of older snip_ds versions (plan, planner state and skipped steps inside
``snip_meta.json``, ``snip_rank00000.safetensors`` per rank) still resume (:func:`read_snip_state`). Our files
are JSON and safetensors; DeepSpeed's files are read with ``torch.load(weights_only=True)`` through
:class:`SafeTorchCheckpointEngine`, never unpickled.

A checkpoint resumes on the number of ranks that saved it. :func:`convert_to_universal` (``snip-ds universal``)
turns one into a universal checkpoint (DeepSpeed's ``ds_to_universal`` layout, ``zero/<param>/*.pt``, plus our
files; ``snip_meta.json`` marked ``universal``) that any number of ranks resumes, DeepSpeed initialized with
:func:`with_load_universal`'s config; DeepSpeed's own ``torch.load`` calls then run under
:func:`safe_torch_load`.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Mapping

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from safetensors.torch import load_file, save as save_bytes

from snip_ds import distributed as sdist
from snip_ds import faults
from snip_ds.artifacts import (CHECKPOINT_FORMAT, CHECKPOINT_LATEST_FILE, CHECKPOINT_META_FILE, STATE_FILE,
                               rng_file)
from snip_ds.fileio import atomic_write_text

META_FILE = CHECKPOINT_META_FILE
LATEST_FILE = CHECKPOINT_LATEST_FILE
FORMAT = CHECKPOINT_FORMAT


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed from; the message names the file."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, a file-size limit, a read-only directory); the same
    message on every rank, naming the file and the cause. ``latest`` still names the previous complete
    checkpoint."""


def _write_error(path: str | os.PathLike, err: BaseException) -> str:
    """``"<path>: cannot be written (<cause>)"``, the cause taken from the first OSError in ``err``'s chain
    (torch's zip writer wraps the OSError of a failed write in a RuntimeError that does not name it)."""
    seen, e = set(), err
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            cause = f"{e.strerror or e} [errno {e.errno}]" if e.errno else str(e)
            break
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    else:
        cause = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return f"{path}: cannot be written ({cause})"


def _safe_globals() -> list:
    """Classes DeepSpeed pickles into its checkpoints that ``weights_only`` loading must accept."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler, DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    import argparse
    import collections
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address, argparse.Namespace,
            collections.OrderedDict, set]


class SafeTorchCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, loading with ``weights_only=True`` (no arbitrary unpickling).

    Saving records the first failed write in :attr:`failure` instead of raising: DeepSpeed's
    ``save_checkpoint`` runs collectives after its writes (ZeRO-3's parameter all-gather, a barrier), so a
    rank that raised there would leave the others waiting. :func:`save` lets DeepSpeed finish, then the ranks
    agree on the first failure. Once a write failed, later writes of the same save are skipped.
    """

    failure: str | None = None

    def save(self, state_dict, path: str):
        if self.failure is not None:
            return
        try:
            with open(path, "wb") as f:  # a Python file: the OSError of a failed write stays in the chain
                torch.save(state_dict, f, _use_new_zipfile_serialization=self.zipfile_serialization)
        except Exception as err:  # noqa: BLE001 -- recorded and reported by every rank after the save
            self.failure = _write_error(path, err)

    def makedirs(self, path, exist_ok=False):
        try:
            os.makedirs(path, exist_ok=exist_ok)
        except OSError as err:
            if self.failure is None:
                self.failure = _write_error(path, err)

    def load(self, path: str, map_location=None):
        with torch.serialization.safe_globals(_safe_globals()):
            try:
                return torch.load(path, map_location=map_location, weights_only=True)
            except Exception as err:  # a corrupt or foreign file: name it
                raise CheckpointError(f"{path}: cannot be read as a DeepSpeed checkpoint file with "
                                      f"weights_only=True ({err})") from None


@contextlib.contextmanager
def safe_torch_load():
    """Within it, every ``torch.load`` (DeepSpeed's own calls included: its universal-checkpoint reader and
    ``ds_to_universal`` pass ``weights_only=False`` themselves, outside its checkpoint engine) loads with
    ``weights_only=True`` and :func:`_safe_globals`; a file that needs more raises :class:`CheckpointError`
    naming it. Restores ``torch.load`` on exit. Not thread-safe (nothing else loads meanwhile)."""
    original = torch.load

    def load(f, map_location=None, *args, **kwargs):
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(_safe_globals()):
            try:
                return original(f, map_location, *args, **kwargs)
            except Exception as err:  # noqa: BLE001 -- a corrupt or foreign file: name it
                raise CheckpointError(f"{f}: cannot be read as a DeepSpeed checkpoint file with "
                                      f"weights_only=True ({str(err).splitlines()[0] if str(err) else err})"
                                      ) from None
    torch.load = load
    try:
        yield
    finally:
        torch.load = original


def install_safe_loader(ds_engine) -> None:
    """Makes ``ds_engine`` (and its optimizer) read checkpoints through :class:`SafeTorchCheckpointEngine`."""
    if type(ds_engine.checkpoint_engine) is TorchCheckpointEngine:
        ds_engine.checkpoint_engine = SafeTorchCheckpointEngine(ds_engine._config)
        opt = getattr(ds_engine, "optimizer", None)
        if opt is not None and hasattr(opt, "checkpoint_engine"):
            opt.checkpoint_engine = ds_engine.checkpoint_engine
        copy_scripts = ds_engine._copy_recovery_script  # rank 0 copies zero_to_fp32.py into each checkpoint
        engine = ds_engine.checkpoint_engine

        def guarded_copy(save_path):  # its failure is recorded like a failed shard write (see save)
            if engine.failure is None:
                try:
                    copy_scripts(save_path)
                except OSError as err:
                    engine.failure = _write_error(err.filename or save_path, err)
        ds_engine._copy_recovery_script = guarded_copy


# Hugging Face config fields that change a decoder's arithmetic. Parameter names and shapes (the
# fingerprint) miss some of them: 8 heads of 8 have the shapes of 4 heads of 16, and eps or RoPE's base none.
# max_position_embeddings is left out: the default model sizes it from block_size, and a run may resume at
# another sequence length (RoPE scalings that read it carry their own original length in rope_scaling).
ARCHITECTURE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                     "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "attention_bias",
                     "mlp_bias", "tie_word_embeddings", "sliding_window", "use_sliding_window", "max_window_layers",
                     "layer_types",
                     # other families' (GPT-NeoX, Phi-3, DeepSeek-V3's MLA, Mixture-of-Experts routing)
                     "layer_norm_eps", "use_parallel_residual", "rotary_pct", "rotary_emb_base", "qk_rope_head_dim",
                     "qk_nope_head_dim", "v_head_dim", "q_lora_rank", "kv_lora_rank", "first_k_dense_replace",
                     "num_experts", "num_local_experts", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                     "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
                     "routed_scaling_factor", "n_group", "topk_group", "decoder_sparse_step", "mlp_only_layers",
                     "rope_interleave")


def model_architecture(model: torch.nn.Module) -> Dict[str, Any]:
    """The :data:`ARCHITECTURE_KEYS` of ``model.config`` that it has, as JSON values; ``{}`` for a model without
    a Hugging Face config (then only the fingerprint is checked)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return {}
    values = config.to_dict()
    return {k: json.loads(json.dumps(values[k], default=str)) for k in ARCHITECTURE_KEYS if k in values}


def model_config(model: torch.nn.Module) -> Dict[str, Any]:
    """``model.config`` in full as JSON values (what ``snip-ds export`` writes as ``config.json``); ``{}`` for a
    model without a Hugging Face config."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return {}
    return json.loads(config.to_json_string(use_diff=False))


def model_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of every parameter's name and full shape (``ds_shape`` under ZeRO-3; a tensor-parallel shard's
    whole, unsharded shape, so that a model fingerprints alike before and after DeepSpeed shards it)."""
    whole = {}
    for module in model.modules():  # DeepSpeed's tensor-parallel layers remember their unsharded shapes
        for attr, shape_attr in (("weight", "_orig_weight_shape"), ("bias", "_orig_bias_shape")):
            param, shape = getattr(module, attr, None), getattr(module, shape_attr, None)
            if isinstance(param, torch.nn.Parameter) and shape is not None:
                whole[id(param)] = tuple(shape)
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        shape = whole.get(id(p), tuple(getattr(p, "ds_shape", p.shape)))
        h.update(f"{name}:{shape};".encode())
    return h.hexdigest()


def _rank_file(tag_dir: Path, rank: int) -> Path:
    """``rank``'s SNIP tensors: ``snip_rng_rank<r>.safetensors``, or in an older checkpoint
    ``snip_rank<rrrrr>.safetensors`` (the same tensors under the same keys)."""
    new = tag_dir / rng_file(rank)
    old = tag_dir / f"snip_rank{rank:05d}.safetensors"
    return old if old.is_file() and not new.is_file() else new


def read_snip_state(tag_dir: Path, meta: Mapping[str, Any]) -> tuple[Dict[str, Any], str]:
    """SNIP's state in the checkpoint and the file it came from: ``snip_state.json``, or in a checkpoint of an
    older snip_ds the plan, planner state and skipped steps inside ``snip_meta.json``.

    Raises:
        CheckpointError: ``snip_state.json`` is unreadable or not an object.
    """
    path = tag_dir / STATE_FILE
    if path.is_file():
        try:
            state = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{path}: unreadable ({err})") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"{path}: not a JSON object")
        return state, str(path)
    return ({k: meta.get(k) for k in ("plan", "planner", "skipped_steps", "settings")}, str(tag_dir / META_FILE))


_CHUNK = 1 << 20  # files are hashed as a stream, 1 MiB at a time: shards can be far larger than memory allows


def file_digest(path: Path) -> Dict[str, Any]:
    """``{"size": bytes, "sha256": hex}`` of the file at ``path``."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def _listing(tag_dir: Path) -> list:
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
    for r, names in enumerate(sdist.all_gather_json(_listing(tag_dir))):
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
            problem = _write_error(tmp, err)
            tmp.unlink(missing_ok=True)
    if problem is None and rank == 0:
        try:
            atomic_write_text(tag_dir / STATE_FILE, json.dumps(snip_state, indent=1, sort_keys=True))
        except OSError as err:
            problem = _write_error(tag_dir / STATE_FILE, err)
    _raise_if_any(problem, tag_dir, save_dir, before)  # collective: every rank's files are complete after it
    files = record_files(tag_dir)
    if rank == 0:
        full = {"format": FORMAT, "tag": tag, "world_size": world_size, "model_fingerprint": fingerprint,
                "model_architecture": dict(architecture or {}), **meta, "files": files}
        try:
            atomic_write_text(tag_dir / META_FILE, json.dumps(full, indent=2, sort_keys=True))
        except OSError as err:
            problem = _write_error(tag_dir / META_FILE, err)
        if problem is None:
            try:
                atomic_write_text(save_dir / LATEST_FILE, tag)
            except OSError as err:
                problem = _write_error(save_dir / LATEST_FILE, err)
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


RUN_CHECKPOINTS = "checkpoints"  # a training run's save directory, inside its output directory


def resolve(path: Path) -> Path:
    """The checkpoint directory ``path`` names: a tag directory, a save directory with ``latest``, or a run's
    output directory (its ``checkpoints/latest``: the last complete checkpoint)."""
    if not path.exists():
        raise CheckpointError(f"{path}: checkpoint path does not exist")
    if (path / META_FILE).is_file():
        return path
    if not (path / LATEST_FILE).exists() and (path / RUN_CHECKPOINTS).is_dir():
        saves = path / RUN_CHECKPOINTS
        if not (saves / LATEST_FILE).is_file():
            raise CheckpointError(f"{saves}: no '{LATEST_FILE}' file: the run has saved no complete checkpoint")
        return resolve(saves)
    latest = path / LATEST_FILE
    if latest.is_file():
        tag_dir = path / latest.read_text().strip()
        if (tag_dir / META_FILE).is_file():
            return tag_dir
        raise CheckpointError(f"{latest}: points to {tag_dir}, which is not a complete snip_ds checkpoint")
    universal_latest = path / UNIVERSAL_LATEST_FILE  # ds_to_universal's, beside the folder it wrote
    if universal_latest.is_file() and (path / universal_latest.read_text().strip()).is_dir():
        return resolve(path / universal_latest.read_text().strip())
    if (path / "zero").is_dir():  # ds_to_universal's output: a folder per Parameter under zero/
        if (path / STATE_FILE).is_file():
            raise CheckpointError(f"{path}: an unfinished 'snip-ds universal' conversion (no {META_FILE}, which it "
                                  f"writes last): remove the folder and convert again")
        raise CheckpointError(f"{path}: a DeepSpeed universal checkpoint without snip_ds's files (no {META_FILE}, "
                              f"{STATE_FILE}, rank RNG files): convert the snip_ds checkpoint it came from with "
                              f"'snip-ds universal CHECKPOINT OUT_DIR' instead of ds_to_universal alone")
    if any(path.glob("*_model_states.pt")):
        raise CheckpointError(f"{path}: not a complete snip_ds checkpoint: it holds DeepSpeed's files but no "
                              f"{META_FILE}, which snip_ds writes last, so its save was interrupted")
    raise CheckpointError(f"{path}: not a snip_ds checkpoint (no {META_FILE}, and no '{LATEST_FILE}' file)")


def read_meta(tag_dir: Path) -> Dict[str, Any]:
    path = tag_dir / META_FILE
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: unreadable ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} metadata file")
    _check_fields(meta, path)
    return meta


_SHA256_HEX = frozenset("0123456789abcdef")


def _check_fields(meta: Mapping[str, Any], path: Path) -> None:
    """The fields a resume reads have their types where present (a hand-edited or damaged file is named, not
    crashed on); :func:`validate` requires the ones a resume cannot do without."""
    def bad(field: str, want: str) -> CheckpointError:
        return CheckpointError(f"{path}: field '{field}' must be {want}, got {json.dumps(meta.get(field))[:80]}")

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if "tag" in meta and not isinstance(meta["tag"], str):
        raise bad("tag", "a string")
    if "world_size" in meta and (not is_int(meta["world_size"]) or meta["world_size"] < 1):
        raise bad("world_size", "a positive integer")
    if "step" in meta and (not is_int(meta["step"]) or meta["step"] < 0):
        raise bad("step", "a non-negative integer")
    if "model_fingerprint" in meta and not isinstance(meta["model_fingerprint"], str):
        raise bad("model_fingerprint", "a string")
    for field in ("model_architecture", "plan", "data", "planner"):
        if meta.get(field) is not None and not isinstance(meta[field], dict):
            raise bad(field, "an object")
    if "files" in meta:
        files = meta["files"]
        if not isinstance(files, dict):
            raise bad("files", "an object")
        for name, rec in files.items():
            ok = (isinstance(rec, dict) and is_int(rec.get("size")) and rec["size"] >= 0
                  and isinstance(rec.get("sha256"), str) and len(rec["sha256"]) == 64
                  and set(rec["sha256"]) <= _SHA256_HEX)
            if not ok or name.startswith("/") or ".." in Path(name).parts:
                raise CheckpointError(f"{path}: field 'files' entry {json.dumps(name)} must be a relative path "
                                      f"with {{\"size\": bytes, \"sha256\": 64 hex digits}}, got "
                                      f"{json.dumps(rec)[:80]}")


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
        _check_universal(meta, path)
    elif meta.get("tensor_parallel", 1) != tensor_parallel:
        raise CheckpointError(f"{path}: tensor_parallel is {meta.get('tensor_parallel', 1)}, but this run's "
                              f"tensor_parallel.autotp_size is {tensor_parallel}; resume with the same, or at "
                              f"another shape convert it first: snip-ds universal {tag_dir} OUT_DIR")
    elif meta.get("world_size") != world_size:
        raise CheckpointError(f"{path}: world_size is {meta.get('world_size')}, but this run has "
                              f"{world_size} ranks; resume with the same number of ranks, or at another number "
                              f"convert it first: snip-ds universal {tag_dir} OUT_DIR")
    for r in range(min(world_size, meta["world_size"])):  # a universal checkpoint's new ranks start fresh RNGs
        if not _rank_file(tag_dir, r).is_file():
            raise CheckpointError(f"{_rank_file(tag_dir, r)}: missing; the checkpoint is incomplete")
    return meta


def check_resumable(path: Path, fingerprint: str, world_size: int, rank: int,
                    architecture: Mapping[str, Any] | None = None,
                    tensor_parallel: int = 1) -> tuple[Path, Dict[str, Any]]:
    """:func:`resolve`, :func:`validate` and :func:`verify_files` (this rank's share of the hashing): the
    checkpoint ``path`` names and its metadata, once nothing in it is found wrong. Not collective: a caller
    with several ranks agrees on the outcome (:func:`snip_ds.distributed.first_error`) before going on.

    A checkpoint written before checksums were recorded (no ``files``) is checked without them.
    """
    tag_dir = resolve(path)
    meta = validate(tag_dir, fingerprint, world_size, architecture, tensor_parallel)
    if "files" in meta:
        verify_files(tag_dir, meta["files"], rank, world_size)
    return tag_dir, meta


def load(ds_engine, tag_dir: Path, rank: int) -> Dict[str, torch.Tensor]:
    """Loads DeepSpeed's state (model, optimizer, scheduler); returns this rank's SNIP tensors (generator and
    RNG states, :meth:`snip_ds.state.SnipState.load_rank_tensors` restores them)."""
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
    path = _rank_file(tag_dir, rank)
    try:
        return load_file(str(path))
    except Exception as err:  # noqa: BLE001 -- a damaged file: name it
        raise CheckpointError(f"{path}: cannot be read as safetensors ({err})") from None


# ------------------------------------------------------------------ universal checkpoints (another world size)

UNIVERSAL_FIELD = "universal"  # in snip_meta.json: what `snip-ds universal` converted (absent in a plain one)
UNIVERSAL_LATEST_FILE = "latest_universal"  # ds_to_universal writes it beside its output folder


def is_universal(meta: Mapping[str, Any]) -> bool:
    return meta.get(UNIVERSAL_FIELD) is not None


def _check_universal(meta: Mapping[str, Any], path: Path) -> None:
    u = meta[UNIVERSAL_FIELD]
    ok = (isinstance(u, dict) and u.get("zero_stage") in (1, 2, 3) and isinstance(u.get("train_batch_size"), int)
          and "files" in meta)
    if not ok:
        raise CheckpointError(f"{path}: field '{UNIVERSAL_FIELD}' must be an object with zero_stage 1-3 and "
                              f"train_batch_size, and the checkpoint must record 'files'; got "
                              f"{json.dumps(u)[:80]}")


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
        CheckpointError: ``src`` is damaged or not convertible (no ZeRO, another format), or ``dest/<tag>``
            exists; the message names the file or folder.
    """
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
        for name in [STATE_FILE] + [_rank_file(tag_dir, r).name for r in range(meta["world_size"])]:
            if (tag_dir / name).is_file():  # a checkpoint of an older snip_ds keeps SNIP's state in snip_meta.json
                shutil.copy2(tag_dir / name, out / name)
        log(f"snip-ds: converting {tag_dir} (ZeRO-{zero_stage}, {meta['world_size']} rank(s)) with DeepSpeed's "
            f"ds_to_universal into {out}")
        run_ds_to_universal(tag_dir, out)
        full = {**meta, UNIVERSAL_FIELD: {"zero_stage": zero_stage, "source": str(tag_dir.resolve()),
                                          "train_batch_size": micro * ga * int(meta["world_size"])
                                          // int(meta.get("tensor_parallel", 1)),  # data-parallel ranks
                                          "source_sha256": file_digest(tag_dir / META_FILE)["sha256"]},
                "files": {name: file_digest(out / name) for name in _listing(out)}}
        atomic_write_text(out / META_FILE, json.dumps(full, indent=2, sort_keys=True))
    except BaseException:  # a failed conversion (a full disk, Ctrl-C, DeepSpeed's refusal) leaves nothing behind
        shutil.rmtree(out, ignore_errors=True)
        raise
    atomic_write_text(out.parent / LATEST_FILE, out.name)
    return out
