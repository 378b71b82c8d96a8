"""The "snip" section's plan-shape settings: allowed precisions, compute budget, FP4 share cap."""
import json

import pytest

from snip_ds.snip_config import ConfigError, SnipSettings, parse_snip_section


def test_defaults_are_two_precisions_without_budget():
    s = parse_snip_section({})
    assert s.allowed == ("fp8", "fp4") and s.compute_budget is None and s.max_share is None


def test_fld_form_defaults_to_sequence_and_parses():
    assert parse_snip_section({}).fld_form == "sequence"
    assert parse_snip_section({"fld_form": "channel"}).fld_form == "channel"


def test_three_precisions_budget_and_cap_parse_and_round_trip():
    s = parse_snip_section({"allowed": ["bf16", "fp8", "fp4"], "compute_budget": 0.4, "max_share": 0.9})
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
    ({"efficiency_saving": 0.75, "max_share": 0.5}, r"snip.max_share: must lie in \[efficiency_saving, 1\]"),
    ({"fld_form": "token"}, "snip.fld_form: unknown value 'token'"),
    ({"estimator": "hessian"}, "snip.estimator: unknown value 'hessian'"),
    ({"dgrad_cost": "half"}, "snip.dgrad_cost: unknown value 'half'"),
    ({"bwd_rounding": "stochastic"}, "snip.bwd_rounding: unknown value 'stochastic'"),
    ({"bwd_estimate": "bias"}, "snip.bwd_estimate: unknown value 'bias'"),
    ({"dgrad_cost": "upstream"}, "snip.dgrad_cost: 'upstream' .* needs snip.per_gemm: true"),
    ({"per_gemm": True, "dgrad_cost": "upstream", "dgrad_calibration": 0}, "snip.dgrad_calibration: must be"),
    ({"dgrad_calibration": "x"}, "snip.dgrad_calibration: expected a number"),
])
def test_bad_values_name_the_field(section, match):
    with pytest.raises(ConfigError, match=match):
        parse_snip_section(section)


def test_no_fp4_is_fine_when_nothing_must_move_to_fp4():
    assert parse_snip_section({"allowed": ["bf16", "fp8"], "efficiency_saving": 0.0}).allowed == ("bf16", "fp8")
    assert isinstance(SnipSettings(), SnipSettings)


def test_dgrad_cost_parses_and_matches_the_planner():
    from snip_ds.planner import DGRAD_COSTS
    from snip_ds.snip_config import DGRAD_COSTS as CONFIG_DGRAD_COSTS
    assert CONFIG_DGRAD_COSTS == DGRAD_COSTS
    assert parse_snip_section({}).dgrad_cost == "split"
    s = parse_snip_section({"per_gemm": True, "dgrad_cost": "upstream", "dgrad_calibration": 30})
    assert (s.dgrad_cost, s.dgrad_calibration) == ("upstream", 30.0)


def test_bwd_settings_parse_and_match_the_collector_and_planner():
    from snip_ds.config import BWD_ROUNDINGS
    from snip_ds.planner import BWD_ESTIMATES
    from snip_ds.snip_config import BWD_ESTIMATES as CONFIG_BWD_ESTIMATES
    assert tuple(BWD_ESTIMATES) == CONFIG_BWD_ESTIMATES and BWD_ROUNDINGS == ("recipe", "nearest")
    s = parse_snip_section({})
    assert (s.bwd_rounding, s.bwd_estimate) == ("recipe", "expected")
    s = parse_snip_section({"bwd_rounding": "nearest", "bwd_estimate": "systematic"})
    assert (s.bwd_rounding, s.bwd_estimate) == ("nearest", "systematic")
