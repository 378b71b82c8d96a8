"""Shared test set-up: the tests directory is importable (for reference_quant), runs are single-threaded-safe,
and no test leaves subnormals flushed for the next."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _subnormals_kept():
    """``snip_ds.trainer.main`` flushes subnormals for its whole process (as launch/train.py wants); a test that
    calls it in-process must not leave later tests' FP32 subnormals flushed to zero."""
    yield
    torch.set_flush_denormal(False)
