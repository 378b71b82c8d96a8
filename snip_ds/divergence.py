"""SNIP's divergence estimators as pure tensor math (docs/method.md derives them).

Nothing here touches a model, hooks or torch.distributed: :mod:`snip_ds.stats` gathers the per-channel
reductions and scalars these functions combine.

Conventions (``T`` rows of a layer's output, ``n`` output channels, ``k`` input channels, ``N`` loss tokens):

* ``E [T, n]``: a layer's output error, e.g. ``Q(X) Q(W)^T - X W^T``.
* ``g [T, n]``: a **per-token-scale** gradient at the layer output, i.e. the gradient of the *summed*
  per-token loss ``Σ_t ℓ_t`` (``N`` times the gradient of the mean loss the trainer minimises). Monte-Carlo
  Fisher probes are the gradient of ``Σ_t CE(logits_t, ŷ_t)`` with ``ŷ_t ~ softmax(logits_t)``.
* The loss is the mean over ``N`` tokens. Its Gauss-Newton matrix is then ``N · E[g_mean g_meanᵀ] =
  E[g gᵀ] / N``, which is where the ``1/(2N)`` of every estimate comes from.
* Per-channel reductions: ``err_sq[j] = Σ_t E_tj²`` (:func:`channel_sq_sum`), ``probe_sq[j] = mean_t g_tj²``. Factorising the diagonal ``Σ_t g_tj² E_tj² ≈ (Σ_t E_tj²)·mean_t g_tj²`` lets a
  single probe suffice, but drops every cross-token and cross-channel pair (the ``channel`` ablation).
* Sequence form (the default): ``Σ_rows (Σ_t g_t·E_t)²`` (:func:`sequence_sq_sum`), whose expectation over
  the probe labels is the exact Gauss-Newton form ``Eᵀ E[g gᵀ] E`` within each sequence.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import torch

PRECOND_SOURCES = ("tensor", "callable", "factored", "grad_sq", "ones")  # where a P came from, for logging
FALLBACKS = ("factored", "grad_sq", "ones")
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


def gram_pays(tokens: int, k: int, rows: int) -> bool:
    """Whether projecting ``rows`` vectors of length k onto the ``tokens`` rows of an input ``[tokens, k]``
    (``Σ_t (x_t·d)²`` for each, :func:`projected_sq_sum`) costs fewer multiply-adds through one shared Gram
    matrix (``T·k² + rows·k²``) than directly (``rows·T·k``)."""
    return tokens * k + rows * k < rows * tokens


def row_sums(v: torch.Tensor, rows: Union[int, torch.Tensor]) -> torch.Tensor:
    """Per-sequence sums of the per-token values ``v`` ``[T]``: ``rows`` an int splits the T tokens into that
    many equal, contiguous sequences; an int64 tensor ``[T]`` gives each token's sequence (the tokens routed to
    one MoE expert come from any sequences, in any order). Sequences without a token sum to 0 (and are left
    out where that changes no sum of squares)."""
    if isinstance(rows, torch.Tensor):
        if rows.shape != v.shape:
            raise ValueError(f"rows: {tuple(rows.shape)} sequence indices for {tuple(v.shape)} tokens")
        if v.numel() == 0:
            return v.new_zeros(0)
        return v.new_zeros(int(rows.max()) + 1).index_add_(0, rows.to(v.device), v)
    if rows < 1 or v.shape[0] % rows:
        raise ValueError(f"rows={rows} does not divide the {v.shape[0]} tokens")
    return v.reshape(rows, -1).sum(1)


def sequence_index(rows: Union[int, torch.Tensor], tokens: int, device=None) -> torch.Tensor:
    """Each token's sequence as an int64 ``[T]`` tensor, for ``rows`` as :func:`row_sums` takes it (an int: that
    many equal, contiguous sequences of the ``tokens`` tokens; a tensor: itself)."""
    if isinstance(rows, torch.Tensor):
        return rows
    if rows < 1 or tokens % rows:
        raise ValueError(f"rows={rows} does not divide the {tokens} tokens")
    return torch.arange(rows, device=device).repeat_interleave(tokens // rows)


def sequence_sq_sum(g: torch.Tensor, e: torch.Tensor, rows: Union[int, torch.Tensor]) -> torch.Tensor:
    """``Σ_r (Σ_{t in row r} g_t·e_t)²``: ``[T, n], [T, n] -> []`` with the T tokens split into ``rows`` equal,
    contiguous sequences, or assigned to sequences by an int64 tensor ``rows`` ``[T]`` (:func:`row_sums`) (FP32).

    With ``g`` a Monte-Carlo Fisher probe (labels drawn from the model's softmax), its expectation is the
    Gauss-Newton quadratic form ``eᵀ(Σ_s J_sᵀ F_s J_s)e`` of the perturbation ``e`` summed over rows: exact
    within a sequence (every token and channel pair), while pairs of different sequences, whose probe
    gradients are independent, have zero expectation and are dropped.
    """
    if g.shape != e.shape:
        raise ValueError(f"g {tuple(g.shape)} and e {tuple(e.shape)} must have the same shape")
    s = row_sums((_as_2d(g).float() * _as_2d(e).float()).sum(-1), rows)
    return (s * s).sum()


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
# The isotropic "noise on the last block's output" ablation
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


def factored_second_moment(grad_w: torch.Tensor, row_sum=None, col_sum=None) -> torch.Tensor:
    """Adafactor's rank-1 estimate of ``G_W²``: ``v̂_ij = R_i C_j / S`` with the row sums ``R_i = Σ_j G_ij²``,
    the column sums ``C_j = Σ_i G_ij²`` and the total ``S``, so ``Σ v̂ = Σ G_W²`` (Adam's first-step scale
    over the layer). Each factor is a sum of squares: an element whose gradient nearly cancels (and so moves
    with the order of summation) changes it by no more than its own square. Rows or columns without any
    gradient get ``v̂ = 0``.

    ``row_sum``/``col_sum`` (optional) complete a tensor-parallel shard's partial sums over its group: a
    column-parallel shard (some rows) passes ``col_sum``, a row-parallel one (some columns) ``row_sum``, so
    every shard computes the unsharded layer's ``v̂`` on its part.
    """
    g2 = grad_w.float().square()
    rows, cols = g2.sum(1), g2.sum(0)
    if row_sum is not None:
        rows = row_sum(rows)
    if col_sum is not None:
        cols = col_sum(cols)
    total = cols.sum() if col_sum is not None else rows.sum()  # the complete one holds every element
    if not total > 0:
        return torch.zeros_like(g2)
    return rows[:, None] * (cols[None, :] / total)


def fallback_preconditioner(grad_w: Optional[torch.Tensor], shape: Sequence[int], mode: str = "factored",
                            eps: float = DEFAULT_ADAM_EPS, row_sum=None, col_sum=None) -> Tuple[torch.Tensor, str]:
    """A preconditioner before the optimizer has state; returns ``(P, source)`` for logging.

    Modes:
        ``factored`` (default): ``P = 1/(sqrt(v̂) + eps)`` with ``v̂`` the rank-1 (row × column) estimate of
            ``G_W²`` (:func:`factored_second_moment`; ``row_sum``/``col_sum`` for a tensor-parallel shard): on
            Adam's scale over the layer, and set by sums of squares, so the price does not follow the round-off
            of the elements whose gradient nearly cancels.
        ``grad_sq``: ``v̂ = G_W²`` from the current gradient, i.e. ``P = 1/(|G_W| + eps)``, exactly Adam's
            first-step ``v̂`` (``v̂₁ = g₁²``). Ill-conditioned: its largest terms are the elements whose gradient
            nearly cancels over the tokens, and those move with the GEMM's order of summation.
        ``ones``: ``P = 1`` (plain SGD drift ``lr·ΔG``); scale differs between layers from Adam's.
    """
    if mode not in FALLBACKS:
        raise ValueError(f"fallback: unknown mode {mode!r}; valid: {', '.join(FALLBACKS)}")
    if mode == "ones":
        return torch.ones(tuple(shape)), "ones"
    if grad_w is None:
        raise ValueError(f"fallback {mode!r} needs the current weight gradient grad_w")
    if mode == "factored":
        return 1.0 / (factored_second_moment(grad_w, row_sum, col_sum).sqrt() + eps), "factored"
    return 1.0 / (grad_w.float().abs() + eps), "grad_sq"
