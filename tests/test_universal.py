"""Resuming on another number of ranks: ``snip-ds universal`` converts a checkpoint with DeepSpeed's
``ds_to_universal`` and adds snip_ds's files; ``--resume_from_checkpoint`` of the result at any world size
initializes DeepSpeed with ``"checkpoint": {"load_universal": true}``.

The unit tests check the safe loading in one process; the slow ones save on 2 ranks (ZeRO-1 and ZeRO-3),
convert, and resume on 1 rank through the launcher (tests/launch_ranks.py). ``tests/test_train_errors.py`` resumes its
2-rank ZeRO-3 run's checkpoint on 2 ranks through a universal one, and checks the error lines.
"""
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from train_utils import TINY_MODEL, launch, restore_environ, scalars, write_configs  # noqa: F401  (a fixture)

from snip_ds.engine.checkpoint_io import safe_torch_load
from snip_ds.engine.checkpoint_layout import CheckpointError
from snip_ds.engine.universal import convert_to_universal, with_load_universal

pytestmark = pytest.mark.usefixtures("restore_environ")  # main() runs in process here

FP32_ULP = 2.0 ** -23  # the spacing of fp32 numbers in [1, 2): a loss L in [4, 8) is stored to 4 * this


# ---------------------------------------------------------------------------------------------- unit tests
class _Payload:  # a class no weights_only load may instantiate
    def __reduce__(self):
        return (print, ("unpickled!",))


def test_safe_torch_load_refuses_pickled_code_also_in_deepspeeds_own_loads(tmp_path):
    """DeepSpeed's universal reader calls ``torch.load(..., weights_only=False)`` itself; inside
    :func:`safe_torch_load` that call loads with ``weights_only=True``, and ``torch.load`` is restored after."""
    from deepspeed.checkpoint import universal_checkpoint

    bad, good = tmp_path / "fp32.pt", tmp_path / "exp_avg.pt"
    bad.write_bytes(pickle.dumps({"param": _Payload()}, protocol=2))
    torch.save({"param": torch.ones(2), "cat_dim": 0}, good)
    original = torch.load
    with safe_torch_load():
        assert universal_checkpoint.torch.load is not original
        assert torch.equal(universal_checkpoint.torch.load(str(good), weights_only=False)["param"], torch.ones(2))
        with pytest.raises(CheckpointError, match="fp32.pt: cannot be read as a DeepSpeed checkpoint file with "
                                                  "weights_only=True"):
            universal_checkpoint.torch.load(str(bad), weights_only=False)
    assert torch.load is original


def test_with_load_universal_sets_the_flag_only_for_a_universal_checkpoint():
    cfg = {"zero_optimization": {"stage": 1}}
    assert with_load_universal(cfg, {"world_size": 2}) == cfg
    assert with_load_universal(cfg, {"universal": {"zero_stage": 1}})["checkpoint"] == {"load_universal": True}
    assert "checkpoint" not in cfg


def _trainer_checkpoint(run, step: int, **state) -> Path:
    """A Hugging Face Trainer's ``checkpoint-N`` as SnipCallback and DeepSpeed leave it (no weights needed here)."""
    folder = run / f"checkpoint-{step}"
    (folder / f"global_step{step}").mkdir(parents=True)
    (folder / "latest").write_text(f"global_step{step}")
    (folder / "trainer_state.json").write_text("{}")
    (folder / "snip_state.json").write_text(json.dumps({"format": "snip_ds.state/1", "driver": "trainer",
                                                         "step": step, "plan": None, "planner": None, **state}))
    return folder


def test_a_trainer_checkpoint_is_refused_up_front_with_the_reason_and_what_works(tmp_path):
    """``snip-ds universal`` converts launch/train.py's and snip_ds.initialize's checkpoints. A Trainer's is refused
    before anything is read but its snip_state.json: at ZeRO-3 with tensor parallelism and a model built under
    zero.Init (``zero_init``, recorded by SnipCallback) because DeepSpeed's converter cannot merge its shards,
    otherwise because the Trainer resumes only at the saved shape; both say what works instead."""
    from snip_ds.cli import main

    tp_zero_init = _trainer_checkpoint(tmp_path / "a", 3, world_size=2, tensor_parallel=2, zero_init=True)
    with pytest.raises(CheckpointError, match=rf"^{tp_zero_init}: a Hugging Face Trainer checkpoint that cannot be "
                                              r"converted: its model was built under deepspeed.zero.Init \(ZeRO-3\) "
                                              r"and trained at tensor_parallel.autotp_size 2: .*ds_to_universal "
                                              r"cannot merge such shards .*; resume it with the Trainer on 2 rank\(s\) "
                                              r"at tensor_parallel.autotp_size 2, .*snip-ds export "):
        convert_to_universal(tmp_path / "a", tmp_path / "out")  # the output directory: its last checkpoint
    for state in ({"world_size": 2, "tensor_parallel": 2, "zero_init": False}, {"world_size": 2, "zero_init": True},
                  {"world_size": 1}):
        folder = _trainer_checkpoint(tmp_path / f"b{len(list(tmp_path.iterdir()))}", 3, **state)
        with pytest.raises(CheckpointError, match=rf"^{folder}: a Hugging Face Trainer checkpoint; 'snip-ds "
                                                  r"universal' converts the checkpoints of launch/train.py and "
                                                  r"snip_ds.initialize, .*at the shape it was saved at"):
            convert_to_universal(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert main(["universal", str(tp_zero_init), str(tmp_path / "out")]) == 2  # one line, exit code 2


# ---------------------------------------------------------------------------------------------- end to end
def _uninterrupted(tmp_path_factory, stage: int) -> dict:
    """An uninterrupted 2-rank run of 4 steps (plan bf16: plain fp32 GEMMs on CPU, no random numbers anywhere
    in a step), saving step_2 and step_4."""
    tmp = tmp_path_factory.mktemp(f"universal_zero{stage}")
    cfg = write_configs(tmp, stage=stage, plan="bf16", max_steps=4, save_steps=2, eval_steps=4)
    proc = launch(["--deepspeed", str(cfg)], num_ranks=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp / "out"
    return {"tmp": tmp, "cfg": cfg, "out": out, "loss": scalars(out / "tensorboard")["train/loss"], "stage": stage}


@pytest.fixture(scope="module")
def zero1(tmp_path_factory):
    return _uninterrupted(tmp_path_factory, 1)


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    return _uninterrupted(tmp_path_factory, 3)


def _params() -> int:
    m = TINY_MODEL
    h, i, v, layers = m["hidden_size"], m["intermediate_size"], m["vocab_size"], m["num_hidden_layers"]
    kv = h // m["num_attention_heads"] * m["num_key_value_heads"]
    return 2 * v * h + h + layers * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("saved", ["zero1", "zero3"])
def test_checkpoint_of_2_ranks_resumes_on_1_rank_with_accumulation(saved, request):
    """step_2 of the 2-rank run (micro-batch 2, accumulation 1), converted, resumed on 1 rank with micro-batch 2
    and accumulation 2: the same 4 samples per optimizer step.

    Tolerance, from the round-off of the changed reduction order (fp32: unit round-off u = 2**-24, and
    1 ulp = 4 * 2**-23 for a loss in [4, 8)):
    - step 3 runs on the restored fp32 master weights, bit for bit the saved ones (ds_to_universal copies
      them), and plan bf16 computes every row of a batch alone, so each sample's loss is the same number; only
      the mean over the 4 samples is formed otherwise (two rank means all-reduced, or two micro-batch means
      accumulated): a few roundings of numbers of about 5.5, <= 2 ulps.
    - step 4: the gradient is (g0 + g1) / 2 on 2 ranks and g0/2 + g1/2 accumulated on 1, the same numbers
      (halving is exact). What differs is the summation order of the global norm that clipping (1.0) divides
      by (per ZeRO partition, all-reduced, vs one sum): relative error <= ~log2(N) u ~ 17 u ~ 1e-6 for N ~ 1e5
      parameters (blocked sums). Adam's m / sqrt(v) cancels a common factor up to its eps, so each weight's
      update differs by <= 1e-6 times the update, which is <= lr (1 - b1) / sqrt(1 - b2) ~ 3.2 lr in the
      first steps (lr 2e-3). To first order the loss moves by <= ||grad L||_1 max|dw| <= sqrt(N) ||grad L||_2
      * 1e-6 * 3.2 * 2e-3, with ||grad L||_2 <= 10 at loss ~5.5 for this model: ~2e-5; plus step 3's 2 ulps.
      (Measured: step 3 within 1 ulp, step 4 equal.)
    With a quantized plan (fp8, fp4) the micro-batches' rows regroup (rank r held samples r and r + 2; one
    rank holds consecutive ones), their per-tensor scales change, and the losses differ by quantization
    noise, not round-off (about 3e-5 relative measured on this model); this test keeps plan bf16.
    """
    run = request.getfixturevalue(saved)  # the uninterrupted run, ZeRO-1 or ZeRO-3
    tmp, out = run["tmp"], run["out"]
    universal = tmp / "universal_step_2"
    convert_to_universal(out / "checkpoints" / "step_2", universal, log=lambda msg: None)
    assert (universal / "latest").read_text() == "step_2"
    meta = json.loads((universal / "step_2" / "snip_meta.json").read_text())
    assert meta["universal"]["zero_stage"] == run["stage"] and meta["universal"]["train_batch_size"] == 4
    assert meta["world_size"] == 2 and meta["step"] == 2

    one = tmp / "one"
    proc = launch(["--deepspeed", str(run["cfg"]), "--resume_from_checkpoint", str(universal),
                   "--gradient_accumulation_steps", "2", "--output_dir", str(one)], num_ranks=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "at step 2 (universal, saved by 2 rank(s), resumed by 1)" in proc.stdout
    loss = scalars(one / "tensorboard")["train/loss"]
    ref = run["loss"]
    assert sorted(loss) == [3, 4]
    assert abs(loss[3] - ref[3]) <= 2 * 4 * FP32_ULP, (loss, ref)
    tolerance = 2 * 4 * FP32_ULP + _params() ** 0.5 * 10 * 1e-6 * 3.2 * 2e-3
    assert 1e-5 < tolerance < 3e-5
    assert abs(loss[4] - ref[4]) <= tolerance, (loss, ref, tolerance)
    assert loss[4] != ref[3]  # it trained on (a different loss than the step before)

    # step counters, the data position (in micro-batches of 2 samples on 1 rank), the plan and SNIP's state
    resumed = json.loads((one / "checkpoints" / "step_4" / "snip_meta.json").read_text())
    saved = json.loads((out / "checkpoints" / "step_4" / "snip_meta.json").read_text())
    assert resumed["step"] == saved["step"] == 4 and resumed["world_size"] == 1 and "universal" not in resumed
    assert resumed["data"]["step"] == 8 and saved["data"]["step"] == 4
    assert resumed["data"]["step"] * resumed["data"]["global_batch_size"] == \
        saved["data"]["step"] * saved["data"]["global_batch_size"]
    state = [json.loads((d / "checkpoints" / "step_4" / "snip_state.json").read_text()) for d in (one, out)]
    for key in ("plan", "planner", "skipped_steps", "step"):
        assert state[0][key] == state[1][key], key
    for s in state:
        del s["settings"]["train"]["output_dir"]  # the resumed run writes elsewhere
    assert state[0]["settings"] == state[1]["settings"]
    assert not (one / "checkpoints" / "step_4" / "snip_rng_rank1.safetensors").exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_an_unfinished_conversion_and_a_changed_global_batch_stop_with_one_line(zero1, capsys):
    """In process (the run stops before DeepSpeed starts): a conversion without its snip_meta.json, and the
    converted checkpoint resumed with another global batch."""
    from snip_ds.run.trainer import main

    tmp = zero1["tmp"]
    universal = tmp / "universal_step_4"
    convert_to_universal(zero1["out"] / "checkpoints" / "step_4", universal, log=lambda msg: None)
    with pytest.raises(CheckpointError, match="already exists .a finished conversion"):
        convert_to_universal(zero1["out"] / "checkpoints" / "step_4", universal, log=lambda msg: None)
    with pytest.raises(CheckpointError, match="already a universal checkpoint"):
        convert_to_universal(universal, tmp / "again", log=lambda msg: None)
    unfinished = tmp / "unfinished"
    shutil.copytree(universal, unfinished)
    (unfinished / "step_4" / "snip_meta.json").unlink()
    (unfinished / "latest").unlink()  # as a conversion stopped before its last two writes leaves it
    cases = [(["--resume_from_checkpoint", str(unfinished)],
              ["unfinished/step_4: an unfinished 'snip-ds universal' conversion (no snip_meta.json"]),
             (["--resume_from_checkpoint", str(universal)],
              ["step_4/snip_meta.json: universal.train_batch_size is 4, but this run's is 2 "
               "(train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 1 x 1 data-parallel ranks)"]),
             ]
    for extra, expected in cases:
        code = main(["--deepspeed", str(zero1["cfg"]), "--output_dir", str(tmp / "never"), "--no_progress", *extra])
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert code == 2 and len(errors) == 1, err
        for text in expected:
            assert text in errors[0], (text, errors[0])
        assert "Traceback" not in err
    assert not (tmp / "never" / "checkpoints").exists()


def test_a_conversion_that_fails_part_way_leaves_nothing(zero1, monkeypatch):
    """DeepSpeed's converter stopping part-way (here a full disk after its first file) removes the half-written
    folder: the error names the checkpoint and the cause, and the same conversion then succeeds."""
    import errno

    from deepspeed.checkpoint import ds_to_universal

    real = ds_to_universal.main

    def full_disk(args):
        (Path(args.output_folder) / "zero").mkdir()
        (Path(args.output_folder) / "zero" / "partial.pt").write_bytes(b"\0" * 64)
        raise OSError(errno.ENOSPC, "No space left on device")

    src, dest = zero1["out"] / "checkpoints" / "step_4", zero1["tmp"] / "failed_conversion"
    monkeypatch.setattr(ds_to_universal, "main", full_disk)
    with pytest.raises(CheckpointError, match=r"step_4: DeepSpeed's ds_to_universal failed \(OSError: .*No space"):
        convert_to_universal(src, dest, log=lambda msg: None)
    assert not (dest / "step_4").exists() and not (dest / "latest").exists()
    monkeypatch.setattr(ds_to_universal, "main", real)
    assert (convert_to_universal(src, dest, log=lambda msg: None) / "snip_meta.json").is_file()
