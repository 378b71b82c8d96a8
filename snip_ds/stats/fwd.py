"""``forward_drift``: what each layer's fprop error does to the update (``fwd``), one estimator of a collection.

The drift ``η·c·ΔG ⊙ P`` of the planned weights, ΔG the change of their training gradient when layer ℓ's
output carries its fprop error ``E_ℓ(p)``, priced in loss units as BWD prices its drift, with the same probes:
``(1/2N)·⟨G^probe_r, η·c·ΔG ⊙ P⟩²`` per probe r. ``⟨v, ΔG⟩`` with ``v = P ⊙ G^probe_r`` is, to first order in
E, ``⟨∂G_Y,ℓ(W + εv)/∂ε, E_ℓ⟩`` (the mixed second derivative read the other way round), so two more forward and
backward passes per probe at ``W ± εv`` give it for every layer at once: a central difference of the output
gradients, contracted with the errors at ``W`` (:meth:`ForwardDrift.passes`). No parameter is touched: each
layer's output is shifted as its weight would be. One weight-sized FP32 tensor per layer while a batch runs.

docs/method.md derives it; this module names its sum (:data:`FWD_SQ`) and prices it (:func:`price`, the ``fwd``
field), and :func:`snip_ds.stats.fields.finalize` composes the artifact.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import torch

from snip_ds.linear import SnipLinear
from snip_ds.stats.common import Pricing, Shared, SumField
from snip_ds.stats.fld import FldEstimator

FWD_STEP = 3e-4  # the finite difference: the weight perturbation's norm relative to the weights'
FWD_SQ = SumField("fwd_sq")  # per precision: Σ over probes of ⟨P ⊙ G^probe_r, ΔG⟩²


def price(px: Pricing, fqn: str) -> Dict[str, float]:
    """A layer's ``fwd`` per precision: ``(ηc)²·mean_r ⟨…⟩² / 2N``."""
    return {p: px.eta2 * px.value(fqn, FWD_SQ, p) / float(px.num_probes) / (2.0 * px.tokens) / px.ranks
            for p in px.precisions}


class ForwardDrift:
    """The ``fwd`` sums of one collection (the module docstring). The fprop errors are ``fld``'s."""

    def __init__(self, shared: Shared, fld: FldEstimator) -> None:
        self.shared, self.fld = shared, fld
        self.x: Dict[str, torch.Tensor] = {}  # this batch's layer inputs ([T, k] FP32): E at the weights
        self.p: Dict[str, torch.Tensor] = {}  # preconditioners
        self.w_sq: Dict[str, float] = {}  # ‖W‖², sizes the finite difference
        self.v: Dict[str, torch.Tensor] = {}  # one probe's preconditioned weight gradient P ⊙ g_rᵀX
        self.dot: Dict[str, Dict[str, float]] = {}  # Σ_sign sign·⟨G_Y(W + sign·ε·v), E(p)⟩
        self.shift = 0.0

    def on_forward(self, fqn: str, x2: torch.Tensor) -> None:
        """The layer's input in the batch's first forward, ``[T, k]`` FP32."""
        self.x[fqn] = x2

    def on_weights(self, fqn: str, module: SnipLinear, pmat: Optional[torch.Tensor]) -> None:
        """The layer's ``‖W‖²`` and (once its training gradient has given it) its preconditioner."""
        w = module.matrix.detach().float()
        self.w_sq[fqn] = float((w * w).sum())
        if pmat is not None:
            self.p[fqn] = pmat

    def on_probe(self, fqn: str, x: torch.Tensor, g2: torch.Tensor) -> None:
        """One probe's output gradient ``g2`` (``[T, n]``) with the layer's saved input ``x``: ``v = P ⊙ g2ᵀX``."""
        self.v[fqn] = (g2.t() @ x.reshape(-1, x.shape[-1]).float()).mul_(self.p[fqn])

    def shifted_output(self, fqn: str, module: SnipLinear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Layer output in a pass at the weights ``W + shift·v``: ``y + shift·X vᵀ`` (differentiable in X, as a
        weight change would be). Its output gradient meets the layer's fprop errors."""
        v = self.v.get(fqn)
        if v is not None and self.shift != 0.0:
            y = y + (self.shift * (x.float() @ v.t())).to(y.dtype)
        if y.requires_grad:
            y.register_hook(lambda g: self._on_grad(fqn, module, g))
        return y

    def _on_grad(self, fqn: str, module: SnipLinear, g: torch.Tensor) -> None:
        x2 = self.x.get(fqn)
        if x2 is None:
            return
        g2 = g.detach().reshape(-1, g.shape[-1]).double()  # FP64 sums: the two passes' dots nearly cancel
        dots = self.dot.setdefault(fqn, {})
        sign = 1.0 if self.shift > 0 else -1.0
        for p, e, _, _ in self.fld.errors(module, x2):
            dots[p] = dots.get(p, 0.0) + sign * float((g2 * e.double()).sum())
            del e

    def passes(self, run_pass: Callable[[], None]) -> None:
        """Prices the update drift for the probe just back-propagated: ``run_pass()`` runs one forward (whose
        layers call :meth:`shifted_output`) and the backward of the training loss, here at ``W + ε·v`` and at
        ``W - ε·v``."""
        if not self.v:
            return
        v_sq = sum(float((v * v).sum()) for v in self.v.values())
        w_sq = sum(self.w_sq.values())
        if v_sq <= 0 or w_sq <= 0:
            self.v.clear()
            return
        eps = FWD_STEP * math.sqrt(w_sq / v_sq)
        self.dot = {}
        for sign in (1.0, -1.0):
            self.shift = sign * eps
            run_pass()
        self.shift = 0.0
        for fqn, dots in self.dot.items():
            for p, d in dots.items():
                a = d / (2.0 * eps)
                self.shared.stats.add(fqn, FWD_SQ.key(p), torch.tensor(a * a))
        self.v.clear()
        self.dot = {}

    def end_batch(self) -> None:
        self.x.clear()
        self.p.clear()

