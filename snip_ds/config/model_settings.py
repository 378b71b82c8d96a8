"""The ``"snip"`` settings against the model they train: what both loops check and decide once the layers are
known, before DeepSpeed starts.

* :func:`check_layer_settings`: settings that name or assume layers (``pinned``, ``research.dgrad_cost``) fit
  the model's layers;
* :func:`initial_plan`: the plan a run starts from (the plan file's, checked against the layers, or a uniform
  one).

:func:`snip_ds.engine.initialize`, ``launch/train.py`` and :class:`snip_ds.hf.SnipCallback` call them.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

from snip_ds.experts.points import ExpertLayerInfo
from snip_ds.plan import Plan, fp4_share
from snip_ds.planner.problem import expand_pinned
from snip_ds.config.settings import ConfigError, SnipSettings


def check_layer_settings(infos: Mapping[str, Any], settings: SnipSettings) -> None:
    """Raises :class:`~snip_ds.config.settings.ConfigError` for ``"snip"`` settings that do not fit the model's layers
    (``infos``: :func:`snip_ds.swap.swap_model`'s): a ``pinned`` name or glob that matches none of them, and,
    for a model with MoE experts, ``research.dgrad_cost: "upstream"`` (the propagated backward estimate follows
    one input per layer, not an expert's routed tokens)."""
    try:  # a pinned name or glob that matches no layer: an error before any step, not at the first solve
        expand_pinned(settings.pinned, list(infos))
    except ValueError as err:
        raise ConfigError(f"snip.pinned: {err}") from None
    if settings.dgrad_cost == "upstream" and any(isinstance(i, ExpertLayerInfo) for i in infos.values()):
        raise ConfigError('snip.research.dgrad_cost: "upstream" is not available for Mixture-of-Experts models (the '
                          'propagated estimate does not follow routed tokens); use "local"')


def initial_plan(fqns: Sequence[str], flops: Mapping[str, float], settings: SnipSettings) -> Plan:
    """The plan a run starts from: the plan file's, a uniform precision's, or (adaptive) uniform FP8 as a
    placeholder until the first statistics are in, before step 1.

    Raises:
        ValueError: the plan file is missing or invalid, or names other layers than ``fqns`` (the message
            names the file).
    """
    fqns = list(fqns)
    if settings.plan_file:
        path = Path(settings.plan_file)
        if not path.is_file():
            raise ValueError(f"{path}: plan file not found")
        plan = Plan.load(path)
        plan.check_layers(fqns, source=str(path))  # before the FLOPs, whose error would not name the file
        if plan.fp4_share is None:
            plan = dataclasses.replace(plan, fp4_share=fp4_share(plan.assignment, flops))
        return plan
    if settings.is_adaptive:
        return Plan.uniform(fqns, "fp8", flops)
    return Plan.uniform(fqns, settings.plan, flops)
