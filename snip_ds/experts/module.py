"""The experts module whose every (expert, projection) pair runs its GEMMs at its own precision.

:class:`SnipExperts` replaces a model's experts module (:mod:`snip_ds.experts`); its layout is proved by
:func:`snip_ds.layouts.experts.recognize` before it is built.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from snip_ds.experts.points import ExpertLayerInfo, ExpertPoint, recomputing
from snip_ds.layouts.experts import BATCHED, ExpertsLayout, recognize
from snip_ds.linear import quantized_linear
from snip_ds.quant_config import QuantConfig
from snip_ds.types import GemmPrecision, LayerPrecision, block_index, full_shape, layer_seed

# experts implementations that run the family's eager loop (None: a module whose config never had one set, which
# the family runs with that loop); all others are followed as grouped_mm runs
EAGER_IMPLEMENTATIONS = (None, "eager")


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
                    rank: int = 0, layout: Optional[ExpertsLayout] = None) -> "SnipExperts":
        """Wraps the experts module ``family`` (at path ``fqn``) without copying its Parameters.

        Args:
            precision: the initial precision of every (expert, projection) pair.
            seed: seed of the per-pair generators (each from ``(seed, rank, layer name)``, see
                :func:`snip_ds.types.layer_seed`); None leaves them to torch's default generator.
            rank: data-parallel rank, mixed into the seeds.
            layout: the family's layout; None recognises and proves it
                (:func:`snip_ds.layouts.experts.recognize`).

        Raises:
            snip_ds.layouts.experts.ExpertsLayoutError: ``family``'s layout is not proved (the message says why).
        """
        if layout is None:
            layout = recognize(family, fqn, cls.unquantized)
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

    @classmethod
    def unquantized(cls, family: nn.Module, fqn: str, layout: ExpertsLayout) -> "SnipExperts":
        """The replacement of ``family`` with every pair at ``bf16`` and torch's default generator: what
        :func:`snip_ds.layouts.experts.recognize` proves against the family's own forward."""
        return cls.from_family(family, fqn, "bf16", seed=None, layout=layout)

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
        if self.layout.convention == BATCHED:  # every expert runs on every token
            share = 1.0
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
            return quantized_linear(x, self.weight(expert, j), bias, prec, self.quant_config,
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
        h = self._project(h, expert, 1, tokens=tokens)
        return self.post_expert_norm(h) if self.layout.post_norm else h

    def forward(self, hidden_states: torch.Tensor, top_k_index: Optional[torch.Tensor] = None,
                top_k_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``hidden_states`` ``[T, H]``, ``top_k_index`` and ``top_k_weights`` ``[T, K]`` -> ``[T, H]``: the sum
        over each token's experts of routing weight times expert output (an index ``>= num_experts``, expert
        parallelism's placeholder, contributes nothing)."""
        if self.layout.convention == BATCHED:
            return self._forward_batched(hidden_states)
        num_experts = self.num_experts
        with torch.no_grad():
            counts = torch.bincount(top_k_index.reshape(-1).clamp(max=num_experts),
                                    minlength=num_experts + 1)[:num_experts]
            if not recomputing():  # activation checkpointing's recomputation: counted the first time
                self._routed_tokens = counts if self._routed_tokens is None else self._routed_tokens + counts
        implementation = getattr(getattr(self, "config", None), "_experts_implementation", None)
        if implementation in EAGER_IMPLEMENTATIONS:
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
        if self.layout.post_norm:
            h = self.post_expert_norm(h)
        weighted = h * top_k_weights.reshape(-1)[perm].unsqueeze(-1)  # [S, H]
        return weighted[inv_perm].view(num_tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)

    def _forward_batched(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states`` ``[E·T, H]`` -> ``[E·T, H]``, expert ``e`` on rows ``e·T .. (e+1)·T`` (each expert sees
        every token, scaled by the MoE block's routing weight for it): the :data:`BATCHED` convention."""
        num_experts = self.num_experts
        tokens = hidden_states.shape[0] // num_experts
        if not recomputing():
            counts = torch.full((num_experts,), tokens, dtype=torch.int64, device=hidden_states.device)
            self._routed_tokens = counts if self._routed_tokens is None else self._routed_tokens + counts
        parts = hidden_states.view(num_experts, tokens, hidden_states.shape[-1])
        index = torch.arange(tokens, device=hidden_states.device)
        return torch.cat([self._expert(parts[e], e, index) for e in range(num_experts)])

    def extra_repr(self) -> str:
        kinds = sorted({p.to_json() if isinstance(p.to_json(), str) else "per-GEMM"
                        for row in self._precisions for p in row})
        return (f"family={self.family_class.__name__}, num_experts={self.num_experts}, "
                f"projections={self.layout.projections}, precisions={kinds}")
