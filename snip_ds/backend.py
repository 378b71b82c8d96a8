"""The quantization backend: how each of a linear layer's three GEMMs is computed at a given precision.

This is the one module that decides *how* quantized GEMMs run. :class:`~snip_ds.linear.SnipLinear` asks it
for ``fprop``, ``dgrad`` and ``wgrad`` and knows nothing about formats. The emulated backend below
quantizes each operand (quantize->dequantize, SNIP.md section 2) and multiplies in FP32; it runs on any
device and is the numerical reference. A hardware backend (Transformer Engine FP8 GEMMs) plugs in here.

Operands (linear ``Y = X W^T``, ``X: [T, k]``, ``W: [n, k]``), quantized along the GEMM's contraction axis:

====== ================== =========== ==========================================
GEMM   math               contraction operands (block axis)
====== ================== =========== ==========================================
fprop  ``Y = X W^T``      k           X along k, W along k
dgrad  ``G_X = G_Y W``    n           G_Y along n, W along n
wgrad  ``G_W = G_Y^T X``  T           G_Y and X along T, from the high-precision copies
====== ================== =========== ==========================================
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from snip_ds.config import QuantConfig
from snip_ds.quant import fake_quantize, hadamard_transform, random_signs


@dataclass(frozen=True)
class OperandRecipes:
    """Recipe names for the input X, the weight W and the output gradient G_Y at one precision."""

    x: str
    w: str
    g: str
    stochastic_g: bool


def operand_recipes(precision: str, cfg: QuantConfig) -> OperandRecipes:
    """The recipes a precision uses for each operand role, per SNIP.md section 2."""
    if precision == "fp8":
        if cfg.fp8_recipe == "fp8_hybrid":
            return OperandRecipes("fp8_e4m3", "fp8_e4m3", "fp8_e5m2", False)
        return OperandRecipes("mxfp8", "mxfp8", "mxfp8", False)
    if precision == "fp4":
        if cfg.fp4_recipe == "nvfp4":
            return OperandRecipes("nvfp4", "nvfp4_2d" if cfg.weight_2d else "nvfp4", "nvfp4",
                                  cfg.stochastic_rounding)
        return OperandRecipes("mxfp4", "mxfp4", "mxfp4", cfg.stochastic_rounding)
    raise ValueError(f"precision: no quantized recipes for {precision!r}; valid: fp8, fp4")


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


class EmulatedBackend:
    """Quantize->dequantize every operand in FP32 and run the GEMM in FP32 (FP32 accumulation).

    At ``bf16`` an operand is used as it is (cast to FP32 for the product). Temporaries are released as soon
    as each product is formed, so no quantized copy outlives the call.
    """

    name = "emulated"

    def quantize(self, t: torch.Tensor, precision: str, role: str, axis: int, cfg: QuantConfig,
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """One operand at one precision, as FP32. ``role`` is ``"x"``, ``"w"`` or ``"g"``."""
        if precision == "bf16":
            return _fp32(t)
        recipes = operand_recipes(precision, cfg)
        stochastic = role == "g" and recipes.stochastic_g
        out = fake_quantize(_fp32(t), getattr(recipes, role), axis=axis, stochastic=stochastic,
                            generator=generator if stochastic else None)
        return out

    def fprop(self, x: torch.Tensor, w: torch.Tensor, precision: str, cfg: QuantConfig) -> torch.Tensor:
        """``Y = Q(X) Q(W)^T`` in FP32. x: [T, k], w: [n, k] -> [T, n]."""
        x_lp = self.quantize(x, precision, "x", -1, cfg)
        w_lp = self.quantize(w, precision, "w", -1, cfg)
        return x_lp @ w_lp.t()

    def dgrad(self, g: torch.Tensor, w: torch.Tensor, precision: str, cfg: QuantConfig,
              generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """``G_X = Q(G_Y) Q(W)`` in FP32. g: [T, n], w: [n, k] -> [T, k]."""
        g_lp = self.quantize(g, precision, "g", -1, cfg, generator)
        w_lp = self.quantize(w, precision, "w", 0, cfg)
        return g_lp @ w_lp

    def wgrad(self, g: torch.Tensor, x: torch.Tensor, precision: str, cfg: QuantConfig,
              generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """``G_W = Q(G_Y)^T Q(X)`` in FP32, both along the token axis. g: [T, n], x: [T, k] -> [n, k]."""
        if precision == "fp4" and cfg.hadamard:
            signs = random_signs(g.shape[0], generator=generator, device=g.device)
            g = hadamard_transform(_fp32(g), axis=0, signs=signs)
            x = hadamard_transform(_fp32(x), axis=0, signs=signs)
        g_lp = self.quantize(g, precision, "g", 0, cfg, generator)
        x_lp = self.quantize(x, precision, "x", 0, cfg)
        return g_lp.t() @ x_lp


_BACKENDS = {"emulated": EmulatedBackend()}


def get_backend(name: str = "emulated") -> EmulatedBackend:
    """The backend registered under ``name``; a ValueError lists the valid names."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"backend: unknown backend {name!r}; valid: {', '.join(sorted(_BACKENDS))}") from None
