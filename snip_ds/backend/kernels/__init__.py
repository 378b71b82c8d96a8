"""Fused Triton kernels for the quantized GEMM operands (GPU; CPU tensors under Triton's interpreter).

:func:`quantize_parts` is :func:`snip_ds.quant.quantize_parts` for 2-D operands as two GPU passes (the tensor
amax, then one fused pass that computes block amaxes and scales, rounds and writes the values, optionally
in BF16 and transposed), bit for bit equal to the reference with stochastic rounding off. :func:`tensor_amax`
is the first pass alone, for quantizing a tensor slice by slice with its whole amax.

Importing this package needs no Triton; :func:`available` says whether the kernels can run. Triton reads
``TRITON_INTERPRET`` when the kernels are defined, i.e. when :mod:`.quantize` is first imported (at the first
call to :func:`quantize_parts`): set it before then to run them on CPU tensors through the interpreter.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import torch


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels, on CPU tensors: how they were defined once imported,
    else whether ``TRITON_INTERPRET=1`` is set (Triton reads it when the kernels are defined)."""
    kernels = sys.modules.get("snip_ds.backend.kernels.quantize")
    if kernels is not None:
        return kernels.INTERPRETED
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available() -> bool:
    """Triton is installed and there is a CUDA device for it, or its interpreter is on
    (``TRITON_INTERPRET=1``). Does not import Triton (which fixes the interpreter choice for the process)."""
    return _triton_installed() and (interpreting() or torch.cuda.is_available())


_TRITON_INSTALLED = None  # asked on every statistics quantization of a CUDA operand: looked up once


def _triton_installed() -> bool:
    global _TRITON_INSTALLED
    if _TRITON_INSTALLED is None:
        _TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
    return _TRITON_INSTALLED


def _kernels():
    if not available():
        raise RuntimeError("triton kernels: need the triton package and a CUDA device "
                           "(or TRITON_INTERPRET=1 for CPU tensors)")
    from snip_ds.backend.kernels import grouped, quantize  # noqa: F401  (grouped's kernels call quantize's
    return quantize  # device functions: defined in the same mode, compiled or interpreted, and loaded with them)


def quantize_parts(*args, **kwargs):
    """See :func:`snip_ds.backend.kernels.quantize.quantize_parts` (imported on first use: it needs Triton)."""
    return _kernels().quantize_parts(*args, **kwargs)


def fake_quantize(*args, **kwargs):
    """See :func:`snip_ds.backend.kernels.quantize.fake_quantize`: round-to-nearest quantize-dequantize."""
    return _kernels().fake_quantize(*args, **kwargs)


def tensor_amax(x):
    """See :func:`snip_ds.backend.kernels.quantize.tensor_amax`: the amax pass alone."""
    return _kernels().tensor_amax(x)
