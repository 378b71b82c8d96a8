"""Quantization settings of the linear layers.

The ``"snip"`` section of a DeepSpeed JSON is parsed by :mod:`snip_ds.config.settings`; this module holds only
the small frozen dataclass the quantized linear needs, so the numerics do not depend on the trainer. (The
statistics' estimator choices, ``ESTIMATORS``, ``FLD_FORMS`` and ``BWD_ROUNDINGS``, are defined with the
other settings in :mod:`snip_ds.options` and imported here by older callers.)
"""
from __future__ import annotations

from dataclasses import dataclass

from snip_ds.options import BWD_ROUNDINGS, ESTIMATORS, FLD_FORMS  # noqa: F401 (re-exported)

FP8_RECIPES = ("fp8_hybrid", "mxfp8")
FP4_RECIPES = ("nvfp4", "mxfp4")
BACKENDS = ("auto", "emulated", "torch", "te")  # how the quantized GEMMs run (snip_ds.backend)


@dataclass(frozen=True)
class QuantConfig:
    """How a :class:`~snip_ds.linear.SnipLinear` quantizes its operands.

    Attributes:
        fp8_recipe: ``"fp8_hybrid"`` (per-tensor current scaling, E4M3 for inputs and weights, E5M2 for
            gradients; what Transformer Engine runs on Hopper) or ``"mxfp8"`` (E4M3 in blocks of 32 with a
            power-of-two scale, for every operand).
        fp4_recipe: ``"nvfp4"`` (E2M1 in blocks of 16 with an E4M3 block scale and an FP32 tensor scale;
            weights in 16x16 2-D blocks when ``weight_2d``) or ``"mxfp4"`` (blocks of 32, E8M0 scale).
        stochastic_rounding: round FP4 gradients (G_Y) stochastically, as NVIDIA's NVFP4 recipe does.
        hadamard: apply a 16x16 random Hadamard transform along the token axis to both wgrad operands
            before FP4 quantization (the product G_Y^T X is unchanged in exact arithmetic).
        weight_2d: NVFP4 weights in 16x16 blocks, so one quantized weight serves fprop and dgrad.
        backend: how the quantized GEMMs of training run: ``"emulated"`` (quantize->dequantize, FP32 GEMM;
            the numerical reference), ``"torch"`` (real FP8 GEMMs where the device has them, otherwise the
            exact grid values in BF16 GEMMs), ``"te"`` (Transformer Engine 2.9 - 2.19, CUDA only;
            :mod:`snip_ds.backend.te`) or ``"auto"`` (the fastest that exists for the device, per precision).
            The statistics always use the emulated numerics.
    """

    fp8_recipe: str = "fp8_hybrid"
    fp4_recipe: str = "nvfp4"
    stochastic_rounding: bool = True
    hadamard: bool = False
    weight_2d: bool = True
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"fp8_recipe: unknown recipe {self.fp8_recipe!r}; valid: {', '.join(FP8_RECIPES)}")
        if self.fp4_recipe not in FP4_RECIPES:
            raise ValueError(f"fp4_recipe: unknown recipe {self.fp4_recipe!r}; valid: {', '.join(FP4_RECIPES)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: unknown backend {self.backend!r}; valid: {', '.join(BACKENDS)}")
        for name in ("stochastic_rounding", "hadamard", "weight_2d"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected true or false, got {getattr(self, name)!r}")
