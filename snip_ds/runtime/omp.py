"""Keeping torch's CPU thread count across python-mip solves.

CBC (python-mip's solver) shares the process's OpenMP runtime with torch and sets its thread count to one
when it solves, which silently left every later torch operation single-threaded (measured: 2 -> 1 threads
after one solve). Every solve inside a torch process runs under :func:`preserve_torch_threads`.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def preserve_torch_threads() -> Iterator[None]:
    """Restores ``torch.get_num_threads()`` when the block exits."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
