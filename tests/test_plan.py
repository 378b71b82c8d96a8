"""Tests for snip_ds.plan: validation, JSON round trip, atomic save, digest, FP4 share."""
import json
import os

import pytest

from snip_ds import plan as plan_mod
from snip_ds.plan import Plan, fp4_share
from snip_ds.types import GEMMS, PRECISIONS

FQNS = [f"model.layers.{b}.mlp.{n}" for b in range(2) for n in ("up_proj", "down_proj")]
FLOPS = {fqn: float(i + 1) for i, fqn in enumerate(FQNS)}  # 1, 2, 3, 4 -> total 10


def test_constants():
    assert PRECISIONS == ("bf16", "fp8", "fp4")
    assert GEMMS == ("fprop", "dgrad", "wgrad")


def test_fp4_share_per_layer_and_per_gemm():
    a = {FQNS[0]: "fp4", FQNS[1]: "fp8", FQNS[2]: "bf16", FQNS[3]: "fp4"}
    assert fp4_share(a, FLOPS) == pytest.approx((1 + 4) / 10)
    # One GEMM of the 2-FLOP layer in fp4 = 2/3 FLOPs; two GEMMs of the 3-FLOP layer = 2.
    b = {FQNS[0]: "fp8", FQNS[1]: {"fprop": "fp4", "dgrad": "fp8", "wgrad": "fp8"},
         FQNS[2]: {"fprop": "fp4", "dgrad": "fp4", "wgrad": "bf16"}, FQNS[3]: "fp8"}
    assert fp4_share(b, FLOPS) == pytest.approx((2 / 3 + 2) / 10)


def test_fp4_share_rejects_mismatched_keys():
    with pytest.raises(ValueError, match="different layers"):
        fp4_share({FQNS[0]: "fp4"}, FLOPS)


def test_plan_is_frozen_and_read_only():
    p = Plan.fixed({fqn: "fp8" for fqn in FQNS}, FLOPS)
    with pytest.raises(Exception):
        p.status = "x"
    with pytest.raises(TypeError):
        p.assignment[FQNS[0]] = "fp4"
    with pytest.raises(TypeError):
        p.meta["x"] = 1


def test_per_gemm_normalisation_and_precision_of():
    p = Plan.fixed({FQNS[0]: "fp4", FQNS[1]: {"fprop": "fp8", "dgrad": "fp4", "wgrad": "bf16"}})
    assert p.per_gemm
    assert p.precision_of(FQNS[0], "wgrad") == "fp4"  # string entry expanded to every GEMM
    assert p.precision_of(FQNS[1]) == "fp8"
    assert p.precision_of(FQNS[1], "dgrad") == "fp4"
    assert p.precision_of(FQNS[1], "wgrad") == "bf16"
    with pytest.raises(ValueError, match="unknown GEMM"):
        p.precision_of(FQNS[1], "bprop")
    with pytest.raises(ValueError, match="no layer"):
        p.precision_of("nope")
    q = Plan.uniform(FQNS, "fp4", FLOPS)
    assert not q.per_gemm and q.fp4_share == 1.0 and q.method == "uniform_fp4"
    assert Plan.uniform(FQNS, "fp8").fp4_share == 0.0


@pytest.mark.parametrize("bad, match", [
    ({"a.0.q": "fp16"}, "valid precisions are bf16, fp8, fp4"),
    ({"a.0.q": {"fprop": "fp8", "dgrad": "fp8", "bprop": "fp8"}}, "unknown GEMM"),
    ({"a.0.q": {"fprop": "fp8"}}, "lacks GEMM"),
    ({"a.0.q": 4}, "precision 4"),
    ({}, "empty"),
])
def test_bad_assignments(bad, match):
    with pytest.raises(ValueError, match=match):
        Plan.fixed(bad)


def test_round_trip_dict_and_file(tmp_path):
    p = Plan(assignment={FQNS[0]: "fp4", FQNS[1]: "fp8", FQNS[2]: "fp4", FQNS[3]: "bf16"},
             fp4_share=0.4, objective=1.5, status="optimal", method="best",
             meta={"step": 100, "rho": 0.4, "lambda": 100.0, "seed": None, "note": "x"})
    assert Plan.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    path = tmp_path / "plan.json"
    p.save(path)
    q = Plan.load(path)
    assert q == p and q.digest() == p.digest() and hash(q) == hash(p)
    g = Plan.fixed({fqn: {"fprop": "fp4", "dgrad": "fp8", "wgrad": "fp8"} for fqn in FQNS}, FLOPS)
    g.save(path)
    assert Plan.load(path) == g


def test_digest_depends_only_on_assignment():
    a = {FQNS[0]: "fp4", FQNS[1]: "fp8"}
    p = Plan.fixed(a)
    q = Plan(assignment=dict(reversed(list(a.items()))), fp4_share=0.3, status="optimal", method="best")
    assert p.digest() == q.digest()
    assert Plan.fixed({FQNS[0]: "fp8", FQNS[1]: "fp8"}).digest() != p.digest()
    # A per-layer plan and its per-GEMM spelling with a string entry expanded are the same plan.
    r = Plan.fixed({FQNS[0]: "fp4", FQNS[1]: {"fprop": "fp8", "dgrad": "fp8", "wgrad": "fp8"}})
    assert r.gemm_assignment() == p.gemm_assignment()


def test_load_bare_mapping(tmp_path):
    path = tmp_path / "user.json"
    path.write_text(json.dumps({FQNS[0]: "fp4", FQNS[1]: "fp8", FQNS[2]: "fp8", FQNS[3]: "fp4"}))
    p = Plan.load(path)
    assert p.status == "fixed" and p.method == "file" and p.fp4_share is None
    assert Plan.load(path, flops=FLOPS).fp4_share == pytest.approx(0.5)


@pytest.mark.parametrize("text, match", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"a.0.q": "int8"}', "layer 'a.0.q' has precision 'int8'"),
    ('{"assignment": {"a.0.q": "fp8"}, "fp4_share": "half"}', "'fp4_share' must be a number"),
    ('{"assignment": {"a.0.q": "fp8"}, "status": 3}', "'status' must be a string"),
    ('{"assignment": {"a.0.q": "fp8"}, "meta": {"x": [1]}}', r"meta\['x'\] must be a JSON scalar"),
    ('{"assignment": {"a.0.q": "fp8"}, "colour": 1}', "unknown field"),
    ('{"format": "other/9", "assignment": {"a.0.q": "fp8"}}', "'format'"),
])
def test_load_errors_name_file_and_field(tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as e:
        Plan.load(path)
    assert str(path) in str(e.value)


def test_load_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        Plan.load(tmp_path / "nope.json")


def test_a_binary_plan_or_statistics_file_is_refused_in_one_line_naming_it(tmp_path):
    from snip_ds.stats_file import load_stats
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(128, 256)))
    for load, what in ((Plan.load, "plan"), (load_stats, "statistics")):
        with pytest.raises(ValueError, match=f"not a {what} file \\(not UTF-8 text\\)") as e:
            load(str(path))
        assert str(path) in str(e.value)


def test_check_layers():
    p = Plan.fixed({FQNS[0]: "fp8", FQNS[1]: "fp8", "model.layers.9.extra": "fp4"})
    p.check_layers([FQNS[0], FQNS[1], "model.layers.9.extra"])
    with pytest.raises(ValueError) as e:
        p.check_layers(FQNS, source="my_plan.json")
    msg = str(e.value)
    assert "my_plan.json" in msg
    assert "1 layer(s) the model lacks: model.layers.9.extra" in msg
    assert "2 model layer(s) the plan misses" in msg and FQNS[2] in msg


def test_check_layers_lists_first_few_and_count():
    p = Plan.fixed({"x": "fp8"})
    many = [f"model.layers.{i}.q" for i in range(20)]
    with pytest.raises(ValueError, match=r"20 model layer\(s\) the plan misses: .*\(\+15 more\)"):
        p.check_layers(many + ["x"])


def test_atomic_save_keeps_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    old = Plan.fixed({FQNS[0]: "fp8"})
    old.save(path)
    before = path.read_bytes()
    new = Plan.fixed({FQNS[0]: "fp4"})

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(plan_mod.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        new.save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["plan.json"]  # no temp file left behind


def test_atomic_save_fails_before_touching_file_on_bad_write(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    Plan.fixed({FQNS[0]: "fp8"}).save(path)
    before = path.read_bytes()

    def bad_fsync(fd):
        raise OSError("io error")

    monkeypatch.setattr(plan_mod.os, "fsync", bad_fsync)
    with pytest.raises(OSError, match="io error"):
        Plan.fixed({FQNS[0]: "fp4"}).save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["plan.json"]
