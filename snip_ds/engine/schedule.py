"""When an adaptive run re-plans and measures: step arithmetic only (no torch, no I/O).

An adaptive run collects statistics and re-solves its plan before optimizer step ``s + 1`` when :func:`replan_due`
says so: before the first step (``s = 0``; Adam holds no state yet, so that plan prices BWD with a prior in place
of Adam's second moments, and sees the forward divergence alone where a warm-up starts the rate at 0), at each of
``early_replan_steps`` (by default after 16, 32, 64 and 128 steps: early in training the weights and Adam's
moments move fastest, and the first plan's provisional BWD is replaced by one priced with Adam's state as soon as
it exists), then every ``replan_every`` steps. The plan's forward divergence is measured
(:func:`measure_due`) right after every re-plan, beside the prediction it was solved from, and every
``additional_bf16_fwd_every_n_steps`` steps.
"""
from __future__ import annotations

from typing import Iterable, List


def replan_due(step: int, replan_every: int, early_replan_steps: Iterable[int] = ()) -> bool:
    """Whether statistics are collected and the plan re-solved before optimizer step ``step + 1``."""
    return step % replan_every == 0 or step in tuple(early_replan_steps)


def measure_due(step: int, every_n: int, replanned_now: bool) -> bool:
    """Whether the plan's forward divergence is measured before optimizer step ``step + 1``: never when
    ``every_n`` is 0; else when a re-plan has just been made at this step, and before every ``every_n``-th step."""
    return bool(every_n) and (replanned_now or (step + 1) % every_n == 0)


def replan_steps(max_steps: int, replan_every: int, early_replan_steps: Iterable[int] = ()) -> List[int]:
    """The steps (``s``: before optimizer step ``s + 1``) at which a run of ``max_steps`` steps re-plans."""
    return [s for s in range(max_steps) if replan_due(s, replan_every, early_replan_steps)]


def describe_replans(max_steps: int, replan_every: int, early_replan_steps: Iterable[int] = (), start: int = 0,
                     shown: int = 8) -> str:
    """The re-plans of a run of ``max_steps`` steps from global step ``start`` on, in words for the start-up line:
    ``"re-planned at steps 0, 16, 32 and 64 (step N: after N optimizer steps)"``; past ``shown`` of them, the
    rest as ``every replan_every``."""
    steps = [s for s in replan_steps(max_steps, replan_every, early_replan_steps) if s >= start]
    if not steps:
        return f"no re-plan left before step {max_steps}"
    words = [str(s) for s in steps[:shown]]
    if len(steps) > shown:
        words.append(f"every {replan_every} steps up to {steps[-1]}")
    listed = words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]
    return f"re-planned at step{'s' if len(steps) > 1 else ''} {listed} (step N: after N optimizer steps)"
