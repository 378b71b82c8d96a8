"""The settings' one home (snip_ds/options.py): the documentation's tables, the consumers built from the
definitions, and the checks they share with the "snip" section."""
import dataclasses
import json
import re
from pathlib import Path

import pytest

from snip_ds.options import OPTIONS, build
from snip_ds.planner import CostSettings, SolverSettings
from snip_ds.quant_config import QuantConfig
from snip_ds.config.settings import TrainSettings, parse_snip_section

DOCS = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def _documented() -> dict:
    """``{key: default cell}`` of every table in docs/configuration.md whose columns start ``key | default``."""
    rows, in_table = {}, False
    for line in DOCS.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if cells[:2] == ["key", "default"]:
            in_table = True
        elif not cells:
            in_table = False
        elif in_table and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1]
    return rows


def _cell_value(cell: str):
    """The value a default cell states: its first code span (or first word), read as JSON where it is JSON."""
    m = re.match(r"`([^`]*)`", cell)
    token = m.group(1) if m else cell.split()[0]
    try:
        return json.loads(token)
    except json.JSONDecodeError:
        return token


def _defined() -> dict:
    """``{documented key: default}`` of every setting: the options, ``quant.*`` and ``train.*``."""
    keys = {("research." if o.research else "") + name: o.default for name, o in OPTIONS.items()}
    for prefix, cls in (("quant", QuantConfig), ("train", TrainSettings)):
        keys.update({f"{prefix}.{f.name}": f.default for f in dataclasses.fields(cls)})
    return keys


def test_every_setting_is_documented_with_its_default_and_nothing_else_is():
    documented, defined = _documented(), _defined()
    assert sorted(set(defined) - set(documented)) == [], "settings missing from docs/configuration.md"
    assert sorted(set(documented) - set(defined)) == [], "docs/configuration.md lists keys that are no settings"
    wrong = {k: (documented[k], v) for k, v in defined.items()
             if _cell_value(documented[k]) != (list(v) if isinstance(v, tuple) else v)}
    assert wrong == {}, "documented default != defined default"


def test_the_docs_check_reads_the_cells_it_compares():
    # the parser of the test above, on the shapes of cell the tables use
    assert _cell_value('`"fp8"` (the shipped configs: `"adaptive"`)') == "fp8"
    assert _readme_default_plan('| adaptive SNIP (default) | `--precision adaptive` | `"snip": {"plan": "adaptive"}` |\n'
                                '| uniform | `--precision bf16\\|fp8\\|fp4` | `"plan": "fp8"` |') == "adaptive"


README = DOCS.parents[1] / "README.md"


def _readme_default_plan(text: str) -> str:
    """The ``plan`` of the README's plan table row marked ``(default)``: the value its JSON cell gives."""
    (row,) = [line for line in text.splitlines() if line.startswith("|") and "(default)" in line and '"plan"' in line]
    return re.search(r'"plan":\s*"([^"]+)"', row).group(1)


def _readme_settings_default(key: str):
    """The default cell of ``key`` in the README's Settings table (columns ``key | default | meaning``)."""
    for line in README.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if cells and cells[0] == f"`{key}`":
            return _cell_value(cells[1])
    raise AssertionError(f"README.md: no row for {key} in its Settings table")


def test_the_readme_states_the_defaults_the_options_define():
    """What ``"snip": {}`` trains, as the README's plan table and Settings table say it, is the options' default,
    and an empty section parses to it (so a user adding ``"snip": {}`` to a DeepSpeed config gets what the README
    promises)."""
    readme = README.read_text()
    assert _readme_default_plan(readme) == OPTIONS["plan"].default == parse_snip_section({}).plan
    for key in ("plan", "efficiency_saving", "method", "replan_every", "collect_batches", "bwd_lambda",
                "per_gemm", "pinned"):
        assert _readme_settings_default(key) == OPTIONS[key].default, key
    assert parse_snip_section({}).is_adaptive
    assert _cell_value("0.75") == 0.75 and _cell_value("`null`") is None and _cell_value("`[]`") == []
    assert _cell_value('`["fp8", "fp4"]`') == ["fp8", "fp4"] and _cell_value("`runs/default`") == "runs/default"


SECTION = {"per_gemm": True, "bwd_lambda": 3.5, "flip_penalty": 0.25, "solver_time_limit": 4.0,
           "allowed": ["bf16", "fp8", "fp4"], "compute_budget": 0.5, "pinned": {"a.b": "fp8"},
           "research": {"bwd_estimate": "systematic", "dgrad_cost": "upstream", "dgrad_calibration": 12.0,
                        "max_share": 0.9, "estimator": "empirical", "fld_form": "channel",
                        "bwd_rounding": "nearest", "study_fields": ["quant_err"]}}


def test_consumers_are_built_from_the_section():
    s = parse_snip_section(SECTION)
    assert build(CostSettings, s) == CostSettings(lam=3.5, per_gemm=True, bwd_key="bwd_bias", dgrad="upstream",
                                                  dgrad_calibration=12.0)
    assert build(SolverSettings, s) == SolverSettings(allowed=("bf16", "fp8", "fp4"), pinned={"a.b": "fp8"},
                                                      flip_penalty=0.25, max_share=0.9, compute_budget=0.5,
                                                      time_limit=4.0)
    assert build(SolverSettings, parse_snip_section({})).pinned is None  # no pinned layers: none


def test_collect_settings_read_the_section_and_take_the_run_state():
    from snip_ds.stats import CollectSettings
    s = parse_snip_section(SECTION)
    how = build(CollectSettings, s, seed=7, retain_graph=False, study_fields=("bwd_bias",))
    assert (how.estimator, how.fld_form, how.bwd_rounding, how.num_probes, how.lam) == (
        "empirical", "channel", "nearest", 1, 3.5)
    assert (how.seed, how.retain_graph, how.study_fields) == (7, False, ("bwd_bias",))


@pytest.mark.parametrize("field, value, match", [
    ("estimator", "hessian", "estimator: unknown value 'hessian'; valid: mc_fisher, empirical, isotropic"),
    ("bwd_rounding", "stochastic", "bwd_rounding: unknown value 'stochastic'; valid: recipe, nearest"),
    ("num_probes", 0, "num_probes: must be at least 1, got 0"),
    ("num_probes", 1.5, "num_probes: expected an integer, got 1.5"),
    ("lam", -1.0, "lam: must not be negative, got -1.0"),
    ("study_fields", ["fwd"], "study_fields: unknown group"),
])
def test_collect_settings_check_their_settings_as_the_section_does(field, value, match):
    from snip_ds.stats import CollectSettings
    with pytest.raises(ValueError, match=re.escape(match)):
        CollectSettings(**{field: value})


def test_cli_plan_flags_default_to_the_settings():
    from snip_ds.cli import build_parser
    args = build_parser().parse_args(["plan", "s.json", "--efficiency-saving", "0.5", "-o", "p.json"])
    for name in ("method", "per_gemm", "dgrad_cost", "bwd_estimate", "dgrad_calibration", "compute_budget",
                 "max_share"):
        assert getattr(args, name) == OPTIONS[name].default, name
    assert (args.seed, args.time_limit, args.flip_penalty) == (0, 10.0, 0.0)
    assert args.lam is None  # the statistics file's λ, unlike the section


def test_cli_plan_flags_build_what_the_section_builds():
    """``snip-ds plan``'s flags and the "snip" section give the planner the same settings objects."""
    from snip_ds.cli import build_parser
    from snip_ds.options import from_flags
    args = build_parser().parse_args(["plan", "s.json", "--rho", "0.5", "--lambda", "3", "--per-gemm",
                                      "--time-limit", "5", "--flip-penalty", "0.25", "--bwd-estimate", "systematic",
                                      "--max-share", "0.6", "--allowed", "bf16,fp4", "--pin", "a.b=fp8", "-o", "p.json"])
    flags = from_flags(args, allowed=("bf16", "fp4"), pinned={"a.b": "fp8"})
    section = parse_snip_section({"efficiency_saving": 0.5, "bwd_lambda": 3, "per_gemm": True, "solver_time_limit": 5, "flip_penalty": 0.25,
                                  "allowed": ["bf16", "fp4"], "pinned": {"a.b": "fp8"},
                                  "research": {"bwd_estimate": "systematic", "max_share": 0.6}}, "cfg")
    for cls in (CostSettings, SolverSettings):
        assert build(cls, flags) == build(cls, section), cls.__name__
    assert build(CostSettings, flags).bwd_key == "bwd_bias" and build(SolverSettings, flags).time_limit == 5


def test_cli_plan_help_reads_as_plain_text(capsys):
    from snip_ds.cli import main
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "--dgrad-cost" in out and "``" not in out and "'best' (SNIP)" in out
