"""Training data: byte tokenizer, the standard-library corpus, fixed-length blocks and a resumable stream.

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

User text (:func:`load_dataset_blocks`): every text file, and every JSON-lines record, is one document;
documents are tokenized, each followed by EOS, concatenated, cut into non-overlapping blocks (the
leftover tail is dropped), and a seeded permutation sends ``validation_split`` of the blocks to
validation, exactly as ``launch/prepare_dataset.py`` does.

Blocks follow the Hugging Face causal-LM convention: ``input_ids`` of length ``block_size`` and
``labels = input_ids``; the model shifts labels internally.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Protocol, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = [
    "BYTE_EOS_ID",
    "BYTE_VOCAB_SIZE",
    "PREPARE_META_FILE",
    "BlockDataset",
    "ByteTokenizer",
    "CorpusSplit",
    "DataStream",
    "TokenizerLike",
    "group_blocks",
    "load_dataset_blocks",
    "load_tokenizer",
    "make_loader",
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


def _tokenizer_name(tokenizer: TokenizerLike) -> str:
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


# ------------------------------------------------------------------ datasets


class BlockDataset(Dataset):
    """Fixed-length blocks; item ``i`` is ``{"input_ids": LongTensor[T], "labels": LongTensor[T]}``.

    Args:
        blocks: Integer array/tensor of shape ``[n_blocks, block_size]`` (kept as int32 in memory).
    """

    def __init__(self, blocks: np.ndarray | torch.Tensor):
        if isinstance(blocks, np.ndarray):  # copy read-only (e.g. memory-mapped Arrow) or non-int32 arrays
            blocks = torch.from_numpy(np.require(blocks, requirements=["C", "W"]))
        if blocks.dim() != 2 or blocks.is_floating_point():
            raise ValueError(f"blocks must be a 2-D integer array [n_blocks, block_size], got "
                             f"{tuple(blocks.shape)} {blocks.dtype}")
        self.blocks = blocks.to(torch.int32).contiguous()

    @classmethod
    def from_tokens(cls, tokens: np.ndarray, block_size: int) -> "BlockDataset":
        """Cut a 1-D token stream into non-overlapping blocks, dropping the tail."""
        return cls(group_blocks(tokens, block_size))

    @property
    def block_size(self) -> int:
        return self.blocks.shape[1]

    @property
    def num_tokens(self) -> int:
        return self.blocks.numel()

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.blocks[index].long()
        return {"input_ids": ids, "labels": ids.clone()}

    def get_batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """Stacked items: ``input_ids`` and ``labels`` of shape ``[len(indices), block_size]``."""
        ids = self.blocks[torch.as_tensor(list(indices), dtype=torch.long)].long()
        return {"input_ids": ids, "labels": ids.clone()}


def _too_small(what: str, n_tokens: int, block_size: int) -> ValueError:
    return ValueError(f"{what}: {n_tokens} tokens are too few for one block of block_size {block_size}")


def _load_prepared(path: Path, block_size: int, tokenizer: Any) -> tuple[BlockDataset, BlockDataset, int, dict]:
    import datasets  # heavy imports, only when needed
    import pyarrow.compute as pc

    meta_path = path / PREPARE_META_FILE
    meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.is_file() else {}
    if meta.get("block_size") not in (None, block_size):
        raise ValueError(f"prepared dataset {str(path)!r} has block_size {meta['block_size']} but "
                         f"block_size={block_size} was requested; re-run prepare_dataset.py or pass "
                         f"--block_size {meta['block_size']}")
    dd = datasets.load_from_disk(str(path))
    missing = [s for s in ("train", "validation") if s not in dd]
    if missing:
        raise ValueError(f"prepared dataset {str(path)!r} lacks split(s) {missing}; has {sorted(dd)}")
    out = {}
    for split in ("train", "validation"):
        ds = dd[split]
        if "input_ids" not in ds.column_names:
            raise ValueError(f"prepared dataset {str(path)!r} split {split!r} has no 'input_ids' column; "
                             f"columns: {ds.column_names}")
        if len(ds) == 0:
            raise ValueError(f"prepared dataset {str(path)!r} split {split!r} is empty")
        column = ds.data.column("input_ids").combine_chunks()
        lengths = set(pc.unique(pc.list_value_length(column)).to_pylist())
        if lengths != {block_size}:
            raise ValueError(f"prepared dataset {str(path)!r} split {split!r} has blocks of length(s) "
                             f"{sorted(lengths)[:5]} but block_size={block_size} was requested")
        flat = np.asarray(column.flatten().to_numpy(zero_copy_only=False), dtype=np.int32)
        out[split] = BlockDataset(flat.reshape(len(ds), block_size))
    vocab_size = meta.get("vocab_size")
    if tokenizer is not None and vocab_size is not None and len(tokenizer) != vocab_size:
        raise ValueError(f"prepared dataset {str(path)!r} was tokenized with vocab_size {vocab_size}, "
                         f"but the given tokenizer has {len(tokenizer)}")
    if vocab_size is None:
        vocab_size = len(tokenizer) if tokenizer is not None else 1 + max(
            int(out[s].blocks.max()) for s in out)
    info = {"dataset": str(path), "tokenizer": meta.get("tokenizer", "unknown"), "prepared": meta}
    return out["train"], out["validation"], int(vocab_size), info


def load_dataset_blocks(
    dataset: str | Path | Sequence[str | Path] | None = None,
    block_size: int = 256,
    tokenizer: str | Path | TokenizerLike | None = None,
    *,
    validation_split: float = 0.05,
    seed: int = 0,
    text_field: str = "text",
    max_bytes: int | None = DEFAULT_MAX_TRAIN_BYTES,
    max_validation_bytes: int | None = DEFAULT_MAX_VALIDATION_BYTES,
) -> tuple[BlockDataset, BlockDataset, int, dict[str, Any]]:
    """Train and validation blocks from the default corpus, user text, or a prepared directory.

    Args:
        dataset: ``None`` for the stdlib corpus; a text/JSON-lines file or a list of them; or a
            directory written by ``launch/prepare_dataset.py``.
        block_size: Tokens per block.
        tokenizer: ``None``/``"byte"`` (ByteTokenizer), a local HF tokenizer directory, or a tokenizer
            object. For prepared directories it is only checked against the recorded vocab size.
        validation_split: Fraction of blocks sent to validation (user text only).
        seed: Seed of the block split (user text only).
        text_field: JSON-lines field holding the text.
        max_bytes: Train token cap for the stdlib corpus.
        max_validation_bytes: Validation token cap for the stdlib corpus.

    Returns:
        ``(train_ds, validation_ds, vocab_size, info)``; ``vocab_size`` is the tokenizer's (unpadded)
        and ``info`` is a JSON-able summary (sources, token and block counts).

    Raises:
        FileNotFoundError: A path does not exist.
        ValueError: Unsupported/empty input, too little data for a block in either split, or a block
            size that disagrees with a prepared directory.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if isinstance(dataset, (list, tuple)) and len(dataset) == 1:
        dataset = dataset[0]
    single = dataset is not None and isinstance(dataset, (str, Path))
    if single and (Path(dataset) / "dataset_dict.json").is_file():
        tok = load_tokenizer(tokenizer) if tokenizer is not None else None
        train_ds, val_ds, vocab_size, info = _load_prepared(Path(dataset), block_size, tok)
    else:
        tok = load_tokenizer(tokenizer)
        vocab_size = len(tok)
        if dataset is None:
            if not isinstance(tok, ByteTokenizer):
                raise ValueError("the default stdlib corpus uses the byte tokenizer; pass dataset= to use "
                                 f"tokenizer {_tokenizer_name(tok)!r}")
            corpus = stdlib_corpus(max_bytes, max_validation_bytes)
            for split, tokens in (("train", corpus.train), ("validation", corpus.validation)):
                if len(tokens) < block_size:
                    raise _too_small(f"{corpus.info['dataset']} {split} split", len(tokens), block_size)
            train_ds = BlockDataset.from_tokens(corpus.train, block_size)
            val_ds = BlockDataset.from_tokens(corpus.validation, block_size)
            info = dict(corpus.info)
        else:
            paths = [dataset] if single else list(dataset)
            if not paths:
                raise ValueError("dataset is an empty list; pass at least one file")
            name = ", ".join(map(str, paths))
            tokens, n_docs = tokenize_documents(read_documents(paths, text_field), tok)
            if n_docs == 0 or len(tokens) == n_docs:  # only EOS tokens: every document is empty
                raise ValueError(f"dataset {name} is empty (no text)")
            blocks = group_blocks(tokens, block_size)
            if len(blocks) < 2:
                raise ValueError(f"dataset {name}: {len(tokens)} tokens make {len(blocks)} block(s) of "
                                 f"block_size {block_size}; need at least 2 (one train, one validation), "
                                 f"i.e. {2 * block_size} tokens")
            train_idx, val_idx = split_block_indices(len(blocks), validation_split, seed)
            train_ds, val_ds = BlockDataset(blocks[train_idx]), BlockDataset(blocks[val_idx])
            info = {"dataset": [str(p) for p in paths], "documents": n_docs, "tokens": int(len(tokens)),
                    "validation_split": validation_split, "seed": seed}
        info["tokenizer"] = _tokenizer_name(tok)
    info.update(block_size=block_size, vocab_size=vocab_size,
                train_blocks=len(train_ds), validation_blocks=len(val_ds),
                train_tokens=train_ds.num_tokens, validation_tokens=val_ds.num_tokens)
    return train_ds, val_ds, vocab_size, info


# ------------------------------------------------------------------ data-parallel stream


class DataStream:
    """Deterministic, resumable batches for one data-parallel rank.

    Sample order is exactly ``torch.utils.data.DistributedSampler``'s (permutation seeded by
    ``seed + epoch``, rank ``r`` takes positions ``r, r + W, ...``) without needing torch.distributed.
    Step ``s`` of an epoch gives rank ``r`` its next ``batch_size`` samples, so the ranks together
    consume permutation positions ``[s*G, (s+1)*G)`` with ``G = world_size * batch_size``: the global
    batch is the same for 1 rank × 2B and 2 ranks × B. With ``drop_last`` the position depends only on
    the global step and ``G``, so a checkpoint resumes exactly even on a different world size with
    the same global batch.

    Args:
        dataset: Map-style dataset; ``get_batch(indices)`` is used when present, else items are stacked.
        batch_size: Samples per rank per step.
        seed: Shuffle seed.
        rank: This rank, ``0 <= rank < world_size``.
        world_size: Number of data-parallel ranks.
        shuffle: Reshuffle every epoch (seeded by ``seed + epoch``); ``False`` keeps dataset order.
        drop_last: Drop the ragged tail so every step has ``batch_size`` samples on every rank;
            ``False`` pads ranks by wrapping around (DistributedSampler) and the last batch may be short.
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, shuffle: bool = True, drop_last: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need world_size >= 1 and 0 <= rank < world_size, got rank={rank}, "
                             f"world_size={world_size}")
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.rank, self.world_size, self.shuffle, self.drop_last = rank, world_size, shuffle, drop_last
        n = len(dataset)
        if drop_last and n % world_size:
            self.num_samples = math.ceil((n - world_size) / world_size)  # as DistributedSampler
        else:
            self.num_samples = math.ceil(n / world_size)
        self.steps_per_epoch = (self.num_samples // batch_size if drop_last
                                else math.ceil(self.num_samples / batch_size))
        if self.steps_per_epoch < 1:
            raise ValueError(f"dataset has {n} samples, fewer than one global batch of "
                             f"{world_size * batch_size} (world_size {world_size} x batch_size {batch_size})")
        self.step = 0
        self._cached: tuple[int, list[int]] | None = None

    @property
    def epoch(self) -> int:
        """Epoch of the next batch."""
        return self.step // self.steps_per_epoch

    def rank_indices(self, epoch: int) -> list[int]:
        """This rank's sample indices for ``epoch``, identical to DistributedSampler's."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            indices = torch.randperm(n, generator=g).tolist()
        else:
            indices = list(range(n))
        total = self.num_samples * self.world_size
        if total > n:  # drop_last=False: wrap around to pad
            indices += (indices * math.ceil((total - n) / n))[: total - n]
        indices = indices[self.rank:total:self.world_size]
        self._cached = (epoch, indices)
        return indices

    def batch_indices(self, step: int) -> list[int]:
        """This rank's sample indices for global step ``step``."""
        epoch, within = divmod(step, self.steps_per_epoch)
        return self.rank_indices(epoch)[within * self.batch_size:(within + 1) * self.batch_size]

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The batch for the current step; advances the step."""
        indices = self.batch_indices(self.step)
        self.step += 1
        if hasattr(self.dataset, "get_batch"):
            return self.dataset.get_batch(indices)
        items = [self.dataset[i] for i in indices]
        return {k: torch.stack([item[k] for item in items]) for k in items[0]}

    def skip_to(self, step: int) -> None:
        """Make ``step`` the next step (no data is read)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self.step = step

    def state_dict(self) -> dict[str, int | bool]:
        """JSON-able position plus the settings a resume must match (the same on every rank)."""
        return {"step": self.step, "seed": self.seed, "num_dataset_samples": len(self.dataset),
                "global_batch_size": self.world_size * self.batch_size, "world_size": self.world_size,
                "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: Mapping[str, int | bool]) -> None:
        """Resume at ``state["step"]``; raises ValueError naming any setting that differs.

        ``world_size`` may differ when ``drop_last`` is set and the global batch size is unchanged.
        """
        mine = self.state_dict()
        keys = ["seed", "num_dataset_samples", "global_batch_size", "shuffle", "drop_last"]
        if not self.drop_last:
            keys.append("world_size")
        missing = [k for k in ["step", *keys] if k not in state]
        if missing:
            raise ValueError(f"data stream state lacks {missing}; expected keys {sorted(mine)}")
        diff = [f"{k}: checkpoint {state[k]!r} vs now {mine[k]!r}" for k in keys if state[k] != mine[k]]
        if diff:
            raise ValueError("data stream state does not match this run (" + "; ".join(diff) + ")")
        self.skip_to(int(state["step"]))


def make_loader(dataset: Dataset, batch_size: int, *, seed: int = 0, rank: int = 0, world_size: int = 1,
                shuffle: bool = True, drop_last: bool = True) -> DataStream:
    """A :class:`DataStream` at step 0 (see its docstring for the sampling contract)."""
    return DataStream(dataset, batch_size, seed=seed, rank=rank, world_size=world_size,
                      shuffle=shuffle, drop_last=drop_last)
