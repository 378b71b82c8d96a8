"""The emulated backend: quantize->dequantize every operand in FP32, then an FP32 GEMM.

It quantizes each operand with its recipe (:func:`operand_recipes`) and multiplies in FP32; it runs on any
device and is the numerical reference of every other backend. The statistics (:mod:`snip_ds.stats`) always
use its numerics, whatever backend trains, through its :meth:`~EmulatedBackend.quantize`, GEMM and ``*_moments``
methods on :func:`statistics_backend`: an instance that rounds to nearest through the fused CPU kernels
(:func:`snip_ds.backend.cpu.fake_quantize`, the same FP32 values bit for bit) where they are built and the
operand is a 2-D CPU tensor, through the compiled Triton kernels (:func:`snip_ds.backend.kernels.fake_quantize`,
bit for bit too) where the operand is a 2-D CUDA tensor, and through :mod:`snip_ds.quant` otherwise. The
registered ``emulated`` backend (training, and the reference the other backends are tested against) always
quantizes with :mod:`snip_ds.quant`.

Operands and the axis each is quantized along: see :mod:`snip_ds.backend.base`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from snip_ds.backend import cpu as cpu_kernels
from snip_ds.backend import kernels as triton_kernels
from snip_ds.backend import operands
from snip_ds.backend.base import GemmBackend
from snip_ds.backend.operands import (gemm_recipe, hadamard_pair, hadamard_wgrad, operand_recipes,
                                      tensor_amax, whole_amax)
from snip_ds.quant_config import QuantConfig
from snip_ds.types import GEMMS
from snip_ds.quant import QuantParts, fake_quantize, get_recipe, quantize_parts, stochastic_moments


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


class EmulatedBackend(GemmBackend):
    """Quantize->dequantize every operand in FP32 and run the GEMM in FP32 (FP32 accumulation).

    At ``bf16`` an operand is used as it is (cast to FP32 for the product). The streamed operand of each GEMM
    (X or G_Y along rows; both wgrad operands along tokens) is quantized slice by slice with the whole
    tensor's amax, which gives exactly the whole-tensor result while keeping temporaries small; only the
    quantized weight exists at full size, and only during its GEMM. No quantized copy outlives the call.
    """

    name = "emulated"

    def __init__(self, fused_rne: bool = False) -> None:
        """``fused_rne``: round-to-nearest quantization of 2-D FP32/BF16 operands through fused kernels (the
        values of :mod:`snip_ds.quant` bit for bit, faster): on the CPU the fused CPU kernels when they are
        built, on CUDA the compiled Triton kernels (:func:`snip_ds.backend.kernels.fake_quantize`); the
        statistics' instance (:func:`statistics_backend`) sets it, the registered reference does not."""
        self.fused_rne = fused_rne

    def quantize(self, t: torch.Tensor, precision: str, role: str, axis: int, cfg: QuantConfig,
                 generator: Optional[torch.Generator] = None,
                 amax: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One operand (or a slice of it, with the whole operand's ``amax``) at one precision, as FP32.

        ``role`` is ``"x"``, ``"w"`` or ``"g"``; stochastic rounding applies to FP4 gradients only.
        """
        if precision == "bf16":
            return _fp32(t)
        recipes = operand_recipes(precision, cfg)
        stochastic = role == "g" and recipes.stochastic_g
        if amax is None:
            amax = whole_amax(t, getattr(recipes, role))  # a shard's: the whole tensor's (operands.shared_amax)
        if not stochastic and self.fused_rne:
            if _fusable(t):
                return cpu_kernels.fake_quantize(t, getattr(recipes, role), axis, tensor_amax=amax)
            if _fusable_cuda(t):
                return triton_kernels.fake_quantize(t, getattr(recipes, role), axis, tensor_amax=amax)
        return fake_quantize(_fp32(t), getattr(recipes, role), axis=axis, stochastic=stochastic,
                             generator=generator if stochastic else None, tensor_amax=amax)

    def quantize_whole(self, t: torch.Tensor, precision: str, role: str, axis: int,
                       cfg: QuantConfig) -> torch.Tensor:
        """A whole 2-D operand quantized along ``axis`` (0 or -1), built slice by slice into one buffer."""
        if precision == "bf16":
            return _fp32(t)
        out = torch.empty(t.shape, dtype=torch.float32, device=t.device)
        amax = tensor_amax(t)
        recipe = get_recipe(getattr(operand_recipes(precision, cfg), role))
        # Per-tensor scales and 16x16 tiles give the same result along either axis: take contiguous rows.
        if axis in (-1, 1) or recipe.block_size == 0 or recipe.block_2d:  # (2-D tiles: multiples of 32 rows)
            for rows in operands.chunks(t.shape[0], t.shape[1], t.device):
                out[rows] = self.quantize(t[rows], precision, role, -1, cfg, None, amax)
        else:  # blocks along columns: slices of columns
            for cols in operands.chunks(t.shape[1], t.shape[0], t.device):
                out[:, cols] = self.quantize(t[:, cols], precision, role, 0, cfg, None, amax)
        return out

    def _rows_times(self, a: torch.Tensor, b_lp: torch.Tensor, precision: str, role: str, cfg: QuantConfig,
                    generator: Optional[torch.Generator]) -> torch.Tensor:
        """``Q(a) @ b_lp`` with ``a`` quantized along its rows' last axis, one slice of rows at a time."""
        if precision == "bf16":
            return _fp32(a) @ b_lp
        out = torch.empty(a.shape[0], b_lp.shape[1], dtype=torch.float32, device=a.device)
        amax = tensor_amax(a)
        for rows in operands.chunks(a.shape[0], a.shape[1], a.device):
            torch.mm(self.quantize(a[rows], precision, role, -1, cfg, generator, amax), b_lp, out=out[rows])
        return out

    def fprop(self, x: torch.Tensor, w: torch.Tensor, precision: str, cfg: QuantConfig, *,
              bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``Y = Q(X) Q(W)^T (+ b)`` in FP32, then cast to ``out_dtype``. x: [T, k], w: [n, k] -> [T, n]."""
        w_lp = self.quantize_whole(w, precision, "w", -1, cfg)
        y = self._rows_times(x, w_lp.t(), precision, "x", cfg, None)
        if bias is not None:
            y += bias.float()
        return y.to(out_dtype)

    def dgrad(self, g: torch.Tensor, w: torch.Tensor, precision: str, cfg: QuantConfig,
              generator: Optional[torch.Generator] = None, *,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``G_X = Q(G_Y) Q(W)`` in FP32, then cast to ``out_dtype``. g: [T, n], w: [n, k] -> [T, k]."""
        w_lp = self.quantize_whole(w, precision, "w", 0, cfg)
        return self._rows_times(g, w_lp, precision, "g", cfg, generator).to(out_dtype)

    def wgrad(self, g: torch.Tensor, x: torch.Tensor, precision: str, cfg: QuantConfig,
              generator: Optional[torch.Generator] = None, *,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``G_W = Q(G_Y)^T Q(X)`` in FP32, both along the token axis, then cast to ``out_dtype``.
        g: [T, n], x: [T, k] -> [n, k]."""
        if precision == "bf16":
            return (_fp32(g).t() @ _fp32(x)).to(out_dtype)
        if hadamard_wgrad(precision, cfg):
            g, x = hadamard_pair(g, x, generator)
        g_w = torch.zeros(g.shape[1], x.shape[1], dtype=torch.float32, device=g.device)
        amax_g, amax_x = tensor_amax(g), tensor_amax(x)
        for tokens in operands.chunks(g.shape[0], g.shape[1] + x.shape[1], g.device):
            g_lp = self.quantize(g[tokens], precision, "g", 0, cfg, generator, amax_g)
            x_lp = self.quantize(x[tokens], precision, "x", 0, cfg, None, amax_x)
            g_w.addmm_(g_lp.t(), x_lp)
        return g_w.to(out_dtype)

    def quantized_operands(self, gemm: str, a: torch.Tensor, b: torch.Tensor, precision: str, cfg: QuantConfig,
                           generator: Optional[torch.Generator] = None) -> Tuple[QuantParts, QuantParts]:
        """The two operands of ``gemm`` as :func:`~snip_ds.quant.quantize_parts` splits them, quantized along
        the axes (and, for stochastic rounding, with the draws) that :meth:`fprop`, :meth:`dgrad` and
        :meth:`wgrad` use; their products of values and tensor scales are the operands those GEMMs multiply.
        ``(a, b)`` is ``(x, w)``, ``(g, w)`` or ``(g, x)``."""
        return reference_operands(gemm, a, b, precision, cfg, generator)

    # ---------------- expectations over the stochastic rounding of G_Y (statistics only) ----------------
    def rounds_g_stochastically(self, precision: str, cfg: QuantConfig) -> bool:
        """Whether ``precision`` rounds the gradient operand G_Y stochastically under ``cfg``."""
        return precision != "bf16" and operand_recipes(precision, cfg).stochastic_g

    def _g_moments(self, g: torch.Tensor, precision: str, cfg: QuantConfig, axis: int,
                   amax: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return stochastic_moments(_fp32(g), operand_recipes(precision, cfg).g, axis=axis, tensor_amax=amax)

    def wgrad_moments(self, g: torch.Tensor, x: torch.Tensor, precision: str, cfg: QuantConfig,
                      generator: Optional[torch.Generator] = None,
                      price_tokens: Optional[torch.Tensor] = None,
                      gram: Optional[torch.Tensor] = None,
                      column_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> "GemmMoments":
        """Mean and element-wise variance of ``G_W = Q(G_Y)^T Q(X)`` over G_Y's stochastic rounding.

        The elements of G_Y round independently (deterministic scales), so ``E[G_W] = E[Q(G_Y)]^T Q(X)`` and
        ``Var[G_W]_ji = Σ_t Var[Q(G_Y)]_tj · Q(X)_ti²``, exactly. With ``price_tokens`` (indices of a sample S
        of the T tokens), also the loss price of the noise ``N = G_W - E[G_W]`` per output channel j,
        ``E Σ_t (x_t·N_j)² = Σ_s Var[Q(G_Y)]_sj · ‖X Q(X)_sᵀ‖²``, estimated without bias from the sample as
        ``(T/|S|) Σ_{s∈S} ...`` (each sampled token costs a ``[T, k]`` by ``[k]`` product; all of them: exact).
        The Hadamard transform (``cfg.hadamard``, FP4) is applied to both operands first, with signs drawn
        from ``generator`` as :meth:`wgrad` draws them (the price is the same in either basis: the transform
        is orthogonal along the tokens). With ``gram = XᵀX`` (``[k, k]`` FP32) and no Hadamard transform, each
        sampled token is priced as ``Q(X)_s (XᵀX) Q(X)_sᵀ`` instead (``k²`` multiply-adds, not ``T·k``; the same
        number in exact arithmetic). With ``column_sum`` (``x`` holds some of the input's columns, the other
        columns on other ranks: a row-parallel shard), each ``X Q(X)_sᵀ`` is summed by it over the ranks before
        its norm is taken, and ``gram`` must be None. Requires a precision that rounds G_Y stochastically.
        """
        if not self.rounds_g_stochastically(precision, cfg):
            raise ValueError(f"precision {precision!r} does not round G_Y stochastically under this config")
        if hadamard_wgrad(precision, cfg):
            g, x = hadamard_pair(g, x, generator)
            gram = None
        tokens, n, k = g.shape[0], g.shape[1], x.shape[1]
        mean = torch.zeros(n, k, dtype=torch.float32, device=g.device)
        var = torch.zeros(n, k, dtype=torch.float32, device=g.device)
        projected = None
        if price_tokens is not None:
            projected = torch.zeros(n, dtype=torch.float32, device=g.device)
            sampled = torch.zeros(tokens, dtype=torch.bool, device=g.device)
            sampled[price_tokens.to(g.device)] = True
            scale = tokens / max(int(sampled.sum()), 1)
        amax_g, amax_x = tensor_amax(g), tensor_amax(x)
        x32 = _fp32(x)
        for chunk in operands.chunks(tokens, n + k, g.device):
            g_mean, g_var = self._g_moments(g[chunk], precision, cfg, 0, amax_g)
            x_lp = self.quantize(x[chunk], precision, "x", 0, cfg, None, amax_x)
            mean.addmm_(g_mean.t(), x_lp)
            del g_mean
            if projected is not None:
                pick = sampled[chunk]
                if pick.any():
                    q = x_lp[pick]  # [|S ∩ chunk|, k]; h_s = ‖X Q(X)_sᵀ‖² = Q(X)_s XᵀX Q(X)_sᵀ
                    if gram is not None:
                        h = (q @ gram).mul_(q).sum(dim=1)
                    else:
                        xq = x32 @ q.t()
                        h = (xq if column_sum is None else column_sum(xq)).square_().sum(dim=0)
                    projected.addmv_(g_var[pick].t(), h, alpha=scale)
            var.addmm_(g_var.t(), x_lp.square_())
        return GemmMoments(mean, var, projected)

    def dgrad_moments(self, g: torch.Tensor, w: torch.Tensor, precision: str,
                      cfg: QuantConfig) -> "GemmMoments":
        """Mean and element-wise variance of ``G_X = Q(G_Y) Q(W)`` over G_Y's stochastic rounding (exact:
        ``E[Q(G_Y)] Q(W)`` and ``Var[Q(G_Y)] Q(W)²``)."""
        if not self.rounds_g_stochastically(precision, cfg):
            raise ValueError(f"precision {precision!r} does not round G_Y stochastically under this config")
        w_lp = self.quantize_whole(w, precision, "w", 0, cfg)
        w_sq = w_lp * w_lp
        mean = torch.empty(g.shape[0], w.shape[1], dtype=torch.float32, device=g.device)
        var = torch.empty_like(mean)
        amax = tensor_amax(g)
        for rows in operands.chunks(g.shape[0], g.shape[1], g.device):
            g_mean, g_var = self._g_moments(g[rows], precision, cfg, -1, amax)
            torch.mm(g_mean, w_lp, out=mean[rows])
            torch.mm(g_var, w_sq, out=var[rows])
        return GemmMoments(mean, var, None)


def _fusable(t: torch.Tensor) -> bool:
    """Whether the fused CPU kernels take ``t`` (checked before asking whether they are built)."""
    return (t.device.type == "cpu" and t.ndim == 2 and t.dtype in (torch.float32, torch.bfloat16)
            and cpu_kernels.available())


def _fusable_cuda(t: torch.Tensor) -> bool:
    """Whether the compiled Triton kernels take ``t``: a 2-D FP32/BF16 CUDA tensor, Triton installed."""
    return (t.device.type == "cuda" and t.ndim == 2 and t.dtype in (torch.float32, torch.bfloat16)
            and triton_kernels.available() and not triton_kernels.interpreting())


_STATISTICS = EmulatedBackend(fused_rne=True)


def statistics_backend() -> EmulatedBackend:
    """The emulated backend the statistics quantize and multiply with: the reference's values, rounding to
    nearest through the fused CPU kernels or, on CUDA, the Triton kernels where they run
    (:class:`EmulatedBackend`, ``fused_rne``)."""
    return _STATISTICS


@dataclass(frozen=True)
class GemmMoments:
    """A GEMM's output over the stochastic rounding of G_Y: ``mean`` and element-wise ``var`` (FP32, the
    output's shape), and for wgrad optionally ``projected``, the noise's loss price per output channel (see
    :meth:`EmulatedBackend.wgrad_moments`)."""

    mean: torch.Tensor
    var: torch.Tensor
    projected: Optional[torch.Tensor]


def reference_operands(gemm: str, a: torch.Tensor, b: torch.Tensor, precision: str, cfg: QuantConfig,
                       generator: Optional[torch.Generator] = None) -> Tuple[QuantParts, QuantParts]:
    """The reference split of ``gemm``'s quantized operands (see :meth:`EmulatedBackend.quantized_operands`);
    at ``bf16`` the operands in FP32 with a tensor scale of 1."""
    if gemm not in GEMMS:
        raise ValueError(f"gemm: unknown GEMM {gemm!r}; valid: {', '.join(GEMMS)}")
    if precision == "bf16":
        return tuple(QuantParts(_fp32(t).clone(), torch.ones((), dtype=torch.float32, device=t.device))
                     for t in (a, b))
    recipe = gemm_recipe(gemm, precision, cfg)
    if recipe.hadamard:
        a, b = hadamard_pair(a, b, generator)
    return tuple(quantize_parts(t, op.recipe, axis=op.axis, stochastic=op.stochastic,
                                generator=generator if op.stochastic else None, tensor_amax=whole_amax(t, op.recipe))
                 for t, op in zip((a, b), recipe.operands))
