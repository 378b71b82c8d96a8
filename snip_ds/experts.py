"""Mixture-of-Experts experts modules whose every expert runs its GEMMs at its own precision.

In transformers 5 the routed experts of an MoE block are not ``nn.Linear`` layers: one ``<Family>Experts``
module holds each projection of all experts as one 3-D Parameter (Mixtral: ``gate_up_proj`` ``[E, 2I, H]``,
``down_proj`` ``[E, H, I]``), and the family's sparse MoE block calls it as
``experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K])``.

:class:`SnipExperts` replaces such a module. It holds the very same Parameter objects (ZeRO-3 partitions them
in place, as for :class:`~snip_ds.linear.SnipLinear`) and slices one expert's 2-D weight inside ``forward``.
Each (expert, projection) pair is one planned layer, named ``<module path>.<expert>.<projection>``, with its own
precision (``bf16``, ``fp8``, ``fp4``, or one per GEMM) and its own stochastic-rounding generator. A pair at
``bf16`` runs the family's own operation on the slice; a quantized pair runs the autograd function of
:class:`~snip_ds.linear.SnipLinear` on the slice, so its fprop, dgrad and wgrad go through
:mod:`snip_ds.backend` exactly as a linear layer's do. Routing, activation, routing weights and biases are the
family's; so is the way the experts' outputs are summed per token, which follows the module's configured
experts implementation (``config._experts_implementation``, read at every forward): ``eager`` runs each
expert in turn and adds its weighted output into the result (``index_add_`` in the model's dtype); the others
(``grouped_mm``, ``batched_mm``, ...) gather the token-expert pairs sorted by expert, apply the element-wise
steps to all pairs at once and sum a token's ``K`` weighted outputs in one operation, as ``grouped_mm`` does.
With every pair at ``bf16`` the module's outputs and gradients are those of the family module under ``eager``
and under ``grouped_mm`` bit for bit (on the CPU, where this is tested); ``batched_mm`` multiplies token by
token, which may round differently from one GEMM per expert.

Each forward adds every expert's routed token count (token-expert pairs, so a token routed to ``K`` experts
counts once at each) to a running total that :meth:`SnipExperts.take_routed_tokens` returns and resets: an
expert's GEMMs cost ``6 * tokens * in_features * out_features`` FLOPs per step (:func:`routed_flops`); before any
token is counted, :meth:`ExpertLayerInfo.flops` expects the even share ``top_k / experts`` of a step's tokens.

For a statistics collection every pair also has an observation point, :class:`ExpertPoint` (:meth:`SnipExperts.points`):
an ``nn.Module`` that looks to :mod:`snip_ds.stats` like a bf16 :class:`~snip_ds.linear.SnipLinear` (``weight``
``[out, in]``, ``quant_config``, ``precision``, ``input_grad_only``, ``input_grad_observer``). While its
``input_grad_only`` is set, the pair's GEMM runs through the point, called with the pair's routed tokens only, so
that the collector's hooks see the pair's input ``X_e`` and the gradient of its own output ``y_e`` (which carries
the routing weight through the chain rule), and the point records which rows of ``hidden_states`` its tokens are.

What the module knows about a family is its entry in :data:`LAYOUTS`; :func:`swap_experts` replaces every
known experts module of a model and refuses, naming it, any other module that looks like one.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from snip_ds.linear import InputGradOnlyLinearFn, QuantizedLinearFn
from snip_ds.quant_config import QuantConfig
from snip_ds.types import GemmPrecision, LayerPrecision, block_index


# ------------------------------------------------------------------------------------------------------
# what each family stores and does
# ------------------------------------------------------------------------------------------------------

def _glu_halves(module: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up`` of the first and second halves of the fused projection's output (Mixtral, Qwen2-MoE,
    Qwen3-MoE, DeepSeek-V3: the operations of their eager loop)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return module.act_fn(gate) * up


@dataclass(frozen=True)
class ExpertsLayout:
    """How one family's experts module stores its experts and applies one of them.

    Attributes:
        projections: the names of the 3-D weight Parameters, in the order an expert applies them: the input
            projection (gate and up fused into one GEMM when gated), then the output projection.
        transposed: the weights are stored ``[E, in, out]`` and applied as ``x @ W[e]``; otherwise ``[E, out, in]``
            and applied as ``F.linear(x, W[e])``.
        bias: every projection has a ``[E, out]`` Parameter named ``<projection>_bias``.
        gated: the first projection computes gate and up together (``between`` combines them); otherwise it
            is an up projection alone and ``between`` the activation.
        interleaved: gate and up are alternate output columns of the first projection (else its two halves).
        between: ``(module, y) -> h``, what the family does between the two projections.
        flags: the values of the attributes transformers' ``use_experts_implementation`` sets on the module
            for this layout; a module whose attributes differ is refused (its class was declared otherwise).
    """

    projections: Tuple[str, str]
    transposed: bool
    bias: bool
    gated: bool
    interleaved: bool
    between: Callable[[nn.Module, torch.Tensor], torch.Tensor]

    @property
    def flags(self) -> Dict[str, bool]:
        return {"is_transposed": self.transposed, "has_bias": self.bias, "has_gate": self.gated,
                "is_concatenated": not self.interleaved, "has_post_expert_norm": False}


def _family_gate(module: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """The family class's own ``_apply_gate`` (GPT-OSS: a clamped SwiGLU of interleaved gate and up columns,
    reading the module's ``alpha`` and ``limit``)."""
    return module.family_class._apply_gate(module, gate_up)


_GATED_LINEAR = ExpertsLayout(("gate_up_proj", "down_proj"), transposed=False, bias=False, gated=True,
                              interleaved=False, between=_glu_halves)
_GPT_OSS = ExpertsLayout(("gate_up_proj", "down_proj"), transposed=True, bias=True, gated=True, interleaved=True,
                         between=_family_gate)

# The experts classes of transformers 5 whose layout is known, by class name.
LAYOUTS: Dict[str, ExpertsLayout] = {
    "MixtralExperts": _GATED_LINEAR,
    "Qwen2MoeExperts": _GATED_LINEAR,
    "Qwen3MoeExperts": _GATED_LINEAR,
    "DeepseekV3Experts": _GATED_LINEAR,
    "GptOssExperts": _GPT_OSS,
}

# experts implementations that run the family's eager loop (None: a module whose config never had one set, which
# the family runs with that loop); all others are followed as grouped_mm runs
_EAGER_IMPLEMENTATIONS = (None, "eager")


def full_shape(param: torch.Tensor) -> Tuple[int, ...]:
    """A Parameter's shape, also when ZeRO-3 has partitioned it (its data then an empty placeholder)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def looks_like_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module: decorated by ``use_experts_implementation`` (it
    has ``_is_expert_parallel``), or a class named ``...Experts`` that holds a 3-D Parameter itself."""
    if isinstance(module, SnipExperts):
        return False
    if hasattr(module, "_is_expert_parallel"):
        return True
    return type(module).__name__.endswith("Experts") and any(
        p.dim() == 3 for p in module.parameters(recurse=False))


def layout_of(module: nn.Module, fqn: str) -> ExpertsLayout:
    """The layout of an experts module, checked against the module's own Parameters and flags.

    Raises:
        ValueError: the class is not in :data:`LAYOUTS`, or the module does not match its entry; the message
            names the module path and its class.
    """
    cls = f"{type(module).__module__}.{type(module).__qualname__}"
    layout = LAYOUTS.get(type(module).__name__)
    if layout is None:
        raise ValueError(f"experts module {fqn!r} ({cls}): unknown experts layout; snip_ds knows "
                         f"{', '.join(sorted(LAYOUTS))} (snip_ds.experts.LAYOUTS)")
    problems = [f"{name}={getattr(module, name)!r} (expected {value!r})" for name, value in layout.flags.items()
                if hasattr(module, name) and getattr(module, name) != value]
    names = list(layout.projections) + ([f"{p}_bias" for p in layout.projections] if layout.bias else [])
    params = dict(module.named_parameters(recurse=False))
    problems += [f"no Parameter {name!r}" for name in names if name not in params]
    if not problems:
        first, second = (full_shape(params[p]) for p in layout.projections)
        if len(first) != 3 or len(second) != 3 or first[0] != second[0]:
            problems.append(f"weights {first} and {second} are not [E, out, in] / [E, in, out] with the same E")
    if not problems and getattr(module, "num_experts", first[0]) != first[0]:
        problems.append(f"num_experts={module.num_experts} but the weights hold {first[0]} experts")
    if problems:
        raise ValueError(f"experts module {fqn!r} ({cls}) does not have the layout snip_ds knows for its "
                         f"class: {'; '.join(problems)}")
    return layout


# ------------------------------------------------------------------------------------------------------
# the module
# ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExpertLayerInfo:
    """What the planner needs to know about one (expert, projection) pair."""

    fqn: str
    block: int
    kind: str  # the projection: "gate_up_proj", "down_proj", ...
    expert: int
    in_features: int
    out_features: int
    routed_share: float = 1.0  # the tokens' share an expert expects under even routing: top-k / experts

    def flops(self, tokens: float) -> float:
        """FLOPs of fprop + dgrad + wgrad when ``tokens`` tokens pass the MoE block, the expert's share of them
        routed to it (:attr:`routed_share`; counted routed tokens: :func:`routed_flops`):
        ``6 * tokens * routed_share * k * n``."""
        return routed_flops(self, tokens * self.routed_share)


def routed_flops(info: "ExpertLayerInfo", routed_tokens: float) -> float:
    """FLOPs of fprop + dgrad + wgrad of an (expert, projection) pair for ``routed_tokens`` routed tokens:
    ``6 * routed_tokens * k * n``."""
    return 6.0 * routed_tokens * info.in_features * info.out_features


def _recomputing() -> bool:
    """Whether the running forward is inside a backward pass: activation checkpointing recomputing it."""
    current_node = getattr(torch._C, "_current_autograd_node", None)
    return current_node is not None and current_node() is not None


def layer_seed(seed: int, fqn: str, rank: int) -> int:
    """The stochastic-rounding seed of the layer ``fqn`` on ``rank``: the same derivation as the linear
    layers' (``snip_ds.swap``), so an (expert, projection) pair is seeded like any other layer."""
    digest = hashlib.sha256(f"{seed}:{rank}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class ExpertPoint(nn.Module):
    """One (expert, projection) pair of a :class:`SnipExperts` as the statistics collection sees a linear layer.

    Not a submodule of its experts module (``model.named_modules()`` does not list it, and it holds no
    Parameter): :meth:`SnipExperts.points` makes it, and the experts module calls it, in place of the family's
    operation, for the pair's routed tokens while ``input_grad_only`` is set and the pair is at ``bf16`` (as the
    collection sets every measured layer). Its forward is :class:`~snip_ds.linear.SnipLinear`'s ``bf16``
    ``input_grad_only`` path on the expert's weight slice: ``y_e = x_e W_eᵀ + b_e``, back-propagating to
    ``x_e`` only and calling ``input_grad_observer``.

    Attributes:
        fqn: the pair's layer name, ``<experts path>.<expert>.<projection>``.
        expert, projection: the pair's expert and projection index.
        in_features, out_features: the pair's GEMM shape (``weight`` is ``[out_features, in_features]``).
        input_grad_only, input_grad_observer: as :class:`~snip_ds.linear.SnipLinear`'s.
        token_index: the rows of the experts module's ``hidden_states`` ``[T, H]`` that the pair's last call
            saw, in the order of its input's rows (int64 ``[t]``); None before a call.
    """

    def __init__(self, experts: "SnipExperts", expert: int, projection: int) -> None:
        super().__init__()
        object.__setattr__(self, "_experts", experts)  # a plain reference: not a child module
        self.expert, self.projection = expert, projection
        self.fqn = experts.layer_name(expert, projection)
        self.out_features, self.in_features = experts.projection_shape(projection)
        self.input_grad_only = False
        self.input_grad_observer: Optional[Callable[[torch.Tensor, Optional[torch.Tensor]], None]] = None
        self.token_index: Optional[torch.Tensor] = None

    @property
    def experts(self) -> "SnipExperts":
        return self._experts

    @property
    def parameter(self) -> nn.Parameter:
        """The 3-D Parameter this pair's weight is a slice of (``[E, out, in]``, or ``[E, in, out]`` stored
        transposed: ``experts.layout.transposed``)."""
        return getattr(self._experts, self._experts.layout.projections[self.projection])

    @property
    def weight(self) -> torch.Tensor:
        """The expert's weight as ``[out, in]`` (a view of the 3-D Parameter)."""
        return self._experts.weight(self.expert, self.projection)

    @property
    def parameter_name(self) -> str:
        """:attr:`parameter`'s name in the model (``<experts path>.<projection>``)."""
        proj = self._experts.layout.projections[self.projection]
        return f"{self._experts.fqn}.{proj}" if self._experts.fqn else proj

    def slice(self, t: torch.Tensor) -> torch.Tensor:
        """This pair's ``[out, in]`` part of a tensor shaped like :attr:`parameter` (an optimizer state)."""
        return t[self.expert].t() if self._experts.layout.transposed else t[self.expert]

    def to_storage(self, t: torch.Tensor) -> torch.Tensor:
        """A weight-shaped ``[out, in]`` tensor in the order :attr:`parameter` stores the expert's weight (the
        expert ``e`` of ``[E, a, b]`` being the flat range ``[e·a·b, (e+1)·a·b)``)."""
        return t.t() if self._experts.layout.transposed else t

    @property
    def bias(self) -> Optional[torch.Tensor]:
        if not self._experts.layout.bias:
            return None
        return getattr(self._experts, f"{self._experts.layout.projections[self.projection]}_bias")[self.expert]

    @property
    def quant_config(self) -> QuantConfig:
        return self._experts.quant_config

    @property
    def generator(self) -> Optional[torch.Generator]:
        return self._experts.generators[self.expert][self.projection]

    @property
    def precision(self) -> LayerPrecision:
        return self._experts._precisions[self.expert][self.projection].to_json()

    @precision.setter
    def precision(self, value: LayerPrecision) -> None:
        self._experts._precisions[self.expert][self.projection] = GemmPrecision.of(value)

    @property
    def gemm_precision(self) -> GemmPrecision:
        return self._experts._precisions[self.expert][self.projection]

    def forward(self, x: torch.Tensor, bias_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x`` ``[t, in]`` (the pair's routed tokens) -> ``[t, out]``; ``bias_rows`` as
        :meth:`SnipExperts._project` takes it."""
        if bias_rows is not None:
            return InputGradOnlyLinearFn.apply(x, self.weight, None, self) + bias_rows
        return InputGradOnlyLinearFn.apply(x, self.weight, self.bias, self)

    def extra_repr(self) -> str:
        return f"{self.fqn}, in_features={self.in_features}, out_features={self.out_features}"


class SnipExperts(nn.Module):
    """A family's experts module whose every (expert, projection) pair has its own precision.

    Build it with :meth:`from_family`; it keeps the family module's Parameters (the same objects, under the
    same names), submodules and plain attributes (``num_experts``, ``config``, ``act_fn``, ...).

    Attributes:
        fqn: the module's path in its model (the prefix of its layer names).
        layout: the family's :class:`ExpertsLayout`.
        quant_config: the :class:`~snip_ds.quant_config.QuantConfig` of the quantized GEMMs.
        generators: ``generators[e][j]``, the stochastic-rounding generator of expert ``e``'s ``j``-th
            projection, or None for torch's default generator.
    """

    def __init__(self) -> None:  # use from_family
        super().__init__()

    @classmethod
    def from_family(cls, family: nn.Module, fqn: str = "", precision: LayerPrecision = "fp8",
                    quant_config: Optional[QuantConfig] = None, *, seed: Optional[int] = 0,
                    rank: int = 0) -> "SnipExperts":
        """Wraps the experts module ``family`` (at path ``fqn``) without copying its Parameters.

        Args:
            precision: the initial precision of every (expert, projection) pair.
            seed: seed of the per-pair generators (each from ``(seed, rank, layer name)``, see
                :func:`layer_seed`); None leaves them to torch's default generator.
            rank: data-parallel rank, mixed into the seeds.

        Raises:
            ValueError: ``family``'s layout is unknown (see :func:`layout_of`).
        """
        layout = layout_of(family, fqn)
        new = cls()
        for name, value in vars(family).items():  # the family's plain attributes (config, sizes, flags)
            if not name.startswith("_") and name != "training":
                setattr(new, name, value)
        new._is_expert_parallel = getattr(family, "_is_expert_parallel", False)
        for name, param in family.named_parameters(recurse=False):
            new.register_parameter(name, param)
        for name, buf in family.named_buffers(recurse=False):
            new.register_buffer(name, buf, persistent=name not in family._non_persistent_buffers_set)
        for name, child in family.named_children():
            new.add_module(name, child)
        new.train(family.training)
        new.family_class = type(family)
        new.layout = layout
        new.fqn = fqn
        new.num_experts = full_shape(getattr(family, layout.projections[0]))[0]
        new.quant_config = quant_config or QuantConfig()
        new._precisions = [[GemmPrecision.of(precision)] * len(layout.projections)
                           for _ in range(new.num_experts)]
        new.generators = [[None] * len(layout.projections) for _ in range(new.num_experts)]
        if seed is not None:
            new.seed_generators(seed, rank)
        new._routed_tokens = None  # int64 [E] on the routing's device, or None: no tokens since the last take
        new._points = None  # [[ExpertPoint]] once points() was called (a plain list: not child modules)
        return new

    # ---------------- the layers the planner sees ----------------
    def weight(self, expert: int, projection: int) -> torch.Tensor:
        """Expert ``expert``'s ``projection``-th weight as ``[out, in]`` (a view of the 3-D Parameter)."""
        w = getattr(self, self.layout.projections[projection])[expert]
        return w.t() if self.layout.transposed else w

    def layer_name(self, expert: int, projection: int) -> str:
        return f"{self.fqn}.{expert}.{self.layout.projections[projection]}" if self.fqn else \
            f"{expert}.{self.layout.projections[projection]}"

    def pair_of(self, name: str) -> Optional[Tuple[int, int]]:
        """``(expert, projection index)`` of the layer ``name`` of this module, or None if it names none."""
        prefix, _, rest = name.rpartition(".")  # rest: the projection
        path, _, expert = prefix.rpartition(".") if self.fqn else ("", "", prefix)
        if path != self.fqn or rest not in self.layout.projections or not expert.isdigit():
            return None
        e = int(expert)
        if e >= self.num_experts or str(e) != expert:
            return None
        return e, self.layout.projections.index(rest)

    def layers(self) -> Dict[str, ExpertLayerInfo]:
        """``{name: ExpertLayerInfo}`` of every (expert, projection) pair, expert-major."""
        try:
            block = block_index(self.fqn)
        except ValueError:
            block = -1
        top_k = getattr(getattr(self, "config", None), "num_experts_per_tok", None)
        share = min(top_k, self.num_experts) / self.num_experts if isinstance(top_k, int) and top_k > 0 else \
            1.0 / self.num_experts
        out = {}
        for e in range(self.num_experts):
            for j, proj in enumerate(self.layout.projections):
                n, k = self.projection_shape(j)
                name = self.layer_name(e, j)
                out[name] = ExpertLayerInfo(name, block, proj, e, k, n, share)
        return out

    def projection_shape(self, projection: int) -> Tuple[int, int]:
        """``(out_features, in_features)`` of every expert's ``projection``-th GEMM."""
        shape = full_shape(getattr(self, self.layout.projections[projection]))  # [E, out, in] / [E, in, out]
        return (int(shape[2]), int(shape[1])) if self.layout.transposed else (int(shape[1]), int(shape[2]))

    def named_generators(self) -> Dict[str, Optional[torch.Generator]]:
        """``{layer name: generator}`` of every pair (for checkpoints: a generator's state fixes its rounding)."""
        return {self.layer_name(e, j): self.generators[e][j] for e in range(self.num_experts)
                for j in range(len(self.layout.projections))}

    def seed_generators(self, seed: int, rank: int = 0) -> None:
        """Gives every (expert, projection) pair its own generator, seeded from ``(seed, rank, layer name)``."""
        param = getattr(self, self.layout.projections[0])
        device = param.device if param.device.type != "meta" else torch.device("cpu")
        for e in range(self.num_experts):
            for j in range(len(self.layout.projections)):
                gen = torch.Generator(device=device)
                self.generators[e][j] = gen.manual_seed(layer_seed(seed, self.layer_name(e, j), rank))

    def points(self) -> Dict[str, "ExpertPoint"]:
        """``{layer name: ExpertPoint}`` of every pair (made once, then the same objects), expert-major."""
        if getattr(self, "_points", None) is None:
            self._points = [[ExpertPoint(self, e, j) for j in range(len(self.layout.projections))]
                            for e in range(self.num_experts)]
        return {p.fqn: p for row in self._points for p in row}

    # ---------------- precisions ----------------
    def _projection_index(self, projection: str) -> int:
        try:
            return self.layout.projections.index(projection)
        except ValueError:
            raise ValueError(f"experts module {self.fqn!r}: unknown projection {projection!r}; valid: "
                             f"{', '.join(self.layout.projections)}") from None

    def _expert_indices(self, expert: Optional[int]) -> range:
        if expert is None:
            return range(self.num_experts)
        if not isinstance(expert, int) or not 0 <= expert < self.num_experts:
            raise ValueError(f"experts module {self.fqn!r}: expert {expert!r} out of range 0..{self.num_experts - 1}")
        return range(expert, expert + 1)

    def set_precision(self, precision: LayerPrecision, expert: Optional[int] = None,
                      projection: Optional[str] = None) -> None:
        """Sets the precision of one expert's projection; ``expert`` or ``projection`` None: all of them."""
        prec = GemmPrecision.of(precision)
        projections = range(len(self.layout.projections)) if projection is None else \
            [self._projection_index(projection)]
        for e in self._expert_indices(expert):
            for j in projections:
                self._precisions[e][j] = prec

    def precision_of(self, expert: int, projection: str) -> LayerPrecision:
        """The precision of one pair: a name, or a ``{gemm: precision}`` dict when its GEMMs differ."""
        (e,) = self._expert_indices(expert)
        return self._precisions[e][self._projection_index(projection)].to_json()

    def set_precisions(self, plan: Dict[str, LayerPrecision]) -> None:
        """Sets the pairs named in ``plan`` (``{layer name: precision}``, names as :meth:`layers` gives them);
        nothing is set if a name is not one of this module's layers (ValueError naming it)."""
        unknown = sorted(name for name in plan if self.pair_of(name) is None)
        if unknown:
            raise ValueError(f"experts module {self.fqn!r}: no layer {unknown[0]!r} "
                             f"({len(unknown)} unknown name(s))")
        resolved = {self.pair_of(name): GemmPrecision.of(value, field=name) for name, value in plan.items()}
        for (e, j), prec in resolved.items():
            self._precisions[e][j] = prec

    def precisions(self) -> Dict[str, LayerPrecision]:
        """``{layer name: precision}`` of every pair."""
        return {self.layer_name(e, j): self._precisions[e][j].to_json() for e in range(self.num_experts)
                for j in range(len(self.layout.projections))}

    # ---------------- routed tokens ----------------
    def take_routed_tokens(self) -> torch.Tensor:
        """Each expert's routed token-expert pairs since the last call, as an int64 CPU tensor ``[E]``; resets
        the count. Every forward counts (evaluation and statistics passes included), except activation
        checkpointing's recomputation during backward."""
        counts = self._routed_tokens
        self._routed_tokens = None
        if counts is None:
            return torch.zeros(self.num_experts, dtype=torch.int64)
        return counts.cpu()

    # ---------------- forward ----------------
    def _project(self, x: torch.Tensor, expert: int, j: int,
                 bias_rows: Optional[torch.Tensor] = None, tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Expert ``expert``'s ``j``-th projection of its tokens ``x`` ``[t, in]`` -> ``[t, out]``.

        ``bias_rows`` (``[t, out]``): the bias gathered per token, as grouped_mm adds it (so that its gradient
        is summed as there); else the expert's bias row is broadcast, as the eager loop adds it. ``tokens``: the
        rows of ``hidden_states`` that ``x``'s rows are (recorded by the pair's :class:`ExpertPoint` when a
        statistics collection observes it).
        """
        name = self.layout.projections[j]
        bias = getattr(self, f"{name}_bias")[expert] if self.layout.bias else None
        prec = self._precisions[expert][j]
        point = self._points[expert][j] if getattr(self, "_points", None) is not None else None
        if point is not None and point.input_grad_only and prec.uniform == "bf16":
            point.token_index = tokens
            return point(x, bias_rows)
        if prec.uniform != "bf16":
            return QuantizedLinearFn.apply(x, self.weight(expert, j), bias, prec, self.quant_config,
                                            self.generators[expert][j])
        w = getattr(self, name)[expert]  # the family's own operation
        if bias is not None and bias_rows is not None:
            return (x @ w if self.layout.transposed else F.linear(x, w)) + bias_rows
        if self.layout.transposed:
            return x @ w if bias is None else x @ w + bias
        return F.linear(x, w, bias)

    def _expert(self, x: torch.Tensor, expert: int, tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = self._project(x, expert, 0, tokens=tokens)
        h = self.layout.between(self, h)
        return self._project(h, expert, 1, tokens=tokens)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """``hidden_states`` ``[T, H]``, ``top_k_index`` and ``top_k_weights`` ``[T, K]`` -> ``[T, H]``: the sum
        over each token's experts of routing weight times expert output (an index ``>= num_experts``, expert
        parallelism's placeholder, contributes nothing)."""
        num_experts = self.num_experts
        with torch.no_grad():
            counts = torch.bincount(top_k_index.reshape(-1).clamp(max=num_experts),
                                    minlength=num_experts + 1)[:num_experts]
            if not _recomputing():  # activation checkpointing's recomputation: counted the first time
                self._routed_tokens = counts if self._routed_tokens is None else self._routed_tokens + counts
        implementation = getattr(getattr(self, "config", None), "_experts_implementation", None)
        if implementation in _EAGER_IMPLEMENTATIONS:
            final = torch.zeros_like(hidden_states)
            for e in counts.nonzero().flatten().tolist():  # ascending, as the family's loop
                top_k_pos, token_idx = torch.where((top_k_index == e).t())  # [K, T]: as the family's mask
                out = self._expert(hidden_states[token_idx], e, token_idx) * top_k_weights[token_idx, top_k_pos, None]
                final.index_add_(0, token_idx, out.to(final.dtype))
            return final
        # grouped_mm / batched_mm: the token-expert pairs sorted by expert and gathered at once, each projection
        # run per expert on its rows, everything between and after over all pairs at once, as grouped_mm does
        # (rows in another order may round otherwise in a GEMM, an element-wise function vectorised
        # differently, and a gradient summed from other terms in another order)
        num_tokens, top_k = top_k_index.shape
        with torch.no_grad():
            perm = torch.sort(top_k_index.reshape(-1))[1]  # [S], S = T*K
            inv_perm = torch.empty_like(perm)
            inv_perm[perm] = torch.arange(perm.numel(), device=perm.device)
            sizes = counts.tolist() + [perm.numel() - int(counts.sum())]  # the last: placeholders
        bias_rows = [[None] * num_experts] * len(self.layout.projections)
        if self.layout.bias:
            expert_ids = top_k_index.reshape(-1)[perm].clamp(max=num_experts - 1)
            bias_rows = [getattr(self, f"{p}_bias")[expert_ids].split(sizes) for p in self.layout.projections]
        token_of_pair = perm // top_k  # [S]: the hidden_states row of each sorted pair
        token_parts = token_of_pair.split(sizes)
        h = hidden_states[token_of_pair]  # [S, H]
        for j in range(len(self.layout.projections)):
            if j:
                h = self.layout.between(self, h)
            parts = h.split(sizes)
            outs = [self._project(x_e, e, j, bias_rows[j][e], token_parts[e])
                    for e, x_e in enumerate(parts[:-1]) if sizes[e]]
            outs.append(h.new_zeros(sizes[-1], self.projection_shape(j)[0]))
            h = torch.cat(outs)
        weighted = h * top_k_weights.reshape(-1)[perm].unsqueeze(-1)  # [S, H]
        return weighted[inv_perm].view(num_tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)

    def extra_repr(self) -> str:
        kinds = sorted({p.to_json() if isinstance(p.to_json(), str) else "per-GEMM"
                        for row in self._precisions for p in row})
        return (f"family={self.family_class.__name__}, num_experts={self.num_experts}, "
                f"projections={self.layout.projections}, precisions={kinds}")


# ------------------------------------------------------------------------------------------------------
# model surgery
# ------------------------------------------------------------------------------------------------------

def find_experts_modules(model: nn.Module) -> Dict[str, nn.Module]:
    """``{path: module}`` of the model's experts modules that :func:`swap_experts` would replace, in model
    order (already replaced ones included).

    Raises:
        ValueError: an experts module (see :func:`looks_like_experts`) whose layout is unknown, naming its
            path and class.
    """
    found = {}
    for fqn, module in model.named_modules():
        if isinstance(module, SnipExperts):
            found[fqn] = module
        elif type(module).__name__ in LAYOUTS or looks_like_experts(module):
            layout_of(module, fqn)
            found[fqn] = module
    return found


def swap_experts(model: nn.Module, precision: LayerPrecision = "fp8",
                 quant_config: Optional[QuantConfig] = None, *, seed: int = 0,
                 rank: int = 0) -> Dict[str, nn.Module]:
    """Replaces every experts module of ``model`` by a :class:`SnipExperts`, in place.

    Every module is checked first, so a model with one unknown experts module is left unchanged. Parameters
    are reused (this works before ``deepspeed.initialize``, on ordinary and ``zero.Init``-partitioned models);
    each (expert, projection) pair gets its own generator seeded from ``(seed, rank, layer name)``. A module
    that is already a :class:`SnipExperts` is given ``precision``, ``quant_config`` and new generators.

    Returns:
        ``{path: the module that was there before}`` in model order.

    Raises:
        ValueError: an experts module whose layout is unknown (nothing is replaced).
    """
    quant_config = quant_config or QuantConfig()
    replaced = {}
    for fqn, old in find_experts_modules(model).items():
        if isinstance(old, SnipExperts):
            new = old
            new.set_precision(precision)
            new.quant_config, new.fqn = quant_config, fqn
            new._points = None  # named after the old path
            new.seed_generators(seed, rank)
        else:
            new = SnipExperts.from_family(old, fqn, precision, quant_config, seed=seed, rank=rank)
        if not fqn:
            raise ValueError(f"model: the model itself is an experts module ({type(old).__name__}); wrap it "
                             f"with SnipExperts.from_family instead")
        parent_name, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
        replaced[fqn] = old
    return replaced


def experts_modules(model: nn.Module) -> Dict[str, SnipExperts]:
    """The model's :class:`SnipExperts` modules by path."""
    return {name: m for name, m in model.named_modules() if isinstance(m, SnipExperts)}


# ------------------------------------------------------------------------------------------------------
# all of a model's experts at once
# ------------------------------------------------------------------------------------------------------

def expert_layers(model: nn.Module) -> Dict[str, ExpertLayerInfo]:
    """``{layer name: ExpertLayerInfo}`` of every (expert, projection) pair of the model, in model order."""
    return {name: info for m in experts_modules(model).values() for name, info in m.layers().items()}


def expert_parameters(model: nn.Module) -> Dict[str, nn.Parameter]:
    """``{parameter name: 3-D Parameter}`` of every projection of the model's experts (the names
    ``model.named_parameters()`` gives them): what an optimizer-state mapping is asked about."""
    return {p.parameter_name: p.parameter for m in experts_modules(model).values()
            for p in (m.points()[m.layer_name(0, j)] for j in range(len(m.layout.projections)))}


def expert_points(model: nn.Module) -> Dict[str, ExpertPoint]:
    """``{layer name: ExpertPoint}`` of every (expert, projection) pair of the model, in model order: what
    :func:`snip_ds.stats.collect_statistics` measures besides the :class:`~snip_ds.linear.SnipLinear` layers."""
    return {name: p for m in experts_modules(model).values() for name, p in m.points().items()}


@contextmanager
def routed_tokens_kept(model: nn.Module) -> Iterator[None]:
    """Forwards inside leave every experts module's routed token count as it was (a statistics collection's
    passes are not training steps)."""
    saved = {m: m._routed_tokens for m in experts_modules(model).values()}
    try:
        yield
    finally:
        for m, counts in saved.items():
            m._routed_tokens = counts


def take_routed_tokens(model: nn.Module) -> Dict[str, int]:
    """``{layer name: routed tokens}`` of every (expert, projection) pair since the last call (both of an
    expert's projections see its tokens), resetting every module's count."""
    out = {}
    for module in experts_modules(model).values():
        counts = module.take_routed_tokens().tolist()
        out.update({module.layer_name(e, j): counts[e] for e in range(module.num_experts)
                    for j in range(len(module.layout.projections))})
    return out


def set_expert_precisions(model: nn.Module, assignment: Dict[str, LayerPrecision]) -> Dict[str, LayerPrecision]:
    """Sets the precision of every (expert, projection) pair named in ``assignment`` (``{layer name:
    precision}``, e.g. a plan's, which may also name other layers); returns the entries that name no pair of
    ``model``'s experts, for the caller to apply elsewhere. Nothing is set if an entry that names a pair is
    invalid (ValueError naming it)."""
    modules = experts_modules(model)
    per_module: Dict[str, Dict[str, LayerPrecision]] = {}
    rest = {}
    for name, precision in assignment.items():
        path = name.rsplit(".", 2)[0]
        if path in modules and modules[path].pair_of(name) is not None:
            per_module.setdefault(path, {})[name] = precision
        else:
            rest[name] = precision
    checked = {path: {name: GemmPrecision.of(value, field=name) for name, value in entries.items()}
               for path, entries in per_module.items()}
    for path, entries in checked.items():
        modules[path].set_precisions(entries)
    return rest
