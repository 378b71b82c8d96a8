"""The quantized linear layer's forward and backward as torch custom ops, so ``torch.compile`` traces through them.

``torch.compile`` (dynamo) cannot trace a ``torch.Generator``, the backends' Python control flow or the
quantization kernels' launches; an opaque operator with a shape function it can. Two ops, registered with
``torch.library.custom_op`` (torch >= 2.6):

* ``snip_ds::quantized_linear(x, weight, bias, spec, layer) -> (y, x_values, x_scale, w_amax)``: the forward
  of :mod:`.layer_step`. ``y`` is ``x @ weight.T + bias`` in ``x``'s dtype; ``x_values`` and ``x_scale`` are
  X's quantized values (stored transposed, ``[k, T]``: wgrad's layout) and tensor scale where the forward
  keeps them for wgrad instead of X (per-tensor FP8 on the Triton kernels' devices: one byte per element),
  else empty placeholders; ``w_amax`` is W's amax where the forward keeps it for dgrad, else a placeholder.
* ``snip_ds::quantized_linear_backward(grad_y, x, x_scale, weight, w_amax, spec, layer, x_quantized,
  w_amax_kept, need_x, need_w, need_b) -> (grad_x, grad_w, grad_b)``: the backward of :mod:`.layer_step`; a
  gradient that is not needed comes back as an empty placeholder. It is the first op's registered autograd formula
  (``register_autograd``).

``spec`` (:func:`op_spec`) names the layer's precisions and :class:`~snip_ds.quant_config.QuantConfig`, and
what the forward keeps for backward (:func:`kept_operands`), so it is a constant of the compiled graph: a layer
whose precision changes (a new plan) makes torch.compile recompile the graphs it is in. ``layer`` is the layer's handle (:func:`register_layer`), through which the ops
find what cannot be an operator argument: the layer's stochastic-rounding ``generator`` and, for a
tensor-parallel shard, its ``amax_reduce``. Each layer has its own generator, and a layer's backward draws
from it in one op, in the eager order (dgrad, then wgrad), so compiled training draws exactly what eager
training draws and a restored generator state resumes it.

The ops run the very functions the eager :class:`~snip_ds.linear.QuantizedLinearFn` runs: compiled and eager
results are equal bit for bit, whatever the backend (the compiled graph adds only reshapes around them).
"""
from __future__ import annotations

import itertools
import threading
import weakref
from functools import lru_cache
from typing import Any, Dict, Optional, Tuple

import torch

from snip_ds.backend import fp8_step, layer_step
from snip_ds.backend.base import WithAmax
from snip_ds.backend.operands import shared_amax
from snip_ds.quant import QuantParts
from snip_ds.quant_config import QuantConfig
from snip_ds.types import GemmPrecision

_LAYERS: Dict[int, "weakref.ref[Any]"] = {}
_HANDLES = itertools.count(1)
_LOCK = threading.Lock()


def register_layer(layer: Any) -> int:
    """A new handle for ``layer`` (an object with ``generator`` and ``amax_reduce`` attributes, read when an op
    runs); the registry holds it weakly and forgets it when the layer is collected."""
    with _LOCK:
        handle = next(_HANDLES)
        _LAYERS[handle] = weakref.ref(layer, lambda _, h=handle: _LAYERS.pop(h, None))
    return handle


def _layer(handle: int) -> Any:
    ref = _LAYERS.get(handle)
    layer = ref() if ref is not None else None
    if layer is None:
        raise RuntimeError(f"snip_ds::quantized_linear: layer handle {handle} names no live SnipLinear (a graph "
                           f"compiled for a layer that was deleted, or a handle from another process)")
    return layer


def op_spec(prec: GemmPrecision, cfg: QuantConfig, kept: str = "") -> str:
    """The ops' ``spec`` argument: the three GEMMs' precisions and every field of ``cfg``, as one string
    (plain string operations on frozen dataclasses, which dynamo traces and guards), and ``kept``
    (:func:`kept_operands`) after a second ``;`` where given."""
    flags = "".join("1" if f else "0" for f in (cfg.stochastic_rounding, cfg.hadamard, cfg.weight_2d))
    spec = (prec.fprop + "," + prec.dgrad + "," + prec.wgrad + ";" + cfg.fp8_recipe + "," + cfg.fp4_recipe + ","
            + flags + "," + cfg.backend)
    return spec + ";" + kept if kept else spec


@torch.compiler.assume_constant_result
def kept_operands(spec: str, x: torch.Tensor, w: torch.Tensor) -> str:
    """What the forward of a layer of ``spec`` (:func:`op_spec`: its precisions and config) on ``x`` with matrix
    ``w`` keeps for backward, as the spec's last part: X's quantized values' dtype or ``x`` (X itself), and
    ``amax`` or ``w`` (W with or without its amax). The op's shape function decides the same from the backends'
    state in this process (which kernels run on which devices); written into the graph, it makes a graph traced
    where X's values are kept another graph than one traced where X is: the compile caches, which outlive the
    process and key on the graph, then never give one state's graph to the other. Decided outside the traced
    graph, as :func:`snip_ds.backend.fp8_traced.applies` is: its arguments a string and tensors, which every
    supported torch's dynamo hands such a function (torch 2.11's takes no module or frozen dataclass)."""
    prec, cfg = parse_spec(spec)
    x_2d = x.reshape(-1, x.shape[-1])
    values = layer_step.kept_x_dtype(x_2d, prec, cfg)
    amax = layer_step.keeps_w_amax(x_2d, w, prec, cfg)
    return ("x" if values is None else str(values).replace("torch.", "")) + "," + ("amax" if amax else "w")


@lru_cache(maxsize=None)
def parse_spec(spec: str) -> Tuple[GemmPrecision, QuantConfig]:
    """The (precisions, config) that :func:`op_spec` wrote into ``spec``; ValueError naming ``spec`` if it is
    not one."""
    try:
        gemms, rest, *kept = spec.split(";")
        if len(kept) > 1:
            raise ValueError(f"{len(kept) + 2} parts")
        fp8, fp4, flags, backend = rest.split(",")
        if len(flags) != 3 or set(flags) - {"0", "1"}:
            raise ValueError(f"flags {flags!r}")
        sr, had, w2d = (f == "1" for f in flags)
        return GemmPrecision(*gemms.split(",")), QuantConfig(fp8, fp4, sr, had, w2d, backend)
    except (ValueError, TypeError) as err:
        raise ValueError(f"spec: {spec!r} is not a snip_ds quantized-linear spec ({err})") from None


_EMPTY_PLACEHOLDER = 0  # the numel of the placeholders of values an op does not produce


def _placeholder(like: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    return like.new_empty(_EMPTY_PLACEHOLDER, dtype=dtype)


@torch.library.custom_op("snip_ds::quantized_linear", mutates_args=())
def quantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], spec: str,
                     layer: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    prec, cfg = parse_spec(spec)
    x_2d = x.reshape(-1, x.shape[-1])
    with shared_amax(_layer(layer).amax_reduce), fp8_step.unshared():  # (an op's outputs alias no other call's)
        y_2d, x_keep, w_keep = layer_step.forward(x_2d, weight, bias, prec, cfg, x.dtype)
    y = y_2d.reshape(*x.shape[:-1], weight.shape[0]).contiguous()
    w_amax = _placeholder(x, torch.float32)
    if isinstance(w_keep, WithAmax):
        w_keep, w_amax = w_keep
    if w_keep is not weight or not (x_keep is x_2d or isinstance(x_keep, QuantParts)):
        raise RuntimeError(f"snip_ds::quantized_linear: the backend of spec {spec!r} keeps operands other than "
                           f"X's quantized values and W's amax for backward, which this op cannot return")
    if isinstance(x_keep, QuantParts):
        return y, x_keep.values.t().contiguous(), x_keep.tensor_scale, w_amax  # (stored [k, T]: no copy)
    return y, _placeholder(x), _placeholder(x, torch.float32), w_amax


@quantized_linear.register_fake
def _quantized_linear_fake(x, weight, bias, spec, layer):
    prec, cfg = parse_spec(spec)
    y = x.new_empty(*x.shape[:-1], weight.shape[0])
    x_2d = x.reshape(-1, x.shape[-1])
    kept = layer_step.kept_x_dtype(x_2d, prec, cfg)
    w_amax = (x.new_empty((), dtype=torch.float32) if layer_step.keeps_w_amax(x_2d, weight, prec, cfg)
              else _placeholder(x, torch.float32))
    if kept is None:
        return y, _placeholder(x), _placeholder(x, torch.float32), w_amax
    return y, x.new_empty(x_2d.shape[::-1], dtype=kept), x.new_empty((), dtype=torch.float32), w_amax


@torch.library.custom_op("snip_ds::quantized_linear_backward", mutates_args=())
def quantized_linear_backward(grad_y: torch.Tensor, x: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                              w_amax: torch.Tensor, spec: str, layer: int, x_quantized: bool, w_amax_kept: bool,
                              need_x: bool, need_w: bool, need_b: bool
                              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    prec, cfg = parse_spec(spec)
    owner = _layer(layer)
    g_2d = grad_y.reshape(-1, grad_y.shape[-1])
    x_keep = QuantParts(x.t(), x_scale) if x_quantized else x.reshape(-1, x.shape[-1])
    w_keep = WithAmax(weight, w_amax) if w_amax_kept else weight
    x_dtype = grad_y.dtype if x_quantized else x.dtype
    with shared_amax(owner.amax_reduce):
        g_x, g_w, g_b = layer_step.backward(g_2d, x_keep, w_keep, prec, cfg, owner.generator,
                                            (need_x, need_w, need_b), x_dtype, weight.dtype)
    g_x = _placeholder(grad_y) if g_x is None else g_x.reshape(*grad_y.shape[:-1], weight.shape[1]).contiguous()
    g_w = _placeholder(weight) if g_w is None else g_w.contiguous()
    g_b = _placeholder(grad_y) if g_b is None else g_b
    return g_x, g_w, g_b


@quantized_linear_backward.register_fake
def _quantized_linear_backward_fake(grad_y, x, x_scale, weight, w_amax, spec, layer, x_quantized, w_amax_kept,
                                    need_x, need_w, need_b):
    x_dtype = grad_y.dtype if x_quantized else x.dtype
    g_x = grad_y.new_empty(*grad_y.shape[:-1], weight.shape[1], dtype=x_dtype) if need_x else _placeholder(grad_y)
    g_w = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_w else _placeholder(weight)
    g_b = grad_y.new_empty(grad_y.shape[-1]) if need_b else _placeholder(grad_y)
    return g_x, g_w, g_b


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, spec, layer = inputs
    _, x_values, x_scale, w_amax = output
    ctx.x_quantized = x_values.dim() == 2  # a placeholder is 1-D
    ctx.w_amax_kept = w_amax.dim() == 0
    ctx.save_for_backward(x_values if ctx.x_quantized else x, x_scale, weight, w_amax)
    ctx.spec, ctx.layer, ctx.has_bias = spec, layer, bias is not None


def _backward(ctx, grad_y, _grad_values, _grad_scale, _grad_amax):
    x, x_scale, weight, w_amax = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_b = ctx.has_bias and ctx.needs_input_grad[2]
    g_x, g_w, g_b = quantized_linear_backward(grad_y, x, x_scale, weight, w_amax, ctx.spec, ctx.layer,
                                              ctx.x_quantized, ctx.w_amax_kept, need_x, need_w, need_b)
    return g_x if need_x else None, g_w if need_w else None, g_b if need_b else None, None, None


quantized_linear.register_autograd(_backward, setup_context=_setup_context)
