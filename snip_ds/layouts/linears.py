"""Which modules are linear GEMMs, proved by behaviour.

A module is a linear GEMM when it is a leaf holding a 2-D ``weight`` (and at most a 1-D ``bias``) and its forward
computes ``y = x·Wᵀ + b`` (:data:`LINEAR`: ``nn.Linear``'s contract) or ``y = x·W + b`` (:data:`TRANSPOSED`: a
weight stored ``[in, out]``, as GPT-2's and OpenAI-GPT's ``Conv1D``). ``nn.Linear`` itself is known; any other
class (an ``nn.Linear`` subclass that overrides ``forward`` included) is checked once per class: its forward runs
on random weights of the module's output width and a random input under ``torch.func.functional_call`` (the
model's own Parameters are neither read nor changed, so partitioned ZeRO-3 Parameters are fine) and must match
one of the two forms within the round-off of summing the same products in another order. A class that matches
neither (BitNet's ternary ``AutoBitLinear``, a LoRA layer) is not a GEMM snip_ds can run for it: it stays as it is.

Which of them are MoE routers is proved by what consumes their output (:mod:`snip_ds.layouts.routers`).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn
from torch.func import functional_call

from snip_ds.types import full_shape

LINEAR = "linear"  # y = x Wᵀ + b, W stored [out, in]
TRANSPOSED = "transposed"  # y = x W + b, W stored [in, out]

_PROBE_IN = 8  # the probe's input width: the forms hold for any width, and a narrow one keeps the probe cheap
_PROBE_ROWS = 3

_forms: Dict[type, Optional[str]] = {}  # proved once per class


def _candidate(module: nn.Module) -> bool:
    """A leaf whose only Parameters are a 2-D ``weight`` and perhaps a 1-D ``bias``."""
    if next(module.children(), None) is not None:
        return False
    params = dict(module.named_parameters(recurse=False))
    weight, bias = params.pop("weight", None), params.pop("bias", None)
    return (not params and weight is not None and len(full_shape(weight)) == 2
            and (bias is None or len(full_shape(bias)) == 1))


def _matches(module: nn.Module, form: str, out: int, has_bias: bool) -> bool:
    gen = torch.Generator().manual_seed(0)
    shape = (out, _PROBE_IN) if form == LINEAR else (_PROBE_IN, out)
    w = torch.randn(shape, generator=gen, dtype=torch.float64)
    b = torch.randn(out, generator=gen, dtype=torch.float64) if has_bias else None
    x = torch.randn(_PROBE_ROWS, _PROBE_IN, generator=gen, dtype=torch.float64)
    params = {"weight": w, **({"bias": b} if has_bias else {})}
    try:
        with torch.no_grad():
            y = functional_call(module, params, (x,))
    except Exception:  # noqa: BLE001 - any failure means: not this form
        return False
    if not isinstance(y, torch.Tensor) or y.shape != (_PROBE_ROWS, out) or y.dtype != torch.float64:
        return False
    w_oi = w if form == LINEAR else w.t()
    ref = x @ w_oi.t() + (b if has_bias else 0)
    # the same _PROBE_IN products (and the bias) summed in any order: |Δ| <= γ_{k+1}·Σ|terms| (u = 2^-53)
    bound = (_PROBE_IN + 1) * 2.0 ** -53 * 2 * (x.abs() @ w_oi.abs().t() + (b.abs() if has_bias else 0))
    return bool(((y - ref).abs() <= bound).all())


def linear_form(module: nn.Module) -> Optional[str]:
    """:data:`LINEAR` or :data:`TRANSPOSED` for a module that is a linear GEMM (module docstring), else None. A
    module that declares its form (``gemm_form``: snip_ds's own :class:`~snip_ds.linear.SnipLinear`) is taken at
    its word."""
    declared = getattr(module, "gemm_form", None)
    if declared in (LINEAR, TRANSPOSED):
        return declared
    if not _candidate(module):
        return None
    cls = type(module)
    if cls is nn.Linear:
        return LINEAR
    if cls not in _forms:
        out_lin, out_tr = full_shape(module.weight)
        has_bias = getattr(module, "bias", None) is not None
        form = None
        if _matches(module, LINEAR, out_lin, has_bias):
            form = LINEAR
        elif _matches(module, TRANSPOSED, out_tr, has_bias):
            form = TRANSPOSED
        _forms[cls] = form
    return _forms[cls]


def gemm_shape(module: nn.Module, form: str):
    """``(in_features, out_features)`` of a linear GEMM of the given form."""
    a, b = full_shape(module.weight)
    return (b, a) if form == LINEAR else (a, b)
