"""Rank 0's view of a training run while it goes: a progress bar on a terminal, plain lines in a log.

On a terminal (``stdout`` is a TTY) :class:`Progress` draws a tqdm bar whose postfix shows the mean train loss of
the last ``interval`` steps, tokens/s and SNIP's share of the time so far; console messages print above it
(:mod:`snip_ds.runtime.console`). Anywhere else (a file, a pipe, a job scheduler's log) a bar would write fragments of
itself, separated by carriage returns, into the log: there it prints instead, every ``interval`` steps and at the
last one, one plain line::

    snip_ds: progress: step 40/120, train loss 2.9012 (mean of 10 steps), 4,120 tokens/s, SNIP 9% of the time so
    far, about 1m 32s left

Tokens/s count every data-parallel rank's tokens over the wall time of the steps since the previous line (SNIP's
statistics and measurements included; evaluation and checkpoints not). SNIP's share: its own seconds
(:attr:`snip_ds.engine.state.SnipState.snip_seconds`) over all training-step seconds so far.
"""
from __future__ import annotations

import math
import sys
from collections import deque
from typing import Optional

from snip_ds.runtime import console

AUTO_INTERVAL = 10  # console lines every this many steps when logging_steps is 1 (one line per step is noise)


def console_interval(logging_steps: int) -> int:
    """Steps between two progress lines: ``logging_steps``, or :data:`AUTO_INTERVAL` when that is 1."""
    return logging_steps if logging_steps > 1 else AUTO_INTERVAL


def duration(seconds: float) -> str:
    """``1h 02m``, ``3m 05s`` or ``42.0 s``."""
    if not math.isfinite(seconds):
        return "n/a"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{seconds:.1f} s"



def over_steps(n: int) -> str:
    """What a mean train loss is taken over, in words: "mean of 10 steps", "1 step"."""
    return f"mean of {n} steps" if n != 1 else "1 step"

class Progress:
    """Rank 0's progress: a bar on a terminal, plain lines elsewhere (``bar=False``, ``--no_progress``: lines
    only; ``show=False``, the other ranks: counts only). :meth:`step` after every optimizer step; :meth:`close` at
    the end (also after an error).

    Attributes:
        train_s: seconds spent in training steps so far (SNIP's work before a step included).
        tokens: tokens trained so far, all data-parallel ranks together.
    """

    def __init__(self, total: int, start: int, interval: int, tokens_per_step: int, bar: bool = True,
                 stream=None, show: bool = True) -> None:
        stream = sys.stdout if stream is None else stream
        self.total, self.start, self.interval, self.tokens_per_step = total, start, interval, tokens_per_step
        self.losses: deque = deque(maxlen=interval)
        self.train_s = 0.0
        self.tokens = 0
        self._window_s, self._window_tokens = 0.0, 0
        self.bar, self.show = None, show
        if show and bar and getattr(stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True, file=stream)
            console.attach(self.bar)

    def mean_loss(self) -> float:
        """Mean train loss of the last ``interval`` steps (fewer at the start); NaN before the first step."""
        finite = [x for x in self.losses if math.isfinite(x)]
        return sum(finite) / len(finite) if finite else math.nan

    def step(self, step: int, loss: float, seconds: float, snip_seconds: float) -> None:
        """Records optimizer step ``step`` (its loss, its wall time with SNIP's work before it) and SNIP's seconds
        so far; updates the bar, or prints a line every ``interval`` steps and at the last."""
        self.losses.append(float(loss))
        self.train_s += seconds
        self.tokens += self.tokens_per_step
        self._window_s += seconds
        self._window_tokens += self.tokens_per_step
        share = snip_seconds / self.train_s if self.train_s > 0 else 0.0
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"loss {self.mean_loss():.3f}, {self.tokens / self.train_s:,.0f} tok/s, "
                                     f"SNIP {share:.0%}", refresh=False)
            return
        if not self.show or (step % self.interval and step != self.total):
            return
        rate = self._window_tokens / self._window_s if self._window_s > 0 else math.nan
        per_step = self._window_s * self.tokens_per_step / self._window_tokens if self._window_tokens else math.nan
        left = f", about {duration((self.total - step) * per_step)} left" if step < self.total else ""
        console.say(f"snip_ds: progress: step {step}/{self.total}, train loss {self.mean_loss():.4f} ("
                    f"{over_steps(len(self.losses))}), {rate:,.0f} tokens/s, SNIP {share:.0%} of the time so far{left}")
        self._window_s, self._window_tokens = 0.0, 0

    def close(self) -> None:
        if self.bar is not None:
            console.detach()
            self.bar.close()
            self.bar = None

