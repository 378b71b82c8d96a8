"""launch/train.py on bad input: exit code 2, one ``error: ...`` line naming the file or field, no traceback,
and an existing output directory (checkpoints, TensorBoard event files) left byte for byte as it was.

One real 2-rank run provides the output directory and the checkpoints; the failing runs are in-process
``snip_ds.run.trainer.main`` calls (they stop before DeepSpeed starts), plus one through the deepspeed launcher.
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from train_utils import TINY_MODEL, copy_of_run, launch, restore_environ  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.usefixtures("restore_environ")]


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def run(tmp_path_factory, zero3_fp8_run):
    """This module's copy of the shared finished 2-rank ZeRO-3 fp8 run (conftest's ``zero3_fp8_run``): ``out/``
    holds step_1, step_2, latest and TensorBoard event files."""
    run = copy_of_run(zero3_fp8_run, tmp_path_factory.mktemp("train_errors"))
    return {**run, "snapshot": _snapshot(run["out"])}


def _variant(run, name: str, mutate) -> str:
    data = json.loads(run["cfg"].read_text())
    mutate(data)
    path = run["tmp"] / f"{name}.json"
    path.write_text(json.dumps(data))
    return str(path)


def _write(run, name: str, text: str) -> str:
    path = run["tmp"] / name
    path.write_text(text)
    return str(path)


def _interrupted(run) -> str:
    """A copy of the step_1 checkpoint that lost its completion marker (killed while saving)."""
    save_dir = run["tmp"] / "interrupted"
    if not save_dir.exists():
        shutil.copytree(run["out"] / "checkpoints" / "step_1", save_dir / "step_1")
        (save_dir / "step_1" / "snip_meta.json").unlink()
        (save_dir / "latest").write_text("step_1")
    return str(save_dir)


def _universal(run) -> str:
    """DeepSpeed's own ds_to_universal run on the step_1 checkpoint (it converts it; snip_ds cannot resume it)."""
    out = run["tmp"] / "universal" / "step_1_universal"
    if not out.exists():
        proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                               str(run["out"] / "checkpoints" / "step_1"), "--output_folder", str(out)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and (out / "zero").is_dir(), proc.stderr[-3000:]
    return str(out)


def _snip_universal(run) -> str:
    """``snip-ds universal`` of the step_1 checkpoint (saved by 2 ranks, ZeRO-3), run as a command: in this
    process, its first import of transformers would bind transformers' log handler to this test's capsys."""
    out = run["tmp"] / "snip_universal"
    if not out.exists():
        proc = subprocess.run([sys.executable, "-m", "snip_ds.cli", "universal",
                               str(run["out"] / "checkpoints" / "step_1"), str(out)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and (out / "step_1" / "snip_meta.json").is_file(), proc.stderr[-3000:]
    return str(out)


def _without_data(run) -> str:
    """``snip-ds universal``'s step_1 (which 1 rank resumes at gradient accumulation 2) whose snip_meta.json lost its
    data stream position, as a checkpoint written by a user's own loop without it would be."""
    out = run["tmp"] / "without_data"
    if not out.exists():
        shutil.copytree(_snip_universal(run), out)
        meta = json.loads((out / "step_1" / "snip_meta.json").read_text())
        del meta["data"]
        (out / "step_1" / "snip_meta.json").write_text(json.dumps(meta))
    return str(out)


def _zero_layers_plan(run) -> str:
    fqns = [f"model.layers.{i}.{m}" for i in range(TINY_MODEL["num_hidden_layers"])
            for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    return _write(run, "plan_missing.json", json.dumps({f: "fp4" for f in fqns[:-1]}))


# name -> (argv after --deepspeed CFG, or a full argv; substrings the error line must contain)
CASES = {
    "config_missing": (lambda r: ["--deepspeed", str(r["tmp"] / "nope.json")], ["nope.json", "not found"]),
    "config_not_json": (lambda r: ["--deepspeed", _write(r, "bad.json", '{"snip": {')], ["bad.json", "not valid JSON"]),
    "config_not_object": (lambda r: ["--deepspeed", _write(r, "list.json", "[1, 2]")], ["list.json", "JSON object"]),
    "snip_unknown_key": (lambda r: ["--deepspeed", _variant(r, "k1", lambda d: d["snip"].update(lr=1e-3))],
                         ["k1.json", "snip: unknown key(s) 'lr'", "valid keys"]),
    "snip_train_unknown_key": (lambda r: ["--deepspeed", _variant(r, "k2", lambda d: d["snip"]["train"].update(
        max_step=3))], ["k2.json", "snip.train: unknown key(s) 'max_step'"]),
    "snip_quant_unknown_key": (lambda r: ["--deepspeed", _variant(r, "k3", lambda d: d["snip"]["quant"].update(
        fp4="nvfp4"))], ["k3.json", "snip.quant", "'fp4'"]),
    "snip_quant_backend_unknown": (lambda r: ["--deepspeed", _variant(r, "b1", lambda d: d["snip"]["quant"].update(
        backend="cuda"))], ["b1.json", "snip.quant.backend", "'cuda'", "auto, emulated, torch, te"]),
    "snip_quant_backend_te": (lambda r: ["--deepspeed", _variant(r, "b2", lambda d: d["snip"]["quant"].update(
        backend="te"))], ["b2.json", "snip.quant.backend", "backend 'te' cannot run fp8_hybrid on cpu",
                          "Transformer Engine runs on CUDA devices only"]),
    "snip_bad_value": (lambda r: ["--deepspeed", _variant(r, "k4", lambda d: d["snip"].update(plan="fp6"))],
                       ["k4.json", "snip.plan", "'fp6'"]),
    "snip_research_key_flat": (lambda r: ["--deepspeed", _variant(r, "r1", lambda d: d["snip"].update(
        fld_form="channel"))], ["r1.json", "snip.fld_form: moved to snip.research.fld_form"]),
    "snip_research_unknown_key": (lambda r: ["--deepspeed", _variant(r, "r2", lambda d: d["snip"].update(
        research={"fwd_lambda": 0.05}))], ["r2.json", "snip.research: unknown key(s) 'fwd_lambda'", "valid keys"]),
    "zero_stage": (lambda r: ["--deepspeed", _variant(r, "z1", lambda d: d["zero_optimization"].update(stage=4))],
                   ["z1.json", "zero_optimization.stage"]),
    "zero_misspelt_key": (lambda r: ["--deepspeed", _variant(r, "z2", lambda d: d["zero_optimization"].update(
        contiguous_gradient=True))], ["z2.json", "zero_optimization.contiguous_gradient"]),
    "optimizer_type": (lambda r: ["--deepspeed", _variant(r, "o1", lambda d: d["optimizer"].update(type="Adamm"))],
                       ["o1.json", "optimizer.type", "'Adamm'"]),
    "scheduler_type": (lambda r: ["--deepspeed", _variant(r, "o2", lambda d: d["scheduler"].update(type="Cos"))],
                       ["o2.json", "scheduler.type", "'Cos'"]),
    "batch_size": (lambda r: ["--deepspeed", str(r["cfg"]), "--per_device_train_batch_size", "0"],
                   ["train_micro_batch_size_per_gpu", "positive integer"]),
    "plan_extra_layer": (lambda r: ["--deepspeed", str(r["cfg"]), "--plan", _write(
        r, "plan_extra.json", json.dumps({"model.layers.7.mlp.up_proj": "fp8"}))],
        ["plan_extra.json", "model lacks: model.layers.7.mlp.up_proj", "the plan misses"]),
    "plan_missing_layer": (lambda r: ["--deepspeed", str(r["cfg"]), "--plan", _zero_layers_plan(r)],
                           ["plan_missing.json", "1 model layer(s) the plan misses: model.layers.1.mlp.down_proj"]),
    "plan_file_missing": (lambda r: ["--deepspeed", str(r["cfg"]), "--plan", str(r["tmp"] / "noplan.json")],
                          ["noplan.json", "not found"]),
    "dataset_missing": (lambda r: ["--deepspeed", str(r["cfg"]), "--dataset", str(r["tmp"] / "nodata.txt")],
                        ["nodata.txt", "does not exist"]),
    "dataset_below_one_block": (lambda r: ["--deepspeed", str(r["cfg"]), "--dataset", _write(
        r, "tiny.txt", "tiny")], ["tiny.txt", "block_size 64"]),
    "dataset_below_one_batch": (lambda r: ["--deepspeed", str(r["cfg"]), "--dataset", _write(
        r, "small.txt", "x" * 300)], ["small.txt", "validation split", "fewer than one global batch"]),
    "model_config_missing": (lambda r: ["--deepspeed", str(r["cfg"]), "--model_config", str(r["tmp"] / "m.json")],
                             ["m.json", "does not exist"]),
    "checkpoint_missing": (lambda r: ["--deepspeed", str(r["cfg"]), "--resume_from_checkpoint",
                                      str(r["tmp"] / "nockpt")], ["nockpt", "does not exist"]),
    "checkpoint_world_size": (lambda r: ["--deepspeed", str(r["cfg"]), "--resume_from_checkpoint",
                                         str(r["out"] / "checkpoints")],
                              ["step_2/snip_meta.json", "world_size is 2", "1 ranks"]),
    "checkpoint_other_model": (lambda r: ["--deepspeed", str(r["cfg"]), "--resume_from_checkpoint",
                                          str(r["out"] / "checkpoints" / "step_1"), "--model_config", _write(
        r, "wide.json", json.dumps({**TINY_MODEL, "intermediate_size": 192}))],
        ["step_1/snip_meta.json", "different model"]),
    # 8 heads of 8 and 4 KV heads: every parameter keeps its name and shape, but attention computes otherwise
    "checkpoint_same_shapes_other_heads": (lambda r: ["--deepspeed", str(r["cfg"]), "--resume_from_checkpoint",
                                                      str(r["out"] / "checkpoints" / "step_1"), "--model_config",
                                                      _write(r, "heads.json", json.dumps({
                                                          **TINY_MODEL, "num_attention_heads": 8,
                                                          "num_key_value_heads": 4}))],
                                           ["step_1/snip_meta.json", "different model",
                                            "model_architecture.num_attention_heads is 4 there and 8 here",
                                            "model_architecture.num_key_value_heads is 2 there and 4 here"]),
    # JetMoE's experts: one [E, 2·inner, hidden] weight per projection module, no layout snip_ds can prove
    "model_moe_unknown_experts": (lambda r: ["--deepspeed", str(r["cfg"]), "--model_config", _write(
        r, "moe.json", json.dumps({**TINY_MODEL, "model_type": "jetmoe", "kv_channels": 16,
                                   "num_local_experts": 4, "num_experts_per_tok": 2}))],
        ["JetMoeForCausalLM: experts module 'model.layers.0.mlp.input_linear'",
         "fit no layout snip_ds knows"]),
    "exclude_matches_nothing": (lambda r: ["--deepspeed", _variant(r, "x1", lambda d: d["snip"].update(
        exclude=["*.qkv_proj"]))], ["snip.exclude: pattern '*.qkv_proj' matches no decoder linear of "
                                    "LlamaForCausalLM"]),
    "exclude_empty_pattern": (lambda r: ["--deepspeed", _variant(r, "x2", lambda d: d["snip"].update(
        exclude=[""]))], ["x2.json", "snip.exclude: an empty pattern matches nothing"]),
    "tensor_parallel": (lambda r: ["--deepspeed", _variant(r, "tp", lambda d: d.update(
                            tensor_parallel={"autotp_size": 2}))],
                        ["tp.json", "tensor_parallel.autotp_size 2 does not divide the world size 1"]),
    "checkpoint_interrupted_tag": (lambda r: ["--deepspeed", str(r["cfg"]), "--resume_from_checkpoint",
                                              _interrupted(r) + "/step_1"],
                                   ["interrupted/step_1", "not a complete snip_ds checkpoint",
                                    "its save was interrupted"]),
    "checkpoint_universal": (lambda r: ["--deepspeed", str(r["cfg"]), "--resume_from_checkpoint", _universal(r)],
                             ["step_1_universal: a DeepSpeed universal checkpoint without snip_ds's files",
                              "convert the snip_ds checkpoint it came from with 'snip-ds universal"]),
    "checkpoint_universal_other_stage": (lambda r: ["--deepspeed", _variant(r, "s1", lambda d: d.update(
        zero_optimization={"stage": 1})), "--gradient_accumulation_steps", "2", "--resume_from_checkpoint",
        _snip_universal(r)], ["snip_universal/step_1/snip_meta.json: universal.zero_stage is 3, but this run's "
                              "zero_optimization.stage is 1"]),
    "checkpoint_without_data_position": (lambda r: ["--deepspeed", str(r["cfg"]), "--gradient_accumulation_steps",
                                                    "2", "--resume_from_checkpoint", _without_data(r)],
                                         ["without_data/step_1/snip_meta.json: field 'data' missing",
                                          "no data stream position"]),
    "checkpoint_interrupted_latest": (lambda r: ["--deepspeed", str(r["cfg"]), "--resume_from_checkpoint",
                                                 _interrupted(r)],
                                      ["interrupted/latest", "not a complete snip_ds checkpoint"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_stops_with_one_line_and_writes_nothing(run, case, capsys):
    import logging

    from snip_ds.run.trainer import main

    # transformers' log handler writes to the sys.stderr of the test that first logged (capsys's, closed after
    # that test), and its flush is bound to that stream too: a later warning would print logging's own
    # "--- Logging error --- Traceback" here. Point both at this test's stderr.
    for handler in logging.getLogger("transformers").handlers:
        if type(handler) is logging.StreamHandler:
            handler.stream = sys.stderr  # (setStream would flush the closed stream first)
            vars(handler).pop("flush", None)
    make_argv, expected = CASES[case]
    argv = make_argv(run) + ["--output_dir", str(run["out"]), "--no_progress"]
    code = main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2, err
    assert len(errors) == 1, err
    for text in expected:
        assert text in errors[0], (text, errors[0])
    assert "Traceback" not in err
    assert _snapshot(run["out"]) == run["snapshot"]  # nothing added, removed or rewritten


def test_launcher_exit_code_and_stderr(run):
    """Through the deepspeed launcher (1 rank resuming a 2-rank checkpoint): the launcher exits 2, its stderr
    carries one error line, and neither stream has a traceback."""
    proc = launch(["--deepspeed", str(run["cfg"]), "--resume_from_checkpoint", str(run["out"] / "checkpoints")],
                  num_ranks=1, launcher="deepspeed")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "world_size is 2" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert _snapshot(run["out"]) == run["snapshot"]


def test_zero3_checkpoint_resumes_on_as_many_ranks_through_universal_as_the_run_went_on(run):
    """step_1 of the 2-rank ZeRO-3 run (fp8), converted by ``snip-ds universal``, resumed on 2 ranks through
    DeepSpeed's universal loading: step 2's loss, the plan and the step counters are the uninterrupted run's.

    Same ranks, same micro-batches, the same fp32 master weights and Adam moments (ds_to_universal copies
    them, merged across the partitions and split again alike), the same generators (each rank's own file):
    step 2 repeats the uninterrupted run's operations, so its loss is equal (allowed: 1 ulp of fp32 at ~5.5,
    4 * 2**-23, for a reduction DeepSpeed might order otherwise after a universal load)."""
    from train_utils import scalars

    universal = _snip_universal(run)
    out = run["tmp"] / "resumed_on_2"
    proc = launch(["--deepspeed", str(run["cfg"]), "--resume_from_checkpoint", universal, "--output_dir", str(out)],
                  num_ranks=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "at step 1 (universal, saved by 2 rank(s), resumed by 2)" in proc.stdout
    loss = scalars(out / "tensorboard")["train/loss"]
    ref = scalars(run["out"] / "tensorboard")["train/loss"]
    assert sorted(loss) == [2] and abs(loss[2] - ref[2]) <= 4 * 2.0 ** -23, (loss, ref)
    meta = json.loads((out / "checkpoints" / "step_2" / "snip_meta.json").read_text())
    assert meta["step"] == 2 and meta["world_size"] == 2 and meta["data"]["step"] == 2
    plans = [json.loads((d / "checkpoints" / "step_2" / "snip_state.json").read_text())["plan"]
             for d in (out, run["out"])]
    assert plans[0] == plans[1]
    assert _snapshot(run["out"]) == run["snapshot"]
