"""``launch/train.py --torch_compile``: the settings and flags, the errors before anything starts, and a compiled
run of the training loop (slow) -- one graph under ZeRO-1, the plan's own numbers, an exact resume."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from snip_ds.config.settings import ConfigError, parse_snip_section
from train_utils import REPO, env, scalars, write_configs


# ------------------------------------------------------------------------------------------------ settings
@pytest.mark.parametrize("train, message", [
    ({"torch_compile_mode": "fast"}, "snip.train.torch_compile_mode: must be one of default, reduce-overhead, "
                                     "max-autotune, max-autotune-no-cudagraphs, got 'fast'"),
    ({"torch_compile_backend": " "}, "snip.train.torch_compile_backend: must name a torch.compile backend, got ' '"),
    ({"torch_compile": "yes"}, "snip.train.torch_compile: expected true/false, got 'yes'"),
])
def test_a_bad_compile_setting_is_named(train, message):
    with pytest.raises(ConfigError) as err:
        parse_snip_section({"train": train}, "ds.json")
    assert str(err.value) == f"ds.json: {message}"


@pytest.mark.parametrize("train, compiles", [
    ({}, False), ({"torch_compile": True}, True), ({"torch_compile_backend": "aot_eager"}, True),
    ({"torch_compile_mode": "max-autotune"}, True),
])
def test_a_backend_or_mode_turns_compiling_on_as_in_the_trainer(train, compiles):
    assert parse_snip_section({"train": train}).train.compiles is compiles


def test_the_flags_override_the_json_and_no_flag_keeps_it(tmp_path):
    from snip_ds.config.train_args import build_parser, settings_from_args

    parser = build_parser()
    on = write_configs(tmp_path, stage=1, torch_compile=True, torch_compile_mode="default")
    _, settings = settings_from_args(parser.parse_args(["--deepspeed", str(on)]))
    assert settings.train.torch_compile and settings.train.torch_compile_mode == "default"
    off = write_configs(tmp_path, stage=2)
    _, settings = settings_from_args(parser.parse_args(["--deepspeed", str(off)]))
    assert not settings.train.compiles
    _, settings = settings_from_args(parser.parse_args(["--deepspeed", str(off), "--torch_compile_backend",
                                                        "aot_eager"]))
    assert settings.train.compiles and settings.train.torch_compile_backend == "aot_eager"
    with pytest.raises(SystemExit):  # argparse names the flag and its choices
        parser.parse_args(["--deepspeed", str(off), "--torch_compile_mode", "fast"])


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("stage, flags, json_train, words", [
    (3, ["--torch_compile"], {}, "error: --torch_compile: not with ZeRO stage 3, whose parameter hooks break the "
                                 "graph at every module"),
    (3, [], {"torch_compile": True}, "{config}: snip.train.torch_compile: not with ZeRO stage 3"),
    (1, ["--torch_compile_backend", "nope"], {}, "error: --torch_compile_backend: unknown torch.compile backend "
                                                 "'nope'; known: "),
    (1, [], {"torch_compile_backend": "nope"}, "{config}: snip.train.torch_compile_backend: unknown torch.compile "
                                               "backend 'nope'"),
])
def test_a_run_that_cannot_compile_is_one_error_line_before_anything_is_written(tmp_path, capsys, monkeypatch,
                                                                                 stage, flags, json_train, words):
    from snip_ds.run.trainer import main

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SNIP_DS_SINGLE_PROCESS"):
        monkeypatch.delenv(key, raising=False)
    config = write_configs(tmp_path, stage=stage, **json_train)
    assert main(["--deepspeed", str(config), *flags, "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words.format(config=config) in err, err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ a compiled run
_RUN = """
import json, sys
from snip_ds.run.trainer import main
code = main(sys.argv[1:])
from torch._dynamo.utils import counters
print("RESULT " + json.dumps({"code": code, "breaks": sum(counters["graph_break"].values()),
                              "graphs": counters["stats"]["unique_graphs"]}))
"""


def _train(tmp_path, name: str, config, *flags):
    out = tmp_path / name
    proc = subprocess.run([sys.executable, "-c", _RUN, "--deepspeed", str(config), "--output_dir", str(out),
                           "--no_progress", *flags], cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    return result, scalars(out / "tensorboard"), proc.stdout


@pytest.mark.slow
def test_a_compiled_run_is_one_graph_computes_the_plan_and_resumes_exactly(tmp_path):
    """ZeRO-1, an adaptive plan re-planned at step 2, aot_eager (inductor's graphs, without its code generation):
    no graph break; the first step's loss is eager's bit for bit (the same forward: the compiled layers run the
    plan's quantization); and a compiled run resumed from its step-2 checkpoint logs the uninterrupted compiled
    run's losses bit for bit. Later losses differ from eager's in the last bits: torch.compile sums the gradients
    of a tensor read by several operators (the query, key and value projections' input) in another order, in
    BF16-plan runs too, and FP8's rounding carries such differences on."""
    config = write_configs(tmp_path, stage=1, plan="adaptive", max_steps=4, eval_steps=4, save_steps=2,
                           eval_batches=1)
    data = json.loads(config.read_text())
    data["snip"].update(early_replan_steps=[2], replan_every=1000, additional_bf16_fwd_every_n_steps=2)
    config.write_text(json.dumps(data))
    compiled_flags = ("--torch_compile_backend", "aot_eager")
    _, eager, _ = _train(tmp_path, "eager", config)
    result, compiled, stdout = _train(tmp_path, "compiled", config, *compiled_flags)
    assert result == {"code": 0, "breaks": 0, "graphs": result["graphs"]} and result["graphs"] >= 1
    assert "snip_ds: torch.compile, backend aot_eager: the first step compiles" in stdout
    assert compiled["train/loss"][1] == eager["train/loss"][1]
    assert sorted(compiled["train/loss"]) == [1, 2, 3, 4]
    checkpoint = tmp_path / "compiled" / "checkpoints" / "step_2"
    result, resumed, _ = _train(tmp_path, "resumed", config, *compiled_flags, "--resume_from_checkpoint",
                                str(checkpoint))
    assert result["code"] == 0 and result["breaks"] == 0
    assert {s: resumed["train/loss"][s] for s in (3, 4)} == {s: compiled["train/loss"][s] for s in (3, 4)}
