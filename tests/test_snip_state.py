"""One SNIP state under both loops: ``launch/train.py`` (SnipEngine) and the Hugging Face Trainer (SnipCallback)
write the same ``snip_state.json`` and ``snip_rng_rank<r>.safetensors``; checkpoints in either loop's older
format still resume bit for bit, and ``snip-ds`` reads old and new."""
import json
import shutil
from pathlib import Path

import pytest

from snip_ds.report.artifacts import load_plan, load_stats
from train_utils import TINY_MODEL, launch, launch_all, scalars, write_configs

pytestmark = [pytest.mark.slow]


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


# ---------------------------------------------------------------- launch/train.py (SnipEngine)
@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    """A one-rank adaptive run of 4 steps (re-plans before steps 1 and 3, measures every 2 steps), checkpoints
    at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("engine")
    cfg = write_configs(tmp, stage=0, plan="adaptive", max_steps=4, save_steps=2, eval_steps=4)
    data = json.loads(cfg.read_text())
    data["snip"].update(replan_every=2, additional_bf16_fwd_every_n_steps=2, efficiency_saving=0.5)
    cfg.write_text(json.dumps(data))
    proc = _ok(launch(["--deepspeed", str(cfg)], num_ranks=1))
    return {"tmp": tmp, "cfg": cfg, "out": tmp / "out", "stdout": proc.stdout}


def _as_old_engine_checkpoint(tag: Path, dest: Path) -> Path:
    """``tag`` rewritten as snip_ds wrote checkpoints before snip_state.json: plan, planner state and skipped
    steps inside snip_meta.json, and ``snip_rank00000.safetensors`` (the same tensors, other name)."""
    from snip_ds.engine.checkpoint_verify import file_digest

    old = dest / tag.name
    shutil.copytree(tag, old)
    state = json.loads((old / "snip_state.json").read_text())
    (old / "snip_state.json").unlink()
    (old / "snip_rng_rank0.safetensors").rename(old / "snip_rank00000.safetensors")
    meta = json.loads((old / "snip_meta.json").read_text())
    meta.update(plan=state["plan"], planner=state["planner"], skipped_steps=state["skipped_steps"])
    meta["files"] = {name: file_digest(old / name) for name in sorted(
        p.relative_to(old).as_posix() for p in old.rglob("*") if p.is_file() and p.name != "snip_meta.json")}
    (old / "snip_meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    (dest / "latest").write_text(tag.name)
    return old


def test_engine_checkpoint_holds_snip_state_beside_its_metadata(engine_run):
    tag = engine_run["out"] / "checkpoints" / "step_2"
    state = json.loads((tag / "snip_state.json").read_text())
    meta = json.loads((tag / "snip_meta.json").read_text())
    assert state["format"] == "snip_ds.state/1" and state["driver"] == "engine" and state["step"] == 2
    assert state["plan"]["method"] == "best" and [h["step"] for h in state["planner"]["history"]] == [0]
    # measured before steps 1 (right after the first plan) and 2
    assert state["measure_stream"]["step"] == 2 and state["skipped_steps"] == 0
    # snip_meta.json stays the completion marker: it lists both files' checksums and no longer holds the plan
    assert {"snip_state.json", "snip_rng_rank0.safetensors"} <= set(meta["files"])
    assert "plan" not in meta and "planner" not in meta and {"data", "lr_schedule", "tokenizer"} <= set(meta)
    # the engine now says a re-plan on the console as the Trainer does
    assert "snip_ds: re-plan at step 2: " in engine_run["stdout"], engine_run["stdout"][-2000:]


def test_old_and_new_engine_checkpoints_resume_bit_for_bit(engine_run, tmp_path):
    out, cfg = engine_run["out"], engine_run["cfg"]
    tag = out / "checkpoints" / "step_2"
    old = _as_old_engine_checkpoint(tag, tmp_path / "old_ckpts")
    assert not (old / "snip_state.json").exists() and (old / "snip_rank00000.safetensors").is_file()
    assert load_plan(old)[0].digest() == load_plan(tag)[0].digest()  # snip-ds reads both
    assert load_stats(old)[0] == load_stats(tag)[0]
    logged = scalars(out / "tensorboard")
    sources = (("new", tag), ("old", old))
    procs = launch_all([["--deepspeed", str(cfg), "--resume_from_checkpoint", str(source), "--output_dir",
                         str(tmp_path / name)] for name, source in sources])
    for (name, source), proc in zip(sources, procs):
        run = tmp_path / name
        assert "resumed from" in _ok(proc).stdout
        again = scalars(run / "tensorboard")
        for step in (3, 4):
            assert again["train/loss"][step] == logged["train/loss"][step], (name, step)
            assert again["plan/fp4_share"][step] == logged["plan/fp4_share"][step], (name, step)
        # the measurement stream resumes where it was (the old checkpoint: fast-forwarded to its measurements)
        assert again["snip/measured_loss_change"][3] == logged["snip/measured_loss_change"][3], name
        state = json.loads((run / "checkpoints" / "step_4" / "snip_state.json").read_text())
        assert state["planner"]["history"][-1]["step"] == 2 and state["measure_stream"]["step"] == 4


# ---------------------------------------------------------------- the Hugging Face Trainer (SnipCallback)
def _trainer_run(out: Path, max_steps: int, resume=None):
    from transformers import Trainer, TrainingArguments, default_data_collator

    from snip_ds.run.data import load_dataset_blocks
    from snip_ds.hf import SnipCallback
    from snip_ds.run.model import build_model

    train, _, vocab, _ = load_dataset_blocks(None, 64, None, seed=0, max_bytes=200_000, max_validation_bytes=4096)
    model = build_model(None, dict(TINY_MODEL), vocab_size=vocab, seed=0, block_size=64)
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, max_steps=max_steps,
                             learning_rate=2e-3, logging_steps=1, save_steps=2, report_to="none",
                             disable_tqdm=True, use_cpu=True, seed=0,
                             resume_from_checkpoint=str(resume) if resume else None)  # the callback reads it
    snip = SnipCallback(settings={"plan": "adaptive", "replan_every": 2, "additional_bf16_fwd_every_n_steps": 2,
                                  "efficiency_saving": 0.5})
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=default_data_collator,
                      callbacks=[snip])
    snip.attach(trainer)
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]


def _as_old_trainer_checkpoint(folder: Path, dest: Path) -> Path:
    """``folder`` rewritten as SnipCallback wrote it before snip_ds.state/1: snip_ds.hf_checkpoint/1, and the
    generator states keyed by the bare layer name, without torch's RNG."""
    from safetensors.torch import load_file, save_file

    old = dest / folder.name
    shutil.copytree(folder, old)
    state = json.loads((old / "snip_state.json").read_text())
    keep = ("step", "world_size", "plan", "settings", "planner", "measure_stream")
    (old / "snip_state.json").write_text(json.dumps({"format": "snip_ds.hf_checkpoint/1",
                                                     **{k: state[k] for k in keep}}))
    tensors = load_file(str(old / "snip_rng_rank0.safetensors"))
    save_file({k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("generator/")},
              str(old / "snip_rng_rank0.safetensors"))
    return old


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer")
    return {"out": tmp / "run", "losses": _trainer_run(tmp / "run", 4)}


def test_old_and_new_trainer_checkpoints_resume_bit_for_bit(trainer_run, tmp_path):
    folder = trainer_run["out"] / "checkpoint-2"
    old = _as_old_trainer_checkpoint(folder, tmp_path / "old")
    assert load_plan(old)[0].digest() == load_plan(folder)[0].digest()  # snip-ds reads both
    assert load_stats(old)[0] == load_stats(folder)[0]
    for source in (folder, old):
        resumed = _trainer_run(tmp_path / f"resumed_{source.parent.name}", 4, resume=source)
        after = [e for e in resumed if e[0] > 2]  # (the Trainer's log history holds steps 1-2 from the checkpoint)
        assert len(after) == 2 and after == [e for e in trainer_run["losses"] if e[0] > 2], source


def test_both_loops_write_one_state_format(engine_run, trainer_run):
    """The engine's step_2 and the Trainer's checkpoint-2 hold the same files with the same fields."""
    from safetensors.torch import load_file

    engine_dir, trainer_dir = engine_run["out"] / "checkpoints" / "step_2", trainer_run["out"] / "checkpoint-2"
    e = json.loads((engine_dir / "snip_state.json").read_text())
    t = json.loads((trainer_dir / "snip_state.json").read_text())
    assert e["format"] == t["format"] == "snip_ds.state/1" and (e["driver"], t["driver"]) == ("engine", "trainer")
    assert set(e) == set(t) and set(e["planner"]) == set(t["planner"])
    assert e["step"] == t["step"] == 2 and t["measure_stream"]["step"] == 2
    e_keys = set(load_file(str(engine_dir / "snip_rng_rank0.safetensors")))
    t_keys = set(load_file(str(trainer_dir / "snip_rng_rank0.safetensors")))
    assert e_keys == t_keys and "torch_rng" in e_keys
    assert {k.split("/", 1)[0] for k in e_keys} == {"generator", "torch_rng", "python_rng", "numpy_rng"}
    assert e["zero_init"] is False and isinstance(t["zero_init"], bool)
