"""One end-to-end run of each entry point, in the fast tier (the README's test command), as a user runs it:

- ``deepspeed launch/train.py`` (1 rank, ZeRO-3, adaptive): statistics, a solved plan, TensorBoard, a checkpoint;
- the ``snip-ds`` command on that run (``show``, ``plan``, ``export``), each in a process of its own;
- ``python launch/train_hf.py``: the Hugging Face Trainer with SNIP's callback (torch AdamW, no DeepSpeed);
- the README's own-loop snippet (``snip_ds.initialize``) in a plain Python process;
- ``python launch/warm_ops.py`` on this environment's builds.

The multi-rank, resume and fault runs of the same entry points are in the ``slow`` tier.
"""
import json
import math
import re
import subprocess
import sys

import pytest

from train_utils import REPO, TINY_MODEL, env, launch, scalars, write_configs, written_twice

pytestmark = pytest.mark.distributed


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return proc


def _run(args, cwd=REPO, timeout=300) -> subprocess.CompletedProcess:
    return _ok(subprocess.run([sys.executable, *args], cwd=cwd, env=env(), capture_output=True, text=True,
                              timeout=timeout))


@pytest.fixture(scope="module")
def adaptive_run(tmp_path_factory):
    """``deepspeed launch/train.py`` on 1 rank: an adaptive ZeRO-3 run of 2 steps re-planned at steps 0 and 1,
    saved at step 2."""
    tmp = tmp_path_factory.mktemp("entry_train")
    cfg = write_configs(tmp, stage=3, plan="adaptive", max_steps=2, save_steps=2, eval_steps=2)
    config = json.loads(cfg.read_text())
    config["snip"]["early_replan_steps"] = [1]  # a re-plan after a logged training step
    cfg.write_text(json.dumps(config))
    proc = _ok(launch(["--deepspeed", str(cfg)], num_ranks=1, launcher="deepspeed"))
    return {"tmp": tmp, "out": tmp / "out", "stdout": proc.stdout, "stderr": proc.stderr}


def test_launch_train_plans_logs_and_saves(adaptive_run):
    out = adaptive_run["out"]
    plan = json.loads((out / "plan.json").read_text())
    stats = json.loads((out / "stats.json").read_text())
    assert plan["method"] == "best" and set(plan["assignment"]) == set(stats["layers"])
    logged = scalars(out / "tensorboard")
    assert sorted(logged["train/loss"]) == [1, 2] and all(math.isfinite(v) for v in logged["train/loss"].values())
    # the ILP's constraint is share >= rho (0.75); 1e-12 absorbs the rounding of the share's FLOP sum
    assert logged["plan/fp4_share"][2] >= 0.75 - 1e-12
    # one value per tag and step: a re-plan's FP4 share and predicted divergence were also logged by set_plan
    # (and at step 0 for the starting plan), by the measurement after it and, at step 1, by the training step
    assert written_twice(out / "tensorboard") == {}
    history = json.loads((out / "checkpoints" / "step_2" / "snip_state.json").read_text())["planner"]["history"]
    assert [h["step"] for h in history] == [0, 1]
    for h in history:
        assert logged["plan/fp4_share"][h["step"]] == pytest.approx(h["fp4_share"], rel=1e-6)  # (float32 events)
        assert {"snip/predicted_fld", "snip/measured_fld"} <= {t for t, s in logged.items() if h["step"] in s}
    assert sorted(logged["eval/loss"]) == [2]
    assert (out / "checkpoints" / "latest").read_text() == "step_2"
    assert (out / "checkpoints" / "step_2" / "snip_meta.json").is_file()


def test_launch_train_console_says_snip_and_not_what_a_user_cannot_act_on(adaptive_run):
    """The messages of other libraries that snip_ds's run causes and a user cannot change are gone (the launcher's
    own, printed before snip_ds starts, remain); the run ends with snip_ds's summary, not DeepSpeed's last line."""
    text = adaptive_run["stdout"] + adaptive_run["stderr"]
    for noise in ("is deprecated. Please use", "Attempting to get learning rate from scheduler",
                  "built successfully", "Failed to load"):
        assert noise not in text, noise
    # deepspeed's runner and its launch.py log their accelerator guess; the training process logs none
    assert text.count("Setting accelerator to CPU") <= 2
    ours = [line for line in adaptive_run["stdout"].splitlines() if line.startswith("snip_ds: ")]
    assert any(re.match(r"snip_ds: first plan at step 0: \d+ layers FP8->FP4", line) for line in ours), ours
    assert ours[-5].startswith("snip_ds: done: 2 steps") and ours[-3].startswith("snip_ds: final plan: ")


def test_snip_ds_command_reads_and_exports_the_run(adaptive_run, tmp_path):
    out = adaptive_run["out"]
    shown = _run(["-m", "snip_ds.cli", "show", str(out / "checkpoints" / "step_2")]).stdout
    assert "fp4" in shown.lower()
    _run(["-m", "snip_ds.cli", "plan", str(out), "--efficiency-saving", "0.5", "-o", str(tmp_path / "p.json")])
    resolved = json.loads((tmp_path / "p.json").read_text())
    assert set(resolved["assignment"]) == set(json.loads((out / "plan.json").read_text())["assignment"])
    _run(["-m", "snip_ds.cli", "export", str(out / "checkpoints"), str(tmp_path / "hf")])
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.hidden_size == TINY_MODEL["hidden_size"]
    assert model.config.num_hidden_layers == TINY_MODEL["num_hidden_layers"]


def test_launch_train_hf_trains_with_snip(tmp_path):
    """launch/train_hf.py without DeepSpeed (torch AdamW): the plan, model and data come from ``--snip_config``'s
    ``"snip"`` section, the Trainer's checkpoint carries SNIP's state."""
    cfg = write_configs(tmp_path, stage=3, plan="fp8")
    _run([str(REPO / "launch" / "train_hf.py"), "--snip_config", str(cfg), "--output_dir", str(tmp_path / "run"),
          "--max_steps", "2", "--save_steps", "2", "--eval_strategy", "no", "--report_to", "none",
          "--per_device_train_batch_size", "2", "--disable_tqdm", "true"], timeout=600)
    state = json.loads((tmp_path / "run" / "checkpoint-2" / "snip_state.json").read_text())
    assert state["plan"]["method"] == "uniform_fp8"
    log = json.loads((tmp_path / "run" / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
    assert [e["step"] for e in log if "loss" in e] == [1, 2]


def test_readme_own_loop_snippet_runs_in_a_plain_python_process(tmp_path):
    """The README's own-loop example on the shipped zero3.json ("auto" values and all), one plain process:
    initialize starts torch.distributed itself, and the first train_step solves SNIP's plan."""
    code = """
import json, torch, snip_ds
from transformers import LlamaConfig, LlamaForCausalLM
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
engine = snip_ds.initialize(model, json.load(open(%r)), tokens_per_step=4 * 16)
ids = torch.randint(0, 64, (4, 16))
loss = engine.train_step([{"input_ids": ids, "labels": ids}])
print(json.dumps({"loss": loss, "method": engine.plan.method, "share": engine.plan_fp4_share(),
                  "history": [h["step"] for h in engine.planner.history]}))
""" % str(REPO / "ds_configs" / "zero3.json")
    proc = _run(["-c", code], cwd=tmp_path)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["method"] == "best" and out["history"] == [0] and out["share"] >= 0.75 - 1e-9  # FP64 share round-off
    assert math.isfinite(out["loss"])  # x == x let an infinite loss through


WARM_OPS = ["snip_ds_cpu_quant", "ShareMemCommBuilder", "FusedAdamBuilder", "CPUAdamBuilder"]


def test_warm_ops_says_each_op_is_ready_in_the_build_root():
    """Each op says it is ready once; the root printed is the one runs load from."""
    from snip_ds.runtime import jit_builds

    proc = _run([str(REPO / "launch" / "warm_ops.py")], timeout=1200)
    lines = proc.stdout.splitlines()
    assert [line for line in lines if line.startswith("warm_ops: ops build under ")] == [
        f"warm_ops: ops build under {jit_builds.build_root()}"], proc.stdout
    for name in WARM_OPS:
        assert sum(line.startswith(f"warm_ops: {name} ready in ") for line in lines) == 1, (name, proc.stdout)
