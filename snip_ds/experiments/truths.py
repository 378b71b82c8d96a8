"""Measured truths of the divergences SNIP's statistics estimate, on fixed batches, per decoder linear.

* :func:`fld_truth` — the symmetrised forward loss divergence of the layer's FP4 fprop error, its
  Gauss-Newton part and the one-shot loss change (FP64);
* :func:`bwd_truth` — the one-step parameter drift after one AdamW step with only the layer's backward GEMM(s)
  at FP4 (:data:`BWD_TRUTHS`), against the unquantized step;
* :func:`fwd_truth` — the loss-unit price of the one-step drift only the layer's FP4 fprop causes.

``launch/validate_metrics.py`` rank-correlates the statistics with them (:mod:`snip_ds.experiments.validation`).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from snip_ds.backend import get_backend
from snip_ds.experiments.training import lm_loss
from snip_ds.swap import snip_layers


@dataclass
class Measured:
    """What one validate_metrics run measured on its fixed batches, per decoder linear.

    Attributes:
        fqns: The layers, in model order.
        stats: The statistics artifact of each estimator (``mc_fisher``, ``empirical``, ``isotropic``).
        sym: The symmetrised FLD truth per layer and batch (:func:`fld_truth`; one "batch" from a table).
        one: The one-shot loss change per layer and batch.
        gn: The Gauss-Newton part of the FLD truth per layer and batch.
        drift: The BWD truth (both backward GEMMs) per layer and batch; ``None`` when not measured.
        split: The per-GEMM BWD truths (:func:`bwd_truth` with ``("wgrad", "dgrad")``); ``None`` when not.
        fwd: The FWD truth per layer and batch (:func:`fwd_truth`); ``None`` when not measured.
        fwd_pred: The collector's FWD estimate per layer (fp4); ``None`` without ``fwd``.
        optimizer_step: The optimizer's step count at the warm-up's end.
        step_scale: Adam's step scale the statistics used.
        seconds: Wall-clock seconds: ``collect`` (per estimator), ``fld_truth``, ``bwd_truth``,
            ``bwd_truth_per_gemm``, ``fwd_truth``.
        step_seconds: One training step's forward and backward on one batch (the cost unit).
    """

    fqns: List[str]
    stats: Dict[str, Dict[str, Any]]
    sym: Dict[str, List[float]]
    one: Dict[str, List[float]]
    gn: Dict[str, List[float]]
    drift: Optional[Dict[str, List[float]]]
    split: Optional[Dict[str, Dict[str, List[float]]]]
    fwd: Optional[Dict[str, List[float]]]
    fwd_pred: Optional[List[float]]
    optimizer_step: int
    step_scale: float
    seconds: Dict[str, Any] = field(default_factory=dict)
    step_seconds: float = float("nan")


def _rne(cfg):
    return replace(cfg, stochastic_rounding=False)


@torch.no_grad()
def _loss_and_logits(model, ids: torch.Tensor) -> tuple:
    """Mean next-token CE and the shifted logits ``[N, V]`` it is computed from."""
    logits = model(input_ids=ids).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))[:, :-1].reshape(-1, logits.shape[-1])
    return F.cross_entropy(logits, ids[:, 1:].reshape(-1)), logits


def fld_truth(model, batches: Sequence[torch.Tensor]) -> tuple:
    """Per layer, per batch: symmetrised FLD, its Gauss-Newton part, and the one-shot loss change (fp4 fprop).

    * symmetrised: ``[ℒ(Y+E) + ℒ(Y-E) - 2ℒ(Y)]/2`` : ``½ Eᵀ H E`` with the full, indefinite
      Hessian (plus 4th-order terms).
    * Gauss-Newton part, from the same two passes: ``d = [z(Y+E) - z(Y-E)]/2 = J E + O(E³)`` (z: logits) and
      ``(1/2N) Σ_t d_tᵀ (diag p_t - p_t p_tᵀ) d_t``: the PSD part that a Fisher estimator can see.

    Runs on an FP64 copy of the model: the symmetrised difference of three losses is often below FP32's
    resolution of a loss near 2-3 nats (2.4e-7). E = Q(X)Q(W)ᵀ - XWᵀ uses the quantized operands exactly.
    """
    model = copy.deepcopy(model).double()
    layers, be = snip_layers(model), get_backend()
    sym = {f: [] for f in layers}
    one = {f: [] for f in layers}
    gn = {f: [] for f in layers}
    for ids in batches:
        base, z0 = _loss_and_logits(model, ids)
        p0 = torch.softmax(z0, -1)
        for fqn, mod in layers.items():
            out, z = {}, {}
            for sign in (1.0, -1.0):
                def hook(m, inp, y, sign=sign):
                    x2 = inp[0].reshape(-1, inp[0].shape[-1])
                    w, cfg = m.weight, _rne(m.quant_config)
                    x_lp = be.quantize(x2, "fp4", "x", -1, cfg).to(x2.dtype)
                    w_lp = be.quantize(w, "fp4", "w", -1, cfg).to(w.dtype)
                    e = x_lp @ w_lp.t() - x2 @ w.t()
                    return y + sign * e.reshape(y.shape).to(y.dtype)
                h = mod.register_forward_hook(hook)
                try:
                    loss, z[sign] = _loss_and_logits(model, ids)
                    out[sign] = loss.item()
                finally:
                    h.remove()
            d = (z[1.0] - z[-1.0]) / 2  # [N, V]
            quad = (p0 * d * d).sum(-1) - (p0 * d).sum(-1) ** 2  # dᵀ(diag p - p pᵀ)d per token
            gn[fqn].append(quad.mean().item() / 2)
            sym[fqn].append((out[1.0] + out[-1.0] - 2 * base.item()) / 2)
            one[fqn].append(out[1.0] - base.item())
    return sym, one, gn


def _adamw_step(params: List[torch.Tensor], opt_state: Dict, hyper: Dict, grads: List[torch.Tensor]):
    """One torch AdamW step on copies of the parameters from a copy of the optimizer state."""
    ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = torch.optim.AdamW(ps, **hyper)
    opt.load_state_dict(copy.deepcopy(opt_state))  # load_state_dict keeps same-device tensors: copy first
    for p, g in zip(ps, grads):
        p.grad = g
    opt.step()
    return [p.detach() for p in ps]


BWD_TRUTHS = {"both": {"fprop": "bf16", "dgrad": "fp4", "wgrad": "fp4"},
              "wgrad": {"fprop": "bf16", "dgrad": "bf16", "wgrad": "fp4"},
              "dgrad": {"fprop": "bf16", "dgrad": "fp4", "wgrad": "bf16"}}


def bwd_truth(model, opt, batches: Sequence[torch.Tensor], gemms: Sequence[str] = ("both",),
              rounding: str = "recipe", draws: int = 1) -> Dict[str, Dict]:
    """Per GEMM set, layer and batch: Σ‖θ' - θ'_ref‖² after one AdamW step with only that layer's backward
    GEMM(s) at fp4 (:data:`BWD_TRUTHS`: ``both``, ``wgrad`` only, ``dgrad`` only), against the unquantized step.

    ``rounding="recipe"`` quantizes as training does (FP4 gradients stochastically rounded, by default) and
    averages the drift over ``draws`` rounding draws per batch (the layer's generator is restored after);
    ``"nearest"`` rounds every operand to nearest (one deterministic draw).

    Returns ``{gemms: {fqn: [drift per batch]}}``; for ``dgrad`` also ``dgrad_linears``, the drift of the
    decoder linears' weights alone (what the propagated estimate models: it leaves out the embedding).
    """
    layers = snip_layers(model)
    params = [p for p in model.parameters()]
    linear_ids = {id(m.weight) for m in layers.values()}
    is_linear = [id(p) in linear_ids for p in params]
    state = opt.state_dict()
    group = opt.param_groups[0]
    hyper = dict(lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"])

    def grads() -> List[torch.Tensor]:
        out = torch.autograd.grad(lm_loss(model, ids), params, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(params, out)]

    keys = list(gemms) + (["dgrad_linears"] if "dgrad" in gemms else [])
    drift = {k: {f: [] for f in layers} for k in keys}
    for ids in batches:
        ref = _adamw_step(params, state, hyper, grads())
        for fqn, mod in layers.items():
            for which in gemms:
                saved_prec, saved_cfg = mod.precision, mod.quant_config
                saved_gen = mod.generator.get_state() if mod.generator is not None else None
                mod.precision = dict(BWD_TRUTHS[which])
                n = draws if rounding == "recipe" else 1
                if rounding == "nearest":
                    mod.quant_config = _rne(saved_cfg)
                sq = [0.0] * len(params)
                try:
                    for _ in range(n):
                        new = _adamw_step(params, state, hyper, grads())
                        sq = [s + float(((a - b) ** 2).sum()) / n for s, a, b in zip(sq, new, ref)]
                finally:
                    mod.precision, mod.quant_config = saved_prec, saved_cfg
                    if saved_gen is not None:
                        mod.generator.set_state(saved_gen)
                drift[which][fqn].append(sum(sq))
                if which == "dgrad":
                    drift["dgrad_linears"][fqn].append(sum(v for v, lin in zip(sq, is_linear) if lin))
    return drift


def fwd_truth(model, opt, batches: Sequence[torch.Tensor], probes: int = 8, seed: int = 0) -> Dict[str, List[float]]:
    """Per layer and batch: the loss-unit price of the one-step drift that only that layer's fprop at FP4 (RNE)
    causes, ``(1/2N)·mean_r ⟨G^probe_r, θ' - θ'_ref⟩²`` over the decoder linears' weights, where ``θ'`` is one
    AdamW step from the warmed-up state with that layer's forward at FP4, ``θ'_ref`` the unquantized step, and
    ``G^probe_r`` the weight gradients of ``Σ_t CE(logits_t, ŷ_t)`` with ``ŷ`` drawn from the model's softmax
    (``probes`` draws per batch, seeded by ``seed``). Returns ``{fqn: [price per batch]}``."""
    layers = snip_layers(model)
    params = [p for p in model.parameters()]
    linear_ids = {id(m.weight) for m in layers.values()}
    idx = [i for i, p in enumerate(params) if id(p) in linear_ids]
    weights = [params[i] for i in idx]
    state = opt.state_dict()
    group = opt.param_groups[0]
    hyper = dict(lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"])
    gen = torch.Generator().manual_seed(seed + 4242)
    out: Dict[str, List[float]] = {f: [] for f in layers}
    for ids in batches:
        flat = model(input_ids=ids).logits[:, :-1].float()
        flat = flat.reshape(-1, flat.shape[-1])
        probs = torch.softmax(flat.detach(), dim=-1)
        probe = []
        for r in range(probes):
            y_hat = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            probe.append(torch.autograd.grad(F.cross_entropy(flat, y_hat, reduction="sum"), weights,
                                             retain_graph=r < probes - 1))
        n = flat.shape[0]

        def grads() -> List[torch.Tensor]:
            g = torch.autograd.grad(lm_loss(model, ids), params, allow_unused=True)
            return [torch.zeros_like(p) if x is None else x for p, x in zip(params, g)]
        ref = _adamw_step(params, state, hyper, grads())
        for fqn, mod in layers.items():
            saved_prec, saved_cfg = mod.precision, mod.quant_config
            mod.precision, mod.quant_config = {"fprop": "fp4", "dgrad": "bf16", "wgrad": "bf16"}, _rne(saved_cfg)
            try:
                new = _adamw_step(params, state, hyper, grads())
            finally:
                mod.precision, mod.quant_config = saved_prec, saved_cfg
            drift = [new[i] - ref[i] for i in idx]
            dots = [float(sum((g.double() * d.double()).sum() for g, d in zip(pg, drift))) for pg in probe]
            out[fqn].append(sum(x * x for x in dots) / len(dots) / (2.0 * n))
    return out
