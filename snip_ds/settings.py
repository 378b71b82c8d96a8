"""The ``"snip"`` section of a DeepSpeed JSON: our settings, validated in one place.

DeepSpeed ignores unknown top-level keys, so this module rejects unknown keys *inside* ``"snip"`` and names
every bad field by its dotted path (``snip.train.max_steps``)::

    "snip": {
      "plan": "adaptive",                 # bf16 | fp8 | fp4 (uniform) | adaptive (SNIP) | path/to/plan.json
      "quant": {"fp8_recipe": "fp8_hybrid", "fp4_recipe": "nvfp4", "stochastic_rounding": true,
                "hadamard": false, "weight_2d": true, "backend": "auto"},   # auto | emulated | torch | te
      "efficiency_saving": 0.75, "method": "best", "replan_every": 200, ...   # the adaptive planner
      "train": {"max_steps": 120, "eval_steps": 40, "save_steps": 60, "output_dir": "runs/default", ...},
      "research": {"fld_form": "sequence", "dgrad_cost": "split", ...}   # ablations: variants for studies
    }

:class:`SnipSettings` keeps every key as a flat attribute (``settings.fld_form``); only the JSON shape (and
:meth:`SnipSettings.to_dict`) nests the :data:`RESEARCH_KEYS` under ``"research"``.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

from snip_ds.quant_config import BWD_ROUNDINGS, ESTIMATORS, FLD_FORMS, QuantConfig
from snip_ds.planner.costs import BWD_ESTIMATES, DGRAD_COSTS, METHODS, plan_study_fields
from snip_ds.stats.artifact import check_study_fields
from snip_ds.types import PRECISIONS

PLAN_KINDS = PRECISIONS + ("adaptive",)
NONFINITE_ACTIONS = ("stop", "skip")
# Switches that exist to compare variants of the method in studies; the JSON holds them under "snip.research".
RESEARCH_KEYS = ("estimator", "fld_form", "bwd_rounding", "bwd_estimate", "dgrad_cost", "dgrad_calibration",
                 "max_share", "study_fields")


class ConfigError(ValueError):
    """A user's configuration is wrong; the message names the file and the field."""


@dataclass(frozen=True)
class TrainSettings:
    """What to train and for how long. Command-line flags of the same name override these."""

    model_name_or_path: Optional[str] = None
    """A local Hugging Face model directory (any Llama-family causal LM)."""
    model_config: Optional[str] = None
    """A JSON model config, trained from scratch. Neither set: the embedded default model."""
    dataset: Optional[str] = None
    """Text / JSON-lines file(s) or a prepare_dataset.py directory. None: Python's stdlib sources."""
    tokenizer_name_or_path: Optional[str] = None
    """A local Hugging Face tokenizer for raw text; None: the byte-level tokenizer."""
    block_size: int = 256
    """Tokens per training sequence."""
    max_steps: int = 120
    """Optimizer steps to train."""
    eval_steps: int = 40
    """Validate every this many steps (and at the end)."""
    eval_batches: int = 8
    """Validation batches per evaluation (per rank)."""
    save_steps: int = 0
    """Checkpoint every this many steps; 0 saves only at the end and on SIGTERM/SIGINT."""
    logging_steps: int = 1
    """Log training scalars every this many steps."""
    seed: int = 0
    """Seeds the model init, the data order and the stochastic-rounding generators."""
    output_dir: str = "runs/default"
    """Checkpoints under ``<output_dir>/checkpoints``, TensorBoard under ``<output_dir>/tensorboard``."""
    max_corpus_bytes: int = 4_000_000
    """Cap on the embedded stdlib corpus (train + validation), to keep the default run short."""


@dataclass(frozen=True)
class SnipSettings:
    """Everything in the ``"snip"`` section. The :data:`RESEARCH_KEYS` come from its ``"research"`` object."""

    plan: str = "fp8"
    """``bf16``/``fp8``/``fp4`` (uniform), ``adaptive`` (SNIP re-planning) or a plan JSON file."""
    quant: QuantConfig = field(default_factory=QuantConfig)
    efficiency_saving: float = 0.75
    """Minimum share of linear-GEMM FLOPs in FP4 (SNIP's rho)."""
    method: str = "best"
    """How the adaptive plan is chosen: ``best`` (SNIP) or one of the baselines."""
    replan_every: int = 200
    """Collect statistics and re-solve every this many optimizer steps."""
    collect_batches: int = 1
    """Micro-batches averaged per collection."""
    estimator: str = "mc_fisher"
    """FLD estimator: ``mc_fisher`` (default), ``empirical`` (Fisher from the training G_Y) or ``isotropic``
    (ablations)."""
    num_probes: int = 1
    """Monte-Carlo Fisher probes per collection batch."""
    fld_form: str = "sequence"
    """FLD quadratic form: ``sequence`` (default; every token and channel pair of a sequence) or ``channel``
    (ablation: diagonal, factorised over tokens)."""
    bwd_rounding: str = "recipe"
    """How the statistics round G_Y for BWD: ``recipe`` (default; as training does, so under stochastic
    rounding BWD is the expected drift, systematic part plus rounding noise) or ``nearest`` (ablation)."""
    bwd_estimate: str = "expected"
    """Which BWD the plan's cost uses: ``expected`` (default; the expected one-step drift) or ``systematic``
    (ablation: only the part that persists from step to step, stochastic rounding's noise left out)."""
    bwd_lambda: float = 2.0
    """Weight of the backward divergence in the plan's cost. 2: the λ at which the statistics price the forward
    and the backward GEMMs in the ratio that training with only one of them in FP4 measured, and the per-GEMM
    λ sweep's choice (docs/experiments.md, "What each GEMM kind costs")."""
    additional_bf16_fwd_every_n_steps: int = 10
    """Every n steps, one extra no-grad bf16 forward measures the plan's forward divergence (0: never)."""
    pinned: Mapping[str, str] = field(default_factory=dict)
    """Layers held at a fixed precision: ``{fqn: precision}``."""
    per_gemm: bool = False
    """Decide fprop, dgrad and wgrad separately."""
    dgrad_cost: str = "split"
    """Per GEMM: how SNIP prices dgrad. ``split``: dgrad and wgrad each carry half of λ·BWD; ``upstream``: dgrad
    carries λ·bwd_dgrad / dgrad_calibration (the upstream drift its error causes; collected with the
    statistics), wgrad the whole λ·BWD."""
    dgrad_calibration: float = 1.0
    """With ``dgrad_cost: upstream``: what bwd_dgrad overstates the measured dgrad-only drift by."""
    flip_penalty: float = 0.0
    """Cost added per layer that changes precision between consecutive plans."""
    solver_time_limit: float = 10.0
    """Seconds python-mip may spend per solve before the best feasible plan is taken."""
    plan_seed: int = 0
    """Seed of the ``random`` baseline."""
    allowed: Tuple[str, ...] = ("fp8", "fp4")
    """Precisions the plan may give a layer; with ``bf16`` among them a layer has one-hot choices."""
    compute_budget: Optional[float] = None
    """Upper bound on the linears' GEMM cost relative to all-BF16 (fp8 costs 1/2, fp4 1/4 of bf16); None: none."""
    max_share: Optional[float] = None
    """Upper bound on the FP4 share (so that every method lands on the same share); None: none."""
    nonfinite: str = "stop"
    """What a NaN or Inf loss or gradient does: ``stop`` the run before the step's update (one line naming the
    step, the micro-batch and the first module whose output went non-finite), or ``skip`` the step (no
    optimizer update, gradients dropped, counted as ``train/skipped_steps`` in TensorBoard)."""
    study_fields: Tuple[str, ...] = ()
    """Study fields each collection also records in ``stats.json`` (groups of
    :data:`snip_ds.stats.artifact.STUDY_FIELDS`: ``fld_forms``, ``first_order``, ``quant_err``, ``bwd_bias``,
    ``bwd_drift``); the plan's own needs are added (:attr:`collect_study_fields`). Default none."""
    train: TrainSettings = field(default_factory=TrainSettings)

    def __post_init__(self) -> None:
        if self.plan not in PLAN_KINDS and not self.plan.endswith(".json"):
            raise ConfigError(f"snip.plan: {self.plan!r} is neither one of {', '.join(PLAN_KINDS)} "
                              f"nor a path to a plan .json file")
        _check_choice("snip.method", self.method, METHODS)
        _check_choice("snip.nonfinite", self.nonfinite, NONFINITE_ACTIONS)
        _check_choice("snip.research.estimator", self.estimator, ESTIMATORS)
        _check_choice("snip.research.fld_form", self.fld_form, FLD_FORMS)
        _check_choice("snip.research.bwd_rounding", self.bwd_rounding, BWD_ROUNDINGS)
        _check_choice("snip.research.bwd_estimate", self.bwd_estimate, BWD_ESTIMATES)
        _check_choice("snip.research.dgrad_cost", self.dgrad_cost, DGRAD_COSTS)
        try:
            object.__setattr__(self, "study_fields", check_study_fields(self.study_fields, "snip.research.study_fields"))
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if self.dgrad_cost == "upstream" and not self.per_gemm:
            raise ConfigError("snip.research.dgrad_cost: 'upstream' prices the dgrad GEMM on its own, which needs "
                              "snip.per_gemm: true")
        if not (self.dgrad_calibration > 0 and self.dgrad_calibration != float("inf")):
            raise ConfigError(f"snip.research.dgrad_calibration: must be a finite number > 0, "
                              f"got {self.dgrad_calibration}")
        if not 0.0 <= self.efficiency_saving <= 1.0:
            raise ConfigError(f"snip.efficiency_saving: must lie in [0, 1], got {self.efficiency_saving}")
        for name in ("replan_every", "collect_batches", "num_probes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"snip.{name}: must be at least 1, got {getattr(self, name)}")
        for name in ("bwd_lambda", "flip_penalty", "additional_bf16_fwd_every_n_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"snip.{name}: must not be negative, got {getattr(self, name)}")
        if self.solver_time_limit <= 0:
            raise ConfigError(f"snip.solver_time_limit: must be positive, got {self.solver_time_limit}")
        for fqn, prec in self.pinned.items():
            _check_choice(f"snip.pinned[{fqn!r}]", prec, PRECISIONS)
        if not self.allowed:
            raise ConfigError(f"snip.allowed: must name at least one of {', '.join(PRECISIONS)}")
        for prec in self.allowed:
            _check_choice("snip.allowed", prec, PRECISIONS)
        if self.efficiency_saving > 0 and "fp4" not in self.allowed:
            raise ConfigError(f"snip.allowed: {list(self.allowed)} has no fp4, so efficiency_saving "
                              f"{self.efficiency_saving} cannot be met")
        if self.compute_budget is not None and not 0.0 < self.compute_budget <= 1.0:
            raise ConfigError(f"snip.compute_budget: must lie in (0, 1] (GEMM cost relative to all-BF16), "
                              f"got {self.compute_budget}")
        if self.max_share is not None and not self.efficiency_saving <= self.max_share <= 1.0:
            raise ConfigError(f"snip.research.max_share: must lie in [efficiency_saving, 1] = "
                              f"[{self.efficiency_saving}, 1], got {self.max_share}")
        t = self.train
        for name in ("block_size", "max_steps", "eval_steps", "eval_batches", "logging_steps",
                     "max_corpus_bytes"):
            if getattr(t, name) < 1:
                raise ConfigError(f"snip.train.{name}: must be at least 1, got {getattr(t, name)}")
        if t.save_steps < 0:
            raise ConfigError(f"snip.train.save_steps: must not be negative, got {t.save_steps}")
        if t.model_name_or_path and t.model_config:
            raise ConfigError("snip.train: give model_name_or_path or model_config, not both")

    @property
    def is_adaptive(self) -> bool:
        return self.plan == "adaptive"

    @property
    def plan_file(self) -> Optional[str]:
        return self.plan if self.plan.endswith(".json") else None

    @property
    def collect_study_fields(self) -> Tuple[str, ...]:
        """The study-field groups a training collection computes: :attr:`study_fields` and what the plan's
        method and BWD estimate are solved from (:func:`snip_ds.planner.costs.plan_study_fields`)."""
        needed = plan_study_fields(self.method, BWD_ESTIMATES[self.bwd_estimate])
        return tuple(sorted(set(self.study_fields) | set(needed)))

    def to_dict(self) -> Dict[str, Any]:
        """JSON-able form in the ``"snip"`` section's shape, research keys under ``"research"`` (as written into
        checkpoints and TensorBoard's text summary; :func:`parse_snip_section` reads it back)."""
        flat = dataclasses.asdict(self)
        research = {k: flat.pop(k) for k in RESEARCH_KEYS}
        return {**flat, "research": research}


def _check_choice(name: str, value: object, valid) -> None:
    if value not in valid:
        raise ConfigError(f"{name}: unknown value {value!r}; valid: {', '.join(valid)}")


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin is typing.Union:
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is tuple:  # Tuple[str, ...]: a JSON list of strings
        return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
    if origin in (dict, collections.abc.Mapping):
        return isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in value.items())
    raise TypeError(f"unsupported annotation {hint!r}")


def _check_keys(data: Any, path: str, valid) -> None:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(valid))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(repr(k) for k in unknown)}; "
                          f"valid keys: {', '.join(sorted(valid))}")


def _field_values(cls, data: Mapping[str, Any], path: str) -> Dict[str, Any]:
    """``data``'s values as ``cls``'s fields take them, wrong types named by dotted path."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, f"{path}.{name}")
            continue
        if not _type_ok(value, hint):
            raise ConfigError(f"{path}.{name}: expected {_hint_name(hint)}, got {value!r}")
        if typing.get_origin(hint) is tuple:
            value = tuple(value)
        kwargs[name] = float(value) if hint is float or (value is not None and hint == Optional[float]) else value
    return kwargs


def _build(cls, data: Any, path: str):
    """Builds dataclass ``cls`` from ``data``, rejecting unknown keys and wrong types by dotted path.

    For :class:`SnipSettings` the :data:`RESEARCH_KEYS` are read from ``data["research"]`` only; at the top
    level they are an error naming each one's place.
    """
    fields = [f.name for f in dataclasses.fields(cls)]
    if cls is SnipSettings:
        if isinstance(data, Mapping):
            moved = [k for k in RESEARCH_KEYS if k in data]
            if moved:  # every one in the line: an old config usually has several
                raise ConfigError("; ".join(f"{path}.{k}: moved to {path}.research.{k}" for k in moved))
        top = [name for name in fields if name not in RESEARCH_KEYS]
        _check_keys(data, path, top + ["research"])
        research = data.get("research", {})
        _check_keys(research, f"{path}.research", RESEARCH_KEYS)
        kwargs = {**_field_values(cls, {k: v for k, v in data.items() if k != "research"}, path),
                  **_field_values(cls, research, f"{path}.research")}
    else:
        _check_keys(data, path, fields)
        kwargs = _field_values(cls, data, path)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as err:  # QuantConfig's own checks name the field without the path
        raise ConfigError(f"{path}.{err}") from None


def _hint_name(hint: Any) -> str:
    if typing.get_origin(hint) is tuple:
        return "a list of strings"
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if args else hint
    name = {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(base, "a mapping")
    return name + (" or null" if type(None) in typing.get_args(hint) else "")


def parse_snip_section(section: Any, source: str = "config") -> SnipSettings:
    """Validates a ``"snip"`` section (a dict) into :class:`SnipSettings`.

    Raises:
        ConfigError: naming ``source`` and the dotted field.
    """
    try:
        return _build(SnipSettings, {} if section is None else section, "snip")
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def load_ds_config(path: str | Path) -> tuple[Dict[str, Any], SnipSettings]:
    """Reads a DeepSpeed JSON; returns DeepSpeed's part (without ``"snip"``) and our validated settings.

    Raises:
        ConfigError: the file is missing, not JSON, not an object, or its ``"snip"`` section is invalid.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: DeepSpeed config file not found")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top level")
    section = data.pop("snip", None)
    return data, parse_snip_section(section, str(path))


def with_overrides(settings: SnipSettings, **overrides: Any) -> SnipSettings:
    """Returns ``settings`` with top-level (research keys included) or ``train``-level fields replaced (None
    values are skipped)."""
    top = {f.name for f in dataclasses.fields(SnipSettings)}
    train_over = {k: v for k, v in overrides.items() if v is not None and k not in top}
    top_over = {k: v for k, v in overrides.items() if v is not None and k in top}
    unknown = sorted(set(train_over) - {f.name for f in dataclasses.fields(TrainSettings)})
    if unknown:
        raise ConfigError(f"unknown setting(s): {', '.join(unknown)}")
    merged = settings.to_dict()
    # The model source is one setting spelt two ways: a flag naming one replaces the JSON's other (both on the
    # command line is still an error).
    for given, other in (("model_name_or_path", "model_config"), ("model_config", "model_name_or_path")):
        if given in train_over and other not in train_over:
            merged["train"][other] = None
    merged["train"].update(train_over)
    merged["research"].update({k: top_over.pop(k) for k in RESEARCH_KEYS if k in top_over})
    merged.update(top_over)
    merged["quant"] = dataclasses.asdict(settings.quant) if "quant" not in top_over else top_over["quant"]
    return parse_snip_section(merged, "command line")
