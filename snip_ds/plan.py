"""The precision plan: an explicit, frozen, JSON-serialisable map fqn -> precision.

A plan says, for every linear layer of the model (named by its fully qualified module name, the ``fqn``),
which precision its GEMMs run in. Two shapes are supported:

* per-layer: ``{"model.layers.0.self_attn.q_proj": "fp4", ...}``
* per-GEMM:  ``{"model.layers.0.self_attn.q_proj": {"fprop": "fp4", "dgrad": "fp8", "wgrad": "fp8"}, ...}``

A plan never lives in global state: the trainer holds one :class:`Plan` and swaps it for another at an
optimizer-step boundary. Ranks agree on a plan by comparing :meth:`Plan.digest`.

This module is pure data (no torch, no torch.distributed).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from types import MappingProxyType

from snip_ds.runtime.fileio import atomic_write_text, read_json_file
from snip_ds.types import GEMMS, PRECISIONS
from typing import Any, Iterable, Mapping

PLAN_FORMAT = "snip_ds.plan/1"

# How many leading / trailing names an error message lists before it only gives a count.
_MAX_LISTED = 5


def listed_names(names: Iterable[str]) -> str:
    """Returns the first few names joined by commas, with '(+N more)' when there are more."""
    names = sorted(names)
    shown = ", ".join(names[:_MAX_LISTED])
    extra = len(names) - _MAX_LISTED
    return f"{shown} (+{extra} more)" if extra > 0 else shown


def _check_precision(value: Any, where: str, source: str) -> str:
    if not isinstance(value, str) or value not in PRECISIONS:
        raise ValueError(
            f"{source}: {where} has precision {value!r}; valid precisions are {', '.join(PRECISIONS)}")
    return value


def _normalise_assignment(assignment: Mapping[str, Any], source: str) -> Mapping[str, Any]:
    """Validates an assignment and returns a read-only, key-sorted copy.

    If any entry is per-GEMM (a mapping), the plan is per-GEMM and plain string entries are expanded to the
    same precision for all three GEMMs. Per-GEMM entries must name every GEMM in :data:`GEMMS`.
    """
    if not isinstance(assignment, Mapping):
        raise ValueError(f"{source}: 'assignment' must be a JSON object fqn -> precision, "
                         f"got {type(assignment).__name__}")
    if not assignment:
        raise ValueError(f"{source}: 'assignment' is empty; a plan must name at least one layer")
    per_gemm = any(isinstance(v, Mapping) for v in assignment.values())
    out: dict[str, Any] = {}
    for fqn in sorted(assignment):
        if not isinstance(fqn, str) or not fqn:
            raise ValueError(f"{source}: layer names must be non-empty strings, got {fqn!r}")
        value = assignment[fqn]
        if not per_gemm:
            out[fqn] = _check_precision(value, f"layer {fqn!r}", source)
            continue
        if isinstance(value, str):
            value = {g: value for g in GEMMS}
        if not isinstance(value, Mapping):
            raise ValueError(f"{source}: layer {fqn!r} must map to a precision or to {{gemm: precision}}, "
                             f"got {type(value).__name__}")
        unknown = set(value) - set(GEMMS)
        if unknown:
            raise ValueError(f"{source}: layer {fqn!r} names unknown GEMM(s) {listed_names(map(str, unknown))}; "
                             f"valid GEMMs are {', '.join(GEMMS)}")
        missing = [g for g in GEMMS if g not in value]
        if missing:
            raise ValueError(f"{source}: layer {fqn!r} lacks GEMM(s) {', '.join(missing)}; "
                             f"a per-GEMM entry must name all of {', '.join(GEMMS)}")
        out[fqn] = MappingProxyType(
            {g: _check_precision(value[g], f"layer {fqn!r} GEMM {g!r}", source) for g in GEMMS})
    return MappingProxyType(out)


def _gemm_view(value: Any) -> Mapping[str, str]:
    """Returns {gemm: precision} for a per-layer (str) or per-GEMM (mapping) entry."""
    return {g: value for g in GEMMS} if isinstance(value, str) else value


def fp4_share(assignment: Mapping[str, Any], flops: Mapping[str, float]) -> float:
    """FP4 share of the linear-GEMM FLOPs of an assignment.

    Each GEMM (fprop, dgrad, wgrad) is one third of a layer's FLOPs (2·T·k·n each, T tokens, k inputs, n outputs).

    Args:
        assignment: fqn -> precision, or fqn -> {gemm: precision}.
        flops: fqn -> FLOPs per step of that layer (all three GEMMs together); same keys as ``assignment``.

    Returns:
        The share in [0, 1].

    Raises:
        ValueError: if the keys differ, a layer's FLOPs are negative or not finite, or all are 0 (a layer may
            have 0 FLOPs: an expert that received no tokens).
    """
    missing = set(assignment) - set(flops)
    extra = set(flops) - set(assignment)
    if missing or extra:
        raise ValueError(f"flops and assignment name different layers: missing FLOPs for "
                         f"[{listed_names(missing)}] ({len(missing)}), FLOPs for unplanned layers "
                         f"[{listed_names(extra)}] ({len(extra)})")
    total = 0.0
    fp4 = 0.0
    for fqn, value in assignment.items():
        f = float(flops[fqn])
        if not math.isfinite(f) or f < 0:
            raise ValueError(f"flops of layer {fqn!r} must be finite and >= 0, got {flops[fqn]!r}")
        total += f
        fp4 += f * sum(p == "fp4" for p in _gemm_view(value).values()) / len(GEMMS)
    if not total > 0:
        raise ValueError("flops: every layer has 0 FLOPs; the FP4 share of nothing is undefined")
    return fp4 / total


def _check_meta(meta: Mapping[str, Any] | None, source: str) -> Mapping[str, Any]:
    meta = {} if meta is None else meta
    if not isinstance(meta, Mapping):
        raise ValueError(f"{source}: 'meta' must be a JSON object, got {type(meta).__name__}")
    for key, value in meta.items():
        if not isinstance(key, str):
            raise ValueError(f"{source}: meta keys must be strings, got {key!r}")
        if value is not None and not isinstance(value, (str, int, float, bool)):
            raise ValueError(f"{source}: meta[{key!r}] must be a JSON scalar (str, number, bool, null), "
                             f"got {type(value).__name__}")
    return MappingProxyType(dict(sorted(meta.items())))


def _check_optional_float(value: Any, field: str, source: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{source}: '{field}' must be a number or null, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True, eq=True, repr=False)
class Plan:
    """A precision plan for the linear layers of a model.

    Attributes:
        assignment: Read-only mapping fqn -> precision (``"bf16"``, ``"fp8"``, ``"fp4"``), or, for a per-GEMM
            plan, fqn -> read-only {gemm: precision} with all of :data:`GEMMS`. Keys are sorted.
        fp4_share: FP4 share of the plan's linear FLOPs (each GEMM counts one third of its layer), or ``None``
            when unknown (a bare plan file loaded without FLOPs).
        objective: The planner's objective value (predicted cost), or ``None`` for plans not from the ILP.
        status: How the plan came about: ``"optimal"``, ``"time_limit_feasible"``, ``"greedy_fallback"``,
            ``"fixed"`` (given, not solved).
        method: Which method made it (``"best"``, ``"random"``, ``"file"``, ``"uniform_fp8"``...).
        meta: Read-only mapping of JSON scalars (step, rho, lambda, seed, solve_time_s...).
    """

    assignment: Mapping[str, Any]
    fp4_share: float | None = None
    objective: float | None = None
    status: str = "fixed"
    method: str = "file"
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        source = "Plan"
        object.__setattr__(self, "assignment", _normalise_assignment(self.assignment, source))
        object.__setattr__(self, "meta", _check_meta(self.meta, source))
        share = _check_optional_float(self.fp4_share, "fp4_share", source)
        if share is not None and not 0.0 <= share <= 1.0 + 1e-12:
            raise ValueError(f"{source}: 'fp4_share' must lie in [0, 1], got {share}")
        object.__setattr__(self, "fp4_share", share)
        object.__setattr__(self, "objective", _check_optional_float(self.objective, "objective", source))
        for field in ("status", "method"):
            if not isinstance(getattr(self, field), str):
                raise ValueError(f"{source}: '{field}' must be a string, got {getattr(self, field)!r}")

    def __repr__(self) -> str:
        share = "unknown" if self.fp4_share is None else f"{self.fp4_share:.4f}"
        kind = "per-GEMM" if self.per_gemm else "per-layer"
        return (f"Plan(method={self.method!r}, status={self.status!r}, {len(self.assignment)} layers "
                f"{kind}, fp4_share={share}, objective={self.objective!r}, digest={self.digest()[:12]})")

    def __hash__(self) -> int:
        return hash((self.digest(), self.fp4_share, self.objective, self.status, self.method,
                     tuple(self.meta.items())))

    # ----------------------------------------------------------------------------------------------------
    # Construction
    # ----------------------------------------------------------------------------------------------------
    @classmethod
    def fixed(cls, assignment: Mapping[str, Any], flops: Mapping[str, float] | None = None,
              method: str = "file", meta: Mapping[str, Any] | None = None) -> "Plan":
        """A given (not solved) plan; ``fp4_share`` is computed when ``flops`` is given, else ``None``."""
        share = None if flops is None else fp4_share(assignment, flops)
        return cls(assignment=assignment, fp4_share=share, objective=None, status="fixed", method=method,
                   meta=meta or {})

    @classmethod
    def uniform(cls, fqns: Iterable[str], precision: str,
                flops: Mapping[str, float] | None = None) -> "Plan":
        """Every layer in ``fqns`` at ``precision`` (method ``"uniform_<precision>"``)."""
        _check_precision(precision, "uniform plan", "Plan.uniform")
        assignment = {fqn: precision for fqn in fqns}
        if flops is not None:
            share = fp4_share(assignment, flops)
        else:
            share = 1.0 if precision == "fp4" else 0.0
        return cls(assignment=assignment, fp4_share=share, objective=None, status="fixed",
                   method=f"uniform_{precision}")

    # ----------------------------------------------------------------------------------------------------
    # Queries
    # ----------------------------------------------------------------------------------------------------
    @property
    def per_gemm(self) -> bool:
        """True when the plan gives one precision per GEMM."""
        return any(not isinstance(v, str) for v in self.assignment.values())

    @property
    def layers(self) -> tuple[str, ...]:
        """The planned fqns, sorted."""
        return tuple(self.assignment)

    def precision_of(self, fqn: str, gemm: str = "fprop") -> str:
        """Precision of one GEMM of layer ``fqn`` (per-layer plans give the same answer for every GEMM)."""
        if gemm not in GEMMS:
            raise ValueError(f"unknown GEMM {gemm!r}; valid GEMMs are {', '.join(GEMMS)}")
        if fqn not in self.assignment:
            raise ValueError(f"plan has no layer {fqn!r} (it plans {len(self.assignment)} layers, "
                             f"e.g. {listed_names(self.assignment)})")
        return _gemm_view(self.assignment[fqn])[gemm]

    def gemm_assignment(self) -> dict[str, dict[str, str]]:
        """The assignment as fqn -> {gemm: precision}, whatever the plan's shape."""
        return {fqn: dict(_gemm_view(v)) for fqn, v in self.assignment.items()}

    def check_layers(self, fqns: Iterable[str], source: str = "plan") -> None:
        """Raises ValueError unless the plan names exactly the layers ``fqns``.

        Args:
            fqns: The model's plannable layer names.
            source: What to call the plan in the message (e.g. its file name).
        """
        model = set(fqns)
        planned = set(self.assignment)
        unknown = planned - model
        missing = model - planned
        if unknown or missing:
            parts = []
            if unknown:
                parts.append(f"{len(unknown)} layer(s) the model lacks: {listed_names(unknown)}")
            if missing:
                parts.append(f"{len(missing)} model layer(s) the plan misses: {listed_names(missing)}")
            raise ValueError(f"{source}: plan does not match the model: " + "; ".join(parts))

    def digest(self) -> str:
        """sha256 hex digest of the canonical JSON of the assignment (ranks compare this)."""
        canonical = json.dumps(self._plain_assignment(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    # ----------------------------------------------------------------------------------------------------
    # Serialisation
    # ----------------------------------------------------------------------------------------------------
    def _plain_assignment(self) -> dict[str, Any]:
        return {fqn: v if isinstance(v, str) else dict(v) for fqn, v in self.assignment.items()}

    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON-serialisable dict (with a ``"format"`` tag)."""
        return {
            "format": PLAN_FORMAT,
            "method": self.method,
            "status": self.status,
            "fp4_share": self.fp4_share,
            "objective": self.objective,
            "meta": dict(self.meta),
            "assignment": self._plain_assignment(),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "<dict>") -> "Plan":
        """Builds a plan from :meth:`to_dict` output, or from a bare {fqn: precision} mapping.

        Args:
            d: The decoded JSON.
            source: Name used in error messages (e.g. the file path).
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"{source}: a plan must be a JSON object, got {type(d).__name__}")
        if "assignment" not in d:
            # A user-written file: the whole object is the assignment.
            return cls._build(source, assignment=d)
        fmt = d.get("format", PLAN_FORMAT)
        if fmt != PLAN_FORMAT:
            raise ValueError(f"{source}: 'format' is {fmt!r}; this version reads {PLAN_FORMAT!r}")
        known = {"format", "assignment", "fp4_share", "objective", "status", "method", "meta"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {listed_names(map(str, unknown))}; "
                             f"valid fields are {', '.join(sorted(known))}")
        for field in ("status", "method"):
            if field in d and not isinstance(d[field], str):
                raise ValueError(f"{source}: '{field}' must be a string, got {d[field]!r}")
        return cls._build(
            source,
            assignment=d["assignment"],
            fp4_share=_check_optional_float(d.get("fp4_share"), "fp4_share", source),
            objective=_check_optional_float(d.get("objective"), "objective", source),
            status=d.get("status", "fixed"),
            method=d.get("method", "file"),
            meta=d.get("meta") or {},
        )

    @classmethod
    def _build(cls, source: str, **kwargs: Any) -> "Plan":
        """Validates with ``source`` in the messages, then constructs."""
        kwargs["assignment"] = _normalise_assignment(kwargs["assignment"], source)
        kwargs["meta"] = _check_meta(kwargs.get("meta"), source)
        try:
            return cls(**kwargs)
        except ValueError as e:
            raise ValueError(str(e).replace("Plan:", f"{source}:", 1)) from None

    def save(self, path: str | os.PathLike) -> None:
        """Writes the plan as JSON atomically: a temp file in the same directory, then ``os.replace``.

        A failed save leaves any previous file at ``path`` untouched and no temp file behind.
        """
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1, sort_keys=False, allow_nan=False) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike, flops: Mapping[str, float] | None = None) -> "Plan":
        """Reads a plan file: full Plan JSON, or a bare {fqn: precision} mapping.

        Args:
            path: The JSON file.
            flops: Per-layer FLOPs; when given and the file has no ``fp4_share`` (bare mapping), the share
                is computed from them.

        Raises:
            FileNotFoundError: no such file.
            ValueError: not JSON or not a valid plan; the message names the file and field.
        """
        path = os.fspath(path)
        plan = cls.from_dict(read_json_file(path, "plan"), source=path)
        if flops is not None and plan.fp4_share is None:
            plan = dataclasses.replace(plan, fp4_share=fp4_share(plan.assignment, flops))
        return plan
