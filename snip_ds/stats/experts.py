"""A statistics collection's MoE experts: each (expert, projection) pair measured as a linear layer on its tokens.

A :class:`~snip_ds.experts.module.SnipExperts` module's pairs are observed through their
:class:`~snip_ds.experts.points.ExpertPoint` (the collector hooks it as it hooks a
:class:`~snip_ds.linear.SnipLinear`): its input is the expert's routed tokens ``X_e`` ``[t_e, k]``, its output
gradient ``∂ℒ/∂y_e``, the routing weight that scales the expert's output included (chain rule). The estimators
then run unchanged, with three differences, all kept here:

* sequences: the sequence-form FLD sums ``g_t·E_t`` within each sequence; an expert's tokens come from any
  sequences in any order, so its rows are each token's sequence index (``token // L``, the MoE block's
  ``hidden_states`` being the ``[B·L, H]`` batch) instead of ``B`` equal runs;
* probe means: a per-channel term is priced with ``mean_t g_tj²`` over the tokens the layer saw, here the
  ``t_e`` routed tokens of the batch (a linear's: all of the batch's);
* no tokens: an expert that no token of a batch was routed to on this rank contributes exact zeros to every
  sum (its estimators are run on one all-zero token, whose error, drift and probe are 0), so that every rank
  all-reduces the same sums whichever experts its tokens chose. An expert that saw no token in a whole
  collection (on any rank) therefore gets ``fld`` and ``bwd`` exactly 0 and ``flops`` 0, with
  ``routed_tokens: 0`` and ``no_tokens: true`` in its record. A training run's planner then gives it back its
  last statistics (:func:`snip_ds.stats_file.carry_unrouted`): its FLOPs stay 0 (nothing runs), but its
  precision is chosen for the harm it did when it last saw tokens, so it stays out of FP4 for nothing.

``routed_tokens`` (each pair's routed tokens per step, summed over ranks, averaged over the collection's batches)
gives the pair's ``flops = 6·routed_tokens·k·n``, as :meth:`~snip_ds.experts.points.ExpertLayerInfo.flops` does.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterator, Tuple

import torch

from snip_ds.experts.points import ExpertPoint
from snip_ds.stats.common import Layer, Sums, SumField

if TYPE_CHECKING:
    from snip_ds.stats.settings import CollectSettings

ROUTED = SumField("routed_tokens")  # per pair: its routed tokens, summed over batches (and ranks)


def check_settings(layers: Dict[str, Layer], settings: "CollectSettings") -> None:
    """Refuses the ablations that do not measure experts yet, naming the first expert layer."""
    first = next((f for f, m in layers.items() if isinstance(m, ExpertPoint)), None)
    if first is None:
        return
    for name in ("forward_drift", "bwd_propagated"):
        if getattr(settings, name):
            raise ValueError(f"{name} does not support MoE experts yet (layer {first!r}); measure the experts "
                             f"without it, or leave them out with layers=")


class Points:
    """The collection's expert pairs: per batch, each pair's routed tokens and their sequences."""

    def __init__(self, points: Dict[str, ExpertPoint]) -> None:
        self.points = points
        self.seq_len = 1
        self._rows: Dict[str, torch.Tensor] = {}
        self._tokens: Dict[str, int] = {}

    def __contains__(self, fqn: str) -> bool:
        return fqn in self.points

    def begin_batch(self, seq_len: int) -> None:
        """A new batch of sequences of ``seq_len`` tokens (the MoE blocks see them as ``[B·L, H]``)."""
        self.seq_len = int(seq_len)
        self._rows.clear()
        self._tokens.clear()

    def on_forward(self, fqn: str, module: Any, x: torch.Tensor, counted: bool) -> None:
        """A forward through pair ``fqn`` on its tokens ``x``: their sequences (for the output gradient that
        follows) and, for the batch's first forward (``counted``), how many they are."""
        if fqn not in self.points:
            return
        if module.token_index is None:
            raise RuntimeError(f"expert layer {fqn!r} ran without its tokens' indices")
        self._rows[fqn] = module.token_index.to(x.device) // self.seq_len
        if counted:  # every call of the batch's forward (a pair inside a block that runs twice counts twice)
            self._tokens[fqn] = self._tokens.get(fqn, 0) + x.numel() // x.shape[-1]

    def rows(self, fqn: str) -> torch.Tensor:
        """Each of the pair's tokens' sequence index (int64 ``[t_e]``) in its last call."""
        return self._rows[fqn]

    def tokens(self, fqn: str) -> int:
        """The pair's routed tokens in this batch."""
        return self._tokens.get(fqn, 0)

    def add_routed(self, sums: Sums) -> None:
        """Adds every pair's routed tokens of this batch (0 included: every rank has every key)."""
        for fqn in self.points:
            sums.add(fqn, ROUTED.key(), torch.tensor(float(self.tokens(fqn))))

    def unrouted(self) -> Iterator[Tuple[str, ExpertPoint]]:
        """The pairs no token of this batch was routed to."""
        return ((f, m) for f, m in self.points.items() if self.tokens(f) == 0)


def record_fields(sums: Sums, fqn: str, point: ExpertPoint, n_batches: int) -> Dict[str, Any]:
    """An expert pair's ``flops``, ``routed_tokens`` (per step, all ranks) and ``no_tokens`` from the
    all-reduced sums."""
    routed = float(sums.get(fqn, ROUTED.key())[0]) / n_batches
    return {"flops": 6.0 * routed * point.in_features * point.out_features, "routed_tokens": routed,
            "no_tokens": routed == 0.0}
