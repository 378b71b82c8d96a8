"""Fault injection for reliability tests: pause one rank at a named point, as a hung or dying rank would.

``SNIP_DS_PAUSE_AT=POINT:STEP:RANK[:SECONDS]`` makes global rank ``RANK`` print one line
``snip_ds: fault injection: rank RANK pid PID paused at POINT of step STEP`` to stdout and sleep ``SECONDS``
(default 3600) when it reaches ``POINT`` with ``STEP`` optimizer steps taken. A test then kills that process
(``SIGKILL``: a rank that dies there) or leaves it asleep (a rank that hangs there: its peers stop after
``--dist_timeout``). The points:

* ``step``: inside an optimizer step, after the backward of its first micro-batch and before the optimizer
  update (the peers wait in the update's collectives);
* ``collect``: at the start of an adaptive re-plan's statistics collection (the peers wait in the
  collection's first collective);
* ``save``: inside a checkpoint save, after DeepSpeed has written this rank's shards and before this rank's
  ``snip_rng_rank*.safetensors`` (the peers wait at the save's barrier; the checkpoint stays incomplete).

Unset (the normal case) it costs one dictionary lookup per point. No torch: callers pass their rank.
"""
from __future__ import annotations

import os
import time
from typing import Optional, Tuple

ENV = "SNIP_DS_PAUSE_AT"
POINTS = ("step", "collect", "save")
DEFAULT_PAUSE_S = 3600.0

_parsed: Optional[Tuple[str, Optional[Tuple[str, int, int, float]]]] = None  # (the text parsed, its result)


def parse(text: str) -> Tuple[str, int, int, float]:
    """``POINT:STEP:RANK[:SECONDS]`` as ``(point, step, rank, seconds)``.

    Raises:
        ValueError: naming the variable and what is wrong.
    """
    parts = text.split(":")
    if len(parts) not in (3, 4):
        raise ValueError(f"{ENV}: expected POINT:STEP:RANK[:SECONDS], got {text!r}")
    point = parts[0]
    if point not in POINTS:
        raise ValueError(f"{ENV}: unknown point {point!r}; valid: {', '.join(POINTS)}")
    try:
        step, rank = int(parts[1]), int(parts[2])
        seconds = float(parts[3]) if len(parts) == 4 else DEFAULT_PAUSE_S
    except ValueError:
        raise ValueError(f"{ENV}: STEP and RANK must be integers and SECONDS a number, got {text!r}") from None
    if step < 0 or rank < 0 or not seconds >= 0:
        raise ValueError(f"{ENV}: STEP, RANK and SECONDS must be non-negative, got {text!r}")
    return point, step, rank, seconds


def spec() -> Optional[Tuple[str, int, int, float]]:
    """The parsed ``SNIP_DS_PAUSE_AT`` (None when unset or empty); re-parsed only when the variable changes.

    Raises:
        ValueError: a malformed value (see :func:`parse`).
    """
    global _parsed
    text = os.environ.get(ENV, "")
    if _parsed is None or _parsed[0] != text:
        _parsed = (text, parse(text) if text else None)
    return _parsed[1]


def pause_point(point: str, step: int, rank: int) -> None:
    """Sleeps here if ``SNIP_DS_PAUSE_AT`` names this point, step and rank (after printing where)."""
    if not os.environ.get(ENV):
        return
    want = spec()
    if want is None or want[:3] != (point, step, rank):
        return
    print(f"snip_ds: fault injection: rank {rank} pid {os.getpid()} paused at {point} of step {step}", flush=True)
    time.sleep(want[3])
