"""The adaptive run's schedule (snip_ds.engine.schedule) and its settings."""
import json
from pathlib import Path

import pytest

from snip_ds.engine.schedule import describe_replans, measure_due, replan_due, replan_steps
from snip_ds.config.settings import ConfigError, parse_snip_section

REPO = Path(__file__).resolve().parents[1]


def test_replans_before_step_one_at_the_early_steps_then_every_k():
    assert replan_steps(600, 250, (16, 32, 64, 128)) == [0, 16, 32, 64, 128, 250, 500]
    assert replan_steps(600, 250, ()) == [0, 250, 500]
    assert replan_steps(10, 4, (3, 4)) == [0, 3, 4, 8]  # an early step that is also a multiple counts once
    assert not replan_due(15, 250, (16,)) and replan_due(16, 250, (16,))


def test_measured_right_after_a_replan_and_every_n_steps():
    assert [s for s in range(12) if measure_due(s, 5, replanned_now=(s == 0))] == [0, 4, 9]
    assert not measure_due(0, 0, replanned_now=True)  # 0: never, not even after a re-plan


def test_the_default_run_replans_three_times_after_the_first_plan_with_adam_state():
    snip = json.loads((REPO / "ds_configs" / "zero3.json").read_text())["snip"]
    settings = parse_snip_section(snip, "zero3.json")
    steps = replan_steps(settings.train.max_steps, settings.replan_every, settings.early_replan_steps)
    assert steps == [0, 16, 32, 64]
    warmup = max(1, settings.train.max_steps // 10)  # resolve_ds_config's "auto" warm-up
    assert all(s > warmup for s in steps[1:])  # Adam has moments, and the learning rate is past warm-up


def test_the_start_up_line_and_the_readme_name_the_default_runs_replan_steps_as_the_run_counts_them():
    """One count of steps (N: after N optimizer steps) in the start-up line, the README and the schedule."""
    settings = parse_snip_section(json.loads((REPO / "ds_configs" / "zero3.json").read_text())["snip"], "zero3.json")
    line = describe_replans(settings.train.max_steps, settings.replan_every, settings.early_replan_steps)
    assert line == "re-planned at steps 0, 16, 32 and 64 (step N: after N optimizer steps)"
    assert "re-plans after 0, 16, 32 and 64 [optimizer steps](docs/configuration.md#step-numbers)" in (
        REPO / "README.md").read_text()
    assert describe_replans(120, 250, (16, 32, 64), start=20) == ("re-planned at steps 32 and 64 (step N: after N "
                                                                  "optimizer steps)")
    assert describe_replans(120, 250, (16,), start=17) == "no re-plan left before step 120"
    long = describe_replans(2000, 250, (16,), shown=3)
    assert long.startswith("re-planned at steps 0, 16, 250 and every 250 steps up to 1750 (")


def test_a_long_run_at_the_shipped_defaults_collects_once_per_replan_every_plus_four():
    settings = parse_snip_section(json.loads((REPO / "ds_configs" / "zero3.json").read_text())["snip"], "zero3.json")
    n = len(replan_steps(20_000, settings.replan_every, settings.early_replan_steps))
    assert n == 20_000 // settings.replan_every + 4


@pytest.mark.parametrize("value, words", [([0], "at least 1"), ([4, "8"], "list of integers"),
                                          (16, "list of integers"), ([2.5], "list of integers")])
def test_invalid_early_replan_steps_name_the_field(value, words):
    with pytest.raises(ConfigError, match=rf"snip\.early_replan_steps.*{words}|{words}.*snip\.early_replan_steps"):
        parse_snip_section({"plan": "adaptive", "early_replan_steps": value}, "cfg.json")


def test_early_replan_steps_sorted_and_round_trip():
    s = parse_snip_section({"plan": "adaptive", "early_replan_steps": [64, 16, 16]}, "cfg.json")
    assert s.early_replan_steps == (16, 64)
    assert parse_snip_section(s.to_dict(), "again").early_replan_steps == (16, 64)
