"""The process's crash handlers, kept across a CBC solve.

CBC (python-mip's solver) installs a handler of its own for SIGABRT, SIGSEGV and SIGFPE when it solves, and
leaves it installed. Every later crash of the process -- a CUDA error, NCCL's watchdog aborting a hung
collective, a communication thread at exit -- then prints "ERROR while running Cbc. Signal ... caught" and
CBC's stack instead of its own cause, and Python's ``faulthandler`` (``python -X faulthandler``, pytest) no
longer reports. :func:`kept_crash_handlers` saves the process's handlers of the fatal signals before a solve and
puts them back after it, whatever they were: the C library's ``sigaction`` records, which Python's
``signal.getsignal`` does not see, copied as they are (their layout is the C library's business). Where there
is no ``sigaction`` (Windows) it does nothing.
"""
from __future__ import annotations

import ctypes
import signal
import sys
from contextlib import contextmanager
from typing import Dict, Iterator, Optional

FATAL_SIGNALS = tuple(getattr(signal, name) for name in ("SIGABRT", "SIGSEGV", "SIGFPE", "SIGBUS", "SIGILL")
                      if hasattr(signal, name))
SIGACTION_BYTES = 512  # room for any C library's struct sigaction (glibc on x86-64: 152 bytes), kept opaque


def _load_libc():
    if sys.platform == "win32":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        sigaction = libc.sigaction
    except (OSError, AttributeError):
        return None
    sigaction.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    sigaction.restype = ctypes.c_int
    return sigaction


_SIGACTION = _load_libc()


def saved_handlers() -> Optional[Dict[int, ctypes.Array]]:
    """``{signal: its sigaction record}`` of the fatal signals now (None without ``sigaction``)."""
    if _SIGACTION is None:
        return None
    saved = {}
    for sig in FATAL_SIGNALS:
        record = ctypes.create_string_buffer(SIGACTION_BYTES)
        if _SIGACTION(int(sig), None, record) == 0:
            saved[int(sig)] = record
    return saved


def restore_handlers(saved: Optional[Dict[int, ctypes.Array]]) -> None:
    """Puts back what :func:`saved_handlers` returned."""
    for sig, record in (saved or {}).items():
        _SIGACTION(sig, record, None)


@contextmanager
def kept_crash_handlers() -> Iterator[None]:
    """Within it, the solver may install handlers of its own; on leaving, the process's handlers of the fatal
    signals are what they were on entering."""
    saved = saved_handlers()
    try:
        yield
    finally:
        restore_handlers(saved)
