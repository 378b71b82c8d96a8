"""The planner's and the statistics' view of one MoE (expert, projection) pair.

:class:`ExpertLayerInfo` is what the planner knows of a pair (its GEMM's shape, block, expert and the share of
the tokens it expects); :func:`routed_flops` its FLOPs for the tokens routed to it; :class:`ExpertPoint` the
object a statistics collection hooks in place of a :class:`~snip_ds.linear.SnipLinear`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from snip_ds.linear import InputGradOnlyLinearFn
from snip_ds.quant_config import QuantConfig
from snip_ds.types import GemmPrecision, LayerPrecision


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


def recomputing() -> bool:
    """Whether the running forward is inside a backward pass: activation checkpointing recomputing it."""
    current_node = getattr(torch._C, "_current_autograd_node", None)
    return current_node is not None and current_node() is not None


class ExpertPoint(nn.Module):
    """One (expert, projection) pair of a :class:`~snip_ds.experts.module.SnipExperts` as the statistics collection sees a linear layer.

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
    def matrix(self) -> torch.Tensor:
        """The GEMM's ``[out, in]`` matrix, as every planned layer has it (:attr:`weight` here)."""
        return self.weight

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
