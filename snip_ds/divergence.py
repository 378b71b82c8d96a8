"""SNIP's divergence estimators as pure tensor math (SNIP.md sections 3 and 4).

Nothing here touches a model, hooks or torch.distributed: :mod:`snip_ds.collect` gathers the per-channel
reductions and scalars these functions combine.

Conventions (``T`` rows of a layer's output, ``n`` output channels, ``k`` input channels, ``N`` loss tokens):

* ``E [T, n]``: a layer's output error, e.g. ``Q(X) Q(W)^T - X W^T``.
* ``g [T, n]``: a **per-token-scale** gradient at the layer output, i.e. the gradient of the *summed*
  per-token loss ``Σ_t ℓ_t`` (``N`` times the gradient of the mean loss the trainer minimises). Monte-Carlo
  Fisher probes are the gradient of ``Σ_t CE(logits_t, ŷ_t)`` with ``ŷ_t ~ softmax(logits_t)``.
* The loss is the mean over ``N`` tokens. Its Gauss-Newton matrix is then ``N · E[g_mean g_meanᵀ] =
  E[g gᵀ] / N``, which is where the ``1/(2N)`` of every estimate comes from.
* Per-channel reductions: ``err_sq[j] = Σ_t E_tj²`` (:func:`channel_sq_sum`), ``probe_sq[j] = mean_t g_tj²``
  (:func:`channel_sq_mean`). Factorising the diagonal ``Σ_t g_tj² E_tj² ≈ (Σ_t E_tj²)·mean_t g_tj²`` lets a
  single probe suffice, but drops every cross-token and cross-channel pair (the ``channel`` ablation).
* Sequence form (the default): ``Σ_rows (Σ_t g_t·E_t)²`` (:func:`sequence_sq_sum`), whose expectation over
  the probe labels is the exact Gauss-Newton form ``Eᵀ E[g gᵀ] E`` within each sequence.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

PRECOND_SOURCES = ("tensor", "callable", "grad_sq", "ones")  # where a P came from, for logging
FALLBACKS = ("grad_sq", "ones")
DEFAULT_ADAM_EPS = 1e-8


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    """``[..., c] -> [rows, c]`` in FP32."""
    return t.reshape(-1, t.shape[-1]).float()


# --------------------------------------------------------------------------------------------------------
# Per-channel reductions and FLD
# --------------------------------------------------------------------------------------------------------
def channel_sq_sum(t: torch.Tensor) -> torch.Tensor:
    """``Σ_t t_tj²`` over all leading dims: ``[..., n] -> [n]`` (FP32)."""
    t2 = _as_2d(t)
    return (t2 * t2).sum(0)


def projected_sq_sum(x: torch.Tensor, d: torch.Tensor, gram: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``Σ_t (x_t · d_j)²`` per row ``j`` of ``d``: ``channel_sq_sum(x @ dᵀ)``, ``[T, k], [n, k] -> [n]``.

    With ``gram = xᵀx`` (``[k, k]``) it is ``d_j (xᵀx) d_jᵀ`` instead, the same number in exact arithmetic
    and cheaper once the Gram matrix is shared (see :func:`gram_pays`).
    """
    if gram is None:
        return channel_sq_sum(x.float() @ d.float().t())
    d = d.float()
    return ((d @ gram) * d).sum(1)


def gram_pays(tokens: int, k: int, n: int, uses: int) -> bool:
    """Whether ``uses`` calls of :func:`projected_sq_sum` on ``[tokens, k]`` by ``[n, k]`` cost fewer
    multiply-adds through one shared Gram matrix (``T·k² + uses·n·k²``) than directly (``uses·T·n·k``)."""
    return tokens * k + uses * n * k < uses * tokens * n


def sequence_sq_sum(g: torch.Tensor, e: torch.Tensor, rows: int) -> torch.Tensor:
    """``Σ_r (Σ_{t in row r} g_t·e_t)²``: ``[T, n], [T, n] -> []`` with the T tokens split into ``rows`` equal,
    contiguous sequences (FP32).

    With ``g`` a Monte-Carlo Fisher probe (labels drawn from the model's softmax), its expectation is the
    Gauss-Newton quadratic form ``eᵀ(Σ_s J_sᵀ F_s J_s)e`` of the perturbation ``e`` summed over rows: exact
    within a sequence (every token and channel pair), while pairs of different sequences, whose probe
    gradients are independent, have zero expectation and are dropped.
    """
    if g.shape != e.shape:
        raise ValueError(f"g {tuple(g.shape)} and e {tuple(e.shape)} must have the same shape")
    if rows < 1 or g.shape[0] % rows:
        raise ValueError(f"rows={rows} does not divide the {g.shape[0]} tokens")
    s = (_as_2d(g).float() * _as_2d(e).float()).sum(-1).reshape(rows, -1).sum(1)
    return (s * s).sum()


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


def next_token_kl(logits_ref: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                  ignore_index: int = -100, chunk: int = 1024) -> Tuple[torch.Tensor, int]:
    """``Σ_t KL(p_ref,t ‖ p_t)`` over the next-token positions that count in the loss, and their number.

    ``p_t = softmax(logits[:, t])`` predicts token ``t+1``; positions whose label ``labels[:, t+1]`` is
    ``ignore_index`` are left out, as the loss leaves them out. To second order in ``δz = logits - logits_ref``
    each term is ``½ δzᵀ(diag p - p pᵀ)δz``, the Gauss-Newton (Fisher) form that the FLD estimates, so the mean
    over positions is the measured counterpart of the predicted FLD (nats per token, never negative).
    Computed in FP64, ``chunk`` positions at a time (a per-token KL of 1e-6 is below FP32's resolution of
    log-probabilities near -10).
    """
    if logits_ref.shape != logits.shape:
        raise ValueError(f"logits_ref {tuple(logits_ref.shape)} and logits {tuple(logits.shape)} differ in shape")
    vocab = logits.shape[-1]
    keep = (labels[:, 1:] != ignore_index).reshape(-1).to(logits.device)
    ref = logits_ref[:, :-1].reshape(-1, vocab)[keep]
    cur = logits[:, :-1].reshape(-1, vocab)[keep]
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    for start in range(0, ref.shape[0], chunk):
        lr = ref[start:start + chunk].double().log_softmax(-1)
        lc = cur[start:start + chunk].double().log_softmax(-1)
        total += (lr.exp() * (lr - lc)).sum()
    return total, int(ref.shape[0])


# --------------------------------------------------------------------------------------------------------
# The isotropic "noise on the last block's output" ablation (SNIP.md section 3)
# --------------------------------------------------------------------------------------------------------
def isotropic_alpha(loss_0: float, loss_plus: float, loss_minus: float, delta: float,
                    noise_sq_norm: float) -> float:
    """Curvature of the mean loss along a random direction at the last block's output ``z``.

    With ``v ~ N(0, I)`` and forward passes at ``z + δv``, ``z - δv``, ``z``:
    ``α = [ℒ(z+δv) + ℒ(z-δv) - 2ℒ(z)] / (δ²·‖v‖²)``, the Hessian ``∂²ℒ/∂z²`` modelled as ``α·I``.
    """
    if delta <= 0 or noise_sq_norm <= 0:
        raise ValueError(f"delta and noise_sq_norm must be positive, got {delta}, {noise_sq_norm}")
    return (loss_plus + loss_minus - 2.0 * loss_0) / (delta * delta * noise_sq_norm)


def quadratic_ratio(loss_0: float, loss_plus: float, loss_2plus: float, loss_minus: float) -> float:
    """Check of the quadratic regime: the even part of the loss change at ``2δ`` over the one at ``δ``.

    With ``a = [ℒ(z+δv) - ℒ(z-δv)]/2`` (the odd part at δ, linear in δ), ``even(δ) = [ℒ(z+δv) + ℒ(z-δv)]/2 -
    ℒ(z)`` and ``even(2δ) ≈ ℒ(z+2δv) - ℒ(z) - 2a``. In the quadratic regime the ratio is 4; NaN when
    ``even(δ) = 0``.
    """
    odd = (loss_plus - loss_minus) / 2.0
    even_1 = (loss_plus + loss_minus) / 2.0 - loss_0
    even_2 = loss_2plus - loss_0 - 2.0 * odd
    return even_2 / even_1 if even_1 != 0 else math.nan


def fld_isotropic(err_sq_per_channel: torch.Tensor, iso_probe_sq_per_channel: torch.Tensor,
                  alpha: float) -> torch.Tensor:
    """``(α/2)·Σ_j (Σ_t E_tj²)·mean_t u_tj²`` with ``u = J_zᵀ v``, ``v ~ N(0, I)`` back-propagated from ``z``.

    ``E[(vᵀ J E)²] = ‖J E‖²`` and ``ℒ(z+JE) - ℒ(z) ≈ (α/2)·‖J E‖²`` (even part) under ``∂²ℒ/∂z² = α·I``.
    """
    return 0.5 * alpha * (err_sq_per_channel.float() * iso_probe_sq_per_channel.float()).sum()


# --------------------------------------------------------------------------------------------------------
# Adam preconditioner
# --------------------------------------------------------------------------------------------------------
def adam_preconditioner(exp_avg_sq: torch.Tensor, step: int, beta2: float,
                        eps: float = DEFAULT_ADAM_EPS) -> torch.Tensor:
    """``P = 1/(sqrt(v̂) + eps)`` with ``v̂ = exp_avg_sq/(1 - β₂^step)`` (``step`` = optimizer steps taken)."""
    if step < 1:
        raise ValueError(f"step must be >= 1 for an Adam state, got {step}")
    v_hat = exp_avg_sq.float() / (1.0 - beta2 ** step)
    return 1.0 / (v_hat.sqrt() + eps)


def adam_step_scale(step: int, beta1: float) -> float:
    """How much of a gradient change enters the *next* Adam update: ``(1-β₁)/(1-β₁ᵗ)``, ``t = step + 1``.

    ``step`` is the number of steps already taken (0 before the first). Over the moment's lifetime the total
    weight is 1, which is the "eventual drift" scale the planner's λ multiplies.
    """
    t = step + 1
    return (1.0 - beta1) / (1.0 - beta1 ** t)


def fallback_preconditioner(grad_w: Optional[torch.Tensor], shape: Sequence[int], mode: str = "grad_sq",
                            eps: float = DEFAULT_ADAM_EPS) -> Tuple[torch.Tensor, str]:
    """A preconditioner before the optimizer has state; returns ``(P, source)`` for logging.

    Modes:
        ``grad_sq`` (default): ``v̂ = G_W²`` from the current BF16 gradient, i.e. ``P = 1/(|G_W| + eps)``.
            This is exactly Adam's first-step ``v̂`` (``v̂₁ = g₁²``), so drifts come out on Adam's scale;
            it is noisy (one batch) and large where the gradient is near zero.
        ``ones``: ``P = 1`` (plain SGD drift ``lr·ΔG``); scale differs between layers from Adam's.
    """
    if mode not in FALLBACKS:
        raise ValueError(f"fallback: unknown mode {mode!r}; valid: {', '.join(FALLBACKS)}")
    if mode == "ones":
        return torch.ones(tuple(shape)), "ones"
    if grad_w is None:
        raise ValueError("fallback 'grad_sq' needs the current weight gradient grad_w")
    return 1.0 / (grad_w.float().abs() + eps), "grad_sq"


# --------------------------------------------------------------------------------------------------------
# BWD
# --------------------------------------------------------------------------------------------------------
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
    """Loss-unit BWD, SNIP.md section 4: ``(1/2N)·mean_r ⟨G^probe_W,r, lr·c·ΔG_W ⊙ P⟩²``.

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
    """Loss-unit BWD with FLD's per-channel Gauss-Newton factorisation (what :mod:`snip_ds.collect` logs).

    A weight perturbation ``δW`` changes the layer output by ``E' = X δWᵀ``; its price is
    ``fld_estimate(Σ_t E'², mean_t g², N)``: the same Fisher probes as FLD, averaged over all tokens (far less
    noisy than :func:`bwd_fisher` with one probe). ``drift_w`` is ``lr·c·ΔG_W ⊙ P``.
    """
    return fld_estimate(channel_sq_sum(_as_2d(x) @ drift_w.float().t()), probe_sq_per_channel, n_tokens)


def bwd_propagated(dgrad_err_sq: float, upstream_precond_grad_sq: float, input_grad_sq: float, lr: float,
                   step_scale: float = 1.0) -> float:
    """Propagated-BWD ratio estimate (ablation, SNIP.md section 4), parameter units.

    The dgrad error ``e`` at layer ℓ's input flows into upstream weight gradients. Model the map from a
    gradient at the input to the upstream preconditioned weight gradients by the *total* gradient there:
    ``drift ≈ (lr·c)²·‖e‖²·Σ_upstream ‖G_W ⊙ P‖² / ‖G_X‖²``. Against the measured dgrad-only drift
    (``launch/validate_metrics.py --bwd_truth_per_gemm``) it ranks layers at 0.6-0.9 (Spearman) and overstates
    10-50×: per-GEMM plans divide it by ``dgrad_calibration``. (``snip_ds.collect`` computes the same ratio
    from its accumulated sums.)

    Args:
        dgrad_err_sq: ``‖Q(G_Y)Q(W) - G_Y W‖²``.
        upstream_precond_grad_sq: ``Σ_m ‖G_W,m ⊙ P_m‖²`` over the layers upstream of ℓ's input.
        input_grad_sq: ``‖G_X‖²``, the total gradient at ℓ's input.
    """
    if input_grad_sq <= 0:
        return 0.0
    return (lr * step_scale) ** 2 * dgrad_err_sq * upstream_precond_grad_sq / input_grad_sq
