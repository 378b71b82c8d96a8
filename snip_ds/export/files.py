"""Writing an export: the output directory checked, the model, tokenizer and :data:`EXPORT_FILE` written into
a temporary directory beside it and renamed into place, so that a failed export leaves nothing behind; the
error every part of ``snip-ds export`` raises (:class:`ExportError`).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
EXPORT_FILE = "snip_export.json"
FORMAT = "snip_ds.export/1"


class ExportError(ValueError):
    """The checkpoint cannot be exported, or ``OUT_DIR`` cannot be written; the message names the file."""


def one_line(err: BaseException) -> str:
    """``err`` as one line for a message: its class and its text, whitespace folded."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def check_out_dir(out_dir: Path, tag_dir: Path, force: bool) -> None:
    """``out_dir`` may receive the export of ``tag_dir``: a directory (or nothing yet) that is not a link, does not
    hold the checkpoint, and is empty or, with ``force``, a previous export.

    Raises:
        ExportError: naming ``out_dir`` and what is wrong.
    """
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


def write_export(model, record: Dict[str, Any], write_tokenizer: Callable[[Path], Dict[str, Any]],
                  out_dir: Path, source: Path, force: bool,
                  after_save: Optional[Callable[[Path], None]] = None) -> Dict[str, Any]:
    """Saves ``model``, the tokenizer and :data:`EXPORT_FILE` into a temporary directory beside ``out_dir``,
    then renames it into place; ``after_save`` runs on the temporary directory once the model is saved (a
    compressed-tensors export writes its ``quantization_config`` there)."""
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
        if after_save is not None:
            after_save(tmp)
        record["tokenizer"] = write_tokenizer(tmp)
        (tmp / EXPORT_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        check_out_dir(out_dir, source, force)  # again: it may have changed meanwhile
        _move_into_place(tmp, out_dir)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return record
