"""Tests for launch/prepare_dataset.py with a tiny tokenizer built locally (no download)."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from snip_ds.run.corpus import PREPARE_META_FILE
from snip_ds.run.data import load_dataset_blocks

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "launch" / "prepare_dataset.py"
_spec = importlib.util.spec_from_file_location("prepare_dataset", SCRIPT)
prepare_dataset = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prepare_dataset)

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a small model learns the structure of text",
    "blocks of tokens are grouped for causal language modelling",
    "every document ends with an end of text token",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    words = sorted({w for s in SENTENCES for w in s.split()})
    vocab = {"[UNK]": 0, "[EOS]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]").save_pretrained(path)
    return path


@pytest.fixture()
def inputs(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("\n".join(SENTENCES * 3), encoding="utf-8")
    jl = tmp_path / "b.jsonl"
    jl.write_text("\n".join(json.dumps({"text": s, "id": i}) for i, s in enumerate(SENTENCES * 4)) + "\n")
    return [txt, jl]


def _args(tok, inputs, out, *extra):
    return ["--tokenizer_name_or_path", str(tok), "--input", *map(str, inputs), "--block_size", "8",
            "--output_dir", str(out), *extra]


def _reference_stream(tokenizer_dir, inputs):
    """Independent encoding: word ids of every document, each followed by EOS."""
    tok = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    docs = [inputs[0].read_text()] + [json.loads(line)["text"] for line in inputs[1].read_text().splitlines()]
    stream = []
    for d in docs:
        stream += [tok.convert_tokens_to_ids(w) for w in d.split()] + [tok.eos_token_id]
    return tok, docs, stream


def test_prepare_then_load_round_trip(tokenizer_dir, inputs, tmp_path, capsys):
    out = tmp_path / "prepared"
    assert prepare_dataset.main(_args(tokenizer_dir, inputs, out, "--validation_split", "0.2")) == 0
    assert "train" in capsys.readouterr().out
    meta = json.loads((out / PREPARE_META_FILE).read_text())
    tok, docs, stream = _reference_stream(tokenizer_dir, inputs)
    n_blocks = len(stream) // 8
    assert meta["block_size"] == 8 and meta["vocab_size"] == len(tok) and meta["documents"] == len(docs)
    assert meta["tokens"] == len(stream) and meta["train_blocks"] + meta["validation_blocks"] == n_blocks
    assert meta["validation_blocks"] == round(0.2 * n_blocks)

    train, val, vocab, info = load_dataset_blocks([out], block_size=8, tokenizer=tokenizer_dir)
    assert vocab == len(tok) and (len(train), len(val)) == (meta["train_blocks"], meta["validation_blocks"])
    want = sorted(tuple(stream[i * 8:(i + 1) * 8]) for i in range(n_blocks))
    got = sorted(map(tuple, train.blocks.tolist() + val.blocks.tolist()))
    assert got == want
    words = set(" ".join(SENTENCES).split()) | {"[EOS]"}
    assert set(tok.decode(train[0]["input_ids"].tolist()).split()) <= words
    assert list(out.parent.glob(".prepared.tmp-*")) == []  # the temp dir is gone


def test_loader_refuses_other_block_size(tokenizer_dir, inputs, tmp_path):
    out = tmp_path / "p"
    assert prepare_dataset.main(_args(tokenizer_dir, inputs, out)) == 0
    with pytest.raises(ValueError, match="has block_size 8 but block_size=16 was requested"):
        load_dataset_blocks(out, block_size=16)


def test_existing_output_refused_unless_overwrite(tokenizer_dir, inputs, tmp_path, capsys):
    out = tmp_path / "p"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert prepare_dataset.main(_args(tokenizer_dir, inputs, out)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists; pass --overwrite" in err
    assert (out / "keep.txt").exists()
    assert prepare_dataset.main(_args(tokenizer_dir, inputs, out, "--overwrite")) == 0
    assert not (out / "keep.txt").exists() and (out / PREPARE_META_FILE).is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("case, match", [
    ("missing_input", "nope.txt' does not exist"),
    ("bad_tokenizer", "is not a local directory"),
    ("bad_jsonl", r"bad.jsonl:2: not a JSON object"),
    ("too_small", r"need at least 2"),
    ("bad_split", r"--validation_split must be in \(0, 1\)"),
])
def test_user_errors_exit_2_one_line(tokenizer_dir, inputs, tmp_path, capsys, case, match):
    tok, files, extra = tokenizer_dir, inputs, []
    if case == "missing_input":
        files = [tmp_path / "nope.txt"]
    elif case == "bad_tokenizer":
        tok = tmp_path / "no_tok"
    elif case == "bad_jsonl":
        files = [tmp_path / "bad.jsonl"]
        files[0].write_text('{"text": "a b"}\n{oops\n')
    elif case == "too_small":
        files = [tmp_path / "s.txt"]
        files[0].write_text("the quick brown")
    else:
        extra = ["--validation_split", "1.5"]
    assert prepare_dataset.main(_args(tok, files, tmp_path / "out", *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith("prepare_dataset.py: error: ") and err.count("\n") == 1
    assert re.search(match, err), err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_script_runs_as_subprocess_without_traceback(tokenizer_dir, tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), *_args(tokenizer_dir, [tmp_path / "x.txt"], tmp_path / "o")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "x.txt' does not exist" in proc.stderr
