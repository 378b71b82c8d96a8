"""Reading a plan or statistics back from whatever a user points `snip-ds` at, and writing them atomically."""
import json

import pytest

from snip_ds.report.artifacts import (CHECKPOINT_FORMAT, CHECKPOINT_LATEST_FILE, CHECKPOINT_META_FILE, load_plan,
                               load_stats, write_plan, write_stats)
from snip_ds.plan import Plan

FQNS = [f"model.layers.0.self_attn.{n}" for n in ("q_proj", "k_proj")]


def _stats():
    return {"format": "snip_ds.stats/1", "step": 4, "lr": 1e-3, "world_size": 1,
            "layers": {f: {"flops": 1e9, "fld": {"fp8": 1e-6, "fp4": 1e-4}, "bwd": {"fp8": 1e-7, "fp4": 1e-5},
                           "quant_err": {"fp8": 1.0, "fp4": 9.0}, "rel_quant_err": {"fp8": 0.1, "fp4": 0.9}}
                       for f in FQNS}}


def _checkpoint(root, plan, stats):
    tag = root / "step_8"
    tag.mkdir(parents=True)
    meta = {"format": CHECKPOINT_FORMAT, "step": 8, "plan": plan.to_dict(),
            "planner": None if stats is None else {"last_stats": stats}}
    (tag / CHECKPOINT_META_FILE).write_text(json.dumps(meta))
    (root / CHECKPOINT_LATEST_FILE).write_text("step_8")
    return tag


def test_plan_and_stats_from_files_output_and_checkpoint_directories(tmp_path):
    plan = Plan.fixed({FQNS[0]: "fp4", FQNS[1]: "fp8"}, {f: 1.0 for f in FQNS})
    write_plan(tmp_path / "run", plan)
    write_stats(tmp_path / "run", _stats())
    tag = _checkpoint(tmp_path / "run" / "checkpoints", plan, _stats())
    for where in ("run", "run/plan.json", "run/checkpoints", "run/checkpoints/step_8"):
        assert load_plan(tmp_path / where)[0].assignment == plan.assignment, where
    for where in ("run", "run/stats.json", "run/checkpoints", "run/checkpoints/step_8"):
        assert load_stats(tmp_path / where)[0] == _stats(), where
    assert load_plan(tag)[1] == str(tag)  # named in the output as the checkpoint
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoints", "plan.json", "stats.json"]


@pytest.mark.parametrize("content, loader, message", [
    ({"format": CHECKPOINT_FORMAT, "step": 3}, load_plan,
     "is a snip_ds checkpoint metadata file, not a plan; pass its directory"),
    ({"format": CHECKPOINT_FORMAT, "step": 3}, load_stats,
     "is a snip_ds checkpoint metadata file, not a statistics file; pass its directory"),
    ({"data": {"epoch": 0}, "step": 3}, load_plan, "is not a snip_ds plan or statistics file (no 'format' field)"),
    ([1, 2], load_stats, "is not a snip_ds plan or statistics file (a JSON list)"),
    ({"format": "snip_ds.other/7"}, load_plan, "'format' is 'snip_ds.other/7', not a snip_ds plan"),
    (_stats(), load_plan, "is a snip_ds statistics file, not a plan; solve a plan from it with 'snip-ds plan"),
    ({FQNS[0]: "fp8"}, load_stats, "is a snip_ds plan file, not a statistics file"),
])
def test_a_wrong_file_says_what_it_is(tmp_path, content, loader, message):
    path = tmp_path / "f.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError) as err:
        loader(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value) and "\n" not in str(err.value)


def test_directories_without_a_plan_or_statistics(tmp_path):
    with pytest.raises(ValueError, match="neither plan.json nor a snip_ds checkpoint"):
        load_plan(tmp_path)
    (tmp_path / "latest").write_text("step_9")
    with pytest.raises(ValueError, match="points to .*step_9, which is not a complete snip_ds checkpoint"):
        load_plan(tmp_path)
    plan = Plan.fixed({f: "fp8" for f in FQNS}, {f: 1.0 for f in FQNS})
    tag = _checkpoint(tmp_path / "fixed", plan, None)
    with pytest.raises(ValueError, match="the checkpoint holds no statistics"):
        load_stats(tag)
    with pytest.raises(FileNotFoundError):
        load_plan(tmp_path / "missing")


def test_a_failed_write_keeps_the_previous_file(tmp_path):
    write_stats(tmp_path, _stats())
    before = (tmp_path / "stats.json").read_text()
    bad = _stats()
    bad["lr"] = float("nan")  # not JSON: refused before anything is written
    with pytest.raises(ValueError):
        write_stats(tmp_path, bad)
    assert (tmp_path / "stats.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats.json"]  # no temporary file left
