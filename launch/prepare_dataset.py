"""Tokenize text / JSON-lines files into fixed-length blocks for training.

Usage:
    python launch/prepare_dataset.py --tokenizer_name_or_path /path/to/local/tokenizer \\
        --input corpus.jsonl more_text.txt --block_size 2048 --output_dir data/my_corpus \\
        [--validation_split 0.05] [--seed 0] [--text_field text] [--overwrite]

Each text file, and each JSON-lines record, is one document. Documents are tokenized without special
tokens, each followed by the tokenizer's EOS, concatenated and cut into non-overlapping ``block_size``
blocks (the tail is dropped), as the SNIP reference's SlimPajama / StarCoderData prepare scripts group
texts. A seeded permutation sends ``validation_split`` of the blocks to validation.

Output: a ``datasets.DatasetDict`` ("train", "validation"; column ``input_ids``) saved with
``save_to_disk``, plus ``snip_prepare.json`` (block size, tokenizer path, vocab size, counts). It is
written to a temporary sibling directory and renamed into place, so a crash leaves no half-written
output. Train on it with ``--dataset <output_dir>``. All tokens are held in memory as int32 while
preparing (4 bytes per token).

User errors print one line to stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from snip_ds.run.corpus import (  # noqa: E402
    PREPARE_META_FILE,
    group_blocks,
    load_tokenizer,
    read_documents,
    split_block_indices,
    tokenize_documents,
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer_name_or_path", required=True, help="local Hugging Face tokenizer directory")
    p.add_argument("--input", required=True, nargs="+", help="text or JSON-lines files")
    p.add_argument("--block_size", required=True, type=int, help="tokens per block")
    p.add_argument("--output_dir", required=True, help="directory to create")
    p.add_argument("--validation_split", type=float, default=0.05, help="fraction of blocks for validation")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/validation split")
    p.add_argument("--text_field", default="text", help="JSON-lines field holding the text")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output_dir")
    return p.parse_args(argv)


def prepare(args: argparse.Namespace) -> dict:
    """Tokenize, block, split and save; returns the metadata written to ``snip_prepare.json``."""
    import datasets  # heavy import, after argument parsing

    if args.block_size < 1:
        raise ValueError(f"--block_size must be >= 1, got {args.block_size}")
    if not 0.0 < args.validation_split < 1.0:
        raise ValueError(f"--validation_split must be in (0, 1), got {args.validation_split}")
    out = Path(args.output_dir)
    if out.exists() and not args.overwrite:
        raise FileExistsError(f"--output_dir {str(out)!r} already exists; pass --overwrite to replace it")
    tok_path = Path(args.tokenizer_name_or_path)
    if not tok_path.is_dir():
        raise FileNotFoundError(f"--tokenizer_name_or_path {str(tok_path)!r} is not a local directory")
    tokenizer = load_tokenizer(tok_path)

    tokens, n_docs = tokenize_documents(read_documents(args.input, args.text_field), tokenizer)
    if n_docs == 0 or len(tokens) == n_docs:
        raise ValueError(f"--input {' '.join(args.input)} holds no text")
    blocks = group_blocks(tokens, args.block_size)
    if len(blocks) < 2:
        raise ValueError(f"--input has {len(tokens)} tokens: {len(blocks)} block(s) of --block_size "
                         f"{args.block_size}; need at least 2 (one train, one validation)")
    train_idx, val_idx = split_block_indices(len(blocks), args.validation_split, args.seed)
    features = datasets.Features(
        {"input_ids": datasets.Sequence(datasets.Value("int32"), length=args.block_size)})
    dd = datasets.DatasetDict({
        split: datasets.Dataset.from_dict({"input_ids": blocks[idx]}, features=features)
        for split, idx in (("train", train_idx), ("validation", val_idx))
    })
    meta = {
        "block_size": args.block_size,
        "tokenizer": str(tok_path.resolve()),
        "vocab_size": len(tokenizer),
        "eos_token_id": int(tokenizer.eos_token_id),
        "inputs": [str(Path(p).resolve()) for p in args.input],
        "text_field": args.text_field,
        "documents": n_docs,
        "tokens": int(len(tokens)),
        "dropped_tail_tokens": int(len(tokens) - blocks.size),
        "validation_split": args.validation_split,
        "seed": args.seed,
        "train_blocks": int(len(train_idx)),
        "validation_blocks": int(len(val_idx)),
    }
    _save_atomically(dd, meta, out)
    return meta


def _save_atomically(dd, meta: dict, out: Path) -> None:
    """Write into a temp sibling, then rename; an old ``out`` is moved aside and removed only on success."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        dd.save_to_disk(str(tmp / "data"))
        (tmp / "data" / PREPARE_META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        if out.exists():  # --overwrite: move the old output aside; the finally removes it
            os.rename(out, tmp / "old")
        os.rename(tmp / "data", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status."""
    args = parse_args(argv)
    try:
        meta = prepare(args)
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"prepare_dataset.py: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.output_dir}: {meta['train_blocks']} train + {meta['validation_blocks']} validation "
          f"blocks of {meta['block_size']} tokens from {meta['documents']} documents "
          f"({meta['tokens']} tokens, vocab {meta['vocab_size']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
