"""``snip-ds export``: a Hugging Face model directory from a training checkpoint.

    snip-ds export runs/zero3/checkpoints hf_model            # the checkpoint 'latest' names
    snip-ds export runs/zero3/checkpoints/step_120 hf_model --dtype bf16

The weights are the FP32 master weights, consolidated from DeepSpeed's shards (any ZeRO stage, any world
size); a checkpoint of a tensor-parallel run has its shards merged first; a universal checkpoint
(``snip-ds universal``'s) is read directly. Every DeepSpeed file is read with ``torch.load(weights_only=True)``
(:mod:`snip_ds.export.weights`).

``OUT_DIR`` gets ``config.json`` (the Hugging Face config the checkpoint recorded), ``model.safetensors``,
the tokenizer the run used (the byte-level default as an equivalent Hugging Face tokenizer:
:mod:`snip_ds.export.config`) and ``snip_export.json`` (where it came from). It is written into a temporary
directory beside ``OUT_DIR`` and renamed at the end, so a failed export leaves nothing behind
(:mod:`snip_ds.export.files`). By default the SNIP precision plan is not part of the model: the exported model runs in
plain BF16/FP32, and the plan stays in the checkpoint's ``snip_state.json`` (``snip_meta.json`` in checkpoints
of older versions).

Before any shard is read, the checkpoint is checked as a resume checks it: the files ``snip_meta.json``
records exist with their sizes and sha256 (:func:`snip_ds.engine.checkpoint_verify.verify_files`); a checkpoint
written before checksums were recorded is exported with a warning that its files are not verified.

A Hugging Face Trainer's ``checkpoint-N`` (saved with :class:`snip_ds.hf.SnipCallback`), or its output
directory, exports the same way (:mod:`snip_ds.export.trainer`).

``--format compressed-tensors`` (``serve=ServeOptions(format="compressed-tensors")``) writes the plan's forward
precisions instead: each planned layer quantized as it ran forward in training, in a compressed-tensors checkpoint
that transformers and vLLM load (:mod:`snip_ds.export.serve`, docs/serving.md).

May import: run/ (data and corpus for calibration), engine/ (checkpoint layout, universal) and everything below;
never hf/, families/ or experiments/. Its modules: :mod:`.files`, :mod:`.config`, :mod:`.weights`, :mod:`.trainer`,
:mod:`.calib`, :mod:`.ct`, :mod:`.serve`, :mod:`.cli`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Dict

import torch

from snip_ds.report.artifacts import STATE_FILE, checkpoint_meta, trainer_checkpoint
from snip_ds.engine.checkpoint_layout import (META_FILE, is_universal, model_architecture, model_fingerprint,
                                              read_meta, resolve)
from snip_ds.engine.checkpoint_verify import validate, verify_files
from snip_ds.export.config import hf_config, write_tokenizer
from snip_ds.export.files import DTYPES, FORMAT, ExportError, check_out_dir, one_line, write_export
from snip_ds.export.serve import ServeOptions, check_options, finish_model, plan_and_settings, plan_note
from snip_ds.export.trainer import export_trainer_checkpoint, warn_if_saved_later
from snip_ds.export.weights import master_weights, merged_shards, universal_weights


def export_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "fp32",
                      force: bool = False, warn: Callable[[str], None] = lambda msg: None,
                      serve: ServeOptions = ServeOptions()) -> Dict[str, Any]:
    """Writes the Hugging Face model of ``checkpoint`` (a ``step_N`` directory, or a checkpoints directory
    with ``latest``; a Trainer's ``checkpoint-N`` or output directory) to ``out_dir``; returns what
    :data:`~snip_ds.export.files.EXPORT_FILE` records. ``serve`` picks the format (:mod:`snip_ds.export.serve`):
    the plain model (default) or the plan's forward precisions as a compressed-tensors checkpoint.

    Raises:
        CheckpointError, ExportError: a missing, incomplete or damaged checkpoint, or an ``out_dir`` that
            exists and is not empty (without ``force``); nothing is written then.
    """
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    check_options(serve)
    out_dir = Path(out_dir)
    try:
        trainer_dir = trainer_checkpoint(Path(checkpoint))
    except ValueError as err:  # a Trainer checkpoint without SnipCallback's state
        raise ExportError(str(err)) from None
    if trainer_dir is not None:
        if trainer_dir != Path(checkpoint):
            warn_if_saved_later(Path(checkpoint), trainer_dir, warn)
        return export_trainer_checkpoint(trainer_dir, out_dir, dtype, force, warn, serve)
    _refuse_saved_model(Path(checkpoint))
    tag_dir = resolve(Path(checkpoint))
    meta = read_meta(tag_dir)
    meta_path = tag_dir / META_FILE
    world_size = meta.get("world_size")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ExportError(f"{meta_path}: world_size is {world_size!r}, expected a positive integer")
    check_out_dir(out_dir, tag_dir, force)
    snip = _serve_meta(tag_dir, meta) if serve.format != "hf" else meta
    if serve.format != "hf":
        plan_and_settings(snip, tag_dir)  # before any shard is read

    from transformers import AutoModelForCausalLM

    config = hf_config(meta, meta_path, warn)
    try:
        with torch.device("meta"):  # shapes only: the weights come from the checkpoint
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except ValueError as err:
        raise ExportError(f"{meta_path}: model_config builds no causal LM ({one_line(err)})") from None
    # The recorded config must rebuild the trained model (parameter names and shapes, architecture fields),
    # and every rank's files must be there.
    tp = meta.get("tensor_parallel", 1)
    validate(tag_dir, model_fingerprint(model), world_size, model_architecture(model), tp)
    if "files" in meta:  # the sizes and sha256 a resume verifies, before any shard is read
        verify_files(tag_dir, meta["files"])
    else:
        warn(f"{meta_path} records no checksums (written by an older snip_ds): its files are not verified")
    if is_universal(meta):
        weights = universal_weights(tag_dir, model)
    elif tp != 1:  # tensor-parallel shards: DeepSpeed's universal conversion merges them
        weights = merged_shards(tag_dir, model, tp, out_dir.parent, warn)
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
    model.config.use_cache = True  # training switched it off; generation wants it
    parameters = int(sum(v.numel() for k, v in model.named_parameters()))  # the model's, before any packing
    served, after_save = finish_model(model, snip, tag_dir, serve, DTYPES[dtype], warn)

    record = {"format": FORMAT, "checkpoint": str(tag_dir.resolve()), "step": meta.get("step"),
              "dtype": dtype, "world_size": world_size, "tensor_parallel": tp,
              "plan": f"{_plan_file(tag_dir).resolve()} (key 'plan'); " + plan_note(serve, dtype),
              "parameters": parameters, **served}
    return write_export(model, record, lambda tmp: write_tokenizer(meta, tmp, warn), out_dir, tag_dir, force,
                        after_save)


def _refuse_saved_model(path: Path) -> None:
    """Refuses a directory ``save_pretrained`` wrote (a config and weights, no snip_ds state), naming what to
    export instead.

    Raises:
        ExportError: naming ``path``.
    """
    weights = (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
    if not (path / "config.json").is_file() or not weights or (path / META_FILE).is_file():
        return
    raise ExportError(f"{path}: a Hugging Face model as save_pretrained writes it (config.json and its weights), "
                      f"without snip_ds's state: transformers loads it as it is; export the run's checkpoint for "
                      f"its plan instead (the Trainer's checkpoint-N, where snip_ds.hf.add_snip saves "
                      f"snip_state.json, or launch/train.py's step_N)")


def _serve_meta(tag_dir: Path, meta: Dict[str, Any]) -> Dict[str, Any]:
    """What a compressed-tensors export reads of a checkpoint besides its weights: the plan (``snip_state.json``)
    and the ``"snip"`` settings, ``snip_meta.json``'s where launch/train.py recorded them there, else
    ``snip_state.json``'s (a run of the user's own loop records them only there). Their ``train`` section names
    the run's training data only where launch/train.py read it (its data stream is in ``snip_meta.json``); a
    user's own loop reads its own, so the section is left out and the calibration asks for
    ``--calibration-data``."""
    snip = dict(meta, **checkpoint_meta(tag_dir))
    if not isinstance(snip.get("settings"), dict) and (tag_dir / STATE_FILE).is_file():
        snip["settings"] = json.loads((tag_dir / STATE_FILE).read_text()).get("settings")
    if "data" not in meta and isinstance(snip.get("settings"), dict):
        snip["settings"] = {k: v for k, v in snip["settings"].items() if k != "train"}
    return snip


def _plan_file(tag_dir: Path) -> Path:
    """Where the checkpoint's plan is: ``snip_state.json``, or ``snip_meta.json`` in an older checkpoint."""
    return tag_dir / STATE_FILE if (tag_dir / STATE_FILE).is_file() else tag_dir / META_FILE
