"""The artifact's per-layer fields from a collection's all-reduced sums.

:func:`finalize` divides the estimators' sums (:mod:`snip_ds.stats.collector`) by the token, batch and rank
counts and prices them: ``fld`` (the sequence or the channel form), ``bwd`` (the drift's loss-unit price), ``fwd``
(``forward_drift``) and the propagated ablation's ``bwd_propagated`` and ``bwd_dgrad`` (:func:`dgrad_cost`),
and the study fields asked for (``study_fields``): both FLD forms, ``bwd_bias`` (the price without the
rounding noise), ``bwd_drift`` (parameter units), ``first_order``, the quantization errors. The record's layout is :mod:`snip_ds.stats.artifact`'s.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, List

from snip_ds.linear import SnipLinear
from snip_ds.stats.artifact import STUDY_FIELDS, clean_layer, stats_header
from snip_ds.stats.common import GLOBAL
from snip_ds.types import OPERANDS

if TYPE_CHECKING:
    from snip_ds.stats.collector import CollectSettings, Collector


def finalize(col: "Collector", mods: Dict[str, SnipLinear], n_batches: int, tokens_per_step: int,
             settings: "CollectSettings", *, lr: float, step: int, world_size: int,
             step_scale: float) -> Dict[str, Any]:
    """The artifact of one collection from ``col``'s all-reduced sums (the module docstring)."""
    num_probes, seed, lam = settings.num_probes, settings.seed, settings.lam
    fld_form, bwd_rounding = settings.fld_form, settings.bwd_rounding
    st, G, W, B = col.stats, GLOBAL, float(world_size), float(n_batches)
    n_tot = float(st.get(G, "n_tokens")[0])
    callable_mode = "callable" in col.bwd.sources
    cover = 1.0 if callable_mode else W  # how many times the reduced P-weighted norms cover each element
    eta2 = (lr * step_scale) ** 2
    out = stats_header(step=step, lr=lr, world_size=world_size, estimator=col.estimator, num_probes=num_probes,
                       fld_form=fld_form, step_scale=step_scale, bwd_rounding=bwd_rounding,
                       precond=",".join(sorted(col.bwd.sources)) or "none", batches=n_batches, tokens=int(n_tot),
                       loss=st.get(G, "loss_sum")[0].item() / n_tot, seed=seed, forward_drift=col.forward_drift,
                       study_fields=settings.study_fields, lam=lam)
    study = set(settings.study_fields)
    curvature = 1.0
    if col.estimator == "isotropic":
        count = float(st.get(G, "alpha_count")[0])
        curvature = float(st.get(G, "alpha_tok")[0]) / count
        out["alpha"] = curvature / (n_tot / (B * W))  # α of one rank-local batch's mean loss
        out["quadratic_ratio"] = float(st.get(G, "quad_ratio")[0]) / count

    # upstream sums for the propagated ablation: layers run before the first layer sharing ℓ's input
    upstream: Dict[str, List[str]] = {}
    if col.propagated:
        order, group = col.groups.order, col.groups.group
        first_of_group: Dict[str, int] = {}
        for fqn, gid in group.items():
            first_of_group[gid] = min(first_of_group.get(gid, 10 ** 9), order[fqn])
        for fqn in mods:
            start = first_of_group.get(group.get(fqn, ""), order.get(fqn, 0))
            upstream[fqn] = [m for m in mods if order.get(m, 10 ** 9) < start]

    def iso_factor(fqn: str, num: str, den: str) -> float:
        """‖ΔG⊙P‖²/‖ΔG‖² (callable mode: the loss price assumes P constant within the layer)."""
        d = float(st.get(fqn, den)[0]) / W
        return float(st.get(fqn, num)[0]) / cover / d if d > 0 else 0.0

    layers_out: Dict[str, Any] = {}
    for fqn, mod in mods.items():
        rec: Dict[str, Any] = {"flops": 6.0 * tokens_per_step * mod.in_features * mod.out_features}
        fld, bwd, drift, first, qe, rqe, fld_ch, fld_sq = {}, {}, {}, {}, {}, {}, {}, {}
        bwd_bias, drift_bias = {}, {}
        qe_op, rqe_op = {r: {} for r in OPERANDS}, {r: {} for r in OPERANDS}
        probes = 1.0 if col.estimator == "empirical" else float(num_probes)
        for p in col.precisions:  # (a study field not asked for comes from absent sums, 0, and is dropped)
            fld_ch[p] = curvature * float(st.get(fqn, f"fld_prod.{p}")[0]) / (2.0 * n_tot)
            fld_sq[p] = curvature * float(st.get(fqn, f"fld_seq.{p}")[0]) / probes / (2.0 * n_tot)
            fld[p] = fld_sq[p] if fld_form == "sequence" else fld_ch[p]
            drift[p] = eta2 * float(st.get(fqn, f"drift_sq.{p}")[0]) / cover / B / W
            price = curvature * float(st.get(fqn, f"drift_prod.{p}")[0]) / (2.0 * n_tot) / W
            scale = iso_factor(fqn, f"drift_sq.{p}", f"dg_sq.{p}") if callable_mode else 1.0
            bwd[p] = eta2 * price * scale
            drift_bias[p] = eta2 * float(st.get(fqn, f"drift_sq_bias.{p}")[0]) / cover / B / W
            price = curvature * float(st.get(fqn, f"drift_prod_bias.{p}")[0]) / (2.0 * n_tot) / W
            scale = iso_factor(fqn, f"drift_sq_bias.{p}", f"dg_sq_bias.{p}") if callable_mode else 1.0
            bwd_bias[p] = eta2 * price * scale
            first[p] = float(st.get(fqn, f"first.{p}")[0]) / n_tot
            for r in OPERANDS:
                e, nrm = float(st.get(fqn, f"qerr_{r}.{p}")[0]), float(st.get(fqn, f"qnorm_{r}")[0])
                qe_op[r][p] = e / (B * W)
                rqe_op[r][p] = e / nrm if nrm > 0 else 0.0
            qe[p] = sum(qe_op[r][p] for r in OPERANDS)
            rqe[p] = sum(rqe_op[r][p] for r in OPERANDS)
        rec.update(fld=fld, fld_sequence=fld_sq, fld_channel=fld_ch, bwd=bwd, bwd_drift=drift, first_order=first,
                   quant_err=qe, rel_quant_err=rqe, bwd_bias=bwd_bias, bwd_drift_bias=drift_bias)
        if col.forward_drift:
            rec["fwd"] = {p: eta2 * float(st.get(fqn, f"fwd_sq.{p}")[0]) / float(num_probes) / (2.0 * n_tot) / W
                          for p in col.precisions}
        for r in OPERANDS:  # per operand, for per-GEMM quant_err plans (each GEMM quantizes two of them)
            rec[f"quant_err_{r}"], rec[f"rel_quant_err_{r}"] = qe_op[r], rqe_op[r]
        if col.propagated:
            gx = float(st.get(G, f"gx_sq.{col.groups.group.get(fqn, '')}")[0])
            up_sq = sum(float(st.get(u, "up_sq")[0]) for u in upstream[fqn]) * W / cover
            up_price = 0.0
            for u in upstream[fqn]:
                pr = curvature * float(st.get(u, "up_prod")[0]) / (2.0 * n_tot) * B * W  # Σ of local prices
                up_price += pr * (iso_factor(u, "up_sq", "gw_sq") if callable_mode else 1.0)
            prop, prop_drift, derr = {}, {}, {}
            for p in col.precisions:
                e_sq = float(st.get(fqn, f"dgrad_sq.{p}")[0])
                derr[p] = e_sq / (B * W)
                e_glob = eta2 * derr[p] / W
                prop_drift[p] = e_glob * up_sq / gx if gx > 0 else 0.0
                prop[p] = bwd[p] + (e_glob * up_price / gx if gx > 0 else 0.0)
            rec.update(bwd_propagated=prop, bwd_drift_propagated=prop_drift, dgrad_err=derr)
        layers_out[fqn] = rec
    if col.propagated:
        dgrad_cost(col, layers_out, upstream, eta2, B, W, cover)
    out["layers"] = {fqn: clean_layer(rec) for fqn, rec in layers_out.items()}
    unasked = [f for group, fields in STUDY_FIELDS.items() if group not in study for f in fields]
    for rec in out["layers"].values():  # computed from absent sums (0) or, bwd_drift, needed by dgrad_cost only
        for f in unasked:
            del rec[f]
    return out


def dgrad_cost(col: "Collector", layers_out: Dict[str, Dict[str, Any]], upstream: Dict[str, List[str]],
                eta2: float, B: float, W: float, cover: float) -> None:
    """``bwd_dgrad``: the upstream drift that ℓ's dgrad error causes (``bwd_drift_propagated``, split over the
    upstream layers u as the ratio estimate splits it, ∝ ‖G_W,u⊙P_u‖²), each part priced in loss units at
    u's own rate for a noise-like drift, ``bwd_u / bwd_drift_u``. (``bwd_propagated`` prices the same drift as
    if it pointed along the gradient, whose Fisher price per unit is far higher: in a one-off check on the
    4-block compare model, not a committed benchmark, it made dgrad ~23× wgrad in loss units where the drifts
    are ~3×.)"""
    st, G = col.stats, GLOBAL
    for fqn, rec in layers_out.items():
        gx = float(st.get(G, f"gx_sq.{col.groups.group.get(fqn, '')}")[0])
        cost = {}
        for p in col.precisions:
            e_glob = eta2 * float(st.get(fqn, f"dgrad_sq.{p}")[0]) / (B * W * W)  # as in _finalize
            total = 0.0
            for u in upstream[fqn]:
                own_loss, own_drift = layers_out[u]["bwd"][p], layers_out[u]["bwd_drift"][p]
                if gx > 0 and own_drift > 0 and math.isfinite(own_loss / own_drift):
                    total += e_glob * float(st.get(u, "up_sq")[0]) * W / cover / gx * (own_loss / own_drift)
            cost[p] = total
        rec["bwd_dgrad"] = cost
