"""The statistics artifact, ``snip_ds.stats/1``: its fields, writing it and reading it back.

A statistics artifact is one JSON object::

    {"format": "snip_ds.stats/1", "step": 0, "lr": 3e-4, "world_size": 2, "estimator": "mc_fisher",
     "num_probes": 1, "fld_form": "sequence", "step_scale": 1.0, "bwd_rounding": "recipe",
     "precond": "factored", "batches": 1, "tokens": 1020, "loss": 5.63, "seed": 0, "forward_drift": false,
     "study_fields": [],                              # the study-only field groups recorded (below)
     "lambda": 2.0,                                   # optional: the planner's default λ
     "alpha": ..., "quadratic_ratio": ...,            # isotropic estimator only
     "layers": {fqn: {"flops": F, "fld": {"fp8": x, "fp4": y}, "bwd": {...}, ..., "nonfinite": false}}}

An MoE expert's (expert, projection) pair also has ``routed_tokens`` (a number) and ``no_tokens`` (a flag); in a
training run's statistics a pair without tokens keeps its last collection's fields, with ``carried_from_step``
(:func:`carry_unrouted`). A layer that no call of the collection's forwards reached (a linear a block holds but
never calls) has ``no_calls: true`` and ``flops`` 0; a linear's ``flops`` otherwise follow the rows of all its
calls (a layer run twice per forward counts twice).
Every per-layer field but ``flops``, ``nonfinite``, ``routed_tokens``, ``no_tokens`` and ``no_calls`` maps a quantized
precision
to a number, or to null
where the collection gave a non-finite value (the layer is then flagged ``nonfinite`` and the planner pins
it to fp8). :data:`PRECISION_FIELDS` lists the fields the reader checks; ``fld`` and ``bwd`` are required.
What each field measures is documented in docs/method.md and in
:func:`snip_ds.stats.collector.collect_statistics`.

Only some fields are recorded always (``flops``, ``fld``, ``bwd``, ``nonfinite``; ``fwd`` with
``forward_drift``; the propagated ablation's fields with ``bwd_propagated``); the others belong to the groups
of :data:`STUDY_FIELDS`, which a collection computes only when asked (``study_fields``, listed in the
header), because only studies and the baseline methods read them. An artifact written before the groups
existed has no ``study_fields`` header and every field.

This module is pure data: no torch, no torch.distributed.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, Mapping, Optional

from snip_ds.runtime.fileio import atomic_write_text, read_json_file
from snip_ds.types import OPERANDS, PRECISIONS, QUANTIZED

STATS_FORMAT = "snip_ds.stats/1"

# Per-layer fields that map precision -> number.
PRECISION_FIELDS = ("fld", "fld_sequence", "fld_channel", "bwd", "bwd_bias", "bwd_propagated", "bwd_dgrad", "fwd",
                    "first_order",
                    "quant_err", "rel_quant_err") + tuple(
                        f"{m}_{o}" for m in ("quant_err", "rel_quant_err") for o in OPERANDS)
REQUIRED_LAYER_FIELDS = ("flops", "fld", "bwd")

STUDY_FIELDS = {
    "fld_forms": ("fld_sequence", "fld_channel"),
    "first_order": ("first_order",),
    "quant_err": ("quant_err", "rel_quant_err") + tuple(
        f"{m}_{o}" for m in ("quant_err", "rel_quant_err") for o in OPERANDS),
    "bwd_bias": ("bwd_bias", "bwd_drift_bias"),
    "bwd_drift": ("bwd_drift",),
}
"""The per-layer fields a collection records only when asked, by group: both FLD forms (``fld`` is always the
configured one), the first-order term, the quantization errors (the ``quant_err``/``rel_quant_err``
baselines), BWD's systematic part (``bwd_estimate: systematic``) and the drift in parameter units."""


def check_study_fields(names: Any, where: str = "study_fields") -> tuple:
    """``names`` as a sorted tuple of :data:`STUDY_FIELDS` groups; a ValueError names ``where`` otherwise."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{where}: expected a list of group names ({', '.join(STUDY_FIELDS)}), got {names!r}")
    bad = [n for n in names if n not in STUDY_FIELDS]
    if bad:
        raise ValueError(f"{where}: unknown group(s) {', '.join(map(repr, bad))}; valid: {', '.join(STUDY_FIELDS)}")
    return tuple(sorted(set(names)))


# --------------------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------------------
def stats_header(*, step: int, lr: float, world_size: int, estimator: str, num_probes: int, fld_form: str,
                 step_scale: float, bwd_rounding: str, precond: str, batches: int, tokens: int, loss: float,
                 seed: int, forward_drift: bool, lam: Optional[float], study_fields: tuple = ()) -> Dict[str, Any]:
    """The artifact's top-level fields, in the order the file lists them (``"lambda"`` only when given)."""
    out: Dict[str, Any] = {"format": STATS_FORMAT, "step": step, "lr": lr, "world_size": world_size,
                           "estimator": estimator, "num_probes": num_probes, "fld_form": fld_form,
                           "step_scale": step_scale, "bwd_rounding": bwd_rounding, "precond": precond,
                           "batches": batches, "tokens": tokens, "loss": loss, "seed": seed,
                           "forward_drift": forward_drift, "study_fields": list(study_fields)}
    if lam is not None:
        out["lambda"] = float(lam)
    return out


def clean_layer(rec: Dict[str, Any]) -> Dict[str, Any]:
    """A layer record made JSON-ready, in place: non-finite numbers -> None, and the ``nonfinite`` flag."""
    nonfinite = False
    for val in rec.values():
        if isinstance(val, dict):
            for p, v in val.items():
                if not math.isfinite(v):
                    nonfinite = True
                    val[p] = None
    rec["nonfinite"] = nonfinite
    return rec


def stats_text(stats: Mapping[str, Any]) -> str:
    """The artifact as JSON text (indent 1; NaN and infinities refused: :func:`clean_layer` removes them)."""
    return json.dumps(stats, indent=1, allow_nan=False)


def save_stats(stats: Mapping[str, Any], path: str, *, final_newline: bool = False) -> None:
    """Writes the artifact as JSON atomically (temporary file in the same directory, then rename).

    ``final_newline``: end the file with a newline (a run's ``stats.json`` does; a bare :func:`save_stats`
    file does not).
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write_text(path, stats_text(stats) + ("\n" if final_newline else ""))


# --------------------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------------------
def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def validate_stats(stats: Any, source: str = "<stats>") -> dict:
    """Checks a decoded statistics artifact; returns it. Messages name ``source`` and the field."""
    if not isinstance(stats, Mapping):
        raise ValueError(f"{source}: statistics must be a JSON object, got {type(stats).__name__}")
    if stats.get("format") != STATS_FORMAT:
        raise ValueError(f"{source}: field 'format' is {stats.get('format')!r}; expected {STATS_FORMAT!r}")
    for field, types in (("step", (int,)), ("world_size", (int,)), ("lr", (int, float)),
                         ("lambda", (int, float)), ("estimator", (str,))):
        if field in stats and (not isinstance(stats[field], types) or isinstance(stats[field], bool)):
            raise ValueError(f"{source}: field '{field}' must be {' or '.join(t.__name__ for t in types)}, "
                             f"got {stats[field]!r}")
    if "study_fields" in stats:
        names = stats["study_fields"]
        if not isinstance(names, list):
            raise ValueError(f"{source}: field 'study_fields' must be a list of group names, got {names!r}")
        try:
            check_study_fields(names)
        except ValueError as err:
            raise ValueError(f"{source}: field {err}") from None
    layers = stats.get("layers")
    if not isinstance(layers, Mapping) or not layers:
        raise ValueError(f"{source}: field 'layers' must be a non-empty object {{fqn: {{...}}}}")
    for fqn, rec in layers.items():
        where = f"{source}: layers[{fqn!r}]"
        if not isinstance(rec, Mapping):
            raise ValueError(f"{where} must be an object, got {type(rec).__name__}")
        for field in REQUIRED_LAYER_FIELDS:
            if field not in rec:
                raise ValueError(f"{where} lacks field '{field}'")
        f = rec["flops"]
        # an MoE expert no token reached, a layer the forward never called: no FLOPs in this collection
        idle = rec.get("no_tokens") is True or rec.get("no_calls") is True
        if not _is_number(f) or not math.isfinite(f) or f < 0 or (f == 0 and not idle):
            raise ValueError(f"{where}.flops must be a positive finite number (0 only with no_tokens or no_calls), "
                             f"got {f!r}")
        for field in PRECISION_FIELDS:
            if field not in rec:
                continue
            table = rec[field]
            if not isinstance(table, Mapping):
                raise ValueError(f"{where}.{field} must be an object {{precision: number}}, got {table!r}")
            for p, v in table.items():
                if p not in PRECISIONS:
                    raise ValueError(f"{where}.{field} has unknown precision {p!r}; valid: {', '.join(PRECISIONS)}")
                if v is not None and not _is_number(v):
                    raise ValueError(f"{where}.{field}.{p} must be a number, got {v!r}")
            if field in ("fld", "bwd"):
                lacking = [p for p in QUANTIZED if p not in table]
                if lacking:
                    raise ValueError(f"{where}.{field} lacks precision(s) {', '.join(lacking)}")
        if "nonfinite" in rec and not isinstance(rec["nonfinite"], bool):
            raise ValueError(f"{where}.nonfinite must be true or false, got {rec['nonfinite']!r}")
    return dict(stats)


def carry_unrouted(stats: Mapping[str, Any], previous: Optional[Mapping[str, Any]]) -> dict:
    """``stats`` in which every MoE pair that no token reached (``no_tokens``) keeps its last statistics: the
    per-precision fields of its record in ``previous`` (the run's last collection; itself carried or not),
    with ``carried_from_step`` naming the collection they were measured at. Its ``flops``, ``routed_tokens``
    and ``no_tokens`` stay this collection's (0, 0, true): the plan's FP4 share counts the FLOPs that run now,
    while the pair's precision is still chosen for the harm it did when it last saw tokens (with zeros the
    planner would be indifferent, and an expert briefly out of favour could land in FP4 for nothing). A pair
    that has never seen a token keeps its zeros. Pure; ``stats`` is not changed."""
    if not previous:
        return dict(stats)
    before = previous.get("layers", {})
    layers = {}
    for fqn, rec in stats["layers"].items():
        old = before.get(fqn)
        if rec.get("no_tokens") is True and old is not None and (old.get("no_tokens") is not True
                                                                  or "carried_from_step" in old):
            rec = {**rec, **{f: old[f] for f in PRECISION_FIELDS if f in old},
                   "carried_from_step": old.get("carried_from_step", previous.get("step"))}
        layers[fqn] = rec
    return {**stats, "layers": layers}


def load_stats(path: str) -> dict:
    """Reads and validates a statistics file (``snip_ds.stats/1`` JSON). (A run's output or checkpoint
    directory: :func:`snip_ds.report.artifacts.load_stats`.)

    Raises:
        FileNotFoundError: no such file.
        ValueError: not JSON or a bad field; the message names the file and the field.
    """
    return validate_stats(read_json_file(path, "statistics"), source=path)
