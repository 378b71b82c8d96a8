"""The "snip" section: plan-shape settings (allowed precisions, compute budget, FP4 share cap), and the research
keys under "snip.research"."""
import json

import pytest

from snip_ds.config.settings import ConfigError, SnipSettings, parse_snip_section


def test_defaults_are_two_precisions_without_budget():
    s = parse_snip_section({})
    assert s.allowed == ("fp8", "fp4") and s.compute_budget is None and s.max_share is None


def test_fld_form_defaults_to_sequence_and_parses():
    assert parse_snip_section({}).fld_form == "sequence"
    assert parse_snip_section({"research": {"fld_form": "channel"}}).fld_form == "channel"


def test_three_precisions_budget_and_cap_parse_and_round_trip():
    s = parse_snip_section({"allowed": ["bf16", "fp8", "fp4"], "compute_budget": 0.4, "research": {"max_share": 0.9}})
    assert s.allowed == ("bf16", "fp8", "fp4") and s.compute_budget == 0.4 and s.max_share == 0.9
    again = parse_snip_section(json.loads(json.dumps(s.to_dict())))  # as a checkpoint stores it
    assert again == s


@pytest.mark.parametrize("section, match", [
    ({"allowed": "fp8"}, "snip.allowed: expected a list of strings"),
    ({"allowed": ["fp8", "int4"]}, "snip.allowed: unknown value 'int4'"),
    ({"allowed": []}, "snip.allowed: must name at least one"),
    ({"allowed": ["bf16", "fp8"]}, "snip.allowed: .* has no fp4"),
    ({"compute_budget": 0}, r"snip.compute_budget: must lie in \(0, 1\]"),
    ({"compute_budget": "half"}, "snip.compute_budget: expected a number"),
    ({"collect_tf32": "yes"}, "snip.collect_tf32: expected true/false, got 'yes'"),
    ({"efficiency_saving": 0.75, "research": {"max_share": 0.5}},
     r"snip.research.max_share: must lie in \[efficiency_saving, 1\]"),
    ({"research": {"fld_form": "token"}}, "snip.research.fld_form: unknown value 'token'"),
    ({"research": {"estimator": "hessian"}}, "snip.research.estimator: unknown value 'hessian'"),
    ({"research": {"dgrad_cost": "half"}}, "snip.research.dgrad_cost: unknown value 'half'"),
    ({"research": {"bwd_rounding": "stochastic"}}, "snip.research.bwd_rounding: unknown value 'stochastic'"),
    ({"research": {"bwd_estimate": "bias"}}, "snip.research.bwd_estimate: unknown value 'bias'"),
    ({"research": {"dgrad_cost": "upstream"}}, "snip.research.dgrad_cost: 'upstream' .* needs snip.per_gemm: true"),
    ({"per_gemm": True, "research": {"dgrad_cost": "upstream", "dgrad_calibration": 0}},
     "snip.research.dgrad_calibration: must be"),
    ({"research": {"dgrad_calibration": "x"}}, "snip.research.dgrad_calibration: expected a number"),
    ({"research": {"max_share": "all"}}, "snip.research.max_share: expected a number or null"),
    ({"research": ["fld_form"]}, "snip.research: expected a JSON object, got list"),
    ({"train": {"seed": -1}}, r"snip.train.seed: must lie in \[0, 2\*\*63\), got -1"),
    ({"train": {"seed": 2 ** 63}}, r"snip.train.seed: must lie in \[0, 2\*\*63\), got 9223372036854775808"),
])
def test_bad_values_name_the_field(section, match):
    with pytest.raises(ConfigError, match=match):
        parse_snip_section(section)


def test_no_fp4_is_fine_when_nothing_must_move_to_fp4():
    assert parse_snip_section({"allowed": ["bf16", "fp8"], "efficiency_saving": 0.0}).allowed == ("bf16", "fp8")
    # constructed directly, the defaults pass their own validation and are the documented ones
    d = SnipSettings()
    assert (d.allowed, d.compute_budget, d.max_share, d.fld_form) == (("fp8", "fp4"), None, None, "sequence")


def test_dgrad_cost_parses_and_matches_the_planner():
    from snip_ds.planner import DGRAD_COSTS
    from snip_ds.config.settings import DGRAD_COSTS as CONFIG_DGRAD_COSTS
    assert CONFIG_DGRAD_COSTS is DGRAD_COSTS  # one definition, the cost model's
    assert parse_snip_section({}).dgrad_cost == "split"
    s = parse_snip_section({"per_gemm": True, "research": {"dgrad_cost": "upstream", "dgrad_calibration": 30}})
    assert (s.dgrad_cost, s.dgrad_calibration) == ("upstream", 30.0)


def test_bwd_settings_parse_and_match_the_collector_and_planner():
    from snip_ds.quant_config import BWD_ROUNDINGS
    from snip_ds.planner import BWD_ESTIMATES
    from snip_ds.config.settings import BWD_ESTIMATES as CONFIG_BWD_ESTIMATES
    assert CONFIG_BWD_ESTIMATES is BWD_ESTIMATES and BWD_ROUNDINGS == ("recipe", "nearest")
    s = parse_snip_section({})
    assert (s.bwd_rounding, s.bwd_estimate) == ("recipe", "expected")
    s = parse_snip_section({"research": {"bwd_rounding": "nearest", "bwd_estimate": "systematic"}})
    assert (s.bwd_rounding, s.bwd_estimate) == ("nearest", "systematic")


# The keys that moved under "snip.research", each with a valid value other than its default; written out here
# rather than read from RESEARCH_KEYS so that a key leaving or joining the research section shows up as a change.
RESEARCH = {"estimator": "empirical", "fld_form": "channel", "bwd_rounding": "nearest", "bwd_estimate": "systematic",
            "dgrad_cost": "upstream", "dgrad_calibration": 15.0, "max_share": 0.9, "study_fields": ["quant_err"]}


def _listed(value):
    """A setting as JSON holds it (tuples are lists there)."""
    return list(value) if isinstance(value, tuple) else value


def test_research_keys_parse_from_the_research_section():
    from snip_ds.config.settings import RESEARCH_KEYS
    assert set(RESEARCH_KEYS) == set(RESEARCH)
    s = parse_snip_section({"per_gemm": True, "research": RESEARCH})
    assert {k: _listed(getattr(s, k)) for k in RESEARCH} == RESEARCH
    assert parse_snip_section({"research": {}}) == parse_snip_section({}) == SnipSettings()


@pytest.mark.parametrize("key", sorted(RESEARCH))
def test_a_flat_research_key_names_its_new_place(key, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"snip": {"per_gemm": True, key: RESEARCH[key]}}))
    from snip_ds.config.settings import load_ds_config
    with pytest.raises(ConfigError) as err:
        load_ds_config(path)
    assert str(err.value) == f"{path}: snip.{key}: moved to snip.research.{key}"


def test_several_flat_research_keys_are_named_in_one_line():
    # the research keys the shipped configs listed at the top before they moved
    old = {"plan": "adaptive", "estimator": "mc_fisher", "bwd_rounding": "recipe", "bwd_estimate": "expected"}
    with pytest.raises(ConfigError) as err:
        parse_snip_section(old, "old.json")
    assert str(err.value) == ("old.json: snip.estimator: moved to snip.research.estimator; "
                              "snip.bwd_rounding: moved to snip.research.bwd_rounding; "
                              "snip.bwd_estimate: moved to snip.research.bwd_estimate")


def test_unknown_research_key_is_named_like_the_top_level():
    with pytest.raises(ConfigError, match=r"cfg.json: snip.research: unknown key\(s\) 'fwd_lambda'; valid keys: "
                                          r"bwd_estimate, bwd_rounding, .*max_share, study_fields$"):
        parse_snip_section({"research": {"fwd_lambda": 0.05, "fld_form": "channel"}}, "cfg.json")
    with pytest.raises(ConfigError, match=r"snip: unknown key\(s\) 'reserch'; valid keys: .*research"):
        parse_snip_section({"reserch": {}})


def test_to_dict_has_the_section_shape_and_reads_back():
    s = parse_snip_section({"per_gemm": True, "research": RESEARCH, "train": {"max_steps": 7}})
    d = json.loads(json.dumps(s.to_dict()))  # as a checkpoint and the TensorBoard summary store it
    assert d["research"] == RESEARCH and not set(RESEARCH) & set(d)
    assert d["per_gemm"] is True and d["train"]["max_steps"] == 7
    assert parse_snip_section(d) == s


def test_overrides_keep_the_research_keys():
    from snip_ds.config.settings import with_overrides
    s = parse_snip_section({"per_gemm": True, "research": RESEARCH})
    over = with_overrides(s, seed=3, plan="fp4", fld_form="sequence")
    assert (over.train.seed, over.plan, over.fld_form) == (3, "fp4", "sequence")
    assert {k: _listed(getattr(over, k)) for k in RESEARCH if k != "fld_form"} == {k: v for k, v in RESEARCH.items()
                                                                          if k != "fld_form"}


def test_shipped_configs_parse_and_hold_only_user_keys_at_the_top():
    from train_utils import REPO
    from snip_ds.config.settings import load_ds_config
    for path in sorted((REPO / "ds_configs").glob("*.json")):
        section = json.loads(path.read_text())["snip"]
        assert not set(RESEARCH) & set(section), path.name
        load_ds_config(path)


@pytest.mark.slow
@pytest.mark.distributed
def test_checkpoint_with_flat_settings_resumes_exactly(tmp_path):
    """Checkpoints written before the research keys moved store the settings flat (``"fld_form"`` beside
    ``"plan"``). Resume reads the plan, the data position and the RNG states, never those settings, so such a
    checkpoint resumes, and steps 4-6 repeat the uninterrupted run's losses bit for bit."""
    from train_utils import launch, scalars, write_configs
    cfg = write_configs(tmp_path, stage=0, plan="fp4")  # fp4: stochastic rounding state must resume too

    def ok(proc):
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return proc

    ok(launch(["--deepspeed", str(cfg)]))
    loss = scalars(tmp_path / "out" / "tensorboard")["train/loss"]
    meta_file = tmp_path / "out" / "checkpoints" / "step_3" / "snip_meta.json"
    meta = json.loads(meta_file.read_text())
    meta["settings"].update(meta["settings"].pop("research"))  # the flat shape of older checkpoints
    assert "fld_form" in meta["settings"] and "research" not in meta["settings"]
    meta_file.write_text(json.dumps(meta, indent=1))
    resumed = ok(launch(["--deepspeed", str(cfg), "--resume_from_checkpoint", str(meta_file.parent),
                         "--output_dir", str(tmp_path / "resumed")]))
    assert "resumed from" in resumed.stdout
    again = scalars(tmp_path / "resumed" / "tensorboard")["train/loss"]
    assert sorted(again) == [4, 5, 6]
    for step in (4, 5, 6):
        assert again[step] == loss[step], (step, again[step], loss[step])
