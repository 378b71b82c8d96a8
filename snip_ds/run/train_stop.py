"""Stopping a ``launch/train.py`` run cleanly: SIGTERM or SIGINT, or the exit of the launcher that started it,
sets a flag the loop reads at each step boundary, where it saves a checkpoint and exits (:class:`StopFlag`).
"""
from __future__ import annotations

import os
import signal
from typing import Optional


def launcher_processes() -> list:
    """The launcher processes this rank outlives only if the job was stopped (psutil handles; [] if none).

    The ``deepspeed`` runner forwards SIGTERM/SIGINT to its ranks only in its multi-node (pdsh) mode; on one
    node a SIGTERM sent to it alone (as a scheduler signalling the job's main process does) kills it and
    leaves ``deepspeed.launcher.launch`` and the ranks training on. So each rank watches its parent (the
    launcher: ``deepspeed.launcher.launch`` or ``torchrun``) and, above ``deepspeed.launcher.launch``, the
    ``deepspeed`` runner. A plain ``python`` run watches nothing.
    """
    if os.environ.get("SNIP_DS_SINGLE_PROCESS") == "1":
        return []
    import psutil
    try:
        parent = psutil.Process().parent()
        if parent is None or parent.pid == 1:
            return []
        watched = [parent]
        if any("deepspeed.launcher.launch" in arg for arg in parent.cmdline()):
            runner = parent.parent()
            if runner is not None and runner.pid != 1:
                watched.append(runner)
        return watched
    except psutil.Error:
        return []


def _exited(process) -> bool:
    import psutil
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


class StopFlag:
    """Set by SIGTERM/SIGINT, or when a launcher process has exited (see :func:`launcher_processes`); the
    loop saves a checkpoint at the next step boundary and exits."""

    def __init__(self) -> None:
        self.signal: Optional[int] = None
        self.reason = ""
        self._watched = launcher_processes()

    def __call__(self, signum, frame) -> None:
        self.signal = signum
        self.reason = signal.Signals(signum).name

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self)
        signal.signal(signal.SIGINT, self)

    def is_set(self) -> bool:
        """Whether to stop: a signal arrived, or a watched launcher process has exited."""
        if self.signal is None:
            gone = [p for p in self._watched if _exited(p)]
            if gone:
                self.signal = signal.SIGTERM
                self.reason = f"the exit of launcher process {gone[0].pid}"
        return self.signal is not None
