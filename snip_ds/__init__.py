"""snip_ds: adaptive FP8/FP4 mixed-precision training of decoder-only LLMs on DeepSpeed (SNIP).

Public names are loaded lazily, so ``import snip_ds.planner`` stays free of torch and DeepSpeed; only
:mod:`snip_ds.engine` imports DeepSpeed, and :func:`initialize` loads it on first use.
"""
import importlib

from snip_ds.runtime import old_paths

old_paths.install()  # the previous release's module paths, for one release

__version__ = "0.1.0"

_EXPORTS = {
    # numerics
    "QuantConfig": "snip_ds.quant_config",
    "SnipLinear": "snip_ds.linear",
    "GemmPrecision": "snip_ds.types",
    "PRECISIONS": "snip_ds.types",
    "GEMMS": "snip_ds.types",
    "cast_to_format": "snip_ds.quant",
    "fake_quantize": "snip_ds.quant",
    # model surgery
    "swap_linears": "snip_ds.swap",
    "find_decoder_linears": "snip_ds.swap",
    "snip_layers": "snip_ds.swap",
    "LayerInfo": "snip_ds.swap",
    "input_groups": "snip_ds.decoder",
    # plans
    "Plan": "snip_ds.plan",
    "solve_plan": "snip_ds.planner",
    # training (imports DeepSpeed)
    "initialize": "snip_ds.engine",
    "NonFiniteError": "snip_ds.engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'snip_ds' has no attribute {name!r}")
