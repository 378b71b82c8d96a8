"""torch's FutureWarnings for the deprecated ``torch.distributed`` collectives DeepSpeed calls, shown once per
process instead of at every step.

DeepSpeed 0.19.8 gathers and reduces ZeRO-3's partitions and tensor-parallel shards with
``torch.distributed.all_gather_into_tensor`` and ``reduce_scatter_tensor``, which torch 2.13 deprecates with a
``FutureWarning`` from ``torch/distributed/c10d_logger.py``. Python shows a warning once per place until the
warning filters change, and every ``warnings.catch_warnings`` block changes them on exit (SNIP's re-plans use
one; so do libraries inside a training step): the same two lines then came back at every re-plan, or every step.
:func:`show_deprecations_once` shows each such message the first time only, from wherever it comes, whatever the
filters do meanwhile; every other warning is shown as before.
"""
from __future__ import annotations

import re
import warnings
from typing import Set

# "`torch.distributed.all_gather_into_tensor` is deprecated. Please use ..." (torch's deprecation wrapper)
DEPRECATED_COLLECTIVE = re.compile(r"^`torch\.distributed\.\w+` is deprecated")

_shown: Set[str] = set()


def show_deprecations_once() -> None:
    """Makes Python show each :data:`DEPRECATED_COLLECTIVE` ``FutureWarning`` once per process. Idempotent; call
    it outside any ``warnings.catch_warnings`` block (which would restore the previous ``warnings.showwarning``
    on exit)."""
    current = warnings.showwarning
    if getattr(current, "_snip_ds_once", False):
        return

    def showwarning(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if issubclass(category, FutureWarning) and DEPRECATED_COLLECTIVE.match(text):
            if text in _shown:
                return
            _shown.add(text)
        current(message, category, filename, lineno, file, line)

    showwarning._snip_ds_once = True  # type: ignore[attr-defined]
    warnings.showwarning = showwarning
