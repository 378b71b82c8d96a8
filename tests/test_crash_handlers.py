"""A CBC solve leaves the process's crash handlers as they were (snip_ds/planner/crash_handlers.py): CBC installs
its own for SIGABRT, SIGSEGV and SIGFPE and keeps them, so that a later crash read "ERROR while running Cbc"."""
import contextlib
import ctypes
import faulthandler
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import snip_ds.planner.ilp as ilp
from snip_ds.planner import SolverSettings, solve_plan
from snip_ds.planner.crash_handlers import FATAL_SIGNALS, restore_handlers, saved_handlers
from train_utils import REPO, env

pytestmark = pytest.mark.skipif(saved_handlers() is None, reason="no sigaction in this C library")


def _solve():
    """A plan CBC solves (three precisions under a compute budget: no shortcut around the solver)."""
    names = [f"model.layers.{i}.mlp.up_proj" for i in range(6)]
    costs = {n: {"bf16": 0.0, "fp8": 0.1 * (i + 1), "fp4": 0.7 * (6 - i)} for i, n in enumerate(names)}
    flops = {n: float(1 + i % 3) for i, n in enumerate(names)}
    return solve_plan(costs, flops, 0.3, SolverSettings(allowed=("bf16", "fp8", "fp4"), compute_budget=0.8))


def _records():
    """Each fatal signal's handler: the record's first field (``sa_handler``; the rest holds bytes the C library
    leaves as they fall)."""
    return {sig: bytes(record)[:ctypes.sizeof(ctypes.c_void_p)] for sig, record in saved_handlers().items()}


def test_a_solve_leaves_the_crash_handlers_as_they_were(monkeypatch):
    before = saved_handlers()  # (whatever earlier tests left: a test's own unguarded CBC call installs CBC's)
    was_enabled = faulthandler.is_enabled()
    faulthandler.disable()
    faulthandler.enable()  # Python's own handlers on the fatal signals, installed anew
    try:
        saved = saved_handlers()
        assert set(saved) == {int(s) for s in FATAL_SIGNALS}
        expected = _records()
        plan = _solve()
        assert _records() == expected
        assert plan.meta  # (solved)
        # the same solve without the guard: CBC's handlers replace the process's
        monkeypatch.setattr(ilp, "kept_crash_handlers", contextlib.nullcontext)
        _solve()
        assert _records() != expected
        restore_handlers(saved)
    finally:
        if not was_enabled:
            faulthandler.disable()
        restore_handlers(before)


def test_a_crash_after_a_solve_is_reported_as_itself():
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_crash_handlers import _solve
        _solve()
        sys.stderr.write("solved\\n"); sys.stderr.flush()
        os.abort()
    """)
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", script], capture_output=True, text=True,
                          timeout=120, env=env(), cwd=REPO)
    assert proc.returncode != 0 and "solved" in proc.stderr, proc.stderr[-2000:]
    assert "Fatal Python error: Aborted" in proc.stderr and "Cbc" not in proc.stderr, proc.stderr[-2000:]
