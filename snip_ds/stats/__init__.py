"""One SNIP statistics collection and the ``snip_ds.stats/1`` artifact it produces.

* :mod:`~snip_ds.stats.collector`: :func:`collect_statistics`, the hooks and passes of one collection, which
  hand what they see to the estimators, one module each: :mod:`~snip_ds.stats.fld` (the FLD forms and the
  fprop operand errors), :mod:`~snip_ds.stats.bwd` (the BWD drift, its noise and price, the propagated
  ablation), :mod:`~snip_ds.stats.fwd` (``forward_drift``), :mod:`~snip_ds.stats.isotropic` (the isotropic
  ablation's probes and α); each names the sums it adds to one :class:`~snip_ds.stats.common.Sums` and prices
  them; :mod:`~snip_ds.stats.idle` measures the layers a batch did not reach on a zero token, and
  :mod:`~snip_ds.stats.preserve` restores what the collection changed on the model;
* :mod:`~snip_ds.stats.fields`: the artifact's per-layer fields, composed from the estimators' prices of the
  all-reduced sums;
* :mod:`~snip_ds.stats.precond`: preconditioners from Adam state, partitioned (ZeRO) states, fallbacks;
* :mod:`~snip_ds.stats_file`: the JSON schema, written and read (pure, no torch: the planner imports it).

Names are loaded lazily, so that ``import snip_ds.stats_file`` stays free of torch.

May import: backend/, experts/, layouts/, the numerics core (linear, swap, divergence, options, stats_file, ...) and
runtime/; never planner/, config/ or anything above.
"""
import importlib

_EXPORTS = {
    "collect_statistics": "snip_ds.stats.collector",
    "CollectSettings": "snip_ds.stats.settings",
    "AdamPrecond": "snip_ds.stats.precond",
    "adam_precond": "snip_ds.stats.precond",
    "STATS_FORMAT": "snip_ds.stats_file",
    "STUDY_FIELDS": "snip_ds.stats_file",
    "save_stats": "snip_ds.stats_file",
    "load_stats": "snip_ds.stats_file",
    "validate_stats": "snip_ds.stats_file",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'snip_ds.stats' has no attribute {name!r}")
