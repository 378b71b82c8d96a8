"""Obviously-correct reference formulas of the divergence estimators, for tests only.

Each takes whole tensors (a layer's output error E, probe gradients g, the weight-gradient error ΔG_W) and
computes an estimate directly, where :mod:`snip_ds.stats` accumulates the same quantities from per-channel
reductions in hooks. The conventions are :mod:`snip_ds.divergence`'s (``E``, ``g`` per-token scale, ``N``
loss tokens, the ``1/(2N)`` of every Gauss-Newton estimate).
"""
from __future__ import annotations

from typing import Sequence

import torch

from snip_ds.divergence import _as_2d, channel_sq_sum


def channel_sq_mean(t: torch.Tensor) -> torch.Tensor:
    """``mean_t t_tj²`` over all leading dims: ``[..., n] -> [n]`` (FP32)."""
    t2 = _as_2d(t)
    return (t2 * t2).mean(0)


def fld_estimate(err_sq_per_channel: torch.Tensor, probe_sq_per_channel: torch.Tensor,
                 n_tokens: float) -> torch.Tensor:
    """Gauss-Newton / Fisher forward loss divergence ``(1/2N)·Σ_j (Σ_t E_tj²)·mean_t g_tj²``.

    Args:
        err_sq_per_channel: ``[n]``, ``Σ_t E_tj²`` of the layer's output error.
        probe_sq_per_channel: ``[n]``, ``mean_t g_tj²`` of per-token-scale probe gradients at the output
            (averaged over probes when there are several).
        n_tokens: ``N``, the number of tokens the (mean) loss averages over.

    Returns:
        A 0-dim FP32 tensor: the predicted ``[ℒ(Y+E) + ℒ(Y-E) - 2ℒ(Y)]/2``.
    """
    if n_tokens <= 0:
        raise ValueError(f"n_tokens must be positive, got {n_tokens}")
    if err_sq_per_channel.shape != probe_sq_per_channel.shape:
        raise ValueError(f"err_sq_per_channel {tuple(err_sq_per_channel.shape)} and probe_sq_per_channel "
                         f"{tuple(probe_sq_per_channel.shape)} must have the same shape [n]")
    return (err_sq_per_channel.float() * probe_sq_per_channel.float()).sum() / (2.0 * n_tokens)


def fld_from_tensors(err: torch.Tensor, probe: torch.Tensor, n_tokens: float) -> torch.Tensor:
    """:func:`fld_estimate` from ``E [T, n]`` and one probe ``g [T, n]`` (per-token scale)."""
    if err.shape[-1] != probe.shape[-1]:
        raise ValueError(f"err has {err.shape[-1]} channels, probe {probe.shape[-1]}")
    return fld_estimate(channel_sq_sum(err), channel_sq_mean(probe), n_tokens)


def first_order(grad_mean: torch.Tensor, err: torch.Tensor) -> torch.Tensor:
    """The signed first-order loss change ``⟨G_Y, E⟩`` (``G_Y``: gradient of the mean loss)."""
    return (grad_mean.float() * err.float()).sum()


def fld_isotropic(err_sq_per_channel: torch.Tensor, iso_probe_sq_per_channel: torch.Tensor,
                  alpha: float) -> torch.Tensor:
    """``(α/2)·Σ_j (Σ_t E_tj²)·mean_t u_tj²`` with ``u = J_zᵀ v``, ``v ~ N(0, I)`` back-propagated from ``z``.

    ``E[(vᵀ J E)²] = ‖J E‖²`` and ``ℒ(z+JE) - ℒ(z) ≈ (α/2)·‖J E‖²`` (even part) under ``∂²ℒ/∂z² = α·I``.
    """
    return 0.5 * alpha * (err_sq_per_channel.float() * iso_probe_sq_per_channel.float()).sum()


def precond_sq_norm(delta_gw: torch.Tensor, precond: torch.Tensor) -> torch.Tensor:
    """``‖ΔG_W ⊙ P‖²`` (0-dim FP32)."""
    d = delta_gw.float() * precond.float()
    return (d * d).sum()


def bwd_direct(delta_gw: torch.Tensor, precond: torch.Tensor, lr: float, step_scale: float = 1.0) -> torch.Tensor:
    """Direct backward weight divergence in parameter units: ``(lr·c)²·‖ΔG_W ⊙ P‖²``.

    Args:
        delta_gw: ``[n, k]`` weight-gradient error ``Q(G_Y)ᵀQ(X) - G_YᵀX`` (gradient of the mean loss).
        precond: ``[n, k]`` Adam preconditioner (:func:`adam_preconditioner`).
        lr: learning rate η.
        step_scale: ``c``; 1 for the eventual drift, :func:`adam_step_scale` for one step's drift.
    """
    return (lr * step_scale) ** 2 * precond_sq_norm(delta_gw, precond)


def bwd_fisher(probe_gws: Sequence[torch.Tensor], delta_gw: torch.Tensor, precond: torch.Tensor, lr: float,
               n_tokens: float, step_scale: float = 1.0) -> torch.Tensor:
    """Loss-unit BWD: ``(1/2N)·mean_r ⟨G^probe_W,r, lr·c·ΔG_W ⊙ P⟩²``.

    ``probe_gws`` are per-token-scale probe weight gradients ``g_rᵀ X`` (one per probe). This is the full
    (non-diagonal) Fisher price of the drift; one probe gives a one-sample (χ²₁) estimate, so it is noisy.
    """
    if not probe_gws:
        raise ValueError("probe_gws is empty: need at least one probe weight gradient")
    drift = (lr * step_scale) * delta_gw.float() * precond.float()
    dots = torch.stack([(pg.float() * drift).sum() for pg in probe_gws])
    return (dots * dots).mean() / (2.0 * n_tokens)


def bwd_channel(x: torch.Tensor, drift_w: torch.Tensor, probe_sq_per_channel: torch.Tensor,
                n_tokens: float) -> torch.Tensor:
    """Loss-unit BWD with FLD's per-channel Gauss-Newton factorisation (what :mod:`snip_ds.stats` logs).

    A weight perturbation ``δW`` changes the layer output by ``E' = X δWᵀ``; its price is
    ``fld_estimate(Σ_t E'², mean_t g², N)``: the same Fisher probes as FLD, averaged over all tokens (far less
    noisy than :func:`bwd_fisher` with one probe). ``drift_w`` is ``lr·c·ΔG_W ⊙ P``.
    """
    return fld_estimate(channel_sq_sum(_as_2d(x) @ drift_w.float().t()), probe_sq_per_channel, n_tokens)


def bwd_propagated(dgrad_err_sq: float, upstream_precond_grad_sq: float, input_grad_sq: float, lr: float,
                   step_scale: float = 1.0) -> float:
    """Propagated-BWD ratio estimate (ablation), parameter units.

    The dgrad error ``e`` at layer ℓ's input flows into upstream weight gradients. Model the map from a
    gradient at the input to the upstream preconditioned weight gradients by the *total* gradient there:
    ``drift ≈ (lr·c)²·‖e‖²·Σ_upstream ‖G_W ⊙ P‖² / ‖G_X‖²``. Against the measured dgrad-only drift
    (``launch/validate_metrics.py --bwd_truth_per_gemm``) it ranks layers at 0.6-0.9 (Spearman) and overstates
    10-50×: per-GEMM plans divide it by ``dgrad_calibration``. (``snip_ds.stats`` computes the same ratio
    from its accumulated sums.)

    Args:
        dgrad_err_sq: ``‖Q(G_Y)Q(W) - G_Y W‖²``.
        upstream_precond_grad_sq: ``Σ_m ‖G_W,m ⊙ P_m‖²`` over the layers upstream of ℓ's input.
        input_grad_sq: ``‖G_X‖²``, the total gradient at ℓ's input.
    """
    if input_grad_sq <= 0:
        return 0.0
    return (lr * step_scale) ** 2 * dgrad_err_sq * upstream_precond_grad_sq / input_grad_sq
