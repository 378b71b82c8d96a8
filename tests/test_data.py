"""Tests for snip_ds.run.corpus and snip_ds.run.data: byte tokenizer, stdlib corpus, blocks, user text, and the resumable
stream."""

import json

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from snip_ds.run.corpus import BYTE_EOS_ID, ByteTokenizer, split_block_indices, stdlib_corpus
from snip_ds.run.data import BlockDataset, DataStream, load_dataset_blocks, make_loader

SMALL = {"max_bytes": 40_000, "max_validation_bytes": 8_000}  # keep the real-stdlib tests fast


# ------------------------------------------------------------------ ByteTokenizer


@pytest.mark.parametrize("text", ["", "hello", "naïve café", "日本語 😀 \u0301", "a\x00b\n\t\r", "\U0010ffff"])
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=True) == ids + [BYTE_EOS_ID]


def test_byte_tokenizer_eos_and_bad_ids():
    tok = ByteTokenizer()
    assert len(tok) == 257 and tok.eos_token_id == 256
    ids = tok.encode("ab", True) + tok.encode("c")
    assert tok.decode(ids) == "ab<|endoftext|>c"
    assert tok.decode(torch.tensor(ids), skip_special_tokens=True) == "abc"
    with pytest.raises(ValueError, match="0..256"):
        tok.decode([1, 257])


# ------------------------------------------------------------------ stdlib corpus


def _fake_stdlib(root):
    """A tree with files the corpus must include and files it must skip."""
    files = {}
    for i in range(60):
        rel = f"pkg{i % 3}/mod_{i:02d}.py"
        files[rel] = f"# module {i}\nx = {i}\n".encode() * (1 + i % 4)
    files["top.py"] = "print('top')\n".encode()
    skipped = ["site-packages/foo.py", "dist-packages/bar.py", "test/test_x.py", "pkg0/tests/t.py",
               "idlelib/idle_test/t.py", "_sysconfigdata__linux.py", "pkg1/readme.txt", "__pycache__/a.py"]
    for rel, data in list(files.items()) + [(s, b"SKIP = 1\n") for s in skipped]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def _expected_stream(files, rels):
    out = []
    for rel in sorted(rels):
        out += list(files[rel]) + [BYTE_EOS_ID]
    return np.array(out, dtype=np.int32)


def _split_of(corpus, files):
    """``{rel: "train" | "validation"}`` read back from the corpus' two streams (each file's bytes are unique)."""
    by_bytes = {data: rel for rel, data in files.items()}
    where = {}
    for name, stream in (("train", corpus.train), ("validation", corpus.validation)):
        for doc in np.split(stream, np.flatnonzero(stream == BYTE_EOS_ID) + 1):
            if len(doc):
                rel = by_bytes[bytes(doc[:-1].astype(np.uint8))]  # KeyError: a skipped or unknown file
                assert rel not in where, f"{rel} in both splits or twice"
                where[rel] = name
    return where


def test_stdlib_corpus_selects_splits_and_joins_files(tmp_path):
    files = _fake_stdlib(tmp_path)
    corpus = stdlib_corpus(max_bytes=None, max_validation_bytes=None, root=tmp_path)
    where = _split_of(corpus, files)
    assert set(where) == set(files)  # every included file exactly once, no skipped file
    val = [r for r in files if where[r] == "validation"]
    assert 0 < len(val) < len(files) / 4  # both splits, validation a small share (1 in 20 expected)
    # each split is its files joined in path order, each followed by EOS
    np.testing.assert_array_equal(corpus.train, _expected_stream(files, [r for r in files if r not in val]))
    np.testing.assert_array_equal(corpus.validation, _expected_stream(files, val))
    assert corpus.info["stdlib_files"] == len(files)


def test_stdlib_split_is_a_property_of_each_path(tmp_path):
    """A file's split depends on its path alone: removing other files or editing a file's contents (a new
    Python version's stdlib) moves no file from one split to the other."""
    files = _fake_stdlib(tmp_path)
    before = _split_of(stdlib_corpus(None, None, root=tmp_path), files)
    kept = {}
    for i, rel in enumerate(sorted(files)):
        if i % 2 and before[rel] == "train":
            (tmp_path / rel).unlink()
        else:
            kept[rel] = files[rel] + f"# edited {i}\n".encode()
            (tmp_path / rel).write_bytes(kept[rel])
    after = _split_of(stdlib_corpus(None, None, root=tmp_path), kept)
    assert len(after) < len(before) and after == {rel: before[rel] for rel in kept}


def test_stdlib_corpus_cap_is_exact_and_deterministic(tmp_path):
    _fake_stdlib(tmp_path)
    full = stdlib_corpus(None, None, root=tmp_path)
    a = stdlib_corpus(max_bytes=300, max_validation_bytes=50, root=tmp_path)
    b = stdlib_corpus(max_bytes=300, max_validation_bytes=50, root=tmp_path)
    assert len(a.train) == 300 and len(a.validation) == 50
    np.testing.assert_array_equal(a.train, b.train)
    assert a.info["train_files"] < full.info["train_files"]
    # capped train is a sample of files, each complete and in path order, joined with EOS
    docs = [bytes(d) for d in np.split(full.train, np.flatnonzero(full.train == BYTE_EOS_ID) + 1) if len(d)]
    capped_docs = np.split(a.train, np.flatnonzero(a.train == BYTE_EOS_ID) + 1)
    for doc in capped_docs[:-1]:
        assert bytes(doc) in docs


def test_stdlib_corpus_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        stdlib_corpus(root=tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no .py files"):
        stdlib_corpus(root=tmp_path)
    with pytest.raises(ValueError, match="max_bytes"):
        stdlib_corpus(max_bytes=0)


def test_real_stdlib_default_blocks():
    train, val, vocab, info = load_dataset_blocks(block_size=64, **SMALL)
    assert vocab == 257 and info["tokenizer"] == "byte"
    assert len(train) == SMALL["max_bytes"] // 64 and len(val) == SMALL["max_validation_bytes"] // 64
    corpus = stdlib_corpus(**SMALL)
    assert (corpus.train == BYTE_EOS_ID).any()
    np.testing.assert_array_equal(train.blocks.flatten().numpy(), corpus.train[: len(train) * 64])
    item = train[3]
    assert item["input_ids"].dtype == torch.long and item["input_ids"].shape == (64,)
    assert torch.equal(item["labels"], item["input_ids"])
    assert json.loads(json.dumps(info)) == info


# ------------------------------------------------------------------ BlockDataset


def test_block_dataset_drops_tail_and_stacks():
    tokens = np.arange(23, dtype=np.int32)
    ds = BlockDataset.from_tokens(tokens, 5)
    assert len(ds) == 4 and ds.block_size == 5 and ds.num_tokens == 20
    assert ds[2]["input_ids"].tolist() == [10, 11, 12, 13, 14]
    item = ds[1]
    item["labels"][0] = -100  # labels must not alias input_ids
    assert item["input_ids"][0] == 5
    batch = ds.get_batch([3, 0])
    assert batch["input_ids"].tolist() == [[15, 16, 17, 18, 19], [0, 1, 2, 3, 4]]
    with pytest.raises(ValueError, match="2-D integer"):
        BlockDataset(np.zeros((2, 3), dtype=np.float32))


# ------------------------------------------------------------------ user text and JSON lines


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_text_files_tokenize_block_and_split(tmp_path):
    texts = ["first file: héllo\n" * 30, "second file ✓\n" * 40]
    paths = [_write(tmp_path / "a.txt", texts[0]), _write(tmp_path / "b.md", texts[1])]
    train, val, vocab, info = load_dataset_blocks(paths, block_size=16, validation_split=0.25, seed=3)
    stream = []
    for t in texts:
        stream += list(t.encode()) + [BYTE_EOS_ID]
    blocks = np.array(stream[: len(stream) // 16 * 16]).reshape(-1, 16)
    # 30 x 19 + 1 and 40 x 16 + 1 bytes ("é" is 2 bytes, "✓" 3): 1212 tokens, 75 blocks of 16; a quarter of
    # them, 18.75, rounds to 19 validation blocks and leaves 56 for training
    assert len(stream) == 1212 and len(blocks) == 75
    assert len(val) == 19 and len(train) == 56
    # the two splits are the blocks dealt out in order: an interleaving of the two keeps every block once
    t_rows, v_rows = [tuple(r) for r in train.blocks.tolist()], [tuple(r) for r in val.blocks.tolist()]
    rows = [tuple(r) for r in blocks.tolist()]
    reach = {(0, 0)}  # (train rows, validation rows) used after each block, every way that works
    for row in rows:
        reach = ({(i + 1, j) for i, j in reach if i < len(t_rows) and t_rows[i] == row}
                 | {(i, j + 1) for i, j in reach if j < len(v_rows) and v_rows[j] == row})
    assert (len(t_rows), len(v_rows)) in reach
    assert vocab == 257 and info["documents"] == 2 and info["tokens"] == len(stream)
    other_train, _, _, _ = load_dataset_blocks(paths, block_size=16, validation_split=0.25, seed=4)
    assert not torch.equal(other_train.blocks, train.blocks)


def test_split_block_indices_counts_and_partition():
    # max(1, round(n * split)) validation blocks, at most n - 1: counts worked out by hand
    for n, split, n_val in ((2, 0.01, 1), (4, 0.5, 2), (10, 0.99, 9), (75, 0.25, 19), (1000, 0.05, 50)):
        t_idx, v_idx = split_block_indices(n, split, seed=0)
        assert len(v_idx) == n_val, (n, split)
        assert sorted(t_idx.tolist() + v_idx.tolist()) == list(range(n))  # a partition of the blocks
        assert t_idx.tolist() == sorted(t_idx.tolist()) and v_idx.tolist() == sorted(v_idx.tolist())
    a, b, c = (split_block_indices(1000, 0.05, seed)[1] for seed in (3, 3, 4))
    assert np.array_equal(a, b) and not np.array_equal(a, c)  # seeded
    for n, split in ((1, 0.5), (10, 0.0), (10, 1.0)):
        with pytest.raises(ValueError):
            split_block_indices(n, split, seed=0)


def test_jsonl_records_are_documents(tmp_path):
    recs = [{"text": f"record {i} " * 5, "meta": i} for i in range(20)]
    path = _write(tmp_path / "d.jsonl", "\n".join(json.dumps(r) for r in recs[:10]) + "\n\n"
                  + "\n".join(json.dumps(r) for r in recs[10:]))
    train, val, _, info = load_dataset_blocks(str(path), block_size=32)
    stream = []
    for r in recs:
        stream += list(r["text"].encode()) + [BYTE_EOS_ID]
    assert info["documents"] == 20
    got = sorted(map(tuple, torch.cat([train.blocks, val.blocks]).tolist()))
    want = sorted(map(tuple, np.array(stream[: len(stream) // 32 * 32]).reshape(-1, 32).tolist()))
    assert got == want


@pytest.mark.parametrize("line, match", [
    ("{not json", r"d.jsonl:2: not a JSON object"),
    ('{"body": "x"}', r"d.jsonl:2: expected an object with a string field 'text', got \['body'\]"),
    ("[1, 2]", r"d.jsonl:2: expected an object .* got list"),
])
def test_jsonl_bad_line_named(tmp_path, line, match):
    path = _write(tmp_path / "d.jsonl", json.dumps({"text": "ok " * 100}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=match):
        load_dataset_blocks(path, block_size=8)


def test_user_data_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        load_dataset_blocks(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match=r"unsupported file type '.parquet'"):
        load_dataset_blocks(_write(tmp_path / "x.parquet", "abc"))
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ValueError, match="bin.txt' is not UTF-8"):
        load_dataset_blocks(tmp_path / "bin.txt")
    with pytest.raises(ValueError, match="empty.txt is empty"):
        load_dataset_blocks(_write(tmp_path / "empty.txt", ""))
    with pytest.raises(ValueError, match=r"small.txt: 11 tokens make 1 block\(s\) of block_size 8; need at least 2"):
        load_dataset_blocks(_write(tmp_path / "small.txt", "ten bytes!"), block_size=8)
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="not one written by launch/prepare_dataset.py"):
        load_dataset_blocks(tmp_path / "d")
    with pytest.raises(ValueError, match="stdlib:.* train split: 1000 tokens are too few for one block of block_size 4096"):
        load_dataset_blocks(block_size=4096, max_bytes=1000, max_validation_bytes=1000)


# ------------------------------------------------------------------ DataStream


def _reference_batches(ds, batch_size, world_size, rank, seed, shuffle, drop_last, epochs):
    """torch's DistributedSampler + DataLoader, the behaviour DataStream must reproduce."""
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    loader = DataLoader(ds, batch_size=batch_size, sampler=sampler, drop_last=drop_last)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out += [b["input_ids"] for b in loader]
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("shuffle, drop_last", [(True, True), (True, False), (False, True), (False, False)])
def test_stream_matches_distributed_sampler(world_size, shuffle, drop_last):
    ds = BlockDataset(torch.arange(23 * 2).reshape(23, 2))
    for rank in range(world_size):
        ref = _reference_batches(ds, 3, world_size, rank, 7, shuffle, drop_last, epochs=3)
        stream = make_loader(ds, 3, seed=7, rank=rank, world_size=world_size, shuffle=shuffle,
                             drop_last=drop_last)
        assert stream.steps_per_epoch * 3 == len(ref)
        for step, want in enumerate(ref):
            assert stream.epoch == step // stream.steps_per_epoch
            assert torch.equal(stream.next_batch()["input_ids"], want), (rank, step)


def test_global_batch_same_for_one_rank_2b_and_two_ranks_b():
    ds = BlockDataset(torch.arange(50).reshape(50, 1))
    one = make_loader(ds, 8, seed=1)
    two = [make_loader(ds, 4, seed=1, rank=r, world_size=2) for r in range(2)]
    assert one.steps_per_epoch == two[0].steps_per_epoch == 6
    for _ in range(3 * one.steps_per_epoch):  # across epoch boundaries (reshuffles)
        single = one.next_batch()["input_ids"].flatten()
        r0, r1 = (s.next_batch()["input_ids"].flatten() for s in two)
        assert torch.equal(torch.stack([r0, r1], 1).flatten(), single)  # rank r holds positions r, r+2, ...


def test_stream_reshuffles_each_epoch_and_covers_dataset():
    ds = BlockDataset(torch.arange(16).reshape(16, 1))
    stream = make_loader(ds, 4, seed=0)
    epochs = [torch.cat([stream.next_batch()["input_ids"].flatten() for _ in range(4)]) for _ in range(2)]
    assert sorted(epochs[0].tolist()) == list(range(16)) == sorted(epochs[1].tolist())
    assert not torch.equal(epochs[0], epochs[1])


def test_stream_resume_exact_via_json_state():
    ds = BlockDataset(torch.arange(40).reshape(20, 2))
    full = make_loader(ds, 3, seed=5)
    batches = [full.next_batch()["input_ids"] for _ in range(15)]  # spans 2+ epochs of 6 steps
    first = make_loader(ds, 3, seed=5)
    for _ in range(8):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))
    resumed = make_loader(ds, 3, seed=5)
    resumed.load_state_dict(state)
    assert resumed.step == 8 and resumed.epoch == 1
    for want in batches[8:]:
        assert torch.equal(resumed.next_batch()["input_ids"], want)


def test_stream_resume_on_other_world_size_same_global_batch():
    ds = BlockDataset(torch.arange(30).reshape(30, 1))
    one = make_loader(ds, 4, seed=2)
    for _ in range(5):
        one.next_batch()
    state = one.state_dict()
    two = [make_loader(ds, 2, seed=2, rank=r, world_size=2) for r in range(2)]
    for s in two:
        s.load_state_dict(state)
    for _ in range(6):
        want = one.next_batch()["input_ids"].flatten()
        got = torch.stack([s.next_batch()["input_ids"].flatten() for s in two], 1).flatten()
        assert torch.equal(got, want)


def _train_steps(streams, accumulation: int, steps: int) -> list:
    """Each optimizer step's samples (as a sorted list): ``accumulation`` micro-batches of every stream."""
    return [sorted(i for _ in range(accumulation) for s in streams for i in s.next_batch()["input_ids"].flatten()
                   .tolist()) for _ in range(steps)]


@pytest.mark.parametrize("n", [48, 49, 52])
def test_stream_resume_on_fewer_ranks_with_accumulation_reads_the_same_steps(n):
    """2 ranks x batch 2 x accumulation 1, saved after 5 optimizer steps, resumed on 1 rank x batch 2 x
    accumulation 2 (the same 4 samples per optimizer step; the stream's G goes from 4 to 2), then back on 2
    ranks: every later optimizer step reads the samples the uninterrupted 2-rank run reads, across epoch
    boundaries (epochs of 48, 48 and 52 samples at either G)."""
    ds = BlockDataset(torch.arange(n).reshape(n, 1))
    want = _train_steps([make_loader(ds, 2, seed=3, rank=r, world_size=2) for r in range(2)], 1, 50)
    saved = [make_loader(ds, 2, seed=3, rank=r, world_size=2) for r in range(2)]
    _train_steps(saved, 1, 5)
    one = make_loader(ds, 2, seed=3)
    one.load_state_dict(json.loads(json.dumps(saved[0].state_dict())))
    assert one.step == 10
    assert _train_steps([one], 2, 35) == want[5:40]
    back = [make_loader(ds, 2, seed=3, rank=r, world_size=2) for r in range(2)]
    for s in back:
        s.load_state_dict(one.state_dict())
    assert _train_steps(back, 1, 10) == want[40:]


def test_stream_resume_at_another_global_batch_refuses_an_order_it_would_not_continue():
    """n=50: epochs of 48 samples at G=4, 50 at G=2; the exact stream refuses, naming the fields; a private
    statistics stream (exact=False) goes on from the next whole batch instead."""
    ds = BlockDataset(torch.arange(50).reshape(50, 1))
    saved = make_loader(ds, 2, seed=3, rank=0, world_size=2)
    saved.skip_to(5)
    with pytest.raises(ValueError, match=r"global_batch_size \(batch size x ranks\) is 4 in the checkpoint and 2 "
                                         r"now.*epochs of 48 vs 50 samples"):
        make_loader(ds, 2, seed=3).load_state_dict(saved.state_dict())
    loose = make_loader(ds, 2, seed=3)
    loose.load_state_dict(saved.state_dict(), exact=False)
    assert loose.step == 10
    odd = make_loader(ds, 1, seed=3)  # G 1 -> 4: position 3 rounds up to 4 (step 1), never re-reading samples
    odd.skip_to(3)
    up = make_loader(ds, 2, seed=3, rank=0, world_size=2)
    up.load_state_dict(odd.state_dict(), exact=False)
    assert up.step == 1
    with pytest.raises(ValueError, match="at step 3 .3 samples into epoch 0"):
        make_loader(ds, 2, seed=3, rank=0, world_size=2).load_state_dict(odd.state_dict())


def test_stream_state_mismatch_and_bad_args():
    ds = BlockDataset(torch.arange(10).reshape(10, 1))
    state = make_loader(ds, 2, seed=0).state_dict()
    with pytest.raises(ValueError, match="seed: checkpoint 0 vs now 1"):
        make_loader(ds, 2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"global_batch_size \(batch size x ranks\) is 2 in the checkpoint and 4 now"
                       r".*\(epochs of 10 vs 8 samples\); resume with global_batch_size 2"):
        make_loader(ds, 4).load_state_dict(state)
    with pytest.raises(ValueError, match="lacks"):
        make_loader(ds, 2).load_state_dict({"step": 3})
    with pytest.raises(ValueError, match="world_size: checkpoint 1 vs now 2"):
        make_loader(ds, 1, world_size=2, drop_last=False).load_state_dict(
            make_loader(ds, 2, drop_last=False).state_dict())
    with pytest.raises(ValueError, match="fewer than one global batch of 12"):
        make_loader(ds, 6, world_size=2)
    with pytest.raises(ValueError, match="rank=2, world_size=2"):
        DataStream(ds, 1, rank=2, world_size=2)
