"""Text to tokens: the byte tokenizer, the standard-library corpus, user documents, fixed-length blocks.

The embedded default needs nothing downloaded: it trains on the ``.py`` sources of the running Python's
own standard library (``sysconfig.get_paths()["stdlib"]``), tokenized byte by byte.

Corpus rules (the default, :func:`stdlib_corpus`):
    * Files: every ``*.py`` under the stdlib directory, excluding ``site-packages``/``dist-packages``,
      test suites (directories named ``test``, ``tests``, ``idle_test``: they hold deliberately broken or
      data-like files and are missing from many distro installs) and the machine-generated
      ``_sysconfigdata*`` files. Symlinked directories are not followed.
    * Split: a file goes to validation iff ``sha256(relative posix path) mod 20 == 0`` (about 1 in 20),
      so the split is the same on every machine that has the file.
    * Cap: files are taken in a fixed pseudo-random order (sha256 of ``"order:" + path``) until the
      split's byte cap is reached, then emitted sorted by relative path, joined with EOS, and cut to the cap.

:mod:`snip_ds.run.data` turns the blocks into datasets and the resumable training stream.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

import numpy as np
import torch

__all__ = [
    "BYTE_EOS_ID",
    "BYTE_VOCAB_SIZE",
    "PREPARE_META_FILE",
    "ByteTokenizer",
    "CorpusSplit",
    "TokenizerLike",
    "group_blocks",
    "load_tokenizer",
    "read_documents",
    "split_block_indices",
    "stdlib_corpus",
    "tokenize_documents",
]

BYTE_EOS_ID = 256  # first id after the 256 byte values
BYTE_VOCAB_SIZE = 257
PREPARE_META_FILE = "snip_prepare.json"  # written next to dataset_dict.json by prepare_dataset.py
DEFAULT_MAX_TRAIN_BYTES = 4 * 2**20  # 4 MiB -> 16,384 blocks of 256: more than a CPU run consumes
DEFAULT_MAX_VALIDATION_BYTES = 2**18  # 256 KiB -> 1,024 blocks of 256
STDLIB_VALIDATION_MODULUS = 20  # 1 file in 20 goes to validation
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson", ".json"})
_BINARY_SUFFIXES = frozenset(
    {".arrow", ".parquet", ".gz", ".bz2", ".xz", ".zst", ".zip", ".tar", ".bin", ".pt", ".pth", ".npy",
     ".npz", ".safetensors", ".pkl", ".pickle"}
)
_SUPPORTED = (
    "UTF-8 text files (any suffix), JSON-lines files (.jsonl/.ndjson/.json) with a text field, "
    "or a directory written by launch/prepare_dataset.py"
)


# ------------------------------------------------------------------ tokenizers


class TokenizerLike(Protocol):
    """What the data pipeline needs from a tokenizer (``ByteTokenizer`` and HF fast tokenizers both fit)."""

    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def __len__(self) -> int: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255 are the ids; 256 is EOS. Vocabulary size 257.

    ``decode(encode(text)) == text`` for every string; EOS decodes to ``eos_text`` (or nothing with
    ``skip_special_tokens``) and invalid byte sequences decode with U+FFFD replacement.
    """

    eos_token_id = BYTE_EOS_ID
    vocab_size = BYTE_VOCAB_SIZE
    eos_text = "<|endoftext|>"
    name_or_path = "byte"

    def __len__(self) -> int:
        return BYTE_VOCAB_SIZE

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of ``text``'s UTF-8 bytes; ``add_special_tokens`` appends EOS."""
        ids = list(text.encode("utf-8"))
        return ids + [BYTE_EOS_ID] if add_special_tokens else ids

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Ids of raw bytes as an int32 array (the fast path for files)."""
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Sequence[int] | torch.Tensor | np.ndarray, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; raises ValueError on an id outside 0..256."""
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        bad = [i for i in ids if not 0 <= i <= BYTE_EOS_ID]
        if bad:
            raise ValueError(f"ByteTokenizer ids must be in 0..{BYTE_EOS_ID}, got {bad[:5]}")
        sep = "" if skip_special_tokens else self.eos_text
        pieces, start = [], 0
        for pos, i in enumerate(ids + [BYTE_EOS_ID]):
            if i == BYTE_EOS_ID:
                pieces.append(bytes(ids[start:pos]).decode("utf-8", errors="replace"))
                start = pos + 1
        return sep.join(pieces)


def load_tokenizer(name_or_path: str | Path | TokenizerLike | None) -> TokenizerLike:
    """``None`` or ``"byte"`` gives the ByteTokenizer; a path loads a local Hugging Face tokenizer.

    Raises:
        FileNotFoundError: The path does not exist.
        ValueError: The directory holds no loadable tokenizer, or it has no EOS token.
    """
    if name_or_path is None or (isinstance(name_or_path, str) and name_or_path == "byte"):
        return ByteTokenizer()
    if not isinstance(name_or_path, (str, Path)):
        tok = name_or_path
    else:
        path = Path(name_or_path)
        if not path.exists():
            raise FileNotFoundError(
                f"tokenizer {str(path)!r} does not exist; pass a local tokenizer directory or 'byte'"
            )
        from transformers import AutoTokenizer  # heavy import, only when needed

        try:
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError, TypeError) as err:
            raise ValueError(f"tokenizer {str(path)!r} could not be loaded: {err}") from None
    if getattr(tok, "eos_token_id", None) is None:
        raise ValueError(
            f"tokenizer {getattr(tok, 'name_or_path', tok)!r} has no eos_token_id; documents are "
            "separated by EOS, so set eos_token in its tokenizer_config.json"
        )
    return tok


def tokenizer_name(tokenizer: TokenizerLike) -> str:
    return str(getattr(tokenizer, "name_or_path", type(tokenizer).__name__))


# ------------------------------------------------------------------ corpora


@dataclass(frozen=True)
class CorpusSplit:
    """A train/validation pair of 1-D int32 token streams, documents separated by EOS."""

    train: np.ndarray
    validation: np.ndarray
    info: dict[str, Any] = field(default_factory=dict)


def _path_hash(rel: str, salt: str = "") -> int:
    return int.from_bytes(hashlib.sha256((salt + rel).encode("utf-8")).digest()[:8], "big")


def _stdlib_files(root: Path) -> list[tuple[str, Path]]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for name in filenames:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                path = Path(dirpath) / name
                if path.is_file():
                    files.append((path.relative_to(root).as_posix(), path))
    return sorted(files)


def _join_capped(files: list[tuple[str, Path]], max_bytes: int | None) -> tuple[np.ndarray, int]:
    """Pick files in hash order up to ``max_bytes``, join them in path order with EOS, cut to the cap."""
    if max_bytes is not None:
        chosen, total = [], 0
        for rel, path in sorted(files, key=lambda f: _path_hash(f[0], "order:")):
            if total >= max_bytes:
                break
            chosen.append((rel, path))
            total += path.stat().st_size + 1
        files = sorted(chosen)
    eos = np.array([BYTE_EOS_ID], dtype=np.int32)
    parts = []
    for _, path in files:
        parts += [np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.int32), eos]
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return (tokens if max_bytes is None else tokens[:max_bytes]), len(files)


def stdlib_corpus(
    max_bytes: int | None = DEFAULT_MAX_TRAIN_BYTES,
    max_validation_bytes: int | None = DEFAULT_MAX_VALIDATION_BYTES,
    root: str | Path | None = None,
) -> CorpusSplit:
    """Byte tokens of the standard library's ``.py`` files, split and capped as the module docstring says.

    Args:
        max_bytes: Cap on train tokens (bytes + EOS); ``None`` takes every train file.
        max_validation_bytes: Cap on validation tokens; ``None`` takes every validation file.
        root: Directory to read instead of ``sysconfig.get_paths()["stdlib"]`` (for tests).

    Raises:
        FileNotFoundError: The directory is missing or has no ``.py`` files.
    """
    for name, cap in (("max_bytes", max_bytes), ("max_validation_bytes", max_validation_bytes)):
        if cap is not None and cap < 1:
            raise ValueError(f"{name} must be >= 1 or None, got {cap}")
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"standard library directory {str(root)!r} does not exist")
    files = _stdlib_files(root)
    if not files:
        raise FileNotFoundError(f"standard library directory {str(root)!r} has no .py files")
    is_val = [_path_hash(rel) % STDLIB_VALIDATION_MODULUS == 0 for rel, _ in files]
    train, n_train = _join_capped([f for f, v in zip(files, is_val) if not v], max_bytes)
    val, n_val = _join_capped([f for f, v in zip(files, is_val) if v], max_validation_bytes)
    info = {
        "dataset": f"stdlib:{root}",
        "stdlib_files": len(files),
        "train_files": n_train,
        "validation_files": n_val,
    }
    return CorpusSplit(train=train, validation=val, info=info)


def read_documents(paths: Sequence[str | Path], text_field: str = "text") -> Iterator[tuple[str, str]]:
    """Yield ``(source, text)`` per document: a whole text file, or one JSON-lines record.

    Raises:
        FileNotFoundError: A path does not exist.
        ValueError: Unsupported or non-UTF-8 file, or a bad JSON line (named ``file:line``).
    """
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"dataset file {str(path)!r} does not exist")
        if path.is_dir():
            raise ValueError(f"dataset {str(path)!r} is a directory but not one written by "
                             f"launch/prepare_dataset.py (no dataset_dict.json); supported: {_SUPPORTED}")
        suffix = path.suffix.lower()
        if suffix in _BINARY_SUFFIXES:
            raise ValueError(f"dataset file {str(path)!r}: unsupported file type {suffix!r}; supported: {_SUPPORTED}")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"dataset file {str(path)!r} is not UTF-8 text ({err}); supported: {_SUPPORTED}") from None
        if suffix not in _JSONL_SUFFIXES:
            yield str(path), text
            continue
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({err.msg}); JSON-lines files need "
                                 f"one object per line with a {text_field!r} string") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{path}:{lineno}: expected an object with a string field {text_field!r}, "
                                 f"got {keys}")
            yield f"{path}:{lineno}", record[text_field]


def tokenize_documents(
    documents: Iterator[tuple[str, str]], tokenizer: TokenizerLike, batch_size: int = 256
) -> tuple[np.ndarray, int]:
    """Concatenate each document's tokens followed by EOS; returns ``(int32 tokens, n_documents)``.

    No BOS or other special tokens are added (``add_special_tokens=False``).
    """
    eos = int(tokenizer.eos_token_id)
    parts: list[np.ndarray] = []
    n_docs = 0
    batch: list[str] = []

    def flush() -> None:
        if isinstance(tokenizer, ByteTokenizer):
            encoded = [tokenizer.encode_bytes(t.encode("utf-8")) for t in batch]
        elif callable(tokenizer) and hasattr(tokenizer, "batch_decode"):  # HF: batched fast path
            encoded = tokenizer(batch, add_special_tokens=False)["input_ids"]
        else:
            encoded = [tokenizer.encode(t, add_special_tokens=False) for t in batch]
        for ids in encoded:
            parts.append(np.asarray(ids, dtype=np.int32))
            parts.append(np.array([eos], dtype=np.int32))
        batch.clear()

    for _, text in documents:
        batch.append(text)
        n_docs += 1
        if len(batch) >= batch_size:
            flush()
    flush()
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return tokens, n_docs


def group_blocks(tokens: np.ndarray, block_size: int) -> np.ndarray:
    """Non-overlapping ``[n_blocks, block_size]`` view of a 1-D token stream; the leftover tail is dropped."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n_blocks = len(tokens) // block_size
    return np.asarray(tokens[: n_blocks * block_size]).reshape(n_blocks, block_size)


def split_block_indices(n_blocks: int, validation_split: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded split of block indices: ``max(1, round(n * split))`` to validation, the rest to train.

    Both index arrays are sorted. Needs ``n_blocks >= 2``; raises ValueError otherwise.
    """
    if not 0.0 < validation_split < 1.0:
        raise ValueError(f"validation_split must be in (0, 1), got {validation_split}")
    if n_blocks < 2:
        raise ValueError(f"need at least 2 blocks (one train, one validation), got {n_blocks}")
    n_val = min(max(1, round(n_blocks * validation_split)), n_blocks - 1)
    perm = np.random.default_rng(seed).permutation(n_blocks)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])
