"""One quantized linear layer's forward and backward through the GEMM backends, as plain functions.

:class:`~snip_ds.linear.QuantizedLinearFn` (eager autograd) and the custom ops of :mod:`.custom_ops` (what
``torch.compile`` traces) both run these two functions, so a layer computes the same numbers bit for bit
whether it runs eagerly or compiled. :func:`forward` picks each GEMM's backend (:func:`layer_backends`),
runs fprop and returns what backward needs of X and W (:meth:`GemmBackend.fprop_and_keep`);
:func:`backward` runs dgrad and wgrad, through one backend call where one backend runs both
(:meth:`GemmBackend.backward_gemms`, which shares what both GEMMs can share). Neither reads a tensor's value
on the host.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from snip_ds.backend.base import GemmBackend, Kept, layer_backends, registrations
from snip_ds.quant_config import QuantConfig
from snip_ds.types import GemmPrecision


def forward(x_2d: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], prec: GemmPrecision,
            cfg: QuantConfig, out_dtype: torch.dtype) -> Tuple[torch.Tensor, Kept, Kept]:
    """``Y = X W^T + b`` (x_2d: [T, k], w: [n, k] -> [T, n] in ``out_dtype``) and what backward keeps of X
    and W: the tensors themselves, or an operand's :class:`~snip_ds.quant.QuantParts` where the backend
    quantized it in the forward exactly as its backward GEMM would."""
    fprop_be, dgrad_be, wgrad_be = layer_backends(prec, cfg, x_2d.device)
    if fprop_be is dgrad_be is wgrad_be:
        return fprop_be.fprop_and_keep(x_2d, w, prec, cfg, bias=bias, out_dtype=out_dtype)
    # backends differ between the GEMMs: keep what every backend accepts
    return fprop_be.fprop(x_2d, w, prec.fprop, cfg, bias=bias, out_dtype=out_dtype), x_2d, w


class StepMemo:
    """The answer of one layer's last :func:`decided_step` and what it was decided from, so that the layer's next
    call with the same precision and config objects, operand shapes, dtypes and device, under an unchanged
    backend registry and the same backend settings (:meth:`~snip_ds.backend.base.GemmBackend.step_settings`),
    takes it without asking the backends again: a re-plan, a new config, another shape, dtype or device, a
    backend registered or the kernels switched decide again. A copied or unpickled memo starts empty (its step
    holds modules, which do not pickle, and belongs to the layer it was found for)."""

    __slots__ = ("key", "backend", "settings", "step")

    def __init__(self) -> None:
        self.key = self.backend = self.settings = self.step = None

    def __deepcopy__(self, memo) -> "StepMemo":
        return StepMemo()

    def __reduce__(self):
        return StepMemo, ()

    def holds(self, key: tuple) -> bool:
        """Whether the step remembered was decided for ``key`` under the backend settings in force now."""
        return (key == self.key and self.settings[0] == registrations()
                and self.settings[1] == self.backend.step_settings())

    def remember(self, key: tuple, backend: GemmBackend, step) -> None:
        self.key, self.backend, self.step = key, backend, step
        self.settings = (registrations(), backend.step_settings())


def decided_step(x: torch.Tensor, w: torch.Tensor, prec: GemmPrecision, cfg: QuantConfig,
                 memo: Optional[StepMemo] = None):
    """The step decided for this layer's shape where one backend runs its three GEMMs as one decided step
    (the torch backend's per-tensor FP8 step, :mod:`.fp8_step`, or block-scaled step, :mod:`.block_step`: what
    :func:`forward` would run), else None. ``x``: ``[..., k]`` (decided for its 2-D view ``[T, k]``). Its
    ``forward(x_2d, w, bias, out_dtype)`` returns ``Y``, X's kept :class:`~snip_ds.quant.QuantParts` and W's
    :class:`~snip_ds.backend.base.WithAmax`; its ``backward`` takes them back. Outside a
    :func:`~snip_ds.backend.operands.shared_amax` reduction only (the caller checks). ``memo``: the layer's
    :class:`StepMemo`, which answers where it holds the answer, and is given it otherwise."""
    key = (prec, cfg, x.shape, w.shape, x.dtype, w.dtype, x.device)
    if memo is not None and memo.holds(key):
        return memo.step
    x_2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    fprop_be, dgrad_be, wgrad_be = layer_backends(prec, cfg, x.device)
    step = None
    if fprop_be is dgrad_be is wgrad_be and hasattr(fprop_be, "decided_fp8_step"):
        step = fprop_be.decided_fp8_step(x_2d, w, prec, cfg) or fprop_be.decided_block_step(x_2d, w, prec, cfg)
    if memo is not None:
        memo.remember(key, fprop_be, step)
    return step


def kept_x_dtype(x_2d: torch.Tensor, prec: GemmPrecision, cfg: QuantConfig) -> Optional[torch.dtype]:
    """The dtype of the quantized values :func:`forward` keeps of X instead of X itself (None: it keeps X),
    decided from ``x_2d``'s device, shape and dtype alone (the custom ops' shape functions ask it)."""
    fprop_be, dgrad_be, wgrad_be = layer_backends(prec, cfg, x_2d.device)
    if fprop_be is dgrad_be is wgrad_be:
        return fprop_be.kept_x_dtype(x_2d, prec, cfg)
    return None


def keeps_w_amax(x_2d: torch.Tensor, w: torch.Tensor, prec: GemmPrecision, cfg: QuantConfig) -> bool:
    """Whether :func:`forward` keeps W with its amax (:class:`~snip_ds.backend.base.WithAmax`), decided from
    the operands' devices, shapes and dtypes alone (the custom ops' shape functions ask it)."""
    fprop_be, dgrad_be, wgrad_be = layer_backends(prec, cfg, x_2d.device)
    return fprop_be is dgrad_be is wgrad_be and fprop_be.keeps_w_amax(x_2d, w, prec, cfg)


def backward(g_2d: torch.Tensor, x_keep: Kept, w_keep: Kept, prec: GemmPrecision, cfg: QuantConfig,
             generator: Optional[torch.Generator], needs: Tuple[bool, bool, bool], x_dtype: torch.dtype,
             w_dtype: torch.dtype) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(G_X, G_W, G_b)`` from ``G_Y`` (g_2d: [T, n]) and what :func:`forward` kept: G_X [T, k] in
    ``x_dtype``, G_W [n, k] in ``w_dtype``, G_b [n] (G_Y summed over the tokens), each None where ``needs``
    (X, W, bias) says it is not wanted. Stochastic rounding and the Hadamard signs draw from ``generator``
    (None: torch's default generator) in the order dgrad, then wgrad."""
    _, dgrad_be, wgrad_be = layer_backends(prec, cfg, g_2d.device)
    # dgrad: G_X = G_Y W, contraction over n; wgrad: G_W = G_Y^T X, contraction over T
    if dgrad_be is wgrad_be:
        g_x, g_w = dgrad_be.backward_gemms(g_2d, x_keep, w_keep, prec, cfg, generator, needs[:2], x_dtype, w_dtype)
    else:  # (forward kept the tensors themselves: its backends differ too)
        g_x = dgrad_be.dgrad(g_2d, w_keep, prec.dgrad, cfg, generator, out_dtype=x_dtype) if needs[0] else None
        g_w = wgrad_be.wgrad(g_2d, x_keep, prec.wgrad, cfg, generator, out_dtype=w_dtype) if needs[1] else None
    g_b = g_2d.sum(0) if needs[2] else None
    return g_x, g_w, g_b
