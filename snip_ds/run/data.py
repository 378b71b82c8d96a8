"""Training data: datasets of fixed-length blocks and a resumable data-parallel stream.

Tokenizers and corpora (the byte tokenizer, the standard-library default, user documents, blocks) are
:mod:`snip_ds.run.corpus`'s.

User text (:func:`load_dataset_blocks`): every text file, and every JSON-lines record, is one document;
documents are tokenized, each followed by EOS, concatenated, cut into non-overlapping blocks (the
leftover tail is dropped), and a seeded permutation sends ``validation_split`` of the blocks to
validation, exactly as ``launch/prepare_dataset.py`` does.

Blocks follow the Hugging Face causal-LM convention: ``input_ids`` of length ``block_size`` and
``labels = input_ids``; the model shifts labels internally.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from snip_ds.run.corpus import (DEFAULT_MAX_TRAIN_BYTES, DEFAULT_MAX_VALIDATION_BYTES, PREPARE_META_FILE, ByteTokenizer,
                            TokenizerLike, group_blocks, load_tokenizer, read_documents, split_block_indices,
                            stdlib_corpus, tokenize_documents, tokenizer_name)

__all__ = [
    "BlockDataset",
    "DataStream",
    "load_dataset_blocks",
    "make_loader",
]

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
                                 f"tokenizer {tokenizer_name(tok)!r}")
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
        info["tokenizer"] = tokenizer_name(tok)
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

    def load_state_dict(self, state: Mapping[str, int | bool], exact: bool = True) -> None:
        """Resume at ``state["step"]``; raises ValueError naming any setting that differs.

        ``world_size`` may differ when ``drop_last`` is set. So may the global batch ``G`` (batch size x world
        size), as when a checkpoint is resumed on fewer ranks with more gradient accumulation: the saved
        position, ``within`` steps into epoch ``e``, is permutation position ``P = within * G_saved``, and this
        stream goes on from the same ``P`` of epoch ``e``. That reads the samples the saved stream would have
        read when ``P`` is a multiple of ``G`` and both cut the epochs alike (``steps_per_epoch * G`` equal,
        always so when ``G_saved`` and ``G`` divide the dataset's size); otherwise ValueError names the fields.
        ``exact=False`` (a private statistics stream, whose samples need only be new ones) rounds ``P`` up to
        the next whole batch instead, the next epoch's start past the last one.
        """
        mine = self.state_dict()
        keys = ["seed", "num_dataset_samples", "shuffle", "drop_last"]
        if not self.drop_last:
            keys += ["world_size", "global_batch_size"]
        missing = [k for k in ["step", "global_batch_size", *keys] if k not in state]
        if missing:
            raise ValueError(f"data stream state lacks {missing}; expected keys {sorted(mine)}")
        diff = [f"{k}: checkpoint {state[k]!r} vs now {mine[k]!r}" for k in keys if state[k] != mine[k]]
        if diff:
            raise ValueError("data stream state does not match this run (" + "; ".join(diff) + ")")
        step, g_saved, g = int(state["step"]), int(state["global_batch_size"]), mine["global_batch_size"]
        if g_saved != g:
            n = len(self.dataset)
            spe_saved = n // g_saved  # steps_per_epoch at G_saved (drop_last: floor(floor(n / W) / B))
            epoch, within = divmod(step, spe_saved)
            pos = within * g_saved
            if exact and (pos % g or spe_saved * g_saved != self.steps_per_epoch * g):
                raise ValueError(
                    f"data stream: global_batch_size (batch size x ranks) is {g_saved} in the checkpoint and {g} "
                    f"now, and at step {step} ({pos} samples into epoch {epoch}) the {n} samples' order at "
                    f"{g} would not continue the saved one (epochs of {spe_saved * g_saved} vs "
                    f"{self.steps_per_epoch * g} samples); resume with global_batch_size {g_saved}")
            within = -(-pos // g)
            if within >= self.steps_per_epoch:
                epoch, within = epoch + 1, 0
            step = epoch * self.steps_per_epoch + within
        self.skip_to(step)


def make_loader(dataset: Dataset, batch_size: int, *, seed: int = 0, rank: int = 0, world_size: int = 1,
                shuffle: bool = True, drop_last: bool = True) -> DataStream:
    """A :class:`DataStream` at step 0 (see its docstring for the sampling contract)."""
    return DataStream(dataset, batch_size, seed=seed, rank=rank, world_size=world_size,
                      shuffle=shuffle, drop_last=drop_last)
