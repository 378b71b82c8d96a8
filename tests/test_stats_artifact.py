"""snip_ds.stats_file: the statistics file's bytes, the non-finite flag and the reader's checks."""
import math

import pytest

from snip_ds.report.artifacts import write_stats
from snip_ds.stats_file import STATS_FORMAT, clean_layer, load_stats, save_stats, stats_header


def _stats():
    head = stats_header(step=3, lr=1e-3, world_size=2, estimator="mc_fisher", num_probes=1, fld_form="sequence",
                        step_scale=1.0, bwd_rounding="recipe", precond="tensor", batches=1, tokens=64, loss=5.5,
                        seed=0, forward_drift=False, lam=2.0)
    layer = clean_layer({"flops": 6.0, "fld": {"fp8": 1e-7, "fp4": 2e-6}, "bwd": {"fp8": 0.0, "fp4": 1e-9}})
    return {**head, "layers": {"model.layers.0.mlp.up_proj": layer}}


def test_header_order_and_optional_lambda():
    s = _stats()
    assert list(s)[:3] == ["format", "step", "lr"] and s["format"] == STATS_FORMAT and s["lambda"] == 2.0
    no_lam = stats_header(step=0, lr=0.0, world_size=1, estimator="empirical", num_probes=1, fld_form="channel",
                          step_scale=1.0, bwd_rounding="nearest", precond="none", batches=1, tokens=1, loss=1.0,
                          seed=0, forward_drift=False, lam=None)
    assert "lambda" not in no_lam and no_lam["study_fields"] == []


def test_clean_layer_flags_nonfinite_values():
    rec = clean_layer({"flops": 1.0, "fld": {"fp8": math.nan, "fp4": 1.0}, "bwd": {"fp8": math.inf, "fp4": 0.0}})
    assert rec["nonfinite"] is True and rec["fld"]["fp8"] is None and rec["bwd"]["fp8"] is None
    assert clean_layer({"flops": 1.0, "fld": {"fp8": 0.5}})["nonfinite"] is False


# _stats() as its file holds it, written out by hand: the header in its documented order, one space per level,
# numbers as Python writes the shortest round-tripping decimal, false/[] as JSON spells them.
EXPECTED_TEXT = """{
 "format": "snip_ds.stats/1",
 "step": 3,
 "lr": 0.001,
 "world_size": 2,
 "estimator": "mc_fisher",
 "num_probes": 1,
 "fld_form": "sequence",
 "step_scale": 1.0,
 "bwd_rounding": "recipe",
 "precond": "tensor",
 "batches": 1,
 "tokens": 64,
 "loss": 5.5,
 "seed": 0,
 "forward_drift": false,
 "study_fields": [],
 "lambda": 2.0,
 "layers": {
  "model.layers.0.mlp.up_proj": {
   "flops": 6.0,
   "fld": {
    "fp8": 1e-07,
    "fp4": 2e-06
   },
   "bwd": {
    "fp8": 0.0,
    "fp4": 1e-09
   },
   "nonfinite": false
  }
 }
}"""


def test_file_bytes_and_round_trip(tmp_path):
    s = _stats()
    save_stats(s, str(tmp_path / "a.json"))
    write_stats(tmp_path / "run", s)
    bare = (tmp_path / "a.json").read_text(encoding="utf-8")
    assert bare == EXPECTED_TEXT                                  # a bare file: no final newline
    assert (tmp_path / "run" / "stats.json").read_text(encoding="utf-8") == EXPECTED_TEXT + "\n"  # a run's: one
    assert load_stats(str(tmp_path / "a.json")) == s


def test_reader_names_the_bad_field(tmp_path):
    s = _stats()
    s["layers"]["model.layers.0.mlp.up_proj"]["bwd"] = {"fp8": 0.0}
    save_stats(s, str(tmp_path / "b.json"))
    with pytest.raises(ValueError, match=r"b.json: layers\['model.layers.0.mlp.up_proj'\].bwd lacks precision"):
        load_stats(str(tmp_path / "b.json"))
    with pytest.raises(ValueError, match="allow|JSON|Out of range"):
        save_stats({**s, "lr": math.nan}, str(tmp_path / "c.json"))


def test_reader_names_a_bad_study_fields_header(tmp_path):
    s = _stats()
    for bad, msg in ((["quant_err", "fld"], r"c.json: field study_fields: unknown group\(s\) 'fld'"),
                     ("quant_err", r"c.json: field 'study_fields' must be a list of group names")):
        save_stats({**s, "study_fields": bad}, str(tmp_path / "c.json"))
        with pytest.raises(ValueError, match=msg):
            load_stats(str(tmp_path / "c.json"))
    save_stats({**s, "study_fields": ["quant_err"]}, str(tmp_path / "d.json"))
    assert load_stats(str(tmp_path / "d.json"))["study_fields"] == ["quant_err"]
