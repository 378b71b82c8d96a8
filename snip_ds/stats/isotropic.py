"""The isotropic ablation's probes and curvature α (``estimator="isotropic"``), one estimator of a collection.

Instead of Monte-Carlo Fisher probes, each probe back-propagates ``Σ u ⊙ z`` with ``u ~ N(0, I)`` from the
last decoder block's output z; the curvature α that turns those probes into loss units comes from four
forward passes with z shifted by ``s·δ·v`` (``s = 0, +1, -1, +2``, ``δ = ISO_DELTA·rms(z)``, v another
``N(0, I)`` draw): :func:`snip_ds.divergence.isotropic_alpha` and, as a check of the quadratic model,
:func:`snip_ds.divergence.quadratic_ratio`.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch
from torch import nn

from snip_ds import divergence as dv
from snip_ds.stats.common import GLOBAL, Shared, Sums, SumField
from snip_ds.types import block_index

ISO_DELTA = 0.02  # δ of the forward-noise passes, relative to rms(z)
# Model-wide (GLOBAL) sums over batches and ranks: α·n_local, the quadratic check's ratio, the batches.
ALPHA_TOK, QUAD_RATIO, ALPHA_COUNT = SumField("alpha_tok"), SumField("quad_ratio"), SumField("alpha_count")


def _mean(sums: Sums, field: SumField) -> float:
    return float(sums.get(GLOBAL, field.key())[0]) / float(sums.get(GLOBAL, ALPHA_COUNT.key())[0])


def curvature(sums: Sums) -> float:
    """The per-token-scale curvature that turns the isotropic probes into loss units (mean over batches)."""
    return _mean(sums, ALPHA_TOK)


def header_fields(sums: Sums, tokens_per_batch: float) -> Dict[str, float]:
    """The artifact's ``alpha`` (of one rank-local batch's mean loss; ``tokens_per_batch`` its target tokens)
    and ``quadratic_ratio`` (4 where the loss is quadratic along the probes)."""
    return {"alpha": curvature(sums) / tokens_per_batch, "quadratic_ratio": _mean(sums, QUAD_RATIO)}


class IsotropicProbe:
    """Hooks the last decoder block's output: keeps z for the probes, shifts it during the α passes."""

    def __init__(self, shared: Shared, gen: torch.Generator) -> None:
        self.shared, self.gen = shared, gen
        self.z: Optional[torch.Tensor] = None
        self.shift: Optional[torch.Tensor] = None

    @staticmethod
    def last_block(model: nn.Module, layers: Dict[str, Any]) -> nn.Module:
        """The decoder block holding the last of ``layers``."""
        last = max(layers, key=block_index)
        prefix = last[: last.index(f"layers.{block_index(last)}") + len(f"layers.{block_index(last)}")]
        return model.get_submodule(prefix)

    def on_block_output(self, module: nn.Module, inputs: Any, output: Any) -> Any:
        """Forward hook of the last block: keeps its output z, or adds the α pass's shift to it."""
        z = output[0] if isinstance(output, tuple) else output
        if self.shift is None:
            self.z = z
            return output
        z = z + self.shift
        return (z, *output[1:]) if isinstance(output, tuple) else z

    def probe_loss(self) -> torch.Tensor:
        """One probe's scalar to back-propagate: ``Σ u ⊙ z``, u drawn from the collection's generator."""
        u = torch.randn(self.z.shape, generator=self.gen, device=self.z.device, dtype=self.z.dtype)
        return (u * self.z).sum()

    @torch.no_grad()
    def alpha(self, loss_of_forward: Callable[[], float], passes_running: Callable[[bool], None]) -> None:
        """α from four forward passes of the batch (``loss_of_forward()`` runs one and returns its mean loss);
        ``passes_running(True/False)`` tells the collector when they start and end."""
        z = self.z.detach()
        delta = ISO_DELTA * float(z.float().pow(2).mean().sqrt())
        v = torch.randn(z.shape, generator=self.gen, device=z.device, dtype=z.dtype)
        losses = {}
        passes_running(True)
        try:
            for name, s in (("0", 0.0), ("+", 1.0), ("-", -1.0), ("2+", 2.0)):
                self.shift = (s * delta) * v
                losses[name] = loss_of_forward()
        finally:
            self.shift = None
            passes_running(False)
        alpha = dv.isotropic_alpha(losses["0"], losses["+"], losses["-"], delta, float((v.float() ** 2).sum()))
        st = self.shared.stats
        st.add(GLOBAL, ALPHA_TOK.key(), torch.tensor(alpha * self.shared.n_local))  # per-token-scale curvature
        st.add(GLOBAL, QUAD_RATIO.key(), torch.tensor(dv.quadratic_ratio(losses["0"], losses["+"], losses["2+"],
                                                                           losses["-"])))
        st.add(GLOBAL, ALPHA_COUNT.key(), torch.tensor(1.0))

    def end_batch(self) -> None:
        self.z = None
