"""The artifact's per-layer fields from a collection's all-reduced sums.

Each estimator's module names the sums it adds to and prices them: :mod:`snip_ds.stats.fld` (``fld``, both FLD
forms, ``first_order``; the operand errors of X and W), :mod:`snip_ds.stats.bwd` (``bwd``, ``bwd_drift`` and
their systematic parts ``bwd_bias``, ``bwd_drift_bias``; the operand error of G_Y; with ``bwd_propagated``
``bwd_propagated``, ``bwd_drift_propagated``, ``dgrad_err`` and ``bwd_dgrad``), :mod:`snip_ds.stats.fwd`
(``fwd``) and :mod:`snip_ds.stats.isotropic` (the curvature α). :func:`finalize` counts the tokens, batches
and ranks behind the sums (:class:`~snip_ds.stats.common.Pricing`), composes the estimators' fields in the
artifact's order and drops the study fields not asked for. The record's layout is :mod:`snip_ds.stats_file`'s.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional, Set, Tuple

from snip_ds.linear import SnipLinear
from snip_ds.experts.points import ExpertPoint
from snip_ds.stats import bwd, experts, fld, fwd, isotropic
from snip_ds.stats_file import STUDY_FIELDS, clean_layer, stats_header
from snip_ds.stats.common import CALL_ROWS, GLOBAL, LOSS_SUM, N_ROWS, N_TOKENS, Pricing, Sums, SumField
from snip_ds.types import OPERANDS

if TYPE_CHECKING:
    from snip_ds.stats.settings import CollectSettings

# Each operand's error sum and norm, by the estimator that measures it.
_OPERAND_SUMS = {"x": (fld.QERR["x"], fld.QNORM["x"]), "w": (fld.QERR["w"], fld.QNORM["w"]),
                 "g": (bwd.QERR_G, bwd.QNORM_G)}


def finalize(sums: Sums, mods: Dict[str, SnipLinear], settings: "CollectSettings", *, sources: Set[str],
             groups: Optional[bwd.InputGroups], n_batches: int, tokens_per_step: int, lr: float, step: int,
             world_size: int, step_scale: float) -> Dict[str, Any]:
    """The artifact of one collection from its all-reduced ``sums`` (the module docstring); ``sources`` says
    where the preconditioners came from, ``groups`` which layers share an input (``bwd_propagated``)."""
    W, B = float(world_size), float(n_batches)
    n_tot = float(sums.get(GLOBAL, N_TOKENS.key())[0])
    n_rows = float(sums.get(GLOBAL, N_ROWS.key())[0])
    callable_mode = "callable" in sources
    isotropic_run = settings.estimator == "isotropic"
    px = Pricing(sums=sums, precisions=tuple(settings.precisions), tokens=n_tot, batches=B, ranks=W,
                 cover=1.0 if callable_mode else W, callable_mode=callable_mode, eta2=(lr * step_scale) ** 2,
                 curvature=isotropic.curvature(sums) if isotropic_run else 1.0,
                 probes=1.0 if settings.estimator == "empirical" else float(settings.num_probes),
                 num_probes=settings.num_probes)
    out = stats_header(step=step, lr=lr, world_size=world_size, estimator=settings.estimator,
                       num_probes=settings.num_probes, fld_form=settings.fld_form, step_scale=step_scale,
                       bwd_rounding=settings.bwd_rounding, precond=",".join(sorted(sources)) or "none",
                       batches=n_batches, tokens=int(n_tot), loss=sums.get(GLOBAL, LOSS_SUM.key())[0].item() / n_tot,
                       seed=settings.seed, forward_drift=settings.forward_drift, study_fields=settings.study_fields,
                       lam=settings.lam)
    if isotropic_run:
        out.update(isotropic.header_fields(sums, n_tot / (B * W)))
    propagated = settings.bwd_propagated
    upstream = bwd.upstream_layers(groups, mods) if propagated else {}
    layers_out: Dict[str, Any] = {}
    for fqn, mod in mods.items():
        if isinstance(mod, ExpertPoint):  # an MoE expert's pair: its FLOPs follow its routed tokens
            rec: Dict[str, Any] = experts.record_fields(sums, fqn, mod, n_batches)
        else:  # a linear's follow the rows its calls saw: a step's tokens once per call
            rows = float(sums.get(fqn, CALL_ROWS.key(), default=float("nan"))[0])
            share = 1.0 if rows != rows or rows == n_rows else rows / n_rows  # nan: no count (1 call per token)
            rec = {"flops": 6.0 * (tokens_per_step * share) * mod.in_features * mod.out_features}
            if rows == 0.0:
                rec["no_calls"] = True
        fld_fields, bwd_fields = fld.price(px, fqn, settings.fld_form), bwd.price(px, fqn)
        ops = {r: _operand_errors(px, fqn, *_OPERAND_SUMS[r]) for r in OPERANDS}
        rec.update(fld=fld_fields["fld"], fld_sequence=fld_fields["fld_sequence"],
                   fld_channel=fld_fields["fld_channel"], bwd=bwd_fields["bwd"], bwd_drift=bwd_fields["bwd_drift"],
                   first_order=fld_fields["first_order"],
                   quant_err={p: sum(ops[r][0][p] for r in OPERANDS) for p in px.precisions},
                   rel_quant_err={p: sum(ops[r][1][p] for r in OPERANDS) for p in px.precisions},
                   bwd_bias=bwd_fields["bwd_bias"], bwd_drift_bias=bwd_fields["bwd_drift_bias"])
        if settings.forward_drift:
            rec["fwd"] = fwd.price(px, fqn)
        for r in OPERANDS:  # per operand, for per-GEMM quant_err plans (each GEMM quantizes two of them)
            rec[f"quant_err_{r}"], rec[f"rel_quant_err_{r}"] = ops[r]
        if propagated:
            rec.update(bwd.price_propagated(px, fqn, groups, upstream[fqn], rec["bwd"]))
        layers_out[fqn] = rec
    if propagated:
        bwd.dgrad_cost(px, groups, layers_out, upstream)
    out["layers"] = {fqn: clean_layer(rec) for fqn, rec in layers_out.items()}
    study = set(settings.study_fields)
    unasked = [f for group, fields in STUDY_FIELDS.items() if group not in study for f in fields]
    for rec in out["layers"].values():  # computed from absent sums (0) or, bwd_drift, needed by dgrad_cost only
        for f in unasked:
            del rec[f]
    return out


def _operand_errors(px: Pricing, fqn: str, err: SumField,
                    norm: SumField) -> Tuple[Dict[str, float], Dict[str, float]]:
    """One operand's quantization error per precision: per batch and rank, and relative to the operand's norm."""
    qe, rqe = {}, {}
    for p in px.precisions:
        e, nrm = px.value(fqn, err, p), px.value(fqn, norm)
        qe[p] = e / (px.batches * px.ranks)
        rqe[p] = e / nrm if nrm > 0 else 0.0
    return qe, rqe
