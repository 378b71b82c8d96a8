"""The backward weight drift (BWD): one estimator of a collection.

With the training gradient ``G_Y`` of a layer and its input X, the weight-gradient error
``ΔG_W = Q_p(G_Y)ᵀQ_p(X) - G_YᵀX`` with G_Y rounded as training rounds it (``bwd_rounding="recipe"``: where that
is stochastic, the exact expectation over the rounding, its systematic part ``E[ΔG_W]`` plus the noise
``Var[G_W]``; ``"nearest"``: round to nearest), preconditioned by the optimizer state P (:mod:`snip_ds.stats.precond`)
and priced per output channel: ``‖ΔG_W ⊙ P‖²`` (``drift_sq``) and ``Σ_t (X (ΔG_W ⊙ P)ᵀ)²`` (``drift_ch``, priced
by the probes at the end of the batch). With ``bwd_propagated``, also the dgrad error ``Q_p(G_Y)Q_p(W) - G_Y W``
and the upstream terms of the ratio estimate, for which :class:`InputGroups` finds the layers that share an input.
With the ``quant_err`` study fields, the operand error of G_Y.

This module names those sums (:class:`~snip_ds.stats.common.SumField`) and prices them: :func:`price` (``bwd``,
``bwd_drift`` and their systematic parts), :func:`price_propagated` and :func:`dgrad_cost` (the propagated
ablation); docs/method.md derives the terms, and :func:`snip_ds.stats.fields.finalize` composes the artifact.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from snip_ds import divergence as dv
from snip_ds.backend.operands import hadamard_wgrad
from snip_ds.linear import SnipLinear
from snip_ds.stats.common import GLOBAL, Pricing, Shared, SumField, rne_config
from snip_ds.stats.precond import Precond, PrecondFn, layer_precond

if TYPE_CHECKING:
    from snip_ds.stats.settings import CollectSettings

PRICE_TOKENS_MIN = 256  # tokens that price stochastic rounding's noise: at least this many (all, if fewer)

# Per precision: the drift ‖ΔG_W⊙P‖², its per-channel projection Σ_t (X (ΔG_W⊙P)ᵀ)² and that priced with the
# batch's probes, and (callable preconditioners) ‖ΔG_W‖²; the *_BIAS twins hold the systematic part alone.
DRIFT_PROD, DRIFT_PROD_BIAS = SumField("drift_prod"), SumField("drift_prod_bias")
DRIFT_SQ, DRIFT_SQ_BIAS = SumField("drift_sq"), SumField("drift_sq_bias")
DRIFT_CH = SumField("drift_ch", folded_into=DRIFT_PROD)
DRIFT_CH_BIAS = SumField("drift_ch_bias", folded_into=DRIFT_PROD_BIAS)
DG_SQ, DG_SQ_BIAS = SumField("dg_sq"), SumField("dg_sq_bias")
QERR_G, QNORM_G = SumField("qerr_g"), SumField("qnorm_g")  # ‖Q_p(G_Y) - G_Y‖² per precision, ‖G_Y‖²
# bwd_propagated: the dgrad error ‖Q_p(G_Y)Q_p(W) - G_Y W‖² per precision; per layer the upstream terms
# ‖G_W⊙P‖² (UP_SQ; ‖G_W‖² in GW_SQ with callable preconditioners) and their projection, priced with the probes;
# per input group (GLOBAL, suffix the group) the input gradient's ‖G_X‖².
DGRAD_SQ, UP_SQ, GW_SQ, UP_PROD, GX_SQ = (SumField(n) for n in ("dgrad_sq", "up_sq", "gw_sq", "up_prod", "gx_sq"))
UP_CH = SumField("up_ch", folded_into=UP_PROD)
FOLDS = (DRIFT_CH, DRIFT_CH_BIAS)  # per precision
LAYER_FOLDS = (UP_CH,)  # one per layer


class InputGroups:
    """``bwd_propagated``: the order in which the layers run and which of them share one input tensor (q/k/v,
    gate/up), each group named by its first layer."""

    def __init__(self) -> None:
        self.order: Dict[str, int] = {}
        self.group: Dict[str, str] = {}  # layer -> its input group
        self._ids: Dict[int, str] = {}  # id(input tensor) -> group, for the current forward only
        self._inputs: List[torch.Tensor] = []  # keeps those ids unique: no input is freed mid-forward

    def new_forward(self) -> None:
        """Ids are unique only while the tensors live: forget the last forward's."""
        self._ids.clear()
        self._inputs.clear()

    def see(self, fqn: str, x: torch.Tensor) -> Optional[str]:
        """Records layer ``fqn`` with input ``x``; returns the group's name when ``x`` is an input not seen
        before in this forward (the caller may hook its gradient), else None."""
        if fqn not in self.order:
            self.order[fqn] = len(self.order)
        key = id(x)
        new = key not in self._ids
        if new:
            self._ids[key] = fqn
            self._inputs.append(x)
        self.group[fqn] = self._ids[key]
        return self._ids[key] if new else None


class BwdEstimator:
    """The BWD sums of one collection (the module docstring): the weight-gradient error's drift, its noise and
    its price."""

    def __init__(self, shared: Shared, settings: "CollectSettings", precond: Precond,
                 device: torch.device) -> None:
        self.shared = shared
        self.rounding, self.propagated = settings.bwd_rounding, settings.bwd_propagated
        self.bias = "bwd_bias" in settings.study_fields
        self.quant_err = "quant_err" in settings.study_fields
        self.precond, self.fallback = precond, settings.precond_fallback
        self.sources: set = set()  # where the preconditioners came from (the artifact's "precond")
        self.had_gen = torch.Generator(device=device).manual_seed(settings.seed + 1)  # Hadamard signs (if on)
        self.price_gen = torch.Generator(device=device).manual_seed(settings.seed + 2)  # tokens pricing noise
        # The layers that share one input (q/k/v, gate/up) share its Gram matrix XᵀX, in this batch:
        self.inputs = InputGroups()
        self._rows: Dict[str, int] = {}  # input group -> the vectors its layers project onto it (gram_pays)
        self._gram: Optional[Tuple[str, Optional[torch.Tensor]]] = None  # (group, its Gram matrix or None)

    def begin_forward(self) -> None:
        self.inputs.new_forward()
        self._rows.clear()
        self._gram = None

    def on_forward(self, fqn: str, module: SnipLinear, x: torch.Tensor) -> Optional[str]:
        """Layer ``fqn`` ran on input ``x`` in the batch's forward: which layers share an input (and so its
        Gram matrix) and how many vectors they all project onto it. Returns the input's group when ``x`` is
        new in this forward (:meth:`InputGroups.see`)."""
        new = self.inputs.see(fqn, x)
        group = self.inputs.group[fqn]
        self._rows[group] = self._rows.get(group, 0) + self._projected_rows(module, x.numel() // x.shape[-1])
        return new

    def end_forward(self) -> None:
        self.inputs.new_forward()  # the groups are known; let the inputs go

    def _projected_rows(self, module: SnipLinear, tokens: int) -> int:
        """The vectors :meth:`on_train_grad` projects onto the layer's input: each precision's drift (and the
        upstream term with ``bwd_propagated``) per output channel, and the tokens that price stochastic
        rounding's noise (through the Gram matrix where there is no Hadamard transform)."""
        n = module.out_features
        rows = (len(self.shared.precisions) + int(self.propagated)) * n
        for p in self.shared.precisions:
            if self._expects_sr(module, p) and not hadamard_wgrad(p, module.quant_config):
                rows += min(tokens, max(PRICE_TOKENS_MIN, n // 4))
        return rows

    def _gram_for(self, fqn: str, module: SnipLinear, x2: torch.Tensor) -> Optional[torch.Tensor]:
        """``x2ᵀx2`` where it saves multiply-adds (:func:`~snip_ds.divergence.gram_pays`) over all the layers
        that share this input, computed once for them when they come one after another (as siblings do in a
        backward), else None."""
        gid = self.inputs.group.get(fqn)
        if gid not in self._rows:  # not seen in this batch's forward: the layer alone
            gid = None
        if gid is not None and self._gram is not None and self._gram[0] == gid:
            return self._gram[1]
        tokens, k = x2.shape
        rows = self._rows[gid] if gid is not None else self._projected_rows(module, tokens)
        gram = x2.t() @ x2 if dv.gram_pays(tokens, k, rows) else None
        if gid is not None:
            self._gram = (gid, gram)
        return gram

    def on_input_grad(self, gid: str, g: torch.Tensor) -> None:
        """The training gradient of an input group's shared input (``bwd_propagated``)."""
        self.shared.stats.add(GLOBAL, GX_SQ.key(gid), (g.float() ** 2).sum())

    def on_train_grad(self, fqn: str, module: SnipLinear, x2: torch.Tensor,
                      g2: torch.Tensor) -> Optional[torch.Tensor]:
        """The layer's terms from its input ``x2`` (``[T, k]``) and training gradient ``g2`` (``[T, n]``), both
        FP32; returns its weight-shaped preconditioner (None for a partitioned state's callable)."""
        st, cfg, be = self.shared.stats, rne_config(module), self.shared.backend
        precisions = self.shared.precisions
        w = module.matrix.detach().float() if self.propagated else None
        gw = g2.t() @ x2  # [n, k], BF16-pass weight gradient (mean loss)
        pmat, pfn = layer_precond(self.precond, self.fallback, fqn, gw, self.sources, module)
        sr = {p: self._expects_sr(module, p) for p in precisions}
        # A row-parallel shard holds some of the input's columns: a projection x_t·d_j is summed over the group
        # before it is squared, and a Gram matrix of its columns alone cannot give it.
        row_sum = module.tp_sum if getattr(module, "tp_shard", None) == "row" else None
        gram = self._gram_for(fqn, module, x2) if row_sum is None else None
        for p in precisions:
            if sr[p]:  # training rounds G_Y stochastically: the exact expectation over that rounding
                sample = self._price_sample(x2.shape[0], gw.shape[0])
                mom = be.wgrad_moments(g2, x2, p, module.quant_config, self.had_gen, sample, gram, row_sum)
                dgw, var, projected = mom.mean.sub_(gw), mom.var, mom.projected
                del mom
            else:
                dgw, var, projected = be.wgrad(g2, x2, p, cfg, self.had_gen) - gw, None, None
            self._drift_stats(fqn, p, dgw, var, projected, x2, pmat, pfn, gram, row_sum)
            del dgw, var, projected
            if self.quant_err:
                g_lp = be.quantize(g2, p, "g", -1, cfg)
                st.add(fqn, QERR_G.key(p), ((g_lp - g2) ** 2).sum())
                del g_lp
            if self.propagated:
                if sr[p]:
                    mom = be.dgrad_moments(g2, w, p, module.quant_config)
                    e = mom.mean - g2 @ w
                    st.add(fqn, DGRAD_SQ.key(p), (e * e).sum() + mom.var.sum())
                else:
                    e = be.dgrad(g2, w, p, cfg, self.had_gen) - g2 @ w
                    st.add(fqn, DGRAD_SQ.key(p), (e * e).sum())
                del e
        if self.quant_err:
            st.add(fqn, QNORM_G.key(), (g2 * g2).sum())
        if self.propagated:
            if pfn is None:
                up = gw * pmat
                st.add(fqn, UP_SQ.key(), (up * up).sum())
            else:
                up = gw
                st.add(fqn, UP_SQ.key(), torch.as_tensor(pfn(fqn, gw), dtype=torch.float32))
                st.add(fqn, GW_SQ.key(), (gw * gw).sum())
            st.add(fqn, UP_CH.key(), dv.projected_sq_sum(x2, up, gram))
        return pmat

    def _price_sample(self, tokens: int, n: int) -> torch.Tensor:
        """Tokens whose inputs price the rounding noise (:meth:`EmulatedBackend.wgrad_moments`): all of them
        up to PRICE_TOKENS_MIN, else ``n / 4`` of them (which keeps that price near a quarter of the wgrad
        GEMM's cost), drawn from a generator of their own."""
        m = min(tokens, max(PRICE_TOKENS_MIN, n // 4))
        if m == tokens:
            return torch.arange(tokens)
        return torch.randperm(tokens, generator=self.price_gen, device=self.price_gen.device)[:m]

    def _expects_sr(self, module: SnipLinear, p: str) -> bool:
        return self.rounding == "recipe" and self.shared.backend.rounds_g_stochastically(p, module.quant_config)

    def _drift_stats(self, fqn: str, p: str, dgw: torch.Tensor, var: Optional[torch.Tensor],
                     projected: Optional[torch.Tensor], x2: torch.Tensor, pmat: Optional[torch.Tensor],
                     pfn: Optional[PrecondFn], gram: Optional[torch.Tensor],
                     row_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        """The weight-gradient error's drift statistics: its systematic part ``dgw`` (the whole error under
        round-to-nearest; its expectation under stochastic rounding) under ``*_bias`` keys (with the
        ``bwd_bias`` study fields only), and with the rounding noise of element-wise variance ``var`` added
        (its expectation) under the plain keys.

        The noise's loss-unit price per output channel j is ``projected_j`` (estimated from a sample of the
        tokens, :meth:`_price_sample`) times ``P²`` averaged over the row j with weights ``var`` (exact when P
        is constant within a row).

        ``row_sum``: a row-parallel shard's sum over its group (its columns of the input and of the weight): the
        per-channel terms are formed from the group's sums and are then whole on every rank of it (counted on
        the first, :meth:`~snip_ds.stats.common.Shared.once`); the element sums stay the shard's part."""
        st = self.shared.stats

        def channels(d: torch.Tensor) -> torch.Tensor:  # Σ_t (x_t·d_j)² per row j of d
            if row_sum is None:
                return dv.projected_sq_sum(x2, d, gram)
            return dv.channel_sq_sum(row_sum(x2.float() @ d.float().t()))

        if pfn is None:
            drift = dgw.mul_(pmat)  # dgw is ours to overwrite
            bias_sq, bias_ch = (drift * drift).sum(), channels(drift)
            noise_sq = None
            if var is not None:
                row_var = var.sum(dim=1)
                weighted = var.mul_(pmat).mul_(pmat)  # P²·Var, in place
                noise_sq = weighted.sum()
                row_w = weighted.sum(dim=1)
                if row_sum is not None:  # the whole row's averages
                    row_w, row_var = row_sum(torch.stack((row_w, row_var))).unbind(0)
                noise_ch = row_w.div_(torch.where(row_var > 0, row_var, 1.0)).mul_(projected)
        else:
            bias_sq = torch.as_tensor(pfn(fqn, dgw), dtype=torch.float32)
            bias_ch = channels(dgw)
            dg_sq = (dgw * dgw).sum()
            if self.bias:
                st.add(fqn, DG_SQ_BIAS.key(p), dg_sq)
            st.add(fqn, DG_SQ.key(p), dg_sq + var.sum() if var is not None else dg_sq)
            noise_sq = torch.as_tensor(pfn(fqn, var.sqrt()), dtype=torch.float32) if var is not None else None
            noise_ch = projected
        once = self.shared.once if row_sum is not None else (lambda t: t)
        if self.bias:
            st.add(fqn, DRIFT_SQ_BIAS.key(p), bias_sq)
            st.add(fqn, DRIFT_CH_BIAS.key(p), once(bias_ch))
        st.add(fqn, DRIFT_SQ.key(p), bias_sq + noise_sq if noise_sq is not None else bias_sq)
        st.add(fqn, DRIFT_CH.key(p), once(bias_ch + noise_ch if noise_sq is not None else bias_ch))


# ------------------------------------------------------------------------------------------------ pricing
def _iso_factor(px: Pricing, fqn: str, num: SumField, den: SumField, suffix: Optional[str] = None) -> float:
    """‖ΔG⊙P‖²/‖ΔG‖² (callable mode: the loss price assumes P constant within the layer)."""
    d = px.value(fqn, den, suffix) / px.ranks
    return px.value(fqn, num, suffix) / px.cover / d if d > 0 else 0.0


def _drift_price(px: Pricing, fqn: str, drift_sq: SumField, drift_prod: SumField,
                 dg_sq: SumField) -> Tuple[Dict[str, float], Dict[str, float]]:
    """Per precision the loss-unit price of a drift and the drift itself (parameter units)."""
    bwd, drift = {}, {}
    for p in px.precisions:
        drift[p] = px.eta2 * px.value(fqn, drift_sq, p) / px.cover / px.batches / px.ranks
        loss_price = px.curvature * px.value(fqn, drift_prod, p) / (2.0 * px.tokens) / px.ranks
        scale = _iso_factor(px, fqn, drift_sq, dg_sq, p) if px.callable_mode else 1.0
        bwd[p] = px.eta2 * loss_price * scale
    return bwd, drift


def price(px: Pricing, fqn: str) -> Dict[str, Dict[str, float]]:
    """A layer's ``bwd`` and ``bwd_drift`` (the expected drift) and ``bwd_bias`` and ``bwd_drift_bias`` (its
    systematic part; from absent sums, 0, without the ``bwd_bias`` study fields)."""
    bwd, drift = _drift_price(px, fqn, DRIFT_SQ, DRIFT_PROD, DG_SQ)
    bwd_bias, drift_bias = _drift_price(px, fqn, DRIFT_SQ_BIAS, DRIFT_PROD_BIAS, DG_SQ_BIAS)
    return {"bwd": bwd, "bwd_drift": drift, "bwd_bias": bwd_bias, "bwd_drift_bias": drift_bias}


def upstream_layers(groups: InputGroups, fqns: Iterable[str]) -> Dict[str, List[str]]:
    """``bwd_propagated``: per layer, the layers that run before the first layer sharing its input."""
    fqns = list(fqns)
    order, group = groups.order, groups.group
    first_of_group: Dict[str, int] = {}
    for fqn, gid in group.items():
        first_of_group[gid] = min(first_of_group.get(gid, 10 ** 9), order[fqn])
    upstream: Dict[str, List[str]] = {}
    for fqn in fqns:
        start = first_of_group.get(group.get(fqn, ""), order.get(fqn, 0))
        upstream[fqn] = [m for m in fqns if order.get(m, 10 ** 9) < start]
    return upstream


def price_propagated(px: Pricing, fqn: str, groups: InputGroups, upstream: List[str],
                     bwd: Dict[str, float]) -> Dict[str, Dict[str, float]]:
    """``bwd_propagated`` (the direct ``bwd`` plus the upstream drift of the dgrad error, priced like the
    gradient direction), ``bwd_drift_propagated`` (that drift, parameter units) and ``dgrad_err``."""
    gx = px.value(GLOBAL, GX_SQ, groups.group.get(fqn, ""))
    up_sq = sum(px.value(u, UP_SQ) for u in upstream) * px.ranks / px.cover
    up_price = 0.0
    for u in upstream:
        pr = px.curvature * px.value(u, UP_PROD) / (2.0 * px.tokens) * px.batches * px.ranks  # Σ of local prices
        up_price += pr * (_iso_factor(px, u, UP_SQ, GW_SQ) if px.callable_mode else 1.0)
    prop, prop_drift, derr = {}, {}, {}
    for p in px.precisions:
        e_sq = px.value(fqn, DGRAD_SQ, p)
        derr[p] = e_sq / (px.batches * px.ranks)
        e_glob = px.eta2 * derr[p] / px.ranks
        prop_drift[p] = e_glob * up_sq / gx if gx > 0 else 0.0
        prop[p] = bwd[p] + (e_glob * up_price / gx if gx > 0 else 0.0)
    return {"bwd_propagated": prop, "bwd_drift_propagated": prop_drift, "dgrad_err": derr}


def dgrad_cost(px: Pricing, groups: InputGroups, layers_out: Dict[str, Dict[str, Any]],
               upstream: Dict[str, List[str]]) -> None:
    """``bwd_dgrad``: the upstream drift that ℓ's dgrad error causes (``bwd_drift_propagated``, split over the
    upstream layers u as the ratio estimate splits it, ∝ ‖G_W,u⊙P_u‖²), each part priced in loss units at
    u's own rate for a noise-like drift, ``bwd_u / bwd_drift_u``. (``bwd_propagated`` prices the same drift as
    if it pointed along the gradient, whose Fisher price per unit is far higher: in a one-off check on the
    4-block compare model, not a committed benchmark, it made dgrad ~23× wgrad in loss units where the drifts
    are ~3×.)"""
    W = px.ranks
    for fqn, rec in layers_out.items():
        gx = px.value(GLOBAL, GX_SQ, groups.group.get(fqn, ""))
        cost = {}
        for p in px.precisions:
            e_glob = px.eta2 * px.value(fqn, DGRAD_SQ, p) / (px.batches * W * W)  # as in price_propagated
            total = 0.0
            for u in upstream[fqn]:
                own_loss, own_drift = layers_out[u]["bwd"][p], layers_out[u]["bwd_drift"][p]
                if gx > 0 and own_drift > 0 and math.isfinite(own_loss / own_drift):
                    total += e_glob * px.value(u, UP_SQ) * W / px.cover / gx * (own_loss / own_drift)
            cost[p] = total
        rec["bwd_dgrad"] = cost
