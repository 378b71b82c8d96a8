"""Every setting of the ``"snip"`` section, defined once: name, type, default, valid values, help text.

:data:`OPTIONS` is the one table. :mod:`snip_ds.config.settings` builds :class:`~snip_ds.config.settings.SnipSettings` from it
(and so parses and validates the JSON), ``snip-ds plan`` builds its flags from it (:func:`add_flags`), and the
dataclasses that read settings (:class:`~snip_ds.stats.CollectSettings`, :class:`~snip_ds.planner.CostSettings`,
:class:`~snip_ds.planner.SolverSettings`) name the setting each field reads (:func:`reads`), so that
:func:`build` fills them with no copying by hand and :func:`check_fields` validates them with the same checks.
docs/configuration.md lists every one with its default (tests/test_options.py holds the two together).

This module is pure data (no torch): the planner and the statistics import it.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from snip_ds.stats_file import check_study_fields
from snip_ds.types import PRECISIONS

# The valid values of the choices (the planner and the statistics re-export the ones they own).
ESTIMATORS = ("mc_fisher", "empirical", "isotropic")  # where the FLD's output sensitivities come from
FLD_FORMS = ("sequence", "channel")  # which quadratic form prices a layer's output error
BWD_ROUNDINGS = ("recipe", "nearest")  # how the backward statistics round G_Y (snip_ds.stats)
METHODS = ("best", "random", "quant_err", "rel_quant_err", "uniform_fp8", "uniform_fp4", "first_last_fp8",
           "last_k_fp8")
"""How a plan is chosen: ``best`` (SNIP's costs) or a baseline (:func:`snip_ds.planner.costs.method_costs`)."""
DGRAD_COSTS = ("split", "upstream")
"""How a per-GEMM SNIP plan prices the dgrad GEMM (:func:`snip_ds.planner.costs.costs_from_stats`)."""
BWD_ESTIMATES = {"expected": "bwd", "systematic": "bwd_bias"}
"""The ``"snip"`` section's and the CLI's names for the BWD fields a plan may be priced with."""
PLAN_KINDS = PRECISIONS + ("adaptive",)
NONFINITE_ACTIONS = ("stop", "skip")

_UNSET = object()  # a Flag's default where the section's applies
Check = Callable[[str, Any], Any]
"""``check(name, value)``: the value as the setting holds it, or a ValueError whose message starts with ``name``."""


@dataclass(frozen=True)
class Flag:
    """How ``snip-ds plan`` spells a setting: its flag names, and where the command's meaning differs from the
    section's (its ``dest``, its default, a help text of its own, required)."""

    names: Tuple[str, ...]
    dest: Optional[str] = None
    default: Any = _UNSET
    help: Optional[str] = None
    required: bool = False


@dataclass(frozen=True)
class Option:
    """One setting of the ``"snip"`` section.

    Attributes:
        name: the JSON key (and the attribute of :class:`~snip_ds.config.settings.SnipSettings`).
        type: its annotation (``int``, ``float``, ``Optional[float]``, ``Tuple[str, ...]`` ...); the JSON value is
            type-checked against it.
        default: the value when the key is absent.
        help: what it means.
        choices: the valid values, where they are a list.
        check: further validation (:data:`Check`), e.g. :func:`at_least`.
        research: held under ``"snip.research"`` (the switches that compare variants of the method in studies).
        flag: the ``snip-ds plan`` flag, if the command takes it.
    """

    name: str
    type: Any
    default: Any
    help: str
    choices: Optional[Tuple[str, ...]] = None
    check: Optional[Check] = None
    research: bool = False
    flag: Optional[Flag] = None

    def validate(self, name: str, value: Any) -> Any:
        """``value`` checked (named ``name`` in the error) and as the setting holds it."""
        if self.choices is not None:
            choice(self.choices)(name, value)
        return self.check(name, value) if self.check is not None else value


# ------------------------------------------------------------------------------------------------ checks
def choice(valid) -> Check:
    def check(name: str, value: Any) -> Any:
        if value not in valid:
            raise ValueError(f"{name}: unknown value {value!r}; valid: {', '.join(valid)}")
        return value
    return check


def at_least(low: int) -> Check:
    def check(name: str, value: Any) -> Any:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name}: expected an integer, got {value!r}")
        if value < low:
            raise ValueError(f"{name}: must be at least {low}, got {value}")
        return value
    return check


def not_negative(name: str, value: Any) -> Any:
    if value < 0:
        raise ValueError(f"{name}: must not be negative, got {value}")
    return value


def positive(name: str, value: Any) -> Any:
    if value <= 0:
        raise ValueError(f"{name}: must be positive, got {value}")
    return value


def _plan(name: str, value: Any) -> Any:
    if value not in PLAN_KINDS and not value.endswith(".json"):
        raise ValueError(f"{name}: {value!r} is neither one of {', '.join(PLAN_KINDS)} nor a path to a plan .json "
                         f"file")
    return value


def _share(name: str, value: Any) -> Any:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}: must lie in [0, 1], got {value}")
    return value


def _calibration(name: str, value: Any) -> Any:
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"{name}: must be a finite number > 0, got {value}")
    return value


def _pinned(name: str, value: Any) -> Any:
    for fqn, prec in value.items():
        choice(PRECISIONS)(f"{name}[{fqn!r}]", prec)
    return value


def _allowed(name: str, value: Any) -> Any:
    if not value:
        raise ValueError(f"{name}: must name at least one of {', '.join(PRECISIONS)}")
    for prec in value:
        choice(PRECISIONS)(name, prec)
    return value


def _steps(name: str, value: Any) -> Any:
    for step in value:
        at_least(1)(name, step)
    return tuple(sorted(set(value)))


def _globs(name: str, value: Any) -> Any:
    for pattern in value:
        if not pattern:
            raise ValueError(f"{name}: an empty pattern matches nothing; give globs such as '*.mlp.down_proj'")
    return value


def _study(name: str, value: Any) -> Any:
    return check_study_fields(value, name)


def _budget(name: str, value: Any) -> Any:
    if value is not None and not 0.0 < value <= 1.0:
        raise ValueError(f"{name}: must lie in (0, 1] (GEMM cost relative to all-BF16), got {value}")
    return value


# ------------------------------------------------------------------------------------------------ the table
OPTIONS: Dict[str, Option] = {o.name: o for o in (
    Option("plan", str, "adaptive", "``adaptive`` (SNIP re-planning; the default), ``bf16``/``fp8``/``fp4`` "
           "(uniform) or a plan JSON file.", check=_plan),
    Option("efficiency_saving", float, 0.75, "Minimum share of linear-GEMM FLOPs in FP4 (SNIP's rho), in [0, 1].",
           check=_share, flag=Flag(("--efficiency-saving", "--rho"))),
    Option("method", str, "best", "How the adaptive plan is chosen: ``best`` (SNIP) or one of the baselines.",
           choices=METHODS, flag=Flag(("--method",))),
    Option("replan_every", int, 250, "Collect statistics and re-solve every this many optimizer steps (and before "
           "the first).", check=at_least(1)),
    Option("early_replan_steps", Tuple[int, ...], (16, 32, 64, 128), "Further re-plans after these many steps, "
           "early in training, when the weights and Adam's moments move fastest (the first plan, before step 1, has "
           "no Adam state to price the backward divergence with). ``[]``: none.", check=_steps),
    Option("collect_batches", int, 1, "Micro-batches averaged per collection.", check=at_least(1)),
    Option("collect_tf32", bool, True, "On CUDA, a collection's FP32 matrix products run on TF32 tensor cores "
           "(their operands rounded to 10 mantissa bits, sums in FP32); ``false``: in IEEE FP32. Training's own "
           "GEMMs are not affected."),
    Option("estimator", str, "mc_fisher", "FLD estimator: ``mc_fisher`` (default), ``empirical`` (Fisher from the "
           "training G_Y) or ``isotropic`` (ablations).", choices=ESTIMATORS, research=True),
    Option("num_probes", int, 1, "Monte-Carlo Fisher probes per collection batch.", check=at_least(1)),
    Option("fld_form", str, "sequence", "FLD quadratic form: ``sequence`` (default; every token and channel pair of "
           "a sequence) or ``channel`` (ablation: diagonal, factorised over tokens).", choices=FLD_FORMS,
           research=True),
    Option("bwd_rounding", str, "recipe", "How the statistics round G_Y for BWD: ``recipe`` (default; as training "
           "does, so under stochastic rounding BWD is the expected drift, systematic part plus rounding noise) or "
           "``nearest`` (ablation).", choices=BWD_ROUNDINGS, research=True),
    Option("bwd_estimate", str, "expected", "Which BWD the plan's cost uses: 'expected' (the expected one-step drift) "
           "or 'systematic' (ablation: only the part that persists from step to step, stochastic rounding's noise "
           "left out).", choices=tuple(BWD_ESTIMATES), research=True, flag=Flag(("--bwd-estimate",))),
    Option("bwd_lambda", float, 2.0, "Weight λ of the backward divergence in the plan's cost FLD + λ·BWD. 2: the λ "
           "at which the statistics price the forward and the backward GEMMs in the ratio that training with only "
           "one of them in FP4 measured, and the per-GEMM λ sweep's choice (docs/experiments.md, \"What each GEMM "
           "kind costs\").", check=not_negative,
           flag=Flag(("--lambda",), dest="lam", default=None,
                     help="BWD weight λ (default: the statistics file's 'lambda')")),
    Option("additional_bf16_fwd_every_n_steps", int, 250, "Every n steps, and right after every re-plan, extra "
           "no-grad forwards (bf16, then the plan) measure the plan's forward divergence (0: never).",
           check=not_negative),
    Option("pinned", Mapping[str, str], {}, "Layers held at a fixed precision by every plan: ``{fqn or glob: "
           "precision}`` (``{\"model.layers.*.mlp.experts.*\": \"fp8\"}``); a layer named exactly overrides a glob, "
           "a glob matching no layer is an error.", check=_pinned),
    Option("exclude", Tuple[str, ...], (), "Decoder linears left unquantized and out of the plan: globs matched on "
           "the fully qualified name (``[\"*.mlp.down_proj\", \"model.layers.0.*\"]``); a pattern that matches no "
           "layer is an error. MoE routers are always left out.", check=_globs),
    Option("per_gemm", bool, False, "Decide fprop, dgrad and wgrad separately.", flag=Flag(("--per-gemm",))),
    Option("dgrad_cost", str, "split", "Per GEMM, how SNIP prices dgrad: 'split' (dgrad and wgrad each carry half "
           "of λ·BWD) or 'upstream' (dgrad carries λ·bwd_dgrad / dgrad_calibration, the upstream drift its error "
           "causes; statistics collected with bwd_propagated).", choices=DGRAD_COSTS, research=True,
           flag=Flag(("--dgrad-cost",))),
    Option("dgrad_calibration", float, 1.0, "With dgrad_cost 'upstream': what bwd_dgrad overstates the measured "
           "dgrad-only drift by.", check=_calibration, research=True, flag=Flag(("--dgrad-calibration",))),
    Option("flip_penalty", float, 0.0, "Cost added per layer that changes precision between consecutive plans.",
           check=not_negative, flag=Flag(("--flip-penalty",), help="cost of flipping all FLOPs vs --previous")),
    Option("solver_time_limit", float, 10.0, "Seconds python-mip may spend per solve before the best feasible plan "
           "is taken.", check=positive, flag=Flag(("--time-limit",), dest="time_limit")),
    Option("plan_seed", int, 0, "Seed of the ``random`` baseline.",
           flag=Flag(("--seed",), dest="seed", help="first seed for --method random")),
    Option("allowed", Tuple[str, ...], ("fp8", "fp4"), "Precisions the plan may give a layer; with ``bf16`` among "
           "them a layer has one-hot choices.", check=_allowed),
    Option("compute_budget", Optional[float], None, "Upper bound on the linears' GEMM cost relative to all-BF16 "
           "(fp8 costs 1/2, fp4 1/4 of bf16), in (0, 1]; with bf16 allowed it decides which layers may stay in bf16. "
           "Default: no bound.", check=_budget, flag=Flag(("--compute-budget",))),
    Option("max_share", Optional[float], None, "Upper bound on the FP4 share (so that every method lands on the "
           "same share), in [efficiency_saving, 1]. Default: no bound.", research=True, flag=Flag(("--max-share",))),
    Option("nonfinite", str, "stop", "What a NaN or Inf loss or gradient does: ``stop`` the run before the step's "
           "update (one line naming the step, the micro-batch and the first module whose output went non-finite), "
           "or ``skip`` the step (no optimizer update, gradients dropped, the learning rate held, counted as "
           "``train/skipped_steps`` in TensorBoard).", choices=NONFINITE_ACTIONS),
    Option("study_fields", Tuple[str, ...], (), "Study fields each collection also records in ``stats.json`` (groups "
           "of :data:`snip_ds.stats_file.STUDY_FIELDS`: ``fld_forms``, ``first_order``, ``quant_err``, "
           "``bwd_bias``, ``bwd_drift``); the plan's own needs are added (``collect_study_fields``). Default none.",
           check=_study, research=True),
)}
RESEARCH_KEYS = tuple(name for name, o in OPTIONS.items() if o.research)
"""The switches that compare variants of the method in studies; the JSON holds them under ``"snip.research"``."""


# ------------------------------------------------------------------------------------------------ consumers
def reads(setting: str, default: Any = dataclasses.MISSING, convert: Optional[Callable[[Any], Any]] = None,
          **field_kwargs: Any) -> Any:
    """A dataclass field that reads ``setting`` of :data:`OPTIONS` (through ``convert``, if given), with its own
    ``default`` for direct use (where that differs from the section's)."""
    if setting not in OPTIONS:
        raise KeyError(f"reads: no setting {setting!r}")
    default = OPTIONS[setting].default if default is dataclasses.MISSING else default
    metadata = {"setting": setting, "convert": convert}
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata, **field_kwargs)
    return dataclasses.field(default=default, metadata=metadata, **field_kwargs)


def build(cls, settings: Any, **runtime: Any):
    """``cls`` (a dataclass whose fields name their settings with :func:`reads`) filled from ``settings`` (an
    object with the settings as attributes); ``runtime`` gives the fields that no setting holds."""
    kwargs: Dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        setting = f.metadata.get("setting")
        if f.name in runtime or setting is None:
            continue
        convert = f.metadata["convert"]
        value = getattr(settings, setting)
        kwargs[f.name] = convert(value) if convert is not None else value
    return cls(**kwargs, **runtime)


def check_fields(obj: Any) -> None:
    """Validates the fields of the frozen dataclass ``obj`` that read a setting with that setting's checks, naming
    the field, and stores each as the setting holds it (``study_fields``: sorted). None passes (a consumer's "not
    given")."""
    for f in dataclasses.fields(obj):
        setting = f.metadata.get("setting")
        value = getattr(obj, f.name)
        if setting is not None and value is not None and f.metadata["convert"] is None:
            object.__setattr__(obj, f.name, OPTIONS[setting].validate(f.name, value))


# ------------------------------------------------------------------------------------------------ command line
def from_flags(args: argparse.Namespace, **given: Any) -> argparse.Namespace:
    """The settings parsed by the flags of :func:`add_flags`, under their settings' names (each read back from its
    flag's ``dest``), plus ``given`` (settings the command spells its own way): what :func:`build` reads."""
    values = {name: getattr(args, o.flag.dest or name) for name, o in OPTIONS.items() if o.flag is not None}
    return argparse.Namespace(**values, **given)


def _typed(flag: Flag, argv) -> str:
    """The name of ``flag`` as the command line spelled it (``--rho`` for ``--efficiency-saving``)."""
    spelled = [a.split("=", 1)[0] for a in argv or ()]
    return next((n for n in flag.names if n in spelled), flag.names[0])


def check_flags(args: argparse.Namespace, argv=None) -> None:
    """Validates the value of every flag of :func:`add_flags` with its setting's checks; a ValueError names the
    flag as ``argv`` (the command line) spelled it, e.g. ``--rho: must lie in [0, 1], got 1.5``."""
    for o in OPTIONS.values():
        value = None if o.flag is None else getattr(args, o.flag.dest or o.name)
        if value is not None:
            o.validate(_typed(o.flag, argv), value)


def plain(text: str) -> str:
    """A help text for a terminal: ````code```` as ``'code'``."""
    return re.sub(r"``([^`]*)``", r"'\1'", text)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of every setting that ``snip-ds plan`` takes (:attr:`Option.flag`), in the table's order."""
    for o in OPTIONS.values():
        if o.flag is None:
            continue
        kwargs: Dict[str, Any] = {"dest": o.flag.dest or o.name, "help": o.flag.help or plain(o.help)}
        if o.type is bool:
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = float if o.type in (float, Optional[float]) else o.type
            if o.choices is not None:
                kwargs["choices"] = o.choices
            if o.flag.required:
                kwargs["required"] = True
            else:
                kwargs["default"] = o.default if o.flag.default is _UNSET else o.flag.default
                if kwargs["default"] is not None and "default" not in kwargs["help"].lower():
                    kwargs["help"] += f" (default {kwargs['default']:g})" if isinstance(kwargs["default"], float) \
                        else f" (default {kwargs['default']})"
        parser.add_argument(*o.flag.names, **kwargs)
