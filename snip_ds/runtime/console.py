"""Console messages that keep a tqdm progress bar readable.

While a bar is attached (``launch/train.py`` attaches its bar on rank 0), :func:`say` prints through
``tqdm.write``: the bar is cleared, the message written on a line of its own, and the bar redrawn below it.
Without a bar it is an ordinary flushed ``print``.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

_bar: Optional[Any] = None


def attach(bar: Any) -> None:
    """Routes :func:`say` through ``bar``'s ``write`` (a ``tqdm`` instance) until :func:`detach`."""
    global _bar
    _bar = bar


def detach() -> None:
    global _bar
    _bar = None


def say(message: str) -> None:
    """Prints ``message`` to stdout on a line of its own, above the progress bar if one is attached."""
    if _bar is None:
        print(message, flush=True)
    else:
        _bar.write(message, file=sys.stdout)
        sys.stdout.flush()
