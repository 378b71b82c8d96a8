"""benchmarks/compile_vs_eager.py: the comparison of two runs' losses and gradients (its runs are the benchmark's)."""
import importlib.util

import pytest
import torch

from train_utils import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("compile_vs_eager", REPO / "benchmarks" / "compile_vs_eager.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_counts_the_gradients_that_are_not_bit_for_bit_equal_per_step():
    bench = _bench()
    g = torch.tensor([1.0, -4.0])
    eager = {"losses": [2.0, 1.5], "grads": {"a": [g, g], "b": [g, g]}}
    nudged = g.clone()
    nudged[0] = torch.nextafter(nudged[0], torch.tensor(2.0))  # one ulp
    compiled = {"losses": [2.0, 1.25], "grads": {"a": [g.clone(), nudged], "b": [-0.0 * g + g, g.clone()]}}
    rows = bench.compare(eager, compiled)
    assert [r["gradients_differing"] for r in rows] == [0, 1] and rows[0]["gradients"] == 2
    assert rows[1]["loss_difference"] == -0.25 and rows[0]["loss_difference"] == 0.0
    assert rows[1]["largest_relative_difference"] == pytest.approx(2.0 ** -23 / 4)
    assert "| bf16 | 2 | 1.5000000 | 1.2500000 | -2.50e-01 | 1 of 2 |" in bench.markdown(
        {"commit": "x", "torch": "t", "steps": 2, "plans": {"bf16": rows}})


def test_no_step_is_an_error_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        _bench().main(["--steps", "0"])
    assert "--steps: must be at least 1, got 0" in capsys.readouterr().err
