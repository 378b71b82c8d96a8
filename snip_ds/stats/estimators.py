"""The per-batch terms of each estimator, computed in the collector's hooks (:mod:`snip_ds.stats.collector`).

Each class below is one estimator's part of the :class:`~snip_ds.stats.collector.Collector`; they read and
write the collector's state (``self.stats``, ``self.backend``, the saved layer inputs) and add named sums
that :mod:`snip_ds.stats.fields` turns into the artifact's fields after the all-reduce:

* :class:`FldTerms`, the forward loss divergence (FLD) of each layer's quantized fprop: its output error
  ``E = Q_p(X)Q_p(W)ᵀ - XWᵀ`` per channel (the channel form), ``Σ_rows (Σ_t g_t·E_t)²`` with each probe's
  output gradient g (the sequence form), the operand errors (the quant_err baselines) and, for the
  isotropic ablation, the curvature α from forward passes with the last block's output shifted;
* :class:`BwdTerms`, the backward weight drift (BWD): ``ΔG_W = Q_p(G_Y)ᵀQ_p(X) - G_YᵀX`` with G_Y rounded as
  training rounds it, preconditioned (``ΔG_W ⊙ P``) and priced per output channel, and the dgrad error and
  upstream terms of the propagated ablation;
* :class:`FwdTerms`, ``forward_drift``: what each layer's fprop error does to the update, from two extra
  passes per probe at weights shifted along ``±ε·P ⊙ G^probe``.

docs/method.md derives every formula.
"""
from __future__ import annotations

import math
from typing import Iterator, Optional, Tuple

import torch
import torch.nn.functional as F

from snip_ds import divergence as dv
from snip_ds.linear import SnipLinear
from snip_ds.stats.common import GLOBAL, targets
from snip_ds.stats.precond import PrecondFn, layer_precond

ISO_DELTA = 0.02  # δ of the isotropic ablation's forward-noise passes, relative to rms(z)
PRICE_TOKENS_MIN = 256  # tokens that price stochastic rounding's noise: at least this many (all, if fewer)
FWD_STEP = 3e-4  # forward_drift's finite difference: the weight perturbation's norm relative to the weights'


class FldTerms:
    """The forward divergence's sums: the fprop errors, priced by the channel and the sequence form."""

    def _fprop_errors(self, module: SnipLinear, x2: torch.Tensor) -> Iterator[Tuple[str, torch.Tensor,
                                                                                   torch.Tensor, torch.Tensor]]:
        """Per precision ``(p, E, Q_p(X), Q_p(W))`` with ``E = Q_p(X)Q_p(W)ᵀ - XWᵀ`` (RNE), one at a time."""
        cfg = self._quant_cfg(module)
        w = module.weight.detach().float()  # [n, k]
        y_ref = x2 @ w.t()  # [T, n]
        for p in self.precisions:
            x_lp = self.backend.quantize(x2, p, "x", -1, cfg)
            w_lp = self.backend.quantize(w, p, "w", -1, cfg)
            yield p, x_lp @ w_lp.t() - y_ref, x_lp, w_lp

    def _fprop_stats(self, fqn: str, module: SnipLinear, x2: torch.Tensor, g2: Optional[torch.Tensor],
                     rows: int = 1) -> None:
        """Per precision, as far as the collection asks for them (the collector's ``train_errors`` says whether
        any is): ``Σ_t E_tj²`` with ``E = Q_p(X)Q_p(W)ᵀ - XWᵀ`` (the channel form), the operand errors of X and
        W (``quant_err``), and (given the training ``G_Y``) the first-order term ``⟨G_Y, E⟩`` from the same E
        (and, for the empirical estimator, its per-sequence square: the sequence-form FLD with ``G_Y`` as the
        probe)."""
        st = self.stats
        w = module.weight.detach().float()  # [n, k]
        if self.train_errors:  # else nothing below needs E (only the study fields and the empirical FLD do)
            for p, e, x_lp, w_lp in self._fprop_errors(module, x2):
                if self.fld_channel:
                    st.add(fqn, f"err_sq.{p}", dv.channel_sq_sum(e))
                if g2 is not None:
                    if self.first_order:
                        st.add(fqn, f"first.{p}", (g2 * e).sum() * self.n_local)
                    if self.estimator == "empirical" and self.fld_sequence:
                        st.add(fqn, f"fld_seq.{p}", dv.sequence_sq_sum(g2 * self.n_local, e, rows))
                if self.quant_err:
                    st.add(fqn, f"qerr_x.{p}", ((x_lp - x2) ** 2).sum())
                    st.add(fqn, f"qerr_w.{p}", ((w_lp - w) ** 2).sum())
                del e, x_lp, w_lp
        if self.quant_err:
            st.add(fqn, "qnorm_x", (x2 * x2).sum())
        if self.quant_err or self.forward_drift:
            w_sq = (w * w).sum()
            if self.quant_err:
                st.add(fqn, "qnorm_w", w_sq)
            if self.forward_drift:
                self.fwd_w_sq[fqn] = float(w_sq)

    def _probe_fld(self, fqn: str, module: SnipLinear, g2: torch.Tensor, rows: int) -> None:
        """Sequence-form FLD: ``Σ_rows (Σ_t g_t·E_t)²`` per precision, E recomputed from the saved input.

        With probe labels drawn from the model's softmax, ``E_ŷ[(g·E)²] = Eᵀ(Σ_s J_sᵀF_sJ_s)E``: the exact
        Gauss-Newton quadratic form of the perturbation, cross-token and cross-channel terms included
        (sequences are independent, so their cross terms vanish in expectation and are left out).
        """
        x = self.xp.get(fqn)
        if x is None or not self.fld_sequence:
            return
        x2 = x.reshape(-1, x.shape[-1]).float()
        for p, e, _, _ in self._fprop_errors(module, x2):
            self.stats.add(fqn, f"fld_seq.{p}", dv.sequence_sq_sum(g2, e, rows))
            del e

    @torch.no_grad()
    def _alpha(self, ids, mask, labels, loss_0: float) -> None:
        z = self.z.detach()
        delta = ISO_DELTA * float(z.float().pow(2).mean().sqrt())
        v = torch.randn(z.shape, generator=self.gen, device=z.device, dtype=z.dtype)
        losses = {}
        self.phase = "alpha"
        try:
            for name, s in (("0", 0.0), ("+", 1.0), ("-", -1.0), ("2+", 2.0)):
                self.z_shift = (s * delta) * v
                lg, tg = targets(self.model(input_ids=ids, attention_mask=mask).logits, labels)
                losses[name] = float(F.cross_entropy(lg, tg))
        finally:
            self.phase, self.z_shift = "off", None
        alpha = dv.isotropic_alpha(losses["0"], losses["+"], losses["-"], delta, float((v.float() ** 2).sum()))
        st = self.stats
        st.add(GLOBAL, "alpha_tok", torch.tensor(alpha * self.n_local))  # per-token-scale curvature
        st.add(GLOBAL, "quad_ratio", torch.tensor(dv.quadratic_ratio(losses["0"], losses["+"], losses["2+"],
                                                                           losses["-"])))
        st.add(GLOBAL, "alpha_count", torch.tensor(1.0))


class BwdTerms:
    """The backward divergence's sums: the weight-gradient error's drift, its noise and its price."""

    def _on_train_grad(self, fqn: str, module: SnipLinear, g2: torch.Tensor, rows: int) -> None:
        st, cfg, be = self.stats, self._quant_cfg(module), self.backend
        x2 = self.x.pop(fqn)
        self._fprop_stats(fqn, module, x2, g2, rows)
        w = module.weight.detach().float() if self.propagated else None
        gw = g2.t() @ x2  # [n, k], BF16-pass weight gradient (mean loss)
        pmat, pfn = layer_precond(self.precond, self.fallback, fqn, gw, self.sources)
        if self.forward_drift:
            self.fwd_p[fqn] = pmat
        sr = {p: self._expects_sr(module, p) for p in self.precisions}
        uses = len(self.precisions) + int(self.propagated)  # projections of X below
        gram = x2.t() @ x2 if dv.gram_pays(x2.shape[0], x2.shape[1], gw.shape[0], uses) else None
        for p in self.precisions:
            if sr[p]:  # training rounds G_Y stochastically: the exact expectation over that rounding
                sample = self._price_sample(x2.shape[0], gw.shape[0])
                mom = be.wgrad_moments(g2, x2, p, module.quant_config, self.had_gen, sample)
                dgw, var, projected = mom.mean.sub_(gw), mom.var, mom.projected
                del mom
            else:
                dgw, var, projected = be.wgrad(g2, x2, p, cfg, self.had_gen) - gw, None, None
            self._drift_stats(fqn, p, dgw, var, projected, x2, pmat, pfn, gram)
            del dgw, var, projected
            if self.quant_err:
                g_lp = be.quantize(g2, p, "g", -1, cfg)
                st.add(fqn, f"qerr_g.{p}", ((g_lp - g2) ** 2).sum())
                del g_lp
            if self.propagated:
                if sr[p]:
                    mom = be.dgrad_moments(g2, w, p, module.quant_config)
                    e = mom.mean - g2 @ w
                    st.add(fqn, f"dgrad_sq.{p}", (e * e).sum() + mom.var.sum())
                else:
                    e = be.dgrad(g2, w, p, cfg, self.had_gen) - g2 @ w
                    st.add(fqn, f"dgrad_sq.{p}", (e * e).sum())
                del e
        if self.quant_err:
            st.add(fqn, "qnorm_g", (g2 * g2).sum())
        if self.estimator == "empirical":
            st.add(fqn, "probe_sq", dv.channel_sq_sum(g2 * self.n_local))
        if self.propagated:
            if pfn is None:
                up = gw * pmat
                st.add(fqn, "up_sq", (up * up).sum())
            else:
                up = gw
                st.add(fqn, "up_sq", torch.as_tensor(pfn(fqn, gw), dtype=torch.float32))
                st.add(fqn, "gw_sq", (gw * gw).sum())
            st.add(fqn, "up_ch", dv.projected_sq_sum(x2, up, gram))

    def _price_sample(self, tokens: int, n: int) -> torch.Tensor:
        """Tokens whose inputs price the rounding noise (:meth:`EmulatedBackend.wgrad_moments`): all of them
        up to PRICE_TOKENS_MIN, else ``n / 4`` of them (which keeps that price near a quarter of the wgrad
        GEMM's cost), drawn from a generator of their own."""
        m = min(tokens, max(PRICE_TOKENS_MIN, n // 4))
        if m == tokens:
            return torch.arange(tokens)
        return torch.randperm(tokens, generator=self.price_gen, device=self.price_gen.device)[:m]

    def _expects_sr(self, module: SnipLinear, p: str) -> bool:
        return self.bwd_rounding == "recipe" and self.backend.rounds_g_stochastically(p, module.quant_config)

    def _drift_stats(self, fqn: str, p: str, dgw: torch.Tensor, var: Optional[torch.Tensor],
                     projected: Optional[torch.Tensor], x2: torch.Tensor, pmat: Optional[torch.Tensor],
                     pfn: Optional[PrecondFn], gram: Optional[torch.Tensor]) -> None:
        """The weight-gradient error's drift statistics: its systematic part ``dgw`` (the whole error under
        round-to-nearest; its expectation under stochastic rounding) under ``*_bias`` keys (with the
        ``bwd_bias`` study fields only), and with the rounding noise of element-wise variance ``var`` added
        (its expectation) under the plain keys.

        The noise's loss-unit price per output channel j is ``projected_j`` (estimated from a sample of the
        tokens, :meth:`_price_sample`) times ``P²`` averaged over the row j with weights ``var`` (exact when P
        is constant within a row)."""
        st = self.stats
        if pfn is None:
            drift = dgw.mul_(pmat)  # dgw is ours to overwrite
            bias_sq, bias_ch = (drift * drift).sum(), dv.projected_sq_sum(x2, drift, gram)
            noise_sq = None
            if var is not None:
                row_var = var.sum(dim=1)
                weighted = var.mul_(pmat).mul_(pmat)  # P²·Var, in place
                noise_sq = weighted.sum()
                noise_ch = weighted.sum(dim=1).div_(torch.where(row_var > 0, row_var, 1.0)).mul_(projected)
        else:
            bias_sq = torch.as_tensor(pfn(fqn, dgw), dtype=torch.float32)
            bias_ch = dv.projected_sq_sum(x2, dgw, gram)
            dg_sq = (dgw * dgw).sum()
            if self.bwd_bias:
                st.add(fqn, f"dg_sq_bias.{p}", dg_sq)
            st.add(fqn, f"dg_sq.{p}", dg_sq + var.sum() if var is not None else dg_sq)
            noise_sq = torch.as_tensor(pfn(fqn, var.sqrt()), dtype=torch.float32) if var is not None else None
            noise_ch = projected
        if self.bwd_bias:
            st.add(fqn, f"drift_sq_bias.{p}", bias_sq)
            st.add(fqn, f"drift_ch_bias.{p}", bias_ch)
        st.add(fqn, f"drift_sq.{p}", bias_sq + noise_sq if noise_sq is not None else bias_sq)
        st.add(fqn, f"drift_ch.{p}", bias_ch + noise_ch if noise_sq is not None else bias_ch)


class FwdTerms:
    """``forward_drift``: the update drift that each layer's fprop error causes."""

    def _on_fwd_forward(self, fqn: str, module: SnipLinear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Layer output at the weights ``W + shift·v``: ``y + shift·X vᵀ`` (differentiable in X, as a
        weight change would be; no parameter is touched). Its output gradient meets the layer's fprop errors."""
        v = self.fwd_v.get(fqn)
        if v is not None and self.fwd_shift != 0.0:
            y = y + (self.fwd_shift * (x.float() @ v.t())).to(y.dtype)
        if y.requires_grad:
            y.register_hook(lambda g: self._on_fwd_grad(fqn, module, g))
        return y

    def _on_fwd_grad(self, fqn: str, module: SnipLinear, g: torch.Tensor) -> None:
        x2 = self.fwd_x.get(fqn)
        if x2 is None:
            return
        g2 = g.detach().reshape(-1, g.shape[-1]).double()  # FP64 sums: the two passes' dots nearly cancel
        dots = self.fwd_dot.setdefault(fqn, {})
        sign = 1.0 if self.fwd_shift > 0 else -1.0
        for p, e, _, _ in self._fprop_errors(module, x2):
            dots[p] = dots.get(p, 0.0) + sign * float((g2 * e.double()).sum())
            del e

    def _forward_drift_passes(self, ids, mask, labels) -> None:
        """Prices the update drift that each layer's fprop error causes, for one probe r (BWD's loss-unit
        price applied to the forward; docs/method.md): ``(1/2N)·⟨G^probe_r, η·c·ΔG ⊙ P⟩²``, where ΔG is the
        change of the planned weights' training gradient when layer ℓ's output carries its error E_ℓ(p).

        ``⟨v, ΔG⟩`` with ``v = P ⊙ G^probe_r`` is, to first order in E, ``⟨∂G_Y,ℓ(W + εv)/∂ε, E_ℓ⟩`` (the mixed
        second derivative read the other way round), so two passes at ``W ± εv`` give it for every layer at
        once: a central difference of the output gradients, contracted with the errors at ``W``.
        """
        if not self.fwd_v:
            return
        v_sq = sum(float((v * v).sum()) for v in self.fwd_v.values())
        w_sq = sum(self.fwd_w_sq.values())
        if v_sq <= 0 or w_sq <= 0:
            self.fwd_v.clear()
            return
        eps = FWD_STEP * math.sqrt(w_sq / v_sq)
        self.fwd_dot = {}
        for sign in (1.0, -1.0):
            self.fwd_shift = sign * eps
            self.phase = "fwd_pass"
            lg, tg = targets(self.model(input_ids=ids, attention_mask=mask).logits, labels)
            self.phase = "fwd_backward"
            torch.autograd.grad(F.cross_entropy(lg, tg), self.emb)
        self.fwd_shift = 0.0
        for fqn, dots in self.fwd_dot.items():
            for p, d in dots.items():
                a = d / (2.0 * eps)
                self.stats.add(fqn, f"fwd_sq.{p}", torch.tensor(a * a))
        self.fwd_v.clear()
        self.fwd_dot = {}
