"""One timer for the benchmarks that run on either device: the median over repeats, after warm-ups.

:func:`median_ms`: on CUDA each repeat is timed with CUDA events around one call, the GPU idle before it (each
repeat is synchronised): the events count from the moment the host records the first one, so the figure holds
any time the GPU waits for the host to issue the call's kernels -- a step whose host work exceeds its kernels'
time reads as slow as one with slow kernels. :func:`pipelined_ms` queues many calls between two events and
synchronises once, and also gives the host's time to issue a call: where the two are about equal the host is
the bottleneck, where the pipelined time is larger the GPU is. On the CPU both use ``time.perf_counter``.
Warm-ups also absorb one-time costs (kernel selection, Triton compilation), which a benchmark that cares
reports on its own.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Tuple

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


def pipelined_ms(fn: Callable[[], object], steps: int, device: str = "cuda", warmups: int = 3) -> Tuple[float, float]:
    """``(per call, host issue per call)``, milliseconds: ``steps`` calls of ``fn`` queued back to back between
    two CUDA events with one synchronisation at the end (the GPU kept busy as far as the host keeps ahead), and
    the host's wall time from the first call to the return of the last, before that synchronisation. On the
    CPU both are the wall time per call."""
    for _ in range(warmups):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        begin = time.perf_counter()
        for _ in range(steps):
            fn()
        issued = time.perf_counter() - begin
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / steps, issued * 1e3 / steps
    begin = time.perf_counter()
    for _ in range(steps):
        fn()
    per = (time.perf_counter() - begin) * 1e3 / steps
    return per, per
