"""The multi-rank runner of the probe-script tests retries once, and only when a rank was killed by a signal."""
import sys

from train_utils import run_ranks


def _script(tmp_path, lines):
    """A command that prints the next line of ``lines`` on each call (as a launcher would) and exits 1,
    or exits 0 when that line is empty."""
    state = tmp_path / "calls"
    state.write_text("0")
    code = (f"import pathlib, sys; p = pathlib.Path({str(state)!r}); n = int(p.read_text()); "
            f"p.write_text(str(n + 1)); line = {lines!r}[n]; print(line); sys.exit(1 if line else 0)")
    return lambda: [sys.executable, "-c", code], state


def test_a_rank_killed_by_a_signal_is_retried_once(tmp_path):
    make, state = _script(tmp_path, ["rank 1 exits with return code = -6", ""])
    assert run_ranks(make, timeout=60).returncode == 0 and state.read_text() == "2"


def test_a_second_signal_death_is_returned(tmp_path):
    make, state = _script(tmp_path, ["exits with return code = -6", "exits with return code = -9", ""])
    proc = run_ranks(make, timeout=60)
    assert proc.returncode == 1 and "-9" in proc.stdout and state.read_text() == "2"


def test_an_ordinary_failure_is_not_retried(tmp_path):
    make, state = _script(tmp_path, ["exits with return code = 1", ""])
    assert run_ranks(make, timeout=60).returncode == 1 and state.read_text() == "1"
