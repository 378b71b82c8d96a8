"""snip_ds.config.model_settings: the "snip" settings checked against the model's layers, and the plan a run starts from."""
import json

import pytest

from snip_ds.config.model_settings import check_layer_settings, initial_plan
from snip_ds.plan import Plan
from snip_ds.config.settings import parse_snip_section
from snip_ds.swap import swap_linears
from tests.test_swap import tiny_llama


def test_settings_that_do_not_fit_the_layers_stop_before_any_step():
    """snip.pinned names or globs that match no layer, and research.dgrad_cost "upstream" on an MoE model, are
    one ConfigError naming the field (raised by initialize and SnipCallback before training)."""
    from snip_ds.experts.points import ExpertLayerInfo
    from snip_ds.config.settings import ConfigError

    model = tiny_llama(layers=2)
    infos = swap_linears(model, "fp8")
    check_layer_settings(infos, parse_snip_section({"pinned": {"model.layers.*.mlp.down_proj": "fp8"}}))
    with pytest.raises(ConfigError, match=r"^snip.pinned: 'pinned' pattern '\*.experts.\*' matches no layer"):
        check_layer_settings(infos, parse_snip_section({"pinned": {"*.experts.*": "fp8"}}))
    upstream = parse_snip_section({"per_gemm": True, "research": {"dgrad_cost": "upstream"}})
    check_layer_settings(infos, upstream)  # a dense model may
    pair = ExpertLayerInfo("model.layers.0.mlp.experts.0.down_proj", 0, "down_proj", 0, 48, 32)
    with pytest.raises(ConfigError, match=r'^snip.research.dgrad_cost: "upstream" is not available for '
                                          r"Mixture-of-Experts models"):
        check_layer_settings({**infos, pair.fqn: pair}, upstream)


def test_the_initial_plan_is_the_plan_file_s_checked_against_the_layers_or_a_uniform_one(tmp_path):
    fqns = ["model.layers.0.mlp.down_proj", "model.layers.0.mlp.up_proj", "model.layers.1.mlp.down_proj"]
    flops = {fqns[0]: 1.0, fqns[1]: 1.0, fqns[2]: 2.0}
    fp4 = initial_plan(fqns, flops, parse_snip_section({"plan": "fp4"}))
    assert fp4.assignment == {f: "fp4" for f in fqns} and fp4.fp4_share == 1.0
    placeholder = initial_plan(fqns, flops, parse_snip_section({"plan": "adaptive"}))
    assert set(placeholder.assignment.values()) == {"fp8"}  # until the first statistics are in

    path = tmp_path / "plan.json"
    path.write_text(json.dumps({fqns[0]: "fp4", fqns[1]: "fp8", fqns[2]: "fp4"}))
    from_file = initial_plan(fqns, flops, parse_snip_section({"plan": str(path)}))
    assert from_file.assignment == {fqns[0]: "fp4", fqns[1]: "fp8", fqns[2]: "fp4"}
    assert from_file.fp4_share == pytest.approx(3.0 / 4.0)  # computed from the FLOPs: the file has none

    path.write_text(json.dumps({fqns[0]: "fp4"}))
    with pytest.raises(ValueError, match=rf"^{path}: "):  # the error names the file
        initial_plan(fqns, flops, parse_snip_section({"plan": str(path)}))
    with pytest.raises(ValueError, match=r"missing\.json: plan file not found"):
        initial_plan(fqns, flops, parse_snip_section({"plan": str(tmp_path / "missing.json")}))
    assert isinstance(from_file, Plan)
