"""One SNIP statistics collection and the ``snip_ds.stats/1`` artifact it produces.

:mod:`snip_ds.stats.artifact` (the JSON schema: written and read; pure, no torch) is what the planner
imports; the collection itself (torch) lives in the other modules and is loaded lazily, so that
``import snip_ds.stats.artifact`` stays free of torch.
"""
import importlib

_EXPORTS = {
    "STATS_FORMAT": "snip_ds.stats.artifact",
    "save_stats": "snip_ds.stats.artifact",
    "load_stats": "snip_ds.stats.artifact",
    "validate_stats": "snip_ds.stats.artifact",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'snip_ds.stats' has no attribute {name!r}")
