"""Atomic file writes: a temporary file in the same directory, fsync'd, then renamed over the target; and a JSON
file read with one-line errors naming it.

A failed or interrupted write leaves any previous file untouched and no temporary file behind, so plans,
statistics and checkpoint markers are never half-written. The file gets the permissions an ordinary
``open(path, "w")`` would give it (0666 less the umask). Pure (no torch).
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Writes ``text`` (UTF-8) to ``path`` atomically."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would hide the file from the user's group
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_json_file(path: str | os.PathLike, what: str) -> Any:
    """The JSON in file ``path`` (``what``: the kind of file, for the messages, e.g. ``"plan"``).

    Raises:
        FileNotFoundError: no such file ("plan file '...' does not exist").
        ValueError: not UTF-8 text, or not valid JSON; the message names the file.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a {what} file (not UTF-8 text)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
