"""SnipCallback in the Hugging Face Trainer: ZeRO-3 on 1 and 2 ranks, resume, plain AdamW, bad inputs."""
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from train_utils import REPO, TINY_MODEL, assert_no_shm_left, env, images, ranks_cmd, run_ranks, scalars

pytest.importorskip("accelerate")  # transformers' Trainer needs it

TRAIN_HF = REPO / "launch" / "train_hf.py"
PROBE = REPO / "tests" / "dist_scripts" / "hf_probe.py"
SMALL = ["--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2", "--disable_tqdm", "true"]


@pytest.fixture(autouse=True)
def _restore_environ():
    """In-process Trainers with a DeepSpeed config leave accelerate's ACCELERATE_* variables in os.environ,
    which would turn later Trainers (and launched runs, which inherit the environment) into DeepSpeed runs."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    try:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
        unset_hf_deepspeed_config()
    except ImportError:
        pass


def _config(tmp: Path, stage: int = 3, **snip) -> Path:
    """ds_configs/zero3.json (its "auto" values untouched: the Trainer fills them) for a tiny adaptive run
    that re-plans every 2 steps."""
    (tmp / "model.json").write_text(json.dumps(TINY_MODEL))
    cfg = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    if stage < 3:
        cfg["zero_optimization"] = {"stage": stage}
    cfg["snip"].update(replan_every=2, additional_bf16_fwd_every_n_steps=2, **snip)
    cfg["snip"]["train"] = {"model_config": str(tmp / "model.json"), "block_size": 64, "max_corpus_bytes": 200_000,
                            "eval_batches": 1}
    path = tmp / f"ds{stage}.json"
    path.write_text(json.dumps(cfg, indent=1))
    return path


def _launcher(script: Path, args, ranks: int):
    return lambda: ranks_cmd(script, args, ranks)


def _assert_plans(history, rho, precond):
    assert [h["step"] for h in history] == [0, 2, 4]  # before step 1, then every replan_every = 2 steps
    assert all(h["status"] == "optimal" for h in history)
    # the ILP's constraint is share >= rho; 1e-12 absorbs the rounding of the share's FLOP sum (~1e-16 relative)
    assert all(h["fp4_share"] >= rho - 1e-12 for h in history)
    assert history[0]["precond"].startswith("none") and {h["precond"] for h in history[1:]} == {precond}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("stage,ranks", [(3, 1), (3, 2), (1, 2)])
def test_trainer_replans_and_matches_initialize(tmp_path, stage, ranks):
    cfg = _config(tmp_path, stage=stage)
    out = tmp_path / "probe.json"
    proc = run_ranks(_launcher(PROBE, ["--deepspeed", str(cfg), "--model_config", str(tmp_path / "model.json"),
                                       "--output_dir", str(tmp_path / "run"), "--out", str(out)], ranks), 600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["world"] == ranks and got["swapped_same_params"]
    _assert_plans(got["history"], got["rho"], f"zero{stage}")
    # Tolerance: none. Both collections run the same code on the same weights, batch, seeds and (empty)
    # optimizer state, with the same ZeRO partitioning and reduction order, so no round-off separates them.
    assert got["first"] == got["reference"]
    assert len(got["losses"]) == 5


def _train_hf(args, ranks=1, deepspeed=True):
    if deepspeed:
        cmd = _launcher(TRAIN_HF, args, ranks)()
    else:
        cmd = [sys.executable, str(TRAIN_HF), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    if deepspeed:
        assert_no_shm_left(cmd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _log(run: Path, step: int):
    return json.loads((run / f"checkpoint-{step}" / "trainer_state.json").read_text())["log_history"]


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_continues_on_restored_plan_bit_for_bit(tmp_path):
    cfg = _config(tmp_path)
    common = ["--deepspeed", str(cfg), "--max_steps", "6", "--save_steps", "3", "--eval_steps", "100",
              "--report_to", "tensorboard", *SMALL]
    _train_hf([*common, "--output_dir", str(tmp_path / "a")])
    proc = _train_hf([*common, "--output_dir", str(tmp_path / "b"), "--resume_from_checkpoint",
                      str(tmp_path / "a" / "checkpoint-3")])
    assert f"restored the plan and planner state from {tmp_path / 'a' / 'checkpoint-3'} at step 3" in proc.stdout
    a, b = _log(tmp_path / "a", 6), _log(tmp_path / "b", 6)
    # CPU, one rank, fp32: the Trainer restores data order and RNG, DeepSpeed the weights and Adam state, the
    # callback the plan, the planner and the rounding generators; so the losses are equal bit for bit.
    assert [e["loss"] for e in b if "loss" in e] == [e["loss"] for e in a if "loss" in e]
    sa = json.loads((tmp_path / "a" / "checkpoint-6" / "snip_state.json").read_text())
    sb = json.loads((tmp_path / "b" / "checkpoint-6" / "snip_state.json").read_text())
    assert sb["plan"]["assignment"] == sa["plan"]["assignment"]  # (its meta holds the solve time)
    assert sb["planner"]["last_stats"] == sa["planner"]["last_stats"]
    assert [h["step"] for h in sb["planner"]["history"]] == [0, 2, 4]
    # The resumed run logs the plan it restored (the step-2 plan, in force at step 3), once, and no other:
    # neither an all-FP8 "initial plan" nor its FP4 share of 0, in Trainer.log nor in TensorBoard.
    in_force = json.loads((tmp_path / "a" / "checkpoint-3" / "snip_state.json").read_text())
    share = in_force["planner"]["history"][-1]["fp4_share"]
    assert in_force["planner"]["history"][-1]["step"] == 2 and share >= 0.75 - 1e-12
    at_resume = [e["plan/fp4_share"] for e in b if e["step"] == 3 and "plan/fp4_share" in e]
    assert at_resume == [pytest.approx(share, rel=1e-12)]
    (events,) = {p.parent for p in (tmp_path / "b").glob("runs/**/events.out.tfevents.*")}
    logged = _events(events)
    assert [v for step, v in logged["scalars"]["train/plan/fp4_share"] if step == 3] == [pytest.approx(share)]
    assert min(step for step, _ in logged["scalars"]["train/plan/fp4_share"]) == 3
    maps = logged["images"]["plan/precision_map"]
    assert min(maps) == 3 and maps.count(3) == 1  # the restored plan's map, then any re-plan's
    assert [t for step, t in logged["texts"]["plan/changes"] if step == 3] == ["step 3: restored"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("nonfinite", ["stop", "skip"])
def test_nonfinite_under_the_trainer_with_deepspeed_on_two_ranks(tmp_path, nonfinite):
    """ZeRO-2 on 2 CPU ranks, rank 1's model.layers.1.mlp returning NaN in step 3: the ranks agree before the
    DeepSpeed engine's update. "stop": both raise the same NonFiniteError naming step 3 and rank 1, after
    steps 1-2; "skip": step 3 changes no parameter on either rank while every other step does, the learning rate
    stays for step 4 (DeepSpeed's scheduler is not stepped), and both count one skipped step."""
    cfg = _config(tmp_path, stage=2, plan="fp8", nonfinite=nonfinite)
    data = json.loads(cfg.read_text())
    del data["scheduler"]  # the Trainer's linear schedule, no warm-up: step 1's learning rate is not 0
    cfg.write_text(json.dumps(data))
    out = tmp_path / "nf"
    proc = run_ranks(_launcher(REPO / "tests" / "dist_scripts" / "hf_nonfinite.py",
                               ["--deepspeed", str(cfg), "--model_config", str(tmp_path / "model.json"),
                                "--output_dir", str(tmp_path / "run"), "--out", str(out)], 2), 600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]
    for r in ranks:
        sums = r["sums"]
        if nonfinite == "stop":
            assert r["error"].startswith("non-finite gradient (of model.embed_tokens.weight, the first such "
                                         "parameter in model order; the loop does not show SNIP the loss) at step "
                                         "3, one of its 1 micro-batch(es) on rank 1"), r["error"]
            assert r["steps"] == 2 and len(sums) == 3
        else:
            assert "error" not in r and r["steps"] == 5 and r["skipped"] == 1
            assert sums[3] == sums[2] and all(sums[i + 1] != sums[i] for i in (0, 1, 3, 4))
            # Logged after steps 1..5; under DeepSpeed the Trainer logs the scheduler's last rate, the next
            # step's: skipped step 3 leaves it where step 2 put it, every other step lowers it.
            lrs = r["lrs"]
            assert len(lrs) == 5 and lrs[2] == lrs[1] and all(lrs[i + 1] < lrs[i] for i in (0, 2, 3)), lrs
    assert ranks[0].get("error") == ranks[1].get("error") and ranks[0]["sums"] == ranks[1]["sums"]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_hung_in_a_collection_stops_its_peer_after_the_ddp_timeout(tmp_path):
    """2 CPU ranks under DeepSpeed: rank 1 hangs at the start of the re-plan's statistics collection before
    step 3 (paused, alive); rank 0's collective times out after TrainingArguments.ddp_timeout (10 s, the process
    group share_cpu_ranks_with_accelerate starts) and rank 0 exits 1 with one error line instead of waiting
    (the launcher then stops rank 1)."""
    from snip_ds.runtime import faults

    cfg = _config(tmp_path)
    cmd = _launcher(TRAIN_HF, ["--deepspeed", str(cfg), "--max_steps", "4", "--save_steps", "100",
                               "--eval_steps", "100", "--report_to", "none", "--ddp_timeout", "10",
                               "--output_dir", str(tmp_path / "o"), *SMALL], 2)()
    e = env()
    e[faults.ENV] = "collect:2:1"
    proc = subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=600)
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*"):  # rank 1 was killed
        if cmd[cmd.index("--master_port") + 1] in path.name:
            path.unlink(missing_ok=True)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-4000:]
    assert "snip_ds: fault injection: rank 1" in text and "paused at collect of step 2" in text
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, text[-4000:]
    assert errors[0].startswith("error: rank 0: a collective failed, another rank died or stopped answering")
    assert "Timed out waiting 10000ms" in errors[0] and "--resume_from_checkpoint" in errors[0]


def _events(log_dir: Path) -> dict:
    """Every scalar (step, value), image step and text (step, string) event, duplicates kept, in write order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.text import metadata as text_metadata
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    texts = {}
    for tag in tags.get("tensors", []):
        if acc.SummaryMetadata(tag).plugin_data.plugin_name == text_metadata.PLUGIN_NAME:
            texts[tag.removesuffix("/text_summary")] = [
                (e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode()) for e in acc.Tensors(tag)]
    return {"scalars": {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags["scalars"]},
            "images": {t: [e.step for e in acc.Images(t)] for t in tags["images"]}, "texts": texts}


@pytest.mark.slow
def test_without_deepspeed_plain_adamw(tmp_path):
    cfg = _config(tmp_path)
    run = tmp_path / "run"
    proc = _train_hf(["--snip_config", str(cfg), "--output_dir", str(run), "--max_steps", "5", "--save_steps", "5",
                      "--eval_steps", "5", *SMALL], deepspeed=False)
    assert "re-plan at step 4: " in proc.stdout
    state = json.loads((run / "checkpoint-5" / "snip_state.json").read_text())
    _assert_plans(state["planner"]["history"], 0.75, "adam")
    logs = [e for e in _log(run, 5) if "snip/collect_time_s" in e]
    assert [e["step"] for e in logs] == [0, 2, 4]  # through Trainer.log
    (events,) = {p.parent for p in run.glob("runs/**/events.out.tfevents.*")}
    tb = scalars(events)  # the Trainer's TensorBoardCallback prefixes "train/"
    # measured right after each re-plan (0, 2, 4) and before every additional_bf16_fwd_every_n_steps = 2nd step
    assert set(tb["train/plan/fp4_share"]) == {0, 2, 4} and set(tb["train/snip/measured_fld"]) == {0, 1, 2, 3, 4}
    assert "plan/precision_map" in images(events)


# ---------------------------------------------------------------- bad inputs: one clear error, before training
def _trainer(tmp_path, deepspeed=None, model=None, callback=None, ga=1, use_cpu=None):
    from transformers import Trainer, TrainingArguments, default_data_collator

    from snip_ds.run.data import BlockDataset
    from snip_ds.hf import SnipCallback
    from snip_ds.run.model import build_model

    import torch

    if model is None:
        model = build_model(None, dict(TINY_MODEL), vocab_size=257, seed=0, block_size=64)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), deepspeed=deepspeed, per_device_train_batch_size=2,
                             gradient_accumulation_steps=ga, max_steps=1, report_to="none",
                             use_cpu=deepspeed is None if use_cpu is None else use_cpu)
    data = BlockDataset(torch.zeros(8, 64, dtype=torch.int32))
    return Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator,
                   callbacks=[callback or SnipCallback()])


def _variant(tmp_path, edit) -> str:
    cfg = json.loads(_config(tmp_path, stage=2).read_text())
    edit(cfg)
    path = tmp_path / "variant.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_unknown_key_in_snip_section(tmp_path):
    from snip_ds.config.settings import ConfigError

    path = _variant(tmp_path, lambda c: c["snip"].update(replan_evry=3))
    with pytest.raises(ConfigError, match=rf"{path}: snip: unknown key\(s\) 'replan_evry'"):
        _trainer(tmp_path, deepspeed=path)


def test_unknown_key_in_settings_argument(tmp_path):
    from snip_ds.hf import SnipCallback
    from snip_ds.config.settings import ConfigError

    with pytest.raises(ConfigError, match=r"SnipCallback\(settings=...\): snip.quant: unknown key\(s\) 'fp5'"):
        _trainer(tmp_path, callback=SnipCallback(settings={"plan": "adaptive", "quant": {"fp5": 1}}))


def test_a_malformed_direct_launch_switch_is_an_error_before_the_trainer_starts(monkeypatch):
    from snip_ds.hf import SnipCallback

    monkeypatch.setenv("SNIP_DS_TRITON_DIRECT", "on")
    with pytest.raises(ValueError, match=r"^SNIP_DS_TRITON_DIRECT='on': expected 0"):
        SnipCallback(settings={"plan": "fp8"})
    monkeypatch.setenv("SNIP_DS_TRITON_DIRECT", "0")
    assert SnipCallback(settings={"plan": "fp8"}).trainer is None


def _poisoned_run(tmp_path, nonfinite: str, steps: int = 5):
    """A plain-AdamW Trainer (no DeepSpeed) whose model.layers.1.mlp returns NaN in step 3 only (the user's
    own module overflowing); returns the Trainer, the callback and the float64 parameter sums before step 1 and
    after every step."""
    from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

    from snip_ds.run.data import BlockDataset
    from snip_ds.hf import SnipCallback
    from snip_ds.run.model import build_model

    import torch

    model = build_model(None, dict(TINY_MODEL), vocab_size=257, seed=0, block_size=64)
    poison = {"on": False}
    model.model.layers[1].mlp.register_forward_hook(
        lambda mod, inputs, out: out * float("nan") if poison["on"] else out)
    sums = [float(sum(p.detach().double().sum() for p in model.parameters()))]

    class Probe(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            poison["on"] = state.global_step == 2  # the forward of step 3

        def on_step_end(self, args, state, control, model=None, **kwargs):
            poison["on"] = False
            sums.append(float(sum(p.detach().double().sum() for p in model.parameters())))

    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=steps,
                             learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none",
                             disable_tqdm=True, use_cpu=True, seed=0)
    snip = SnipCallback(settings={"plan": "fp8", "nonfinite": nonfinite})
    trainer = Trainer(model=model, args=args, train_dataset=BlockDataset(torch.randint(0, 257, (16, 64))),
                      data_collator=default_data_collator, callbacks=[snip, Probe()])
    snip.attach(trainer)
    return trainer, snip, sums


def test_nonfinite_step_stops_the_trainer_before_its_update(tmp_path):
    """snip.nonfinite "stop" (the default) under the Trainer: the NaN of step 3 raises NonFiniteError naming the
    step, the rank and the first parameter with a non-finite gradient, before step 3's update; the Trainer
    cannot hand SNIP the batch, and the message says the module is not located."""
    from snip_ds import NonFiniteError

    trainer, snip, sums = _poisoned_run(tmp_path, "stop")
    with pytest.raises(NonFiniteError) as err:
        trainer.train()
    msg = str(err.value)
    assert msg.startswith("non-finite gradient (of model.embed_tokens.weight, the first such parameter in model "
                          "order; the loop does not show SNIP the loss) at step 3, one of its 1 micro-batch(es) on "
                          "rank 0; the module whose output went non-finite is not located"), msg
    assert "the step's update was not applied" in msg
    assert trainer.state.global_step == 2 and len(sums) == 3  # steps 1-2 done, step 3 never finished
    assert all(math.isfinite(float(p.detach().sum())) for p in trainer.model.parameters())  # no NaN in the weights


def test_nonfinite_step_is_skipped_by_the_trainer_and_counted(tmp_path):
    """snip.nonfinite "skip" under the Trainer: step 3 changes no parameter (the float64 sum of every parameter
    is the same before and after it, while every other step changes it), the Trainer's linear schedule holds its
    learning rate for step 4, training goes on to step 5 with finite weights, and the skip is counted and logged
    through Trainer.log."""
    trainer, snip, sums = _poisoned_run(tmp_path, "skip")
    trainer.train()
    assert trainer.state.global_step == 5 and len(sums) == 6
    assert sums[3] == sums[2]  # step 3: exactly no update
    assert all(sums[i + 1] != sums[i] for i in (0, 1, 3, 4))
    assert all(math.isfinite(x) for x in sums)
    assert snip.state.skipped_steps == 1
    assert [e["train/skipped_steps"] for e in trainer.state.log_history if "train/skipped_steps" in e] == [1.0]
    lrs = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]  # the rates steps 1..5 ran at
    assert len(lrs) == 5 and lrs[3] == lrs[2] and all(lrs[i + 1] < lrs[i] for i in (0, 1, 3)), lrs
    assert "step" not in vars(trainer.lr_scheduler)  # the stand-in for the skipped schedule step is gone


@pytest.mark.slow
def test_trainer_logs_the_measured_loss_change(tmp_path):
    """Both loops measure the same way: after each re-plan and every additional_bf16_fwd_every_n_steps steps the
    Trainer logs the measured divergence and snip/measured_loss_change (the plan's loss minus the unquantized loss
    on the measurement stream's batch; FP8 moves it off zero) through Trainer.log."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    from snip_ds.run.data import load_dataset_blocks
    from snip_ds.hf import SnipCallback
    from snip_ds.run.model import build_model

    train, _, vocab, _ = load_dataset_blocks(None, 64, None, seed=0, max_bytes=200_000, max_validation_bytes=4096)
    model = build_model(None, dict(TINY_MODEL), vocab_size=vocab, seed=0, block_size=64)
    args = TrainingArguments(output_dir=str(tmp_path / "o"), per_device_train_batch_size=2, max_steps=4,
                             logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                             use_cpu=True, seed=0)
    snip = SnipCallback(settings={"plan": "adaptive", "method": "uniform_fp8", "replan_every": 100,
                                  "additional_bf16_fwd_every_n_steps": 2})
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=default_data_collator,
                      callbacks=[snip])
    snip.attach(trainer)
    trainer.train()
    logged = [e for e in trainer.state.log_history if "snip/measured_loss_change" in e]
    # measured right after the re-plan before step 1, and before steps 2 and 4 (Trainer.log's step: taken)
    assert [e["step"] for e in logged] == [0, 1, 3]
    assert all(math.isfinite(e["snip/measured_loss_change"]) and e["snip/measured_loss_change"] != 0
               and e["snip/measured_fld"] > 0 for e in logged)
    assert snip.state.measure_stream.step == 3  # its own stream, not the Trainer's batches
    # One owner of the settings, the state: the callback and the planner read them there, so settings the state
    # is given are the ones the schedule follows (the planner used to keep a copy of its own).
    from snip_ds.config.settings import with_overrides

    assert not snip.planner.due(5)
    snip.state.settings = with_overrides(snip.state.settings, replan_every=5)
    assert snip.settings.replan_every == 5 and snip.planner.due(5)


@pytest.mark.parametrize("tp, message", [
    ({"autotp_size": 2}, r"tensor_parallel.autotp_size 2 does not divide the world size 1"),
    ({"autotp_size": "2"}, r"tensor_parallel.autotp_size must be a positive integer, got '2'"),
    ({"autotp_size": 1}, None),
    ({"autotp_size": 0}, None),
])
def test_tensor_parallel_settings_are_checked_before_training(tmp_path, tp, message):
    """Under the Trainer a tensor-parallel config trains quantized shards (tests/test_tensor_parallel.py); what
    cannot run is refused from ``Trainer(...)``/``add_snip``, naming the config file and the field. A degree of 1
    (or DeepSpeed's default 0) is no tensor parallelism."""
    from snip_ds.config.settings import ConfigError

    path = _variant(tmp_path, lambda c: c.update(tensor_parallel=tp))
    if message is None:
        _trainer(tmp_path, deepspeed=path)
        return
    with pytest.raises(ConfigError, match=rf"^{path}: {message}"):
        _trainer(tmp_path, deepspeed=path)


def test_a_degree_that_does_not_divide_the_heads_is_refused_under_the_trainer(tmp_path, monkeypatch):
    """Two launched ranks at ``autotp_size: 2``: a model of 3 heads is refused before DeepSpeed would split them,
    and so is a ``train_batch_size`` other than "auto"."""
    from snip_ds.run.model import build_model
    from snip_ds.config.settings import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr("snip_ds.hf.checks.cpu_ranks_unshared", lambda args: False)
    path = _variant(tmp_path, lambda c: c.update(tensor_parallel={"autotp_size": 2}))
    with pytest.raises(ConfigError, match=r"^tensor_parallel.autotp_size: 2 does not divide the model's "
                                          r"num_attention_heads \(3\)"):
        _trainer(tmp_path, deepspeed=path, model=build_model(None, dict(TINY_MODEL, num_attention_heads=3,
                                                                        num_key_value_heads=3, hidden_size=48),
                                                             vocab_size=257, seed=0, block_size=64))
    # a train_batch_size of its own: transformers and DeepSpeed count tensor-parallel ranks in it
    path = _variant(tmp_path, lambda c: c.update(tensor_parallel={"autotp_size": 2}, train_batch_size=2))
    with pytest.raises(ConfigError, match=rf"^{path}: train_batch_size is 2; under the Hugging Face Trainer with "
                                          rf"tensor_parallel.autotp_size 2 set it to \"auto\" or remove it"):
        _trainer(tmp_path, deepspeed=path)


def test_gradient_accumulation_disagrees(tmp_path):
    from snip_ds.config.settings import ConfigError

    path = _variant(tmp_path, lambda c: c.update(gradient_accumulation_steps=2))
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps is 2 but TrainingArguments"
                                          r".gradient_accumulation_steps is 1"):
        _trainer(tmp_path, deepspeed=path)


def test_settings_in_two_places(tmp_path):
    from snip_ds.hf import SnipCallback
    from snip_ds.config.settings import ConfigError

    path = _variant(tmp_path, lambda c: None)
    with pytest.raises(ConfigError, match="give them in one place"):
        _trainer(tmp_path, deepspeed=path, callback=SnipCallback(settings={"plan": "fp8"}))


def test_plan_file_naming_missing_layers(tmp_path):
    from snip_ds.hf import SnipCallback
    from snip_ds.config.settings import ConfigError

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"model.layers.7.mlp.up_proj": "fp4"}))
    with pytest.raises(ConfigError, match=rf"{plan}"):
        _trainer(tmp_path, callback=SnipCallback(settings={"plan": str(plan)}))


def test_model_without_decoder_linears(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from snip_ds.hf import SnipCallback

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=257))
    with pytest.raises(ValueError, match="^GPT2LMHeadModel: no quantizable linears found: .* every one is excluded"):
        _trainer(tmp_path, model=model, callback=SnipCallback(settings={"plan": "fp8", "exclude": ["*"]}))


def test_phi3_under_the_trainer_swaps_its_fused_projections_less_the_excluded(tmp_path):
    from torch import nn

    from snip_ds.hf import SnipCallback
    from snip_ds.linear import SnipLinear
    from snip_ds.run.model import build_model
    from train_utils import TINY_PHI3

    model = build_model(None, dict(TINY_PHI3), vocab_size=257, seed=0, block_size=64)
    callback = SnipCallback(settings={"plan": "fp4", "exclude": ["*.mlp.down_proj"]})
    trainer = _trainer(tmp_path, model=model, callback=callback)
    callback.attach(trainer)
    trainer.train()
    assert [i.kind for i in callback.infos.values()] == ["self_attn.o_proj", "self_attn.qkv_proj",
                                                         "mlp.gate_up_proj"] * 2
    layers = model.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj, SnipLinear) and layers[0].self_attn.qkv_proj.precision == "fp4"
    assert type(layers[1].mlp.down_proj) is nn.Linear
    assert set(callback.state.plan.assignment) == set(callback.infos)


def test_mixtral_under_the_trainer_plans_every_expert_pair(tmp_path):
    """SnipCallback on a Mixtral: its experts modules are swapped too, and the first adaptive plan (solved from
    the Trainer's batches before step 1) gives every (expert, projection) pair its own precision, applied to
    the model, at the FP4 share asked for."""
    from snip_ds.experts.points import ExpertLayerInfo
    from snip_ds.experts.module import SnipExperts
    from snip_ds.hf import SnipCallback
    from snip_ds.run.model import build_model
    from snip_ds.swap import model_layers
    from snip_ds.types import GemmPrecision
    from train_utils import TINY_MIXTRAL

    model = build_model(None, dict(TINY_MIXTRAL), vocab_size=257, seed=0, block_size=64)
    callback = SnipCallback(settings={"plan": "adaptive", "efficiency_saving": 0.5})
    trainer = _trainer(tmp_path, model=model, callback=callback)
    callback.attach(trainer)
    trainer.train()
    pairs = [f for f, info in callback.infos.items() if isinstance(info, ExpertLayerInfo)]
    assert len(pairs) == 16 and len(callback.infos) == 24
    assert isinstance(model.model.layers[1].mlp.experts, SnipExperts)
    plan = callback.state.plan
    assert plan.method == "best" and set(plan.assignment) == set(callback.infos) and plan.fp4_share >= 0.5
    for fqn, layer in model_layers(model).items():
        assert layer.gemm_precision == GemmPrecision.of(plan.assignment[fqn]), fqn


def test_accelerate_plugin_config_is_read(tmp_path, monkeypatch):
    """Under accelerate launch, TrainingArguments.deepspeed is None and the config is the DeepSpeed plugin's
    deepspeed_config_file (ACCELERATE_DEEPSPEED_CONFIG_FILE): its "snip" section is read, errors name it."""
    from snip_ds.hf import SnipCallback
    from snip_ds.config.settings import ConfigError

    path = _variant(tmp_path, lambda c: c["snip"].update(replan_evry=3))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", path)
    with pytest.raises(ConfigError, match=rf"{path}: snip: unknown key\(s\) 'replan_evry'"):
        _trainer(tmp_path, deepspeed=None, use_cpu=False)
    good = _variant(tmp_path, lambda c: c["snip"].update(plan="fp4"))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", good)
    trainer = _trainer(tmp_path, deepspeed=None, use_cpu=False)
    assert trainer.args.deepspeed is None and trainer.is_deepspeed_enabled
    (snip,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, SnipCallback)]
    assert snip.settings.plan == "fp4" and set(snip.plan.assignment.values()) == {"fp4"}


def test_trainer_arguments_are_validated_once_per_add_snip(tmp_path, monkeypatch):
    """The Trainer's arguments and its DeepSpeed config are checked once (hf_checks.check_trainer, reading the
    config file once): attaching again and trainer.train() (whose resume check reads the frozen result) validate
    nothing again. train() is stopped where accelerate starts DeepSpeed."""
    import deepspeed
    from transformers import TrainerState

    from snip_ds import hf
    from snip_ds.hf import checks as hf_checks
    from snip_ds.hf import SnipCallback, add_snip

    calls = {}

    def counted(module, name):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return original(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    counted(hf, "check_trainer")
    for name in ("deepspeed_config", "load_ds_config", "launched_world", "cpu_ranks_unshared"):
        counted(hf_checks, name)

    class Started(Exception):
        pass

    def initialize(*args, **kwargs):
        raise Started

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    snip = SnipCallback()
    trainer = _trainer(tmp_path, deepspeed=str(_config(tmp_path, stage=2)), callback=snip)  # on_init_end checks
    assert add_snip(trainer) is snip and snip.attach(trainer) is snip
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    (folder / "snip_state.json").write_text(json.dumps({"step": 1, "world_size": 1, "tensor_parallel": 1}))
    TrainerState(global_step=1, train_batch_size=2).save_to_json(str(folder / "trainer_state.json"))  # read first
    with pytest.raises(Started):
        trainer.train(resume_from_checkpoint=str(folder))
    assert calls == {"check_trainer": 1, "deepspeed_config": 1, "load_ds_config": 1, "launched_world": 1,
                     "cpu_ranks_unshared": 1}
    assert snip.checks.ds_source == str(tmp_path / "ds2.json") and snip.checks.settings.train.seed == trainer.args.seed


def test_unattached_callback_stops_training_naming_what_to_call(tmp_path):
    from snip_ds.hf import SnipCallback

    trainer = _trainer(tmp_path, callback=SnipCallback(settings={"plan": "fp8"}))
    with pytest.raises(RuntimeError, match=r"call snip_ds.hf.add_snip\(trainer\), or callback.attach\(trainer\)"):
        trainer.train()


def test_add_snip_adds_or_attaches_one_callback(tmp_path):
    from transformers import Trainer, TrainingArguments, default_data_collator

    from snip_ds.run.data import BlockDataset
    from snip_ds.hf import SnipCallback, add_snip
    from snip_ds.linear import SnipLinear
    from snip_ds.run.model import build_model
    from snip_ds.config.settings import ConfigError

    import torch

    model = build_model(None, dict(TINY_MODEL), vocab_size=257, seed=0, block_size=64)
    weight = model.model.layers[0].mlp.up_proj.weight
    args = TrainingArguments(output_dir=str(tmp_path / "o"), max_steps=2, per_device_train_batch_size=2,
                             report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=BlockDataset(torch.randint(0, 257, (8, 64))),
                      data_collator=default_data_collator)
    snip = add_snip(trainer, settings={"plan": "fp4"})
    assert [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, SnipCallback)] == [snip]
    layer = model.model.layers[0].mlp.up_proj
    assert isinstance(layer, SnipLinear) and layer.weight is weight and layer.precision == "fp4"
    assert add_snip(trainer) is snip  # the callback already there is attached again, not duplicated
    with pytest.raises(ConfigError, match="already has a SnipCallback"):
        add_snip(trainer, settings={"plan": "fp8"})
    trainer.train()
    assert snip.state.plan_fp4_share() == pytest.approx(1.0) and trainer.state.global_step == 2


@pytest.mark.slow
def test_cli_reports_one_line(tmp_path):
    path = _variant(tmp_path, lambda c: c["snip"].update(replan_evry=3))
    proc = subprocess.run([sys.executable, str(TRAIN_HF), "--deepspeed", path, "--output_dir", str(tmp_path / "o")],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {path}: snip: unknown key(s) 'replan_evry'; ")
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["zero2", "ddp"])
def test_torchrun_two_ranks(tmp_path, mode):
    """torchrun with 2 ranks: DeepSpeed ZeRO-2 (preconditioner from its partitions), or DDP without DeepSpeed."""
    from snip_ds.engine.core import _free_port

    cfg = _config(tmp_path, stage=2)
    run = tmp_path / "run"
    extra = ["--deepspeed", str(cfg)] if mode == "zero2" else ["--use_cpu", "true", "--snip_config", str(cfg)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           str(TRAIN_HF), *extra, "--output_dir", str(run), "--max_steps", "5", "--save_steps", "5",
           "--eval_steps", "5", "--report_to", "none", *SMALL]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    state = json.loads((run / "checkpoint-5" / "snip_state.json").read_text())
    assert state["world_size"] == 2
    _assert_plans(state["planner"]["history"], 0.75, "zero2" if mode == "zero2" else "adam")
    assert any("eval_loss" in e for e in _log(run, 5))  # evaluation gathers over both ranks


@pytest.mark.slow
def test_statistics_leave_no_trace(tmp_path):
    """An adaptive run whose solver always answers uniform FP8 (collections every 2 steps, measured forwards
    every 2) trains bit for bit as the fixed FP8 run: the private stream does not shift the Trainer's data
    order, and collecting leaves parameters, gradients, optimizer state and RNG streams as they were."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    from snip_ds.run.data import load_dataset_blocks
    from snip_ds.hf import SnipCallback
    from snip_ds.run.model import build_model

    train, _, vocab, _ = load_dataset_blocks(None, 64, None, seed=0, max_bytes=200_000, max_validation_bytes=4096)
    losses = {}
    for name, settings in {"fixed": {"plan": "fp8"},
                           "adaptive": {"plan": "adaptive", "method": "uniform_fp8", "replan_every": 2,
                                        "additional_bf16_fwd_every_n_steps": 2}}.items():
        model = build_model(None, dict(TINY_MODEL), vocab_size=vocab, seed=0, block_size=64)
        args = TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=2, max_steps=5,
                                 learning_rate=2e-3, logging_steps=1, save_strategy="no", report_to="none",
                                 disable_tqdm=True, use_cpu=True, seed=0)
        snip = SnipCallback(settings=settings)
        trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=default_data_collator,
                          callbacks=[snip])
        snip.attach(trainer)
        trainer.train()
        losses[name] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        if name == "adaptive":
            assert [h["step"] for h in snip.planner.history] == [0, 2, 4]
            assert set(snip.state.plan.assignment.values()) == {"fp8"}
    assert len(losses["fixed"]) == 5 and losses["adaptive"] == losses["fixed"]


# ---------------------------------------------------------------- a run_clm.py-shaped script, ZeRO-3, 2 ranks
RUN_CLM = REPO / "tests" / "dist_scripts" / "run_clm_snip.py"


def _run_clm_inputs(tmp: Path, tp: int = 1) -> dict:
    """A tiny Llama config directory, the byte-level tokenizer as a Hugging Face tokenizer directory, a text file
    of Python's standard-library sources, and the tiny adaptive ZeRO-3 config (re-plans every 2 steps; with
    ``tp`` > 1 at ``tensor_parallel.autotp_size`` ``tp``)."""
    from transformers import LlamaConfig

    from snip_ds.export.config import byte_tokenizer

    LlamaConfig(**{k: v for k, v in TINY_MODEL.items() if k != "model_type"}).save_pretrained(tmp / "config")
    byte_tokenizer().save_pretrained(str(tmp / "tokenizer"))
    text, size = [], 0
    for path in sorted(Path(os.__file__).parent.glob("*.py")):
        text.append(path.read_text(encoding="utf-8", errors="replace"))
        size += len(text[-1])
        if size > 60_000:
            break
    (tmp / "corpus.txt").write_text("".join(text))
    ds = _config(tmp)
    if tp > 1:
        cfg = json.loads(ds.read_text())
        cfg["tensor_parallel"] = {"autotp_size": tp}
        ds.write_text(json.dumps(cfg, indent=1))
    return {"ds": ds, "args": [
        "--config_name", str(tmp / "config"), "--tokenizer_name", str(tmp / "tokenizer"), "--train_file",
        str(tmp / "corpus.txt"), "--block_size", "64", "--do_train", "--do_eval", "--max_steps", "4",
        "--save_steps", "4", "--logging_steps", "1", "--report_to", "none", "--seed", "0", *SMALL]}


def _run_clm(tmp: Path, launcher: str, out: Path, tp: int = 1) -> subprocess.CompletedProcess:
    from snip_ds.engine.core import _free_port

    inputs = _run_clm_inputs(tmp, tp)
    port = str(_free_port())
    if launcher == "deepspeed":
        cmd = ranks_cmd(RUN_CLM, ["--deepspeed", inputs["ds"]], 2, port, "deepspeed")
    else:  # accelerate's own DeepSpeed plugin names the config: no --deepspeed flag
        (tmp / "accelerate.yaml").write_text(
            "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
            f"  deepspeed_config_file: {inputs['ds']}\n  zero3_init_flag: true\nmachine_rank: 0\n"
            "num_machines: 1\nnum_processes: 2\nuse_cpu: false\n")
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp / "accelerate.yaml"),
               "--num_processes", "2", "--main_process_port", port, str(RUN_CLM)]
    e = env()
    e.update(HF_DATASETS_CACHE=str(tmp / "datasets_cache"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run([*cmd, *inputs["args"], "--output_dir", str(out)], cwd=tmp, env=e, capture_output=True,
                          text=True, timeout=900)
    left = sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))
    for path in left:
        path.unlink(missing_ok=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not left, f"the run left {[p.name for p in left]} in /dev/shm"
    return proc


def _logits(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32)
    ids = torch.arange(64).remainder(257).reshape(1, 64)
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("launcher", ["deepspeed", "accelerate"])
def test_run_clm_zero3_two_ranks_saves_a_loadable_model_and_snip_ds_reads_its_checkpoint(tmp_path, launcher):
    """run_clm.py's shape with add_snip(trainer), ZeRO-3 on 2 CPU ranks: under the deepspeed launcher
    (--deepspeed) and under accelerate launch (the DeepSpeed plugin's deepspeed_config_file, no --deepspeed).
    trainer.save_model() leaves a model from_pretrained loads; snip-ds show/plan/diff/export read checkpoint-4
    and the output directory; the export's logits are the saved model's."""
    from snip_ds.cli import main

    out = tmp_path / "out"
    proc = _run_clm(tmp_path, launcher, out)
    assert "re-plan at step 2: " in proc.stdout
    ckpt = out / "checkpoint-4"
    state = json.loads((ckpt / "snip_state.json").read_text())
    assert state["world_size"] == 2 and state["format"] == "snip_ds.state/1" and state["driver"] == "trainer"
    history = state["planner"]["history"]
    assert [h["step"] for h in history] == [0, 2] and all(h["status"] == "optimal" for h in history)
    assert all(h["fp4_share"] >= 0.75 - 1e-12 for h in history) and history[1]["precond"] == "zero3"
    metrics = json.loads((out / "eval_results.json").read_text())
    assert math.isfinite(metrics["eval_loss"])

    # trainer.save_model(): ZeRO-3's 16-bit gather on save (the shipped config) writes the weights
    saved = _logits(out)
    # snip-ds reads the Trainer checkpoint as it reads step_N
    assert main(["show", str(ckpt)]) == 0 and main(["show", str(out)]) == 0
    assert main(["plan", str(ckpt), "--efficiency-saving", "0.5", "-o", str(tmp_path / "p.json")]) == 0
    assert main(["diff", str(ckpt), str(tmp_path / "p.json")]) == 0
    # export: DeepSpeed's FP32 masters from global_step4; the run is FP32, so they are the saved weights exactly
    for source, name in ((ckpt, "hf_ckpt"), (out, "hf_out")):
        assert main(["export", str(source), str(tmp_path / name)]) == 0
        record = json.loads((tmp_path / name / "snip_export.json").read_text())
        assert record["checkpoint"] == str(ckpt.resolve()) and record["step"] == 4
        assert record["weights"] == "DeepSpeed's FP32 master weights (global_step4)"
        assert record["tokenizer"]["exported"]
        exported = _logits(tmp_path / name)
        assert exported.shape == saved.shape and bool((exported == saved).all())


@pytest.mark.slow
@pytest.mark.distributed
def test_run_clm_tensor_parallel_under_accelerate_launch(tmp_path):
    """run_clm.py's shape under ``accelerate launch`` whose DeepSpeed plugin config asks ``autotp_size: 2`` (ZeRO-3,
    the model built under zero.Init, 2 CPU ranks: one tensor-parallel group): SNIP re-plans on the shards,
    checkpoint-4 records the degree, ``trainer.save_model()`` leaves a whole model from_pretrained loads, and
    ``snip-ds export`` of checkpoint-4 (the Trainer's model.safetensors, gathered by DeepSpeed) computes the
    saved model's logits exactly. The checkpoint records that zero.Init partitioned the model, so ``snip-ds
    universal`` refuses it up front saying DeepSpeed's converter cannot merge its shards, which the converter
    confirms, and an export without the gathered model.safetensors stops before running it."""
    import shutil

    from snip_ds.cli import main
    from snip_ds.engine.checkpoint_layout import CheckpointError
    from snip_ds.engine.universal import convert_to_universal, run_ds_to_universal
    from snip_ds.export import export_checkpoint
    from snip_ds.export.files import ExportError

    out = tmp_path / "out"
    proc = _run_clm(tmp_path, "accelerate", out, tp=2)
    assert "first plan at step 0: " in proc.stdout and "re-plan at step 2: " in proc.stdout
    state = json.loads((out / "checkpoint-4" / "snip_state.json").read_text())
    assert state["tensor_parallel"] == 2 and state["world_size"] == 2
    assert math.isfinite(json.loads((out / "eval_results.json").read_text())["eval_loss"])
    saved = _logits(out)
    assert main(["export", str(out / "checkpoint-4"), str(tmp_path / "hf")]) == 0
    record = json.loads((tmp_path / "hf" / "snip_export.json").read_text())
    assert record["tensor_parallel"] == 2 and "gathered by DeepSpeed" in record["weights"]
    assert bool((_logits(tmp_path / "hf") == saved).all())

    ckpt = out / "checkpoint-4"
    assert state["zero_init"] is True
    with pytest.raises(CheckpointError, match=r"cannot be converted: its model was built under deepspeed.zero.Init "
                                              r"\(ZeRO-3\) and trained at tensor_parallel.autotp_size 2: "):
        convert_to_universal(ckpt, tmp_path / "universal")
    with pytest.raises(CheckpointError, match=r"exceeds dimension size"):  # what the refusal spares the user
        run_ds_to_universal(ckpt / (ckpt / "latest").read_text().strip(), tmp_path / "ds_universal")
    masters_only = tmp_path / "masters" / "checkpoint-4"
    shutil.copytree(ckpt, masters_only)
    (masters_only / "model.safetensors").unlink()
    with pytest.raises(ExportError, match=r"holds no gathered model.safetensors, and its FP32 master weights cannot "
                                          r"be merged: its model was built under deepspeed.zero.Init"):
        export_checkpoint(masters_only, tmp_path / "hf_masters")


def test_plain_trainer_checkpoint_exports_its_safetensors_with_tied_weights(tmp_path, capsys):
    """Without DeepSpeed the Trainer's checkpoint-N holds model.safetensors (a tied lm_head stored once): the
    export loads, its logits are the checkpoint's; the output directory exports its last checkpoint-N (by
    step), saying so when the Trainer saved there later."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    from snip_ds.cli import main
    from snip_ds.run.data import load_dataset_blocks
    from snip_ds.hf import add_snip
    from snip_ds.run.model import build_model

    train, _, vocab, _ = load_dataset_blocks(None, 64, None, seed=0, max_bytes=100_000, max_validation_bytes=4096)
    model = build_model(None, dict(TINY_MODEL, tie_word_embeddings=True), vocab_size=vocab, seed=0, block_size=64)
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=5,
                             save_steps=2, report_to="none", disable_tqdm=True, use_cpu=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=default_data_collator)
    add_snip(trainer, settings={"plan": "adaptive", "replan_every": 2, "additional_bf16_fwd_every_n_steps": 100})
    trainer.train()
    trainer.save_model()
    trainer.save_state()
    ckpt = tmp_path / "run" / "checkpoint-4"
    assert main(["export", str(ckpt), str(tmp_path / "hf")]) == 0
    record = json.loads((tmp_path / "hf" / "snip_export.json").read_text())
    assert record["weights"] == "the Trainer's model.safetensors" and record["step"] == 4
    assert not record["tokenizer"]["exported"] and "holds no tokenizer" in capsys.readouterr().err
    assert bool((_logits(tmp_path / "hf") == _logits(ckpt)).all())
    assert main(["show", str(tmp_path / "run")]) == 0  # the Trainer saved the last step too: checkpoint-5
    assert capsys.readouterr().out.startswith(f"{tmp_path / 'run' / 'checkpoint-5'}: method ")
    shutil.rmtree(tmp_path / "run" / "checkpoint-5")  # as if that save had not been kept
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "hf_run")]) == 0
    assert "saved there at step 5, after its last checkpoint; exporting checkpoint-4" in capsys.readouterr().err
    assert json.loads((tmp_path / "hf_run" / "snip_export.json").read_text())["checkpoint"] == str(ckpt.resolve())
    assert main(["show", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out.startswith(f"{ckpt}: method ")


def _trainer_dirs(tmp: Path, steps, with_state=True) -> Path:
    """An output directory of Trainer checkpoint folders as a DeepSpeed run leaves them (no weights)."""
    from snip_ds.plan import Plan

    plan = Plan({"model.layers.0.mlp.up_proj": "fp4", "model.layers.0.mlp.down_proj": "fp8"}, method="test")
    for step in steps:
        folder = tmp / "run" / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "trainer_state.json").write_text("{}")
        (folder / "latest").write_text(f"global_step{step}")
        if with_state:
            (folder / "snip_state.json").write_text(json.dumps(
                {"format": "snip_ds.hf_checkpoint/1", "step": step, "world_size": 1, "plan": plan.to_dict(),
                 "planner": None}))
    return tmp / "run"


def test_trainer_checkpoints_are_picked_by_step_and_wrong_ones_named(tmp_path, capsys):
    from snip_ds.cli import main

    run = _trainer_dirs(tmp_path, [2, 10, 9])
    assert main(["show", str(run)]) == 0
    assert capsys.readouterr().out.startswith(f"{run / 'checkpoint-10'}: method test")
    assert main(["plan", str(run / "checkpoint-2"), "--efficiency-saving", "0.5", "-o", str(tmp_path / "p.json")]) == 2
    assert "the checkpoint holds no statistics" in capsys.readouterr().err
    (run / "checkpoint-10" / "snip_state.json").write_text("{not json")
    assert main(["show", str(run / "checkpoint-10")]) == 2
    assert f"{run / 'checkpoint-10' / 'snip_state.json'}: not valid JSON" in capsys.readouterr().err

    bare = _trainer_dirs(tmp_path / "b", [5], with_state=False)
    for cmd in (["show", str(bare / "checkpoint-5")], ["export", str(bare / "checkpoint-5"), str(tmp_path / "o")]):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert f"{bare / 'checkpoint-5'}: a Trainer checkpoint without snip_state.json" in err, err
    assert main(["show", str(bare)]) == 2
    assert "none of its 1 checkpoint-N folder(s) holds snip_state.json" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_cpu_ranks_unknown_to_accelerate_are_refused(tmp_path):
    """The run_clm-shaped script without share_cpu_ranks_with_accelerate, 2 CPU ranks under DeepSpeed:
    accelerate counts one process (each rank would train on the same batches), and add_snip refuses, naming
    the call that fixes it."""
    script = tmp_path / "run_clm_unshared.py"
    text = RUN_CLM.read_text()
    line = "    share_cpu_ranks_with_accelerate(training_args)  # SNIP (CPU ranks only; a no-op on GPUs)\n"
    assert line in text
    script.write_text(text.replace(line, "").replace(
        "os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))", repr(str(REPO))))
    inputs = _run_clm_inputs(tmp_path)
    cmd = ranks_cmd(script, ["--deepspeed", inputs["ds"], *inputs["args"], "--output_dir", tmp_path / "out"], 2)
    e = env()
    e.update(HF_DATASETS_CACHE=str(tmp_path / "datasets_cache"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=e, capture_output=True, text=True, timeout=600)
    assert_no_shm_left(cmd)
    assert proc.returncode != 0
    assert ("2 ranks were launched with DeepSpeed on CPUs, but accelerate counts 1 process: every rank would read "
            "the same batches; call snip_ds.hf.share_cpu_ranks_with_accelerate(args)") in proc.stdout + proc.stderr
    assert not (tmp_path / "out" / "checkpoint-4").exists()


def test_deepspeed_started_by_the_trainer_reads_an_architecture_list_it_can_parse(tmp_path, monkeypatch):
    """A CUDA image's TORCH_CUDA_ARCH_LIST=9.0a stops DeepSpeed's JIT builds (its parser wants <int>.<int>): the
    Trainer starts DeepSpeed inside train(), where the CPU Adam of an optimizer offload is built, so from the
    callback's setup until on_train_begin the variable reads 9.0, and the user's 9.0a is back from then on."""
    import deepspeed

    from snip_ds.runtime import jit_builds
    from snip_ds.hf import SnipCallback

    seen = {}

    class Started(Exception):
        pass

    def initialize(*args, **kwargs):  # deepspeed.initialize as accelerate calls it, stopped there
        seen["arch"] = os.environ.get(jit_builds.ARCH_VAR)
        raise Started

    monkeypatch.setenv(jit_builds.ARCH_VAR, "9.0a")
    monkeypatch.setattr(deepspeed, "initialize", initialize)
    snip = SnipCallback()
    trainer = _trainer(tmp_path, deepspeed=str(_config(tmp_path, stage=2)), callback=snip)
    snip.attach(trainer)
    with pytest.raises(Started):
        trainer.train()
    assert seen["arch"] == "9.0"
    assert os.environ[jit_builds.ARCH_VAR] == "9.0"  # held until on_train_begin
    try:
        snip.on_train_begin(trainer.args, trainer.state, trainer.control)
    except Exception:  # noqa: BLE001 -- no DeepSpeed engine was made; only the variable matters here
        pass
    assert os.environ[jit_builds.ARCH_VAR] == "9.0a"
