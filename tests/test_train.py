"""launch/train.py end to end through the launcher (tests/launch_ranks.py): ZeRO-3 on 2 ranks, TensorBoard,
exact resume, ZeRO-0 vs ZeRO-3, fp8 vs bf16."""
import json
import math

import pytest

from train_utils import images, launch, launch_all, restore_environ, scalars, write_configs  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LOGGED = {"train/loss", "train/lr", "perf/tokens_per_s", "perf/step_time_s", "plan/fp4_share", "eval/loss",
          "eval/perplexity"}


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def test_two_rank_zero3_run_logs_and_resumes_exactly(tmp_path):
    cfg = write_configs(tmp_path, stage=3, plan="fp4")  # fp4: stochastic rounding state must resume too
    run = _ok(launch(["--deepspeed", str(cfg)], num_ranks=2))
    assert "2 rank(s)" in run.stdout
    out = tmp_path / "out"
    logged = scalars(out / "tensorboard")
    assert LOGGED <= set(logged)
    loss = logged["train/loss"]
    assert sorted(loss) == [1, 2, 3, 4, 5, 6]
    assert loss[6] < loss[1] - 0.25  # from ~ln(264)=5.6; step 1 runs at warmup lr 0
    assert logged["plan/fp4_share"][6] == pytest.approx(1.0)
    assert math.isclose(logged["eval/perplexity"][6], math.exp(logged["eval/loss"][6]), rel_tol=1e-5)
    assert "plan/precision_map" in images(out / "tensorboard")
    assert sorted(logged["eval/loss"]) == [3, 6]  # every eval_steps (3) and at the end
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1  # rank 0 writes, rank 1 does not
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    (image,) = acc.Images("plan/precision_map")  # the plan was set once and never changed
    assert image.width >= 600 and image.height >= 200  # a labelled figure, readable at TensorBoard's size
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_6"
    meta = json.loads((ckpts / "step_3" / "snip_meta.json").read_text())
    state = json.loads((ckpts / "step_3" / "snip_state.json").read_text())
    assert meta["world_size"] == 2 and meta["step"] == 3 and state["plan"]["method"] == "uniform_fp4"

    # Resume from step 3 into a new output directory: the losses of steps 4-6 are the same, bit for bit.
    resumed = _ok(launch(["--deepspeed", str(cfg), "--resume_from_checkpoint", str(ckpts / "step_3"),
                          "--output_dir", str(tmp_path / "resumed")], num_ranks=2))
    assert "resumed from" in resumed.stdout
    again = scalars(tmp_path / "resumed" / "tensorboard")["train/loss"]
    assert sorted(again) == [4, 5, 6]
    for step in (4, 5, 6):
        assert again[step] == loss[step], (step, again[step], loss[step])


@pytest.mark.rounding
def test_zero0_equals_zero3_and_fp8_stays_close_to_bf16(tmp_path):
    """Same data and init: ZeRO-3 only partitions, so bf16-plan losses match ZeRO-0's to 1e-5 relative
    (the all-gathered parameters are bitwise the same; only gradient-norm and reduction order differ).
    An fp8 plan perturbs each loss by the fp8 rounding noise only: loss-curve SQNR above 30 dB."""
    runs = ((0, "bf16"), (3, "bf16"), (3, "fp8"))
    cfgs = [write_configs(tmp_path, stage=stage, plan=plan, save_steps=0, output_dir=str(tmp_path / f"s{stage}_{plan}"))
            for stage, plan in runs]
    for proc in launch_all([["--deepspeed", str(cfg)] for cfg in cfgs]):
        _ok(proc)
    series = {(stage, plan): scalars(tmp_path / f"s{stage}_{plan}" / "tensorboard")["train/loss"]
              for stage, plan in runs}
    ref = series[0, "bf16"]
    # measured: bitwise equal at all 6 steps, natively (AVX-512) and under MKL/oneDNN limited to AVX2; 1e-5
    # leaves room for a change of reduction order (the Adam-state probe of test_zero_state measured weight
    # drifts up to 6.3e-6 relative from one, which moves a loss near 5 by far less than 5e-5)
    for step, value in series[3, "bf16"].items():
        assert value == pytest.approx(ref[step], rel=1e-5), step
    fp8 = series[3, "fp8"]
    noise = sum((fp8[s] - ref[s]) ** 2 for s in ref)
    signal = sum(v ** 2 for v in ref.values())
    assert noise > 0  # fp8 really quantized
    # a floor, not a round-off bound: E4M3's per-operand SQNR is ~31 dB; measured 66.7 dB (AVX-512), 66.9 (AVX2)
    assert 10 * math.log10(signal / noise) > 30.0


def test_adaptive_two_rank_zero3_replans_logs_and_resumes_exactly(tmp_path):
    """The default method end to end: statistics before step 1 and every 4 steps, one plan on all ranks,
    measured vs predicted FLD logged, planner state in the checkpoint, and an exact resume from step 3:
    step 4 trains on the plan restored from the checkpoint (solved at step 0), then the run re-plans."""
    cfg = write_configs(tmp_path, stage=3, plan="adaptive")
    data = json.loads(cfg.read_text())
    data["snip"].update(replan_every=4, additional_bf16_fwd_every_n_steps=2, efficiency_saving=0.5)
    cfg.write_text(json.dumps(data))
    run = _ok(launch(["--deepspeed", str(cfg)], num_ranks=2))
    # torch's FutureWarnings for the collectives ZeRO-3 calls (all_gather_into_tensor, reduce_scatter_tensor):
    # once per rank, not again after each re-plan (whose warning capture used to make Python show them anew)
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        assert (run.stdout + run.stderr).count(f"`torch.distributed.{name}` is deprecated") <= 2, name
    logged = scalars(tmp_path / "out" / "tensorboard")
    assert sorted(logged["snip/solve_time_s"]) == [0, 4]
    # measured right after the re-plans at steps 0 and 4 and before every 2nd optimizer step (at steps 1, 3, 5);
    # logged at the global step it was measured at, as the re-plans are (docs/configuration.md, "Step numbers")
    assert sorted(logged["snip/measured_fld"]) == sorted(logged["snip/measured_loss_change"]) == [0, 1, 3, 4, 5]
    assert all(v > 0 for v in logged["snip/predicted_fld"].values())
    assert all(v > 0 for v in logged["snip/measured_fld"].values())  # a KL divergence: fp4 layers move it
    assert all(0.5 <= v <= 0.75 for s, v in logged["plan/fp4_share"].items() if s >= 1)
    meta = json.loads((tmp_path / "out" / "checkpoints" / "step_6" / "snip_state.json").read_text())
    history = meta["planner"]["history"]
    assert [h["step"] for h in history] == [0, 4]
    assert history[0]["precond"].startswith("none") and history[1]["precond"] == "zero3"
    assert meta["plan"]["method"] == "best" and meta["plan"]["fp4_share"] >= 0.5
    assert meta["planner"]["last_stats"]["world_size"] == 2

    resumed = _ok(launch(["--deepspeed", str(cfg), "--resume_from_checkpoint",
                          str(tmp_path / "out" / "checkpoints" / "step_3"),
                          "--output_dir", str(tmp_path / "resumed")], num_ranks=2))
    assert "resumed from" in resumed.stdout
    again = scalars(tmp_path / "resumed" / "tensorboard")
    for step in (4, 5, 6):
        assert again["train/loss"][step] == logged["train/loss"][step], step
    assert again["plan/fp4_share"][6] == logged["plan/fp4_share"][6]


def test_a_model_with_dropout_trains_the_same_twice_and_resumes_exactly(tmp_path):
    """The global generators dropout draws from start from the run's seed (torch seeds its own randomly at
    start-up): two runs of a model with attention dropout give the same losses bit for bit and save the same
    torch RNG state, which dropout has moved past the seeded one; a resume from step 2 restores it and repeats
    steps 3-4 bit for bit."""
    import torch
    from safetensors.torch import load_file

    from train_utils import TINY_MODEL

    cfg = write_configs(tmp_path, stage=3, plan="fp8", model={**TINY_MODEL, "attention_dropout": 0.5},
                        max_steps=4, save_steps=2, eval_steps=4)
    for proc in launch_all([["--deepspeed", str(cfg), "--output_dir", str(tmp_path / name)] for name in "ab"]):
        _ok(proc)
    runs = {name: scalars(tmp_path / name / "tensorboard")["train/loss"] for name in "ab"}
    assert sorted(runs["a"]) == [1, 2, 3, 4] and runs["a"] == runs["b"]
    rng = [load_file(str(tmp_path / n / "checkpoints" / "step_2" / "snip_rng_rank0.safetensors"))["torch_rng"]
           for n in ("a", "b")]
    assert torch.equal(rng[0], rng[1])
    torch.manual_seed(0)  # the run's seed (snip.train.seed)
    assert not torch.equal(rng[0], torch.get_rng_state())  # dropout drew from it
    step2 = tmp_path / "a" / "checkpoints" / "step_2"
    _ok(launch(["--deepspeed", str(cfg), "--resume_from_checkpoint", str(step2), "--output_dir",
                str(tmp_path / "resumed")]))
    again = scalars(tmp_path / "resumed" / "tensorboard")["train/loss"]
    assert sorted(again) == [3, 4] and all(again[s] == runs["a"][s] for s in (3, 4))


def test_a_resume_builds_the_training_stream_once(tmp_path, monkeypatch, restore_environ):  # noqa: F811
    """``--resume_from_checkpoint``: the training data stream is built once and set to the checkpoint's position
    once, while the checkpoint is checked (before DeepSpeed starts); the run then goes on from there. (A trial
    stream used to be built for the check and the real one set again after DeepSpeed had loaded.)"""
    from snip_ds.run import data
    from snip_ds.run.trainer import main

    cfg = write_configs(tmp_path, stage=3, plan="fp8", max_steps=2, save_steps=2, eval_steps=2)
    _ok(launch(["--deepspeed", str(cfg)]))
    built, loaded = [], []
    init, load = data.DataStream.__init__, data.DataStream.load_state_dict

    def counted_init(self, dataset, batch_size, *args, **kwargs):
        init(self, dataset, batch_size, *args, **kwargs)
        if self.shuffle:  # the training stream (the validation batches come unshuffled)
            built.append(self)

    def counted_load(self, state, *args, **kwargs):
        load(self, state, *args, **kwargs)
        loaded.append((self, self.step))

    monkeypatch.setattr(data.DataStream, "__init__", counted_init)
    monkeypatch.setattr(data.DataStream, "load_state_dict", counted_load)
    assert main(["--deepspeed", str(cfg), "--resume_from_checkpoint", str(tmp_path / "out"), "--max_steps", "3",
                 "--output_dir", str(tmp_path / "resumed"), "--no_progress"]) == 0
    assert len(built) == 1 and loaded == [(built[0], 2)]
    assert built[0].step == 3  # it fed step 3
    assert sorted(scalars(tmp_path / "resumed" / "tensorboard")["train/loss"]) == [3]
