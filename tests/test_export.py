"""``snip-ds export``: a trained run's checkpoint becomes a Hugging Face model that reproduces the run's
validation loss; bad checkpoints and output directories are refused with one line and nothing written."""
import json
import os
import shutil

import pytest
import torch

from snip_ds.cli import main
from snip_ds.run.corpus import BYTE_EOS_ID, ByteTokenizer


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("snip-ds: error:")]
    assert len(lines) == 1, err
    return lines[0]


def _leftovers(parent):
    """Temporary directories an export left beside its output."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".") and p.suffix in (".tmp", ".old"))


# --------------------------------------------------------------------------------------------------------
# the byte-level tokenizer, as a Hugging Face tokenizer
# --------------------------------------------------------------------------------------------------------
def _texts():
    """Strings whose UTF-8 encodings use every byte value valid UTF-8 can hold (all but C0, C1, F5..FF)."""
    one_and_two = "".join(chr(c) for c in range(0x800))  # bytes 00..7F, C2..DF, 80..BF
    three = "".join(chr(c) for c in (0x800, *range(0x1000, 0x10000, 0x1000)))  # E0..EF
    four = "".join(chr(c) for c in (0x10000, 0x40000, 0x80000, 0xC0000, 0x100000, 0x10FFFF))  # F0..F4
    return [one_and_two, three + "\uE000\uFFFD", four, "def f(x):\n\treturn x  # héllo 日本 🎉\n", "", " ",
            "a<|endoftext|>b", "  leading and trailing  "]


def test_byte_tokenizer_encodes_and_decodes_like_the_byte_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from snip_ds.export.config import byte_tokenizer

    byte_tokenizer().save_pretrained(str(tmp_path))
    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)  # what a user of the export loads
    ref = ByteTokenizer()
    covered = set()
    for text in _texts():
        ids = ref.encode(text)
        covered.update(ids)
        assert hf(text, add_special_tokens=False)["input_ids"] == ids, text[:40]
        assert hf.encode(text, add_special_tokens=False) == ids
        assert hf.decode(ids) == text
    assert covered == set(range(256)) - {0xC0, 0xC1, *range(0xF5, 0x100)}
    assert hf.eos_token_id == BYTE_EOS_ID and hf.eos_token == ref.eos_text and len(hf) == len(ref)
    # Every id, also bytes no valid text holds and broken sequences around EOS: the same text (U+FFFD).
    cut = [0xE6, 0x97, BYTE_EOS_ID, 0xA5, 0x41]  # U+65E5 cut in two by an EOS
    for ids in (list(range(BYTE_EOS_ID + 1)), cut, [0xFF, 0xC0, 0x80, 0x41], [0x41, BYTE_EOS_ID, 0xC3, 0xA9]):
        assert hf.decode(ids) == ref.decode(ids)
    for ids in (list(range(BYTE_EOS_ID + 1)), [0xFF, 0xC0, 0x80, 0x41], [0x41, BYTE_EOS_ID, 0xC3, 0xA9]):
        assert hf.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    # The one documented difference: skipping EOS, the Hugging Face decoder joins the bytes around it.
    assert ref.decode(cut, skip_special_tokens=True) == "\ufffd\ufffdA"
    assert hf.decode(cut, skip_special_tokens=True) == "\u65e5A"


def test_tokenizer_of_the_run_is_copied_or_reported_missing(tmp_path):
    from transformers import AutoTokenizer

    from snip_ds.export.config import byte_tokenizer, tokenizer_source, write_tokenizer

    user_tok = tmp_path / "user_tok"  # a local Hugging Face tokenizer a run trained with
    byte_tokenizer().save_pretrained(str(user_tok))
    out = tmp_path / "out"
    out.mkdir()
    warnings = []
    record = write_tokenizer({"tokenizer": str(user_tok)}, out, warnings.append)
    assert record == {"kind": "huggingface", "source": str(user_tok), "exported": True} and not warnings
    assert AutoTokenizer.from_pretrained(str(out)).encode("ab", add_special_tokens=False) == [97, 98]
    record = write_tokenizer({"tokenizer": str(tmp_path / "gone")}, tmp_path / "out2", warnings.append)
    assert not record["exported"] and len(warnings) == 1 and str(tmp_path / "gone") in warnings[0]
    # Checkpoints that predate the recorded tokenizer: read from the settings.
    assert tokenizer_source({"settings": {"train": {"dataset": None}}})[0] == "byte"
    assert tokenizer_source({"settings": {"train": {"tokenizer_name_or_path": "tok"}}})[0] == "tok"
    assert tokenizer_source({"tokenizer": "unknown"})[0] is None
    # a checkpoint of the user's own loop (snip_ds.initialize): snip_ds never saw its tokenizer
    assert tokenizer_source({"step": 3})[0] is None and "your own loop" in tokenizer_source({"step": 3})[1]


def test_a_checkpoint_without_the_full_config_exports_its_architecture_with_a_warning(tmp_path):
    from snip_ds.export.config import hf_config

    arch = {"model_type": "llama", "vocab_size": 264, "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-6}
    warnings = []
    config = hf_config({"model_architecture": arch}, tmp_path / "snip_meta.json", warnings.append)
    assert type(config).__name__ == "LlamaConfig" and len(warnings) == 1 and "snip_meta.json" in warnings[0]
    assert {k: getattr(config, k) for k in arch if k != "model_type"} == {k: v for k, v in arch.items()
                                                                           if k != "model_type"}
    with pytest.raises(ValueError, match="model_config.model_type 'nope'"):
        hf_config({"model_config": {"model_type": "nope"}}, tmp_path / "snip_meta.json", warnings.append)
    with pytest.raises(ValueError, match="neither model_config nor model_architecture"):
        hf_config({}, tmp_path / "snip_meta.json", warnings.append)


# --------------------------------------------------------------------------------------------------------
# errors found before anything is read (no training run needed)
# --------------------------------------------------------------------------------------------------------
def _fake_checkpoint(tmp_path):
    """A tag directory that resolve() accepts: snip_meta.json, nothing else."""
    tag = tmp_path / "checkpoints" / "step_2"
    tag.mkdir(parents=True)
    (tag / "snip_meta.json").write_text(json.dumps({"format": "snip_ds.checkpoint/1", "world_size": 1,
                                                    "step": 2}))
    return tag


def test_missing_and_incomplete_checkpoints_exit_2(tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "nope"), str(out)]) == 2
    assert f"{tmp_path / 'nope'}: checkpoint path does not exist" in _error_line(capsys)
    interrupted = tmp_path / "checkpoints" / "step_4"  # DeepSpeed's files, but no snip_meta.json
    interrupted.mkdir(parents=True)
    (interrupted / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert main(["export", str(interrupted), str(out)]) == 2
    assert "snip_meta.json" in _error_line(capsys)
    (tmp_path / "checkpoints" / "latest").write_text("step_4")
    assert main(["export", str(tmp_path / "checkpoints"), str(out)]) == 2
    line = _error_line(capsys)
    assert "latest" in line and "not a complete snip_ds checkpoint" in line
    assert not out.exists() and _leftovers(tmp_path) == []


def test_output_directory_errors_exit_2_and_touch_nothing(tmp_path, capsys):
    tag = _fake_checkpoint(tmp_path)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["export", str(tag), str(out)]) == 2
    assert f"{out}: exists and is not empty; pass --force" in _error_line(capsys)
    assert main(["export", str(tag), str(out), "--force"]) == 2  # --force replaces only a previous export
    assert "not a previous export" in _error_line(capsys)
    assert (out / "notes.txt").read_text() == "mine"
    for holder in (tag, tag.parent, tmp_path):  # would delete the checkpoint itself
        assert main(["export", str(tag), str(holder), "--force"]) == 2
        assert "holds the checkpoint being exported" in _error_line(capsys)
    (tmp_path / "file").write_text("x")
    assert main(["export", str(tag), str(tmp_path / "file")]) == 2
    assert "is not a directory" in _error_line(capsys)
    with pytest.raises(SystemExit) as exit_:  # argparse's usage error
        main(["export", str(tag), str(tmp_path / "new"), "--dtype", "fp8"])
    assert exit_.value.code == 2 and "--dtype" in capsys.readouterr().err
    assert not (tmp_path / "new").exists() and _leftovers(tmp_path) == []


# --------------------------------------------------------------------------------------------------------
# a real run: 2 ranks, ZeRO-3, and 1 rank without ZeRO
# --------------------------------------------------------------------------------------------------------
def _validation_loss(model, world_size: int) -> float:
    """The validation loss as launch/train.py computes it for write_configs' run: each rank's mean over its
    eval batches (float64), averaged over the ranks."""
    from snip_ds.run.data import load_dataset_blocks
    from snip_ds.run.trainer import _eval_batches

    # write_configs: block_size 64, max_corpus_bytes 200_000, micro-batch 2, eval_batches 2
    _, val, _, _ = load_dataset_blocks(None, 64, None, seed=0, max_bytes=200_000,
                                       max_validation_bytes=max(200_000 // 16, 64 * 64))
    model.eval()
    per_rank = []
    with torch.no_grad():
        for rank in range(world_size):
            batches = _eval_batches(val, 2, 2, rank, world_size)
            per_rank.append(sum(model(input_ids=b["input_ids"], labels=b["labels"]).loss.double()
                                for b in batches) / len(batches))
    return float(sum(per_rank) / world_size)


# Both runs log eval/loss with a 'bf16' plan, which runs the linears unquantized: with DeepSpeed's bf16 on, a
# BF16 forward of the BF16 copies of the master weights (round to nearest, as torch's .to rounds the exported
# FP32 masters); with it off, an FP32 forward of the masters themselves.
#
# FP32 (LOSS_TOL): TensorBoard stores the scalar as float32 (half an ulp at 4..8: 2.4e-7), and the GEMMs'
# summation order may differ (thread count, DeepSpeed's ZeRO-3 linear): per dot product of width k <= 128 at
# most k*u = 128 * 2^-24 = 7.6e-6 relative, on logits of magnitude < 5 through 2 blocks: below 1e-4 on the
# mean cross-entropy (observed: equal up to the float32 storage).
# BF16 (BF16_LOSS_TOL): the same weights; a different summation order changes a GEMM output only where its
# FP32 sum rounds to the other neighbouring bf16 value, by one bf16 ulp (2^-8 relative). Even if every logit
# (magnitude < 4) moved by one ulp in the same direction the mean cross-entropy would move by at most
# 2 * 2^-8 * 4 = 0.03; observed 1.4e-5.
# One training step moves the loss by ~0.08; the step-3 and step-6 losses differ by ~0.25.
LOSS_TOL = 1e-4
BF16_LOSS_TOL = 0.03


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    """2 ranks, ZeRO-3, DeepSpeed's bf16 on (FP32 master weights in the optimizer shards), 'bf16' plan."""
    from train_utils import launch, write_configs

    tmp = tmp_path_factory.mktemp("zero3")
    cfg = write_configs(tmp, stage=3, plan="bf16")
    data = json.loads(cfg.read_text())
    data["bf16"] = {"enabled": True}
    cfg.write_text(json.dumps(data))
    proc = launch(["--deepspeed", str(cfg)], num_ranks=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return tmp / "out"


@pytest.mark.slow
@pytest.mark.distributed
def test_two_rank_zero3_export_loads_and_reproduces_the_bf16_validation_loss(zero3_run, tmp_path, capsys):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train_utils import TINY_MODEL, scalars

    logged = scalars(zero3_run / "tensorboard")["eval/loss"]
    assert sorted(logged) == [3, 6] and abs(logged[3] - logged[6]) > 5 * BF16_LOSS_TOL
    for source, step in ((zero3_run / "checkpoints", 6), (zero3_run / "checkpoints" / "step_3", 3)):
        out = tmp_path / f"hf{step}"
        assert main(["export", str(source), str(out)]) == 0
        assert f"{out}: step {step}," in capsys.readouterr().out
        model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16, local_files_only=True)
        assert abs(_validation_loss(model, 2) - logged[step]) < BF16_LOSS_TOL, step

    config = json.loads((tmp_path / "hf6" / "config.json").read_text())
    for key, value in TINY_MODEL.items():  # the full config: max_position_embeddings is no architecture field
        assert config[key] == value, key
    record = json.loads((tmp_path / "hf6" / "snip_export.json").read_text())
    assert record["step"] == 6 and record["world_size"] == 2 and record["dtype"] == "fp32"
    assert "snip_state.json" in record["plan"] and record["tokenizer"]["kind"] == "byte"
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf6"), local_files_only=True)
    text = "import os\nprint(os.sep)  # é\n"
    assert tok.encode(text, add_special_tokens=False) == ByteTokenizer().encode(text)

    # The FP32 export holds the masters (the BF16 model trained on their rounding holds none of them); --dtype
    # bf16 writes those rounded to nearest, nothing else; --force replaces the previous export.
    fp32 = load_file(str(tmp_path / "hf6" / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in fp32.values())
    assert any(not torch.equal(t.bfloat16().float(), t) for t in fp32.values())
    assert main(["export", str(zero3_run / "checkpoints"), str(tmp_path / "hf6"), "--dtype", "bf16",
                 "--force"]) == 0
    bf16 = load_file(str(tmp_path / "hf6" / "model.safetensors"))
    assert json.loads((tmp_path / "hf6" / "snip_export.json").read_text())["dtype"] == "bf16"
    assert set(bf16) == set(fp32) and all(torch.equal(fp32[k].bfloat16(), bf16[k]) for k in bf16)
    assert _leftovers(tmp_path) == []


@pytest.mark.slow
@pytest.mark.distributed
def test_damaged_shards_are_refused_with_one_line_and_nothing_written(zero3_run, tmp_path, capsys):
    source = zero3_run / "checkpoints" / "step_6"
    out = tmp_path / "hf"

    def broken(name):
        tag = tmp_path / name / "step_6"
        shutil.copytree(source, tag)
        return tag

    tag = broken("missing")  # (bf16_)zero_pp_rank_R_mp_rank_00_optim_states.pt: rank R's master weights
    sorted(tag.glob("*_optim_states.pt"))[1].unlink()
    assert main(["export", str(tag), str(out)]) == 2
    line = _error_line(capsys)
    assert str(tag) in line and "optim_states" in line

    tag = broken("truncated")  # the sizes snip_meta.json records are checked before any shard is read
    shard = sorted(tag.glob("*_optim_states.pt"))[1]
    shard.write_bytes(shard.read_bytes()[:5000])
    assert main(["export", str(tag), str(out)]) == 2
    line = _error_line(capsys)
    assert f"{shard}: 5000 bytes, but snip_meta.json records" in line and "the file is truncated" in line

    tag = broken("bit_flipped")  # the size kept, the content changed: the sha256 differs
    shard = sorted(tag.glob("*_model_states.pt"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    assert main(["export", str(tag), str(out)]) == 2
    assert f"{shard}: sha256 differs from the one snip_meta.json records" in _error_line(capsys)

    tag = broken("truncated_unrecorded")  # a checkpoint without checksums: the loader names the file
    meta = json.loads((tag / "snip_meta.json").read_text())
    del meta["files"]
    (tag / "snip_meta.json").write_text(json.dumps(meta))
    shard = sorted(tag.glob("*_optim_states.pt"))[1]
    shard.write_bytes(shard.read_bytes()[:5000])
    assert main(["export", str(tag), str(out)]) == 2
    err = capsys.readouterr().err
    assert "records no checksums" in err and "its files are not verified" in err
    line = [ln for ln in err.splitlines() if ln.startswith("snip-ds: error: ")][0]
    assert f"{shard}: cannot be read" in line and "weights_only=True" in line

    tag = broken("no_rank_file")  # the checkpoint's own completeness check
    (tag / "snip_rng_rank1.safetensors").unlink()
    assert main(["export", str(tag), str(out)]) == 2
    assert f"{tag / 'snip_rng_rank1.safetensors'}: missing" in _error_line(capsys)

    tag = broken("other_model")  # the recorded config no longer builds the trained model
    meta = json.loads((tag / "snip_meta.json").read_text())
    meta["model_config"]["num_attention_heads"], meta["model_config"]["head_dim"] = 2, 32
    (tag / "snip_meta.json").write_text(json.dumps(meta))
    assert main(["export", str(tag), str(out)]) == 2
    assert "num_attention_heads" in _error_line(capsys)
    assert not out.exists() and _leftovers(tmp_path) == []


class _Payload:
    """Unpickling this creates a directory: evidence that a loader executed pickled code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_pickle_payload_in_a_shard_is_refused(zero3_run, tmp_path, capsys):
    from snip_ds.engine.checkpoint_verify import file_digest

    tag = tmp_path / "evil" / "step_6"
    shutil.copytree(zero3_run / "checkpoints" / "step_6", tag)
    shard = sorted(tag.glob("*_optim_states.pt"))[0]
    torch.save({"optimizer_state_dict": {"payload": _Payload(tmp_path / "pwned")}}, shard)
    meta = json.loads((tag / "snip_meta.json").read_text())  # the metadata edited to match: only the
    meta["files"][shard.name] = file_digest(shard)  # weights_only loading stands between it and the payload
    (tag / "snip_meta.json").write_text(json.dumps(meta))
    probe = tmp_path / "probe.pt"  # the same payload does run under a plain unpickling load
    torch.save(_Payload(tmp_path / "ran"), probe)
    torch.load(probe, weights_only=False)
    assert (tmp_path / "ran").is_dir()

    assert main(["export", str(tag), str(tmp_path / "hf")]) == 2
    line = _error_line(capsys)
    assert f"{shard}: cannot be read" in line and "weights_only=True" in line
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "hf").exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_one_rank_without_zero_exports_the_module_weights(tmp_path, capsys):
    """No ZeRO, FP32 (bf16 'auto' is off on CPU): the module DeepSpeed saved holds the master weights."""
    from transformers import AutoModelForCausalLM

    from train_utils import launch, scalars, write_configs

    cfg = write_configs(tmp_path, stage=0, plan="bf16")
    proc = launch(["--deepspeed", str(cfg)], num_ranks=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert not list((tmp_path / "out" / "checkpoints" / "step_6").glob("*optim_states.pt"))  # no ZeRO shards
    assert main(["export", str(tmp_path / "out" / "checkpoints"), str(tmp_path / "hf")]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    logged = scalars(tmp_path / "out" / "tensorboard")["eval/loss"]
    assert abs(_validation_loss(model, 1) - logged[6]) < LOSS_TOL and abs(logged[3] - logged[6]) > 1000 * LOSS_TOL
