"""The ``"snip"`` section of a DeepSpeed JSON: our settings, validated in one place.

DeepSpeed ignores unknown top-level keys, so this module rejects unknown keys *inside* ``"snip"`` and names
every bad field by its dotted path (``snip.train.max_steps``)::

    "snip": {
      "plan": "adaptive",                 # bf16 | fp8 | fp4 (uniform) | adaptive (SNIP) | path/to/plan.json
      "quant": {"fp8_recipe": "fp8_hybrid", "fp4_recipe": "nvfp4", "stochastic_rounding": true,
                "hadamard": false, "weight_2d": true, "backend": "auto"},   # auto | emulated | torch | te
      "efficiency_saving": 0.75, "method": "best", "replan_every": 250, ...   # the adaptive planner
      "train": {"max_steps": 120, "eval_steps": 40, "save_steps": 60, "output_dir": "runs/default", ...},
      "research": {"fld_form": "sequence", "dgrad_cost": "split", ...}   # ablations: variants for studies
    }

Every key of the section (but ``quant`` and ``train``) is defined once, in :data:`snip_ds.options.OPTIONS`;
:class:`SnipSettings` is built from that table and checks each value with the table's checks, then the ones that
relate settings to one another. It keeps every key as a flat attribute (``settings.fld_form``); only the JSON
shape (and ``SnipSettings.to_dict``) nests the :data:`RESEARCH_KEYS` under ``"research"``.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

from snip_ds.options import BWD_ESTIMATES, DGRAD_COSTS, OPTIONS, RESEARCH_KEYS  # noqa: F401 (re-exported)
from snip_ds.planner.costs import plan_study_fields
from snip_ds.quant_config import QuantConfig


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's modes


class ConfigError(ValueError):
    """A user's configuration is wrong; the message names the file and the field."""


@dataclass(frozen=True)
class TrainSettings:
    """What to train and for how long. Command-line flags of the same name override these."""

    model_name_or_path: Optional[str] = None
    """A local Hugging Face model directory (a decoder-only causal LM: README, "Model families")."""
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
    torch_compile: bool = False
    """Compile the model with ``torch.compile`` (DeepSpeed's ``engine.compile()``) before the first step."""
    torch_compile_backend: Optional[str] = None
    """``torch.compile``'s backend (None: inductor); set, it turns ``torch_compile`` on, as in the Trainer."""
    torch_compile_mode: Optional[str] = None
    """``torch.compile``'s mode, one of :data:`COMPILE_MODES` (None: its default); set, it turns
    ``torch_compile`` on, as in the Trainer."""

    @property
    def compiles(self) -> bool:
        """Whether the run compiles the model (``torch_compile``, or a backend or mode named)."""
        return self.torch_compile or self.torch_compile_backend is not None or self.torch_compile_mode is not None


class _SnipSettingsMethods:
    """What :class:`SnipSettings` does besides holding the :data:`~snip_ds.options.OPTIONS`: the checks that
    relate settings to one another, and the section's JSON shape."""

    def __post_init__(self) -> None:
        for name, option in OPTIONS.items():
            try:
                value = option.validate(_path(name), getattr(self, name))
            except ValueError as err:
                raise ConfigError(str(err)) from None
            object.__setattr__(self, name, value)  # as the setting holds it (study_fields: sorted)
        if self.dgrad_cost == "upstream" and not self.per_gemm:
            raise ConfigError("snip.research.dgrad_cost: 'upstream' prices the dgrad GEMM on its own, which needs "
                              "snip.per_gemm: true")
        if self.efficiency_saving > 0 and "fp4" not in self.allowed:
            raise ConfigError(f"snip.allowed: {list(self.allowed)} has no fp4, so efficiency_saving "
                              f"{self.efficiency_saving} cannot be met")
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
        if not 0 <= t.seed < 2 ** 63:  # the generators take 64-bit seeds, offset by a few thousand per stream
            raise ConfigError(f"snip.train.seed: must lie in [0, 2**63), got {t.seed}")
        if t.torch_compile_mode is not None and t.torch_compile_mode not in COMPILE_MODES:
            raise ConfigError(f"snip.train.torch_compile_mode: must be one of {', '.join(COMPILE_MODES)}, got "
                              f"{t.torch_compile_mode!r}")
        if t.torch_compile_backend is not None and not t.torch_compile_backend.strip():
            raise ConfigError(f"snip.train.torch_compile_backend: must name a torch.compile backend, got "
                              f"{t.torch_compile_backend!r}")
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
        """The study-field groups a training collection computes: ``study_fields`` and what the plan's method
        and BWD estimate are solved from (:func:`snip_ds.planner.costs.plan_study_fields`)."""
        needed = plan_study_fields(self.method, BWD_ESTIMATES[self.bwd_estimate])
        return tuple(sorted(set(self.study_fields) | set(needed)))

    def to_dict(self) -> Dict[str, Any]:
        """JSON-able form in the ``"snip"`` section's shape, research keys under ``"research"`` (as written into
        checkpoints and TensorBoard's text summary; :func:`parse_snip_section` reads it back)."""
        flat = dataclasses.asdict(self)
        research = {k: flat.pop(k) for k in RESEARCH_KEYS}
        return {**flat, "research": research}


def _path(name: str) -> str:
    """A setting's dotted path in the JSON, as errors name it."""
    return f"snip.research.{name}" if name in RESEARCH_KEYS else f"snip.{name}"


def _option_field(option) -> Tuple[str, Any, Any]:
    default = option.default
    made = (field(default_factory=lambda: type(default)(default)) if isinstance(default, (dict, list))
            else field(default=default))
    return option.name, option.type, made


_FIELDS = [_option_field(o) for o in OPTIONS.values()]
SnipSettings = dataclasses.make_dataclass(
    "SnipSettings",
    _FIELDS[:1] + [("quant", QuantConfig, field(default_factory=QuantConfig))] + _FIELDS[1:]
    + [("train", TrainSettings, field(default_factory=TrainSettings))],
    bases=(_SnipSettingsMethods,), frozen=True)
SnipSettings.__module__ = __name__
SnipSettings.__doc__ = ("Everything in the ``\"snip\"`` section: ``quant`` "
                        "(:class:`~snip_ds.quant_config.QuantConfig`), ``train`` (:class:`TrainSettings`) and one "
                        "field per :data:`~snip_ds.options.OPTIONS` entry (the :data:`RESEARCH_KEYS` come from its "
                        "``\"research\"`` object):\n\n"
                        + "\n".join(f"* ``{o.name}`` (default ``{o.default!r}``): {o.help}" for o in OPTIONS.values()))


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
    if origin is tuple:  # Tuple[str, ...] / Tuple[int, ...]: a JSON list of strings / integers
        return isinstance(value, (list, tuple)) and all(_type_ok(v, typing.get_args(hint)[0]) for v in value)
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
        return "a list of integers" if typing.get_args(hint)[0] is int else "a list of strings"
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
