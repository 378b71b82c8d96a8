"""Third-party messages a snip_ds user cannot act on, dropped where snip_ds's runs cause them; every other warning
and log line is kept.

Each filter names one message of one library, matched by category or logger and text, never a whole library:

* torch's ``FutureWarning`` for the deprecated ``torch.distributed`` collectives (``all_gather_into_tensor``,
  ``reduce_scatter_tensor``) when DeepSpeed's code calls them (ZeRO-3's partitions, tensor-parallel shards): the
  caller is DeepSpeed, which the user does not edit. The same warning for a call from anywhere else (the user's
  own code) is shown, once per process, however often the warning filters change in between (every
  ``warnings.catch_warnings`` block changes them on exit, and Python then shows a warning anew).
* DeepSpeed's "Setting accelerator to CPU. If you have GPU ..." (logged when ``deepspeed`` is imported; snip_ds's
  start line says which device it trains on) and, around ``deepspeed.initialize`` only (:func:`dropped_logs`),
  "Attempting to get learning rate from scheduler before it has started" (DeepSpeed asks its own scheduler).
* torchao's "Failed to load .../torchao/_C..." (its optional CUDA kernels, compiled for another torch, when
  transformers imports it) and torch's warning that registering torchao's Enum classes with pytree is deprecated.
"""
from __future__ import annotations

import contextlib
import logging
import re
import sys
import warnings
from typing import Iterator, Set

# "`torch.distributed.all_gather_into_tensor` is deprecated. Please use ..." (torch's deprecation wrapper)
DEPRECATED_COLLECTIVE = re.compile(r"^`torch\.distributed\.\w+` is deprecated")
LR_BEFORE_START = re.compile(r"^Attempting to get learning rate from scheduler before it has started")
# logger name -> the messages of it dropped for the whole process
DROPPED_LOGS = {
    "DeepSpeed": (re.compile(r"^Setting accelerator to CPU\. If you have GPU or other accelerator"),),
    "torchao": (re.compile(r"^Failed to load \S*torchao\S*_C\w*[.\w-]*\.so"),),
    "torch.utils._pytree": (re.compile(r"is an Enum subclass and is now natively supported by torch\.compile"),),
}

_shown: Set[str] = set()
_MACHINERY = ("warnings", "typing_extensions", "torch")  # packages whose frames sit between a caller and its warning


class MessageFilter(logging.Filter):
    """Drops a logger's records whose message matches one of ``patterns``."""

    def __init__(self, patterns) -> None:
        super().__init__()
        self.patterns = tuple(patterns)

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(p.search(text) for p in self.patterns)


def _called_from_deepspeed() -> bool:
    """Whether the code that called the deprecated function is DeepSpeed's: the first frame up the stack outside
    the warnings machinery (``warnings``, ``typing_extensions``' ``deprecated``, this module) and torch."""
    frame = sys._getframe(2)
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        top = module.split(".")[0]
        if module != __name__ and top not in _MACHINERY and not frame.f_code.co_filename.startswith("<"):
            return top == "deepspeed"
        frame = frame.f_back
    return False


def quiet_third_party() -> None:
    """Installs this module's filters (idempotent): the log filters of :data:`DROPPED_LOGS`, and a
    ``warnings.showwarning`` that drops :data:`DEPRECATED_COLLECTIVE` warnings raised for DeepSpeed and shows the
    others once. Call it before DeepSpeed or transformers is imported, outside any ``warnings.catch_warnings``
    block (which would restore the previous ``warnings.showwarning`` on exit)."""
    for name, patterns in DROPPED_LOGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, MessageFilter) for f in logger.filters):
            logger.addFilter(MessageFilter(patterns))
    current = warnings.showwarning
    if getattr(current, "_snip_ds_once", False):
        return

    def showwarning(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if issubclass(category, FutureWarning) and DEPRECATED_COLLECTIVE.match(text):
            if _called_from_deepspeed() or text in _shown:
                return
            _shown.add(text)
        current(message, category, filename, lineno, file, line)

    showwarning._snip_ds_once = True  # type: ignore[attr-defined]
    warnings.showwarning = showwarning


show_deprecations_once = quiet_third_party  # the earlier name


@contextlib.contextmanager
def dropped_logs(logger_name: str, *patterns: re.Pattern) -> Iterator[None]:
    """Drops ``logger_name``'s records matching ``patterns`` for the duration of the block (a call of ours into
    the library that logs them)."""
    logger = logging.getLogger(logger_name)
    flt = MessageFilter(patterns)
    logger.addFilter(flt)
    try:
        yield
    finally:
        logger.removeFilter(flt)
