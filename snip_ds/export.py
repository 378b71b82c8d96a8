"""``snip-ds export``: a Hugging Face model directory from a training checkpoint.

    snip-ds export runs/zero3/checkpoints hf_model            # the checkpoint 'latest' names
    snip-ds export runs/zero3/checkpoints/step_120 hf_model --dtype bf16

The weights are the FP32 master weights, consolidated from DeepSpeed's shards (any ZeRO stage, any world
size) by DeepSpeed's own ``deepspeed.utils.zero_to_fp32``; without ZeRO and without mixed precision, the
module weights DeepSpeed saved are the master weights. A checkpoint of a tensor-parallel run is first converted
by DeepSpeed's ``ds_to_universal`` (in a temporary folder), which merges the shards of every layer; a universal
checkpoint (``snip-ds universal``'s) is read directly (its ``zero/<name>/fp32.pt``). Every DeepSpeed file is read with
``torch.load(weights_only=True)``: ``zero_to_fp32`` itself unpickles (``weights_only=False``), so while it
runs its module-level ``torch`` is replaced by :class:`_SafeTorch`, which forces ``weights_only=True`` and
names the file it cannot read.

``OUT_DIR`` gets ``config.json`` (the Hugging Face config the checkpoint recorded), ``model.safetensors``,
the tokenizer the run used (the byte-level default as an equivalent Hugging Face tokenizer, see
:func:`byte_tokenizer`) and ``snip_export.json`` (where it came from). It is written into a temporary
directory beside ``OUT_DIR`` and renamed at the end, so a failed export leaves nothing behind. The SNIP
precision plan is not part of the model: the exported model runs in plain BF16/FP32, and the plan stays in
the checkpoint's ``snip_state.json`` (``snip_meta.json`` in checkpoints of older versions).

Before any shard is read, the checkpoint is checked as a resume checks it: the files ``snip_meta.json``
records exist with their sizes and sha256 (:func:`snip_ds.engine.checkpoint.verify_files`); a checkpoint
written before checksums were recorded is exported with a warning that its files are not verified.

A Hugging Face Trainer's ``checkpoint-N`` (saved with :class:`snip_ds.hf.SnipCallback`: ``snip_state.json``
there), or its output directory (the last such ``checkpoint-N``), exports the same way: the config is the
Trainer's ``config.json``, the weights the FP32 masters in DeepSpeed's ``global_stepN`` folder (named by its
``latest``) when there is one, else the Trainer's ``model.safetensors`` (read with safetensors, no
unpickling), and the tokenizer the one the Trainer saved with it. The Trainer records no checksums, so
those files are checked by name and shape only.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch

from snip_ds.corpus import BYTE_EOS_ID, PREPARE_META_FILE, ByteTokenizer
from snip_ds.engine import checkpoint as ckpt

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
EXPORT_FILE = "snip_export.json"
FORMAT = "snip_ds.export/1"


class ExportError(ValueError):
    """The checkpoint cannot be exported, or ``OUT_DIR`` cannot be written; the message names the file."""


# --------------------------------------------------------------------------------------------------------
# reading DeepSpeed's files without unpickling
# --------------------------------------------------------------------------------------------------------
class _SafeTorch:
    """Stands in for the ``torch`` module inside ``zero_to_fp32``: ``load`` always uses ``weights_only=True``
    (with the DeepSpeed classes :func:`snip_ds.engine.checkpoint._safe_globals` allows); everything else is
    torch's."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def load(f, map_location=None, **kwargs):
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(ckpt._safe_globals()):
            try:
                return torch.load(f, map_location=map_location, **kwargs)
            except Exception as err:  # a damaged file, or one that needs unpickling: name it
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise ExportError(f"{f}: cannot be read as a DeepSpeed checkpoint file with weights_only=True "
                                  f"({first})") from None


@contextlib.contextmanager
def _safe_zero_to_fp32():
    """``deepspeed.utils.zero_to_fp32`` with :class:`_SafeTorch` as its ``torch``, its prints and progress bars
    silenced."""
    from deepspeed.utils import zero_to_fp32

    saved = zero_to_fp32.torch, zero_to_fp32.tqdm
    zero_to_fp32.torch, zero_to_fp32.tqdm = _SafeTorch(), lambda iterable, **kwargs: iterable
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield zero_to_fp32
    finally:
        zero_to_fp32.torch, zero_to_fp32.tqdm = saved


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def master_weights(tag_dir: Path) -> Dict[str, torch.Tensor]:
    """The FP32 master weights of the checkpoint in ``tag_dir``, by parameter name (tied ones under each name).

    Raises:
        ExportError: missing, damaged or unreadable DeepSpeed files (the message names the file).
    """
    with _safe_zero_to_fp32() as z:
        try:
            model_files = z.get_model_state_files(str(tag_dir))
        except FileNotFoundError:
            raise ExportError(f"{tag_dir}: no DeepSpeed '*_model_states.pt' file; the checkpoint is "
                              f"incomplete") from None
        states = z.torch.load(model_files[0], map_location="cpu")
        ds_config = states.get("ds_config") if isinstance(states, dict) else None
        ds_config = ds_config if isinstance(ds_config, dict) else {}
        stage = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
        mixed = any((ds_config.get(k) or {}).get("enabled") is True for k in ("bf16", "fp16"))
        if sorted(tag_dir.glob("*_optim_states.pt")):
            try:
                state = z.get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
            except ExportError:
                raise
            except Exception as err:  # DeepSpeed's own checks (shard count ...) or a foreign file
                raise ExportError(f"{tag_dir}: DeepSpeed could not consolidate the ZeRO shards "
                                  f"({_one_line(err)})") from None
            return {k: v.float() for k, v in state.items()}
        if stage > 0 or mixed:
            raise ExportError(f"{tag_dir}: no DeepSpeed '*_optim_states.pt' files, which hold the FP32 master "
                              f"weights of a {'ZeRO' if stage else 'mixed-precision'} run; the checkpoint is "
                              f"incomplete")
        # No ZeRO, no mixed precision: the optimizer steps the module's own FP32 parameters.
        module = states.get("module") if isinstance(states, dict) else None
        if not isinstance(module, Mapping) or not all(isinstance(v, torch.Tensor) for v in module.values()):
            raise ExportError(f"{model_files[0]}: holds no 'module' state dict")
        return {k: v.float() for k, v in module.items()}


def universal_weights(tag_dir: Path, model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The FP32 master weights of a universal checkpoint (``zero/<name>/fp32.pt``, whole parameters: DeepSpeed's
    conversion merged ZeRO partitions and tensor-parallel shards), by the names of ``model``'s state dict (a
    tied parameter, stored once, under each of its names); read with ``weights_only=True``.

    Raises:
        ExportError: an unreadable file, or a parameter of ``model`` that is not there (named).
    """
    weights: Dict[str, torch.Tensor] = {}
    zero = tag_dir / "zero"
    for folder in sorted(zero.iterdir()) if zero.is_dir() else []:
        path = folder / "fp32.pt"
        if not path.is_file():
            continue
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 -- a damaged or foreign file: name it
            raise ExportError(f"{path}: cannot be read as a tensor file ({_one_line(err)})") from None
        tensor = state.get("param") if isinstance(state, dict) else None
        if not isinstance(tensor, torch.Tensor):
            raise ExportError(f"{path}: holds no 'param' tensor")
        weights[folder.name] = tensor.float()
    names: Dict[int, list] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for group in names.values():  # a tied parameter: under every name that shares it
        found = next((weights[n] for n in group if n in weights), None)
        for n in group:
            if found is None:
                raise ExportError(f"{zero / n / 'fp32.pt'}: missing; the universal checkpoint does not hold "
                                  f"parameter {n}")
            weights.setdefault(n, found)
    return weights


# --------------------------------------------------------------------------------------------------------
# config, model, tokenizer
# --------------------------------------------------------------------------------------------------------
def hf_config(meta: Mapping[str, Any], meta_path: Path, warn: Callable[[str], None]):
    """The model's Hugging Face config: the full one the checkpoint recorded (``model_config``), or for a
    checkpoint that predates it, one rebuilt from its ``model_architecture`` fields (the others, such as
    ``max_position_embeddings`` or the special token ids, then take transformers' defaults: ``warn`` says so)."""
    from transformers import CONFIG_MAPPING

    fields = meta.get("model_config")
    if not fields:
        fields = meta.get("model_architecture")
        if not fields:
            raise ExportError(f"{meta_path}: records neither model_config nor model_architecture; the "
                              f"model's Hugging Face config cannot be rebuilt")
        warn(f"{meta_path}: records only the architecture fields (written before model_config was stored); "
             f"the other config fields take transformers' defaults")
    if not isinstance(fields, dict):
        raise ExportError(f"{meta_path}: model_config is not a JSON object")
    fields = dict(fields)
    model_type = fields.pop("model_type", None)
    if model_type not in CONFIG_MAPPING:
        raise ExportError(f"{meta_path}: model_config.model_type {model_type!r} is not a transformers model type")
    try:
        return CONFIG_MAPPING[model_type].from_dict(fields)
    except (TypeError, ValueError) as err:
        raise ExportError(f"{meta_path}: model_config is not a valid {model_type} config "
                          f"({_one_line(err)})") from None


def byte_tokenizer():
    """A Hugging Face fast tokenizer that encodes and decodes exactly as :class:`snip_ds.corpus.ByteTokenizer`:
    every UTF-8 byte is one token whose id is the byte's value, ``<|endoftext|>`` is EOS (id 256).

    GPT-2's byte-level pre-tokenizer (no regex split, no prefix space) maps each byte to one printable
    character, a BPE without merges maps that character to the byte's value, and the byte-level decoder
    inverts it. ``split_special_tokens`` keeps a literal ``<|endoftext|>`` in text as bytes, as the
    ByteTokenizer does. One difference: decoding with ``skip_special_tokens``, the ByteTokenizer decodes the
    bytes on each side of an EOS separately, this decoder joins them (only a UTF-8 sequence cut by an EOS
    decodes differently).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    eos = ByteTokenizer.eos_text
    tok.add_special_tokens([AddedToken(eos, special=True, normalized=False)])
    if tok.token_to_id(eos) != BYTE_EOS_ID:
        raise AssertionError(f"byte tokenizer: EOS got id {tok.token_to_id(eos)}, expected {BYTE_EOS_ID}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, split_special_tokens=True)


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's byte -> character table: printable Latin-1 bytes map to themselves, the other 68 to U+0100..."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    for n, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + n)
    return table


def tokenizer_source(meta: Mapping[str, Any]) -> Tuple[Optional[str], str]:
    """``("byte", why)``, ``(path, why)`` of a local Hugging Face tokenizer, or ``(None, why)`` when the
    checkpoint does not tell. Checkpoints record it (``tokenizer``); older ones are read from the settings."""
    recorded = meta.get("tokenizer")
    if recorded == "unknown":
        return None, "the run's dataset did not record its tokenizer"
    if isinstance(recorded, str) and recorded:
        return recorded, "recorded in the checkpoint"
    train = ((meta.get("settings") or {}).get("train") or {})
    if train.get("tokenizer_name_or_path"):
        return str(train["tokenizer_name_or_path"]), "settings.train.tokenizer_name_or_path"
    dataset = train.get("dataset")
    if dataset is None:
        return "byte", "the default corpus"
    prepared = Path(dataset) / PREPARE_META_FILE if isinstance(dataset, str) else None
    if prepared is not None and (Path(dataset) / "dataset_dict.json").is_file():
        try:
            return str(json.loads(prepared.read_text())["tokenizer"]), str(prepared)
        except (OSError, ValueError, KeyError, TypeError):
            return None, f"prepared dataset {dataset} records no tokenizer"
    if prepared is not None and not Path(dataset).exists():
        return None, f"dataset {dataset} (named in the settings) is not here"
    return "byte", "raw text without tokenizer_name_or_path"


def _write_tokenizer(meta: Mapping[str, Any], out: Path, warn: Callable[[str], None]) -> Dict[str, Any]:
    source, why = tokenizer_source(meta)
    if source == "byte":
        byte_tokenizer().save_pretrained(str(out))
        return {"kind": "byte", "exported": True, "note": (
            "snip_ds's byte-level tokenizer as a Hugging Face tokenizer: token id = UTF-8 byte value, "
            "<|endoftext|> (id 256) = EOS separating documents; the model's vocabulary is padded to a "
            "multiple of 8 and the extra ids are never produced. Encoding is identical; decoding too, except "
            "that with skip_special_tokens a UTF-8 sequence cut by an EOS is joined rather than replaced by U+FFFD")}
    if source is not None and Path(source).is_dir():
        from transformers import AutoTokenizer
        try:
            tok = AutoTokenizer.from_pretrained(source, local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError, TypeError) as err:
            raise ExportError(f"tokenizer {source}: cannot be loaded ({_one_line(err)})") from None
        tok.save_pretrained(str(out))
        return {"kind": "huggingface", "source": source, "exported": True}
    reason = why if source is None else f"the run's tokenizer {source} ({why}) is not a directory here"
    warn(f"no tokenizer exported: {reason}; copy the run's tokenizer files into the export yourself")
    return {"kind": "unknown" if source is None else "huggingface", "source": source, "exported": False,
            "note": reason}


# --------------------------------------------------------------------------------------------------------
# the export
# --------------------------------------------------------------------------------------------------------
def _check_out_dir(out_dir: Path, tag_dir: Path, force: bool) -> None:
    if out_dir.is_symlink():
        raise ExportError(f"{out_dir}: is a symbolic link; name the directory itself")
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"{out_dir}: exists and is not a directory")
    resolved, source = out_dir.resolve(), tag_dir.resolve()
    if resolved == source or resolved in source.parents:
        raise ExportError(f"{out_dir}: holds the checkpoint being exported; choose another output directory")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not force:
            raise ExportError(f"{out_dir}: exists and is not empty; pass --force to replace a previous export")
        if not (out_dir / EXPORT_FILE).is_file():
            raise ExportError(f"{out_dir}: is not empty and holds no {EXPORT_FILE}, so it is not a previous "
                              f"export; --force replaces only those: remove it yourself or choose another")


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    if out_dir.is_dir():
        if any(out_dir.iterdir()):  # a previous export (checked): swap, then delete it
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
            return
        out_dir.rmdir()
    os.replace(tmp, out_dir)


def export_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "fp32",
                      force: bool = False, warn: Callable[[str], None] = lambda msg: None) -> Dict[str, Any]:
    """Writes the Hugging Face model of ``checkpoint`` (a ``step_N`` directory, or a checkpoints directory
    with ``latest``; a Trainer's ``checkpoint-N`` or output directory) to ``out_dir``; returns what
    :data:`EXPORT_FILE` records.

    Raises:
        CheckpointError, ExportError: a missing, incomplete or damaged checkpoint, or an ``out_dir`` that
            exists and is not empty (without ``force``); nothing is written then.
    """
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    out_dir = Path(out_dir)
    trainer_dir = trainer_checkpoint(Path(checkpoint))
    if trainer_dir is not None:
        if trainer_dir != Path(checkpoint):
            _warn_if_saved_later(Path(checkpoint), trainer_dir, warn)
        return _export_trainer_checkpoint(trainer_dir, out_dir, dtype, force, warn)
    tag_dir = ckpt.resolve(Path(checkpoint))
    meta = ckpt.read_meta(tag_dir)
    meta_path = tag_dir / ckpt.META_FILE
    world_size = meta.get("world_size")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ExportError(f"{meta_path}: world_size is {world_size!r}, expected a positive integer")
    _check_out_dir(out_dir, tag_dir, force)

    from transformers import AutoModelForCausalLM

    config = hf_config(meta, meta_path, warn)
    try:
        with torch.device("meta"):  # shapes only: the weights come from the checkpoint
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except ValueError as err:
        raise ExportError(f"{meta_path}: model_config builds no causal LM ({_one_line(err)})") from None
    # The recorded config must rebuild the trained model (parameter names and shapes, architecture fields),
    # and every rank's files must be there.
    tp = meta.get("tensor_parallel", 1)
    ckpt.validate(tag_dir, ckpt.model_fingerprint(model), world_size, ckpt.model_architecture(model), tp)
    if "files" in meta:  # the sizes and sha256 a resume verifies, before any shard is read
        ckpt.verify_files(tag_dir, meta["files"])
    else:
        warn(f"{meta_path} records no checksums (written by an older snip_ds): its files are not verified")
    if ckpt.is_universal(meta):
        weights = universal_weights(tag_dir, model)
    elif tp != 1:  # tensor-parallel shards: DeepSpeed's universal conversion merges them
        weights = _merged_shards(tag_dir, model, tp, out_dir.parent, warn)
    else:
        weights = master_weights(tag_dir)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in weights.items()}
    if expected != got:
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        wrong = sorted(k for k in set(expected) & set(got) if expected[k] != got[k])
        raise ExportError(f"{tag_dir}: DeepSpeed's files do not hold the model's parameters (missing "
                          f"{missing[:3]}, unexpected {extra[:3]}, other shape {wrong[:3]})")
    model.load_state_dict(weights, strict=True, assign=True)
    model.to(DTYPES[dtype])
    model.config.use_cache = True  # training switched it off; generation wants it

    record = {"format": FORMAT, "checkpoint": str(tag_dir.resolve()), "step": meta.get("step"),
              "dtype": dtype, "world_size": world_size, "tensor_parallel": tp,
              "plan": f"{_plan_file(tag_dir).resolve()} (key 'plan'); not applied by this model, "
                      f"which runs in plain {dtype}",
              "parameters": int(sum(v.numel() for k, v in model.named_parameters()))}
    return _write_export(model, record, lambda tmp: _write_tokenizer(meta, tmp, warn), out_dir, tag_dir, force)


def _merged_shards(tag_dir: Path, model: torch.nn.Module, tp: int, scratch: Path,
                   warn: Callable[[str], None]) -> Dict[str, torch.Tensor]:
    """The FP32 master weights of the tensor-parallel DeepSpeed checkpoint ``tag_dir``, its shards merged by
    DeepSpeed's universal conversion in a temporary folder under ``scratch``."""
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".snip-export-", dir=scratch) as tmp:
        warn(f"{tag_dir}: tensor-parallel shards ({tp} per layer): merged through DeepSpeed's universal "
             f"conversion in a temporary folder")
        quiet = io.StringIO()  # DeepSpeed's converter prints its progress (stdout) and progress bars (stderr)
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            ckpt.run_ds_to_universal(tag_dir, Path(tmp) / "merged")
        return universal_weights(Path(tmp) / "merged", model)


def _plan_file(tag_dir: Path) -> Path:
    """Where the checkpoint's plan is: ``snip_state.json``, or ``snip_meta.json`` in an older checkpoint."""
    from snip_ds.artifacts import STATE_FILE

    return tag_dir / STATE_FILE if (tag_dir / STATE_FILE).is_file() else tag_dir / ckpt.META_FILE


def _write_export(model, record: Dict[str, Any], write_tokenizer: Callable[[Path], Dict[str, Any]],
                  out_dir: Path, source: Path, force: bool) -> Dict[str, Any]:
    """Saves ``model``, the tokenizer and :data:`EXPORT_FILE` into a temporary directory beside ``out_dir``,
    then renames it into place."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would outlive the rename
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(tmp))
        record["tokenizer"] = write_tokenizer(tmp)
        (tmp / EXPORT_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        _check_out_dir(out_dir, source, force)  # again: it may have changed meanwhile
        _move_into_place(tmp, out_dir)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return record


# --------------------------------------------------------------------------------------------------------
# Hugging Face Trainer checkpoints (snip_ds.hf.SnipCallback)
# --------------------------------------------------------------------------------------------------------
def trainer_checkpoint(path: Path) -> Optional[Path]:
    """The Trainer ``checkpoint-N`` that ``path`` names (itself, or an output directory's last one), or None
    when ``path`` is not a Trainer's (then it is read as a snip_ds checkpoint).

    Raises:
        ExportError: a Trainer checkpoint (or output directory of them) without SnipCallback's state.
    """
    from snip_ds.artifacts import TRAINER_CHECKPOINT_PREFIX, TRAINER_STATE_FILE, last_trainer_checkpoint

    if not path.is_dir() or (path / ckpt.META_FILE).is_file():  # launch/train.py's (its snip_state.json too)
        return None
    if (path / TRAINER_STATE_FILE).is_file():
        return path
    if path.name.startswith(TRAINER_CHECKPOINT_PREFIX) and (path / "trainer_state.json").is_file():
        raise ExportError(f"{path}: a Trainer checkpoint without {TRAINER_STATE_FILE}: it was not saved by a run "
                          f"with snip_ds.hf's SnipCallback, or its save was interrupted")
    if (path / ckpt.LATEST_FILE).exists() or (path / ckpt.RUN_CHECKPOINTS).is_dir():
        return None
    try:
        return last_trainer_checkpoint(path)
    except ValueError as err:
        raise ExportError(str(err)) from None


def _warn_if_saved_later(run: Path, folder: Path, warn: Callable[[str], None]) -> None:
    """A Trainer output directory whose own ``trainer.save_model()`` / ``save_state()`` came after its last
    checkpoint: the export is the checkpoint's, which ``warn`` says."""
    try:
        step = json.loads((run / "trainer_state.json").read_text())["global_step"]
        saved = int(folder.name.rsplit("-", 1)[1])
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return
    if isinstance(step, int) and step > saved:
        warn(f"{run}: the Trainer saved there at step {step}, after its last checkpoint; exporting {folder.name} "
             f"(the weights the callback's plan and state belong to)")


def _trainer_weights(folder: Path, model: torch.nn.Module, tp: int, scratch: Path,
                     warn: Callable[[str], None]) -> Tuple[Dict[str, torch.Tensor], str]:
    """The weights of a Trainer checkpoint and what they are: DeepSpeed's FP32 masters (``latest`` names the
    ``global_stepN`` folder), else the Trainer's own safetensors file(s). With tensor parallelism (``tp`` > 1)
    the Trainer's safetensors first, which DeepSpeed gathered from the shards when the Trainer saved (with
    ``gather_16bit_weights_on_model_save``); else the masters, merged by DeepSpeed's universal conversion."""
    latest = folder / ckpt.LATEST_FILE
    index = folder / "model.safetensors.index.json"
    saved = index.is_file() or (folder / "model.safetensors").is_file()
    if latest.is_file() and not (tp > 1 and saved):
        tag_dir = folder / latest.read_text().strip()
        if not tag_dir.is_dir():
            raise ExportError(f"{latest}: names {tag_dir}, which does not exist; the checkpoint is incomplete")
        if tp > 1:
            try:
                return (_merged_shards(tag_dir, model, tp, scratch, warn),
                        f"DeepSpeed's FP32 master weights ({tag_dir.name}, {tp} tensor-parallel shards merged)")
            except ckpt.CheckpointError as err:
                raise ExportError(f"{err}; set zero_optimization.gather_16bit_weights_on_model_save (ZeRO-3: "
                                  f"stage3_gather_16bit_weights_on_model_save) to true so that the Trainer saves "
                                  f"the gathered model.safetensors, which export reads") from None
        return master_weights(tag_dir), f"DeepSpeed's FP32 master weights ({tag_dir.name})"
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ExportError(f"{index}: not a safetensors index ({_one_line(err)})") from None
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ExportError(f"{folder}: holds neither DeepSpeed's '{ckpt.LATEST_FILE}' and global_stepN folder nor "
                          f"the Trainer's model.safetensors; the checkpoint has no weights")
    weights: Dict[str, torch.Tensor] = {}
    for name in files:
        try:
            weights.update(load_file(str(folder / name), device="cpu"))
        except (OSError, SafetensorError, ValueError) as err:
            raise ExportError(f"{folder / name}: cannot be read ({_one_line(err)})") from None
    source = f"the Trainer's {files[0] if len(files) == 1 else index.name}"
    if tp > 1:
        source += f" ({tp} tensor-parallel shards gathered by DeepSpeed when the Trainer saved)"
    return {k: v.float() for k, v in weights.items()}, source


def _export_trainer_checkpoint(folder: Path, out_dir: Path, dtype: str, force: bool,
                               warn: Callable[[str], None]) -> Dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from snip_ds.artifacts import checkpoint_meta

    try:
        meta = checkpoint_meta(folder)
    except ValueError as err:
        raise ExportError(str(err)) from None
    _check_out_dir(out_dir, folder, force)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ExportError(f"{config_file}: missing; the Trainer writes the model's config there when it saves")
    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ExportError(f"{config_file}: builds no causal LM ({_one_line(err)})") from None
    tp = meta.get("tensor_parallel", 1)
    weights, source = _trainer_weights(folder, model, tp, out_dir.parent, warn)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in weights.items()}
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    wrong = sorted(k for k in set(expected) & set(got) if expected[k] != got[k])
    if not (extra or wrong):
        model.load_state_dict(weights, strict=False, assign=True)
        if missing:  # a safetensors file holds tied weights once: tie them, then nothing may be left unloaded
            model.tie_weights()
            missing = sorted(k for k, v in model.state_dict().items() if v.is_meta)
    if missing or extra or wrong:
        raise ExportError(f"{folder}: {source} do not hold the parameters of the model {config_file.name} "
                          f"describes (missing {missing[:3]}, unexpected {extra[:3]}, other shape {wrong[:3]})")
    model.to(DTYPES[dtype])
    model.config.use_cache = True
    record = {"format": FORMAT, "checkpoint": str(folder.resolve()), "step": meta.get("step"), "dtype": dtype,
              "world_size": meta.get("world_size"), "tensor_parallel": tp, "weights": source,
              "plan": f"{folder.resolve() / 'snip_state.json'} (key 'plan'); not applied by this model, which "
                      f"runs in plain {dtype}",
              "parameters": int(sum(v.numel() for k, v in model.named_parameters()))}
    return _write_export(model, record, lambda tmp: _copy_trainer_tokenizer(folder, tmp, warn), out_dir, folder,
                         force)


def _copy_trainer_tokenizer(folder: Path, out: Path, warn: Callable[[str], None]) -> Dict[str, Any]:
    if not (folder / "tokenizer_config.json").is_file():
        reason = f"{folder} holds no tokenizer (the Trainer saves one given as processing_class)"
        warn(f"no tokenizer exported: {reason}; copy the run's tokenizer files into the export yourself")
        return {"kind": "unknown", "source": None, "exported": False, "note": reason}
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, TypeError) as err:
        raise ExportError(f"tokenizer {folder}: cannot be loaded ({_one_line(err)})") from None
    tok.save_pretrained(str(out))
    return {"kind": "huggingface", "source": str(folder), "exported": True}
