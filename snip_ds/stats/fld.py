"""The forward loss divergence (FLD) of each layer's quantized fprop: one estimator of a collection.

A layer's fprop error at precision p is ``E = Q_p(X)Q_p(W)ᵀ - XWᵀ`` (round to nearest). The collector
(:mod:`snip_ds.stats.collector`) hands this estimator a layer's input X and, as they arrive, the training
gradient ``G_Y`` and each probe's output gradient g; it adds, as far as the collection asks for them:

* the sequence form ``Σ_rows (Σ_t g_t·E_t)²`` with the probe's g (``fld_seq``; with the empirical estimator
  ``G_Y`` plays the probe), the Gauss-Newton form of E in expectation over the probe labels;
* the channel form's ``Σ_t E_tj²`` per output channel (``err_sq``, priced per channel by the probes at the
  end of the batch);
* the study fields: the first-order term ``⟨G_Y, E⟩`` (``first``) and the operand errors of X and W
  (``qerr_x``, ``qerr_w`` with their norms ``qnorm_x``, ``qnorm_w``: the quant_err baselines).

This module names those sums (:class:`~snip_ds.stats.common.SumField`) and prices them (:func:`price`);
docs/method.md derives the forms, and :func:`snip_ds.stats.fields.finalize` composes the artifact's fields.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F

from snip_ds import divergence as dv
from snip_ds.linear import SnipLinear
from snip_ds.stats.common import Pricing, Rows, Shared, SumField, rne_config

if TYPE_CHECKING:
    from snip_ds.stats.settings import CollectSettings


FLD_PROD = SumField("fld_prod")  # the channel form: ERR_SQ priced with the batch's probes
ERR_SQ = SumField("err_sq", folded_into=FLD_PROD)  # per precision: Σ_t E_tj² per output channel
FLD_SEQ = SumField("fld_seq")  # the sequence form Σ_rows (Σ_t g_t·E_t)²
FIRST = SumField("first")  # the first-order term ⟨G_Y, E⟩·n_local
QERR = {"x": SumField("qerr_x"), "w": SumField("qerr_w")}  # per precision: ‖Q_p(X) - X‖², ‖Q_p(W) - W‖²
QNORM = {"x": SumField("qnorm_x"), "w": SumField("qnorm_w")}  # ‖X‖², ‖W‖²
FOLDS = (ERR_SQ,)  # per precision


def price(px: Pricing, fqn: str, fld_form: str) -> Dict[str, Dict[str, float]]:
    """A layer's ``fld`` (the ``fld_form`` one), ``fld_sequence``, ``fld_channel`` and ``first_order``, per
    precision: each sum over ``2N`` (the sequence form also over the probes), times the curvature."""
    fld, fld_sq, fld_ch, first = {}, {}, {}, {}
    for p in px.precisions:
        fld_ch[p] = px.curvature * px.value(fqn, FLD_PROD, p) / (2.0 * px.tokens)
        fld_sq[p] = px.curvature * px.value(fqn, FLD_SEQ, p) / px.probes / (2.0 * px.tokens)
        fld[p] = fld_sq[p] if fld_form == "sequence" else fld_ch[p]
        first[p] = px.value(fqn, FIRST, p) / px.tokens
    return {"fld": fld, "fld_sequence": fld_sq, "fld_channel": fld_ch, "first_order": first}


class FldEstimator:
    """The FLD sums of one collection (the module docstring)."""

    def __init__(self, shared: Shared, settings: "CollectSettings") -> None:
        study = set(settings.study_fields)
        self.shared = shared
        self.sequence = settings.fld_form == "sequence" or "fld_forms" in study
        self.channel = settings.fld_form == "channel" or "fld_forms" in study
        self.first_order, self.quant_err = "first_order" in study, "quant_err" in study
        self.empirical = settings.estimator == "empirical"
        # whether the training gradient's hook needs the fprop errors E (else only the probe's hook does)
        self.train_errors = self.channel or self.first_order or self.quant_err or (self.empirical and self.sequence)
        self._pending: list = []  # tensor-parallel shards' per-sequence sums, until flush
        self._calls: dict = {}  # (layer, precision) -> (module, per-row sums so far) of a layer run several times

    def errors(self, module: SnipLinear, x2: torch.Tensor) -> Iterator[Tuple[str, torch.Tensor, torch.Tensor,
                                                                             torch.Tensor]]:
        """Per precision ``(p, E, Q_p(X), Q_p(W))`` with ``E = Q_p(X)Q_p(W)ᵀ - XWᵀ`` (RNE), one at a time;
        ``x2`` is the layer's input as ``[T, k]`` FP32."""
        be, cfg = self.shared.backend, rne_config(module)
        w = module.matrix.detach().float()  # [n, k]
        y_ref = x2 @ w.t()  # [T, n]
        for p in self.shared.precisions:
            x_lp = be.quantize(x2, p, "x", -1, cfg)
            w_lp = be.quantize(w, p, "w", -1, cfg)
            yield p, x_lp @ w_lp.t() - y_ref, x_lp, w_lp

    def on_output(self, fqn: str, module: SnipLinear, x2: torch.Tensor, g2: Optional[torch.Tensor],
                  rows: Rows = 1) -> None:
        """The terms of the layer's output: called with the training gradient ``g2 = G_Y`` (``[T, n]`` FP32,
        ``rows`` sequences) when it arrives, or with None for an output no gradient will reach (then no
        first-order term). Per precision ``Σ_t E_tj²`` (the channel form), the operand errors of X and W
        (``quant_err``), and the first-order term ``⟨G_Y, E⟩`` from the same E (and, for the empirical
        estimator, its per-sequence square: the sequence form with ``G_Y`` as the probe)."""
        st, n_local = self.shared.stats, self.shared.n_local
        w = module.matrix.detach().float()  # [n, k]
        if self.train_errors:  # else nothing below needs E (only the study fields and the empirical FLD do)
            for p, e, x_lp, w_lp in self.errors(module, x2):
                if self.channel:
                    st.add(fqn, ERR_SQ.key(p), dv.channel_sq_sum(e))
                if g2 is not None:
                    if self.first_order:
                        st.add(fqn, FIRST.key(p), (g2 * e).sum() * n_local)
                    if self.empirical and self.sequence:
                        st.add(fqn, FLD_SEQ.key(p), dv.sequence_sq_sum(g2 * n_local, e, rows))
                if self.quant_err:
                    st.add(fqn, QERR["x"].key(p), ((x_lp - x2) ** 2).sum())
                    st.add(fqn, QERR["w"].key(p), ((w_lp - w) ** 2).sum())
                del e, x_lp, w_lp
        if self.quant_err:
            st.add(fqn, QNORM["x"].key(), (x2 * x2).sum())
            st.add(fqn, QNORM["w"].key(), (w * w).sum())

    def on_probe(self, fqn: str, module: SnipLinear, x: Optional[torch.Tensor], g2: torch.Tensor,
                 rows: Rows, dx: Optional[torch.Tensor] = None, several: bool = False) -> None:
        """Sequence form: ``Σ_rows (Σ_t g_t·E_t)²`` per precision with one probe's output gradient ``g2``
        (``[T, n]`` FP32) and the layer's saved input ``x`` (None: not saved, nothing to add); ``rows``: the
        sequences, as :func:`snip_ds.divergence.row_sums` takes them (an MoE expert's: each token's sequence).

        Each row's ``Σ_t g_t·E_t`` is ``Σ_t (g_t Q_p(W))·Q_p(x_t) - (g_t W)·x_t``, and ``g_t W`` is the layer's own
        input gradient, which the probe's backward computes anyway: with it (``dx``, ``[T, k]`` FP32) one
        product per precision suffices instead of two, and the terms cancel element by element as in E
        itself (without ``dx``, E is formed from XWᵀ and the quantized product).

        With probe labels drawn from the model's softmax, ``E_ŷ[(g·E)²] = Eᵀ(Σ_s J_sᵀF_sJ_s)E``: the exact
        Gauss-Newton quadratic form of the perturbation, cross-token and cross-channel terms included
        (sequences are independent, so their cross terms vanish in expectation and are left out).

        ``several``: the layer runs more than once per forward; each row's sum is added over its calls in this
        probe's backward and squared by :meth:`end_probe` (the calls' errors meet in one loss).
        """
        if x is None or not self.sequence:
            return
        x2 = x.reshape(-1, x.shape[-1]).float()
        st = self.shared.stats
        if dx is None:
            for p, e, _, _ in self.errors(module, x2):
                st.add(fqn, FLD_SEQ.key(p), dv.sequence_sq_sum(g2, e, rows))
                del e
            return
        be, cfg = self.shared.backend, rne_config(module)
        w = module.matrix.detach().float()  # [n, k]
        for p in self.shared.precisions:
            terms = (g2 @ be.quantize(w, p, "w", -1, cfg)).mul_(be.quantize(x2, p, "x", -1, cfg))
            terms.addcmul_(dx, x2, value=-1.0)
            # per row Σ_t g_t·E_t (an expert's tokens: by their sequence index)
            s = terms.reshape(rows, -1).sum(1) if isinstance(rows, int) else dv.row_sums(terms.sum(1), rows)
            del terms
            if several:  # squared once every call has added its part (end_probe)
                held = self._calls.get((fqn, p))
                if held is not None and held[1].shape != s.shape:  # calls over other sequences: pad to the longer
                    n = max(held[1].numel(), s.numel())
                    held = (module, F.pad(held[1], (0, n - held[1].numel())))
                    s = F.pad(s, (0, n - s.numel()))
                self._calls[(fqn, p)] = (module, s if held is None else held[1] + s)
            else:
                self._square(fqn, p, module, s)

    def _square(self, fqn: str, p: str, module: SnipLinear, s: torch.Tensor) -> None:
        if getattr(module, "tp_shard", None) is not None:  # a shard's part of each row's sum (see flush)
            self._pending.append((fqn, p, module, s))
        else:
            self.shared.stats.add(fqn, FLD_SEQ.key(p), (s * s).sum())

    def end_probe(self) -> None:
        """A probe's backward ended: the per-row sums of layers that run more than once, summed over their
        calls, are squared now."""
        for (fqn, p), (module, s) in self._calls.items():
            self._square(fqn, p, module, s)
        self._calls.clear()

    def flush(self) -> None:
        """Tensor-parallel shards: each sequence's ``Σ_t g_t·E_t`` is linear in the shard's outputs (a column
        shard's channels, a row shard's partial products), so the shards' parts, kept since the start of the
        collection, are summed over the group in one all-reduce and only then squared (counted on the group's
        first rank: :meth:`~snip_ds.stats.common.Shared.once`)."""
        if not self._pending:
            return
        parts = [s for _, _, _, s in self._pending]
        total = self._pending[0][2].tp_sum(torch.cat(parts))
        st, at = self.shared.stats, 0
        for (fqn, p, _, s) in self._pending:
            v = total[at:at + s.numel()]
            at += s.numel()
            st.add(fqn, FLD_SEQ.key(p), self.shared.once((v * v).sum()))
        self._pending.clear()
