"""One timer for the benchmarks that run on either device: the median over repeats, after warm-ups.

On CUDA each repeat is timed with CUDA events (the GPU's own clock, no host overhead in the figure); on the
CPU with ``time.perf_counter``. Warm-ups also absorb one-time costs (kernel selection, Triton compilation),
which a benchmark that cares reports on its own.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def median_ms(fn: Callable[[], object], repeats: int, device: str = "cuda", warmups: int = 3) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` runs on ``device`` ("cuda" or "cpu")."""
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)
