"""Checkpoint integrity: sizes and sha256 of every file recorded in ``snip_meta.json`` and verified before a
resume; a damaged checkpoint stops every rank with the same ``error:`` line (exit code 2, no traceback);
``--resume_from_checkpoint`` accepts a run's output directory.

The unit tests check the pieces in one process; the slow ones damage copies of a real 2-rank ZeRO-3
checkpoint and start the two ranks as separate processes (the environment a launcher gives them), so that each
rank's exit code and output are seen on their own.
"""
import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import pytest

from train_utils import copy_of_run, launch, ranks_directly

from snip_ds.engine.checkpoint_layout import META_FILE, CheckpointError, read_meta, resolve
from snip_ds.engine.checkpoint_verify import file_digest, record_files, verify_files


# ---------------------------------------------------------------------------------------------- unit tests
def _tag_dir(tmp_path: Path) -> Path:
    tag = tmp_path / "step_1"
    tag.mkdir()
    rng = random.Random(0)
    for name, size in (("a.pt", 3 * (1 << 20) + 17), ("b.safetensors", 1000), ("c.pt", 0)):
        (tag / name).write_bytes(bytes(rng.getrandbits(8) for _ in range(size)))
    (tag / "x.tmp").write_bytes(b"left over")  # temporaries are not part of a checkpoint
    return tag


def test_a_failed_save_removes_only_what_it_created(tmp_path):
    """A new step directory goes whole; in one that existed before the save (a re-save over an interrupted
    one) only the entries the save added go, and the checkpoint next to it is untouched."""
    from snip_ds.engine.checkpoint import _remove_partial

    previous = _tag_dir(tmp_path)
    kept = {p.name: p.read_bytes() for p in previous.iterdir()}
    new = tmp_path / "step_2"
    (new / "sub").mkdir(parents=True)
    (new / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"partial")
    (new / "sub" / "x").write_bytes(b"x")
    _remove_partial(new, None)
    assert not new.exists()
    _remove_partial(new, None)  # another rank removed it first: nothing to do, no error

    again = tmp_path / "step_3"
    again.mkdir()
    (again / "old_shard.pt").write_bytes(b"from the interrupted save")
    before = {p.name for p in again.iterdir()}
    (again / "new_shard.pt").write_bytes(b"this save")
    (again / "zero_to_fp32.d").mkdir()
    (again / "zero_to_fp32.d" / "f").write_bytes(b"this save")
    _remove_partial(again, before)
    assert sorted(p.name for p in again.iterdir()) == ["old_shard.pt"]
    assert {p.name: p.read_bytes() for p in previous.iterdir()} == kept


def test_file_digest_streams_a_file_larger_than_its_chunk(tmp_path):
    tag = _tag_dir(tmp_path)
    data = (tag / "a.pt").read_bytes()
    assert file_digest(tag / "a.pt") == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_record_files_covers_every_file_but_the_metadata_and_temporaries(tmp_path):
    tag = _tag_dir(tmp_path)
    (tag / META_FILE).write_text("{}")
    files = record_files(tag)  # one process: torch.distributed is not initialised
    assert sorted(files) == ["a.pt", "b.safetensors", "c.pt"]
    for name, rec in files.items():
        data = (tag / name).read_bytes()
        assert rec == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_verify_files_names_the_file_and_what_is_wrong(tmp_path):
    tag = _tag_dir(tmp_path)
    files = record_files(tag)
    verify_files(tag, files)  # intact
    data = bytearray((tag / "b.safetensors").read_bytes())
    data[10] ^= 0x01
    (tag / "b.safetensors").write_bytes(bytes(data))
    # the hashing is split: of the sorted names a.pt, b.safetensors, c.pt, rank 1 of 2 hashes b, rank 0 a and c
    verify_files(tag, files, rank=0, world=2)
    with pytest.raises(CheckpointError, match=r"b\.safetensors: sha256 differs from the one snip_meta\.json"):
        verify_files(tag, files, rank=1, world=2)
    (tag / "a.pt").write_bytes((tag / "a.pt").read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"a\.pt: 1000 bytes, but snip_meta\.json records 3145745: "
                                              r"the file is truncated"):
        verify_files(tag, files, rank=1, world=2)  # sizes are checked by every rank
    (tag / "c.pt").unlink()
    (tag / "a.pt").unlink()
    with pytest.raises(CheckpointError, match=r"a\.pt: missing; snip_meta\.json records it \(3145745 bytes\)"):
        verify_files(tag, files)  # the first in name order


def _meta(tmp_path: Path, **change) -> Path:
    tag = tmp_path / "step_1"
    tag.mkdir(exist_ok=True)
    meta = {"format": "snip_ds.checkpoint/1", "tag": "step_1", "world_size": 2, "step": 1,
            "model_fingerprint": "f" * 64, "plan": None, "files": {"a.pt": {"size": 3, "sha256": "0" * 64}}}
    meta.update(change)
    (tag / META_FILE).write_text(json.dumps(meta))
    return tag


@pytest.mark.parametrize("change, words", [
    ({"world_size": "2"}, "field 'world_size' must be a positive integer, got \"2\""),
    ({"world_size": 0}, "field 'world_size' must be a positive integer"),
    ({"step": -1}, "field 'step' must be a non-negative integer"),
    ({"tag": None}, "field 'tag' must be a string"),
    ({"model_fingerprint": 7}, "field 'model_fingerprint' must be a string"),
    ({"plan": ["fp8"]}, "field 'plan' must be an object"),
    ({"files": []}, "field 'files' must be an object"),
    ({"files": {"a.pt": {"size": 3}}}, "field 'files' entry \"a.pt\""),
    ({"files": {"a.pt": {"size": 3, "sha256": "g" * 64}}}, "field 'files' entry \"a.pt\""),
    ({"files": {"../a.pt": {"size": 3, "sha256": "0" * 64}}}, "field 'files' entry \"../a.pt\""),
])
def test_read_meta_names_a_field_of_the_wrong_type(tmp_path, change, words):
    tag = _meta(tmp_path, **change)
    with pytest.raises(CheckpointError) as info:
        read_meta(tag)
    assert str(info.value).startswith(f"{tag / META_FILE}: ") and words in str(info.value)


def test_validate_names_the_fields_a_resume_needs(tmp_path):
    from snip_ds.engine.checkpoint_verify import validate

    tag = _meta(tmp_path)
    meta = json.loads((tag / META_FILE).read_text())
    del meta["tag"], meta["model_fingerprint"]
    (tag / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"snip_meta\.json: field\(s\) 'tag', 'model_fingerprint' missing"):
        validate(tag, "f" * 64, 2)


def test_read_meta_accepts_a_checkpoint_without_checksums(tmp_path):
    tag = _meta(tmp_path)
    meta = json.loads((tag / META_FILE).read_text())
    del meta["files"]
    (tag / META_FILE).write_text(json.dumps(meta))
    assert "files" not in read_meta(tag)


def test_resolve_a_run_directory_to_its_latest_checkpoint(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="checkpoints: no 'latest' file: the run has saved no complete"):
        resolve(run)
    for tag in ("step_2", "step_1"):  # _meta writes step_1
        _meta(run / "checkpoints")
        (run / "checkpoints" / "step_1").rename(run / "checkpoints" / tag)
    (run / "checkpoints" / "latest").write_text("step_1")
    assert resolve(run) == run / "checkpoints" / "step_1"
    assert resolve(run / "checkpoints") == run / "checkpoints" / "step_1"
    assert resolve(run / "checkpoints" / "step_2") == run / "checkpoints" / "step_2"


# --------------------------------------------------------------------------- real 2-rank runs (slow)
@pytest.fixture(scope="module")
def run(tmp_path_factory, zero3_fp8_run):
    """This module's copy of the shared finished 2-rank ZeRO-3 fp8 run (conftest's ``zero3_fp8_run``):
    ``out/checkpoints`` holds step_1, step_2 and latest."""
    return copy_of_run(zero3_fp8_run, tmp_path_factory.mktemp("integrity"))


def _damaged(run, name: str, damage) -> Path:
    """A copy of the run's checkpoints with ``damage(step_1 directory)`` applied; returns its step_1."""
    tag = run["tmp"] / f"damaged_{name}" / "step_1"
    shutil.copytree(run["out"] / "checkpoints" / "step_1", tag)
    damage(tag)
    return tag


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _edit_meta(tag: Path, change) -> None:
    meta = json.loads((tag / META_FILE).read_text())
    change(meta)
    (tag / META_FILE).write_text(json.dumps(meta))


RANK1_OPTIM = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
RANK1_MODEL = "zero_pp_rank_1_mp_rank_00_model_states.pt"  # 6th of the sorted files: hashed by rank 1 alone

# name -> (how the step_1 copy is damaged, extra argv, substrings of the error line after the file's path)
DAMAGE = {
    "shard_truncated": (lambda t: _truncate(t / RANK1_OPTIM), [],
                        [RANK1_OPTIM + ":", "bytes, but snip_meta.json records", "the file is truncated"]),
    "shard_missing": (lambda t: (t / "zero_pp_rank_0_mp_rank_00_model_states.pt").unlink(), [],
                      ["zero_pp_rank_0_mp_rank_00_model_states.pt: missing; snip_meta.json records it"]),
    "rank_file_missing": (lambda t: (t / "snip_rng_rank1.safetensors").unlink(), [],
                          ["snip_rng_rank1.safetensors: missing; the checkpoint is incomplete"]),
    "checksum_differs": (lambda t: _flip_byte(t / RANK1_MODEL), [],
                         [RANK1_MODEL + ": sha256 differs from the one snip_meta.json records"]),
    "meta_not_json": (lambda t: (t / META_FILE).write_text('{"format": "snip_ds.checkpoint/1", "ta'), [],
                      ["snip_meta.json: unreadable"]),
    "meta_wrong_field": (lambda t: _edit_meta(t, lambda m: m.update(world_size="two")), [],
                         ["snip_meta.json: field 'world_size' must be a positive integer"]),
    "meta_other_world_size": (lambda t: _edit_meta(t, lambda m: m.update(world_size=4)), [],
                              ["snip_meta.json: world_size is 4, but this run has 2 ranks"]),
    "other_plan": (lambda t: None, ["--plan", "fp4"],
                   ["snip_state.json: the checkpoint was trained on another plan (snip.plan 'fp8'",
                    "this run's snip.plan 'fp4'"]),
}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_checkpoint_stops_every_rank_with_the_same_error(run, case):
    damage, extra, expected = DAMAGE[case]
    tag = _damaged(run, case, damage)
    if case == "checksum_differs":  # the file is hashed by rank 1 alone: rank 0 learns of it collectively
        names = sorted(json.loads((run["out"] / "checkpoints" / "step_1" / META_FILE).read_text())["files"])
        assert names.index(RANK1_MODEL) % 2 == 1
    out_dir = run["tmp"] / f"out_{case}"
    results = ranks_directly(["--deepspeed", str(run["cfg"]), "--resume_from_checkpoint", str(tag),
                               "--output_dir", str(out_dir), *extra])
    lines = []
    for rank, (code, out, err) in enumerate(results):
        assert code == 2, (rank, out[-2000:], err[-3000:])
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, (rank, err[-3000:])
        assert "Traceback" not in out + err, (rank, err[-3000:])
        lines.append(errors[0])
    assert lines[0] == lines[1]
    assert lines[0].startswith(f"error: {tag}/")
    for text in expected:
        assert text in lines[0], (text, lines[0])
    assert not out_dir.exists()  # stopped before anything was written


@pytest.mark.slow
@pytest.mark.distributed
def test_truncated_shard_through_the_launcher(run):
    """The launcher exits 2; both ranks' error lines reach its stderr whole, and no traceback."""
    tag = _damaged(run, "launcher", lambda t: _truncate(t / RANK1_OPTIM))
    proc = launch(["--deepspeed", str(run["cfg"]), "--resume_from_checkpoint", str(tag),
                   "--output_dir", str(run["tmp"] / "out_launcher")], num_ranks=2)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and errors[0] == errors[1], proc.stderr[-3000:]
    assert f"{tag / RANK1_OPTIM}: " in errors[0] and "truncated" in errors[0]
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_from_a_run_directory_takes_its_latest_checkpoint_also_without_checksums(run):
    """A run directory (a copy of the run's, whose latest checkpoint was written before checksums were
    recorded) resumes from checkpoints/latest, saying once that its files are not verified."""
    copy = run["tmp"] / "old_run"
    shutil.copytree(run["out"] / "checkpoints", copy / "checkpoints")
    _edit_meta(copy / "checkpoints" / "step_2", lambda m: m.pop("files"))
    proc = launch(["--deepspeed", str(run["cfg"]), "--resume_from_checkpoint", str(copy), "--max_steps", "3",
                   "--output_dir", str(run["tmp"] / "out_resumed")], num_ranks=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"resumed from {copy} at step 2" in proc.stdout
    assert proc.stdout.count("records no checksums") == 1
    resumed = run["tmp"] / "out_resumed" / "checkpoints"
    assert (resumed / "latest").read_text() == "step_3"
    assert "files" in json.loads((resumed / "step_3" / META_FILE).read_text())
