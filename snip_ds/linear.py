"""The quantized linear layer: an ``nn.Linear`` whose three GEMMs run at a per-layer, per-GEMM precision.

:class:`SnipLinear` is built from an existing linear GEMM by :meth:`SnipLinear.from_linear`: an ``nn.Linear``, or a
module whose weight is stored transposed (``[in, out]``, ``y = x·W + b``: GPT-2's ``Conv1D``), which keeps its
Parameter as it is stored (its checkpoints and ``state_dict`` unchanged) and multiplies by its transpose
(:attr:`SnipLinear.matrix`, the ``[out, in]`` view every GEMM and statistic reads). The swap reuses
the original Parameter objects (ZeRO-3 partitions parameters in place and keeps its bookkeeping on them, so
the swap must not copy them). At ``bf16`` the layer runs ``F.linear`` itself and is bit-identical to
``nn.Linear``, forward and backward. Otherwise one ``autograd.Function`` runs each GEMM through the backend
:mod:`snip_ds.backend` picks for its precision (``QuantConfig.backend``), which quantizes the operands and
decides what is kept for backward (by default what ``nn.Linear`` keeps: input and weight in high
precision, re-quantized along the right axis in backward); where the backend decided one step for the
layer's shape (:func:`snip_ds.backend.layer_step.decided_step`), a leaner function runs that step alone
(:class:`DecidedStepFn`, the same numbers). Under ``torch.compile`` the layer calls the same step through
the custom ops of :mod:`snip_ds.backend.custom_ops` instead, which dynamo traces without a graph break; each
layer has a handle (``op_handle``) through which those ops find its generator.
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from snip_ds.backend import custom_ops, fp8_traced, layer_step
from snip_ds.backend.base import Kept, WithAmax
from snip_ds.backend.operands import AmaxReduce, amax_shared, shared_amax
from snip_ds.quant import QuantParts
from snip_ds.quant_config import QuantConfig
from snip_ds.types import GemmPrecision, LayerPrecision, full_shape


class QuantizedLinearFn(torch.autograd.Function):
    """``Y = X W^T + b`` with fprop, dgrad and wgrad each at its own precision (FP32 accumulation): the eager
    autograd function around :mod:`snip_ds.backend.layer_step` (under ``torch.compile`` :class:`SnipLinear`
    runs the same functions through the custom ops of :mod:`snip_ds.backend.custom_ops`). Returns ``Y`` as
    ``[T, n]`` (``T`` the product of X's leading dims): a tensor of its own, which the model may modify in
    place once the caller has given it X's leading dims back (``reshape``)."""

    @staticmethod
    def forward(ctx, x_hp: torch.Tensor, w_hp: torch.Tensor, bias: Optional[torch.Tensor],
                prec: GemmPrecision, cfg: QuantConfig, generator: Optional[torch.Generator],
                amax_reduce: Optional[AmaxReduce] = None) -> torch.Tensor:
        ctx.amax_reduce = amax_reduce  # a tensor-parallel shard's: operands scaled by the whole tensor's amax
        x_2d = x_hp if x_hp.dim() == 2 else x_hp.reshape(-1, x_hp.shape[-1])  # (a reshape: a view, microseconds)
        with _amax_context(amax_reduce):
            y_2d, x_keep, w_keep = layer_step.forward(x_2d, w_hp, bias, prec, cfg, x_hp.dtype)
        tensors, ctx.kept_as = _flatten((x_keep, w_keep))
        ctx.save_for_backward(*tensors)
        ctx.has_bias = bias is not None
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x_hp.shape, x_hp.dtype, w_hp.dtype
        ctx.prec, ctx.cfg, ctx.generator = prec, cfg, generator
        return y_2d  # [T, n]: the caller restores x's leading dims (a view made here would forbid in-place ops)

    @staticmethod
    def backward(ctx, g_y: torch.Tensor):
        x_keep, w_keep = _unflatten(ctx.saved_tensors, ctx.kept_as)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2])
        flat = len(ctx.x_shape) == 2  # a 2-D X: nothing to reshape
        with _amax_context(ctx.amax_reduce):
            g_x, g_w, g_b = layer_step.backward(g_y if flat else g_y.reshape(-1, g_y.shape[-1]), x_keep, w_keep,
                                                ctx.prec, ctx.cfg, ctx.generator, needs, ctx.x_dtype, ctx.w_dtype)
        return (g_x if g_x is None or flat else g_x.reshape(ctx.x_shape)), g_w, g_b, None, None, None, None


class DecidedStepFn(torch.autograd.Function):
    """:class:`QuantizedLinearFn` for a layer whose three GEMMs run one step decided for its shape
    (:func:`snip_ds.backend.layer_step.decided_step`: the torch backend's per-tensor FP8 or block-scaled step),
    with nothing left to decide per call: the step is found once per forward and its backward is the same
    object's. The same functions, so the same numbers bit for bit; what it leaves out is Python (the backends'
    lookups in forward and again in backward, what is kept packed and unpacked), the host work a GPU step pays
    per layer. Returns ``Y`` as ``[T, n]``, as :class:`QuantizedLinearFn` does."""

    @staticmethod
    def forward(ctx, x_hp: torch.Tensor, w_hp: torch.Tensor, bias: Optional[torch.Tensor], step,
                generator: Optional[torch.Generator]) -> torch.Tensor:
        x_2d = x_hp if x_hp.dim() == 2 else x_hp.reshape(-1, x_hp.shape[-1])
        y_2d, x_keep, w_keep = step.forward(x_2d, w_hp, bias, x_hp.dtype)
        ctx.save_for_backward(x_keep.values, x_keep.tensor_scale, w_keep.tensor, w_keep.amax)
        ctx.step, ctx.generator = step, generator
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x_hp.shape, x_hp.dtype, w_hp.dtype
        return y_2d

    @staticmethod
    def backward(ctx, g_y: torch.Tensor):
        need_x, need_w, need_b = ctx.needs_input_grad[:3]  # (need_b: a bias was given and needs its gradient)
        g_x = g_w = None
        if need_x or need_w:
            x_values, x_scale, w, w_amax = ctx.saved_tensors
            g_x, g_w = ctx.step.backward(g_y, QuantParts(x_values, x_scale), WithAmax(w, w_amax), (need_x, need_w),
                                         ctx.generator, ctx.x_dtype, ctx.w_dtype)
            if g_x is not None and len(ctx.x_shape) != 2:
                g_x = g_x.reshape(ctx.x_shape)
        return g_x, g_w, g_y.sum(0) if need_b else None, None, None


def quantized_linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], prec: GemmPrecision,
                     cfg: QuantConfig, generator: Optional[torch.Generator],
                     amax_reduce: Optional[AmaxReduce] = None,
                     memo: Optional[layer_step.StepMemo] = None) -> torch.Tensor:
    """``x Wᵀ + bias`` at ``prec`` in eager mode, ``[T, n]``: :class:`DecidedStepFn` where the layer's shape has
    a decided step and no amax reduction is in force, else :class:`QuantizedLinearFn` (the same numbers).
    ``memo``: the calling layer's :class:`~snip_ds.backend.layer_step.StepMemo` (its step found once per
    precision, config, shape, dtype and device, not asked of the backends per call)."""
    if amax_reduce is None and not amax_shared():
        step = layer_step.decided_step(x, w, prec, cfg, memo)
        if step is not None:
            return DecidedStepFn.apply(x, w, bias, step, generator)
    return QuantizedLinearFn.apply(x, w, bias, prec, cfg, generator, amax_reduce)


def _amax_context(amax_reduce: Optional[AmaxReduce]):
    """:func:`shared_amax` for a shard's reduction; for a whole layer outside any reduction, nothing to set
    (two context-variable writes less per call)."""
    return shared_amax(amax_reduce) if amax_reduce is not None or amax_shared() else contextlib.nullcontext()


def _flatten(kept: Tuple[Kept, ...]) -> Tuple[List[torch.Tensor], Tuple[type, ...]]:
    """The tensors of kept operands (a :class:`QuantParts` or :class:`WithAmax` gives its two), for
    ``save_for_backward``, and the type each was kept as."""
    tensors: List[torch.Tensor] = []
    for k in kept:
        tensors += list(k) if isinstance(k, WithAmax) else [k.values, k.tensor_scale] if isinstance(
            k, QuantParts) else [k]
    return tensors, tuple(type(k) if isinstance(k, (QuantParts, WithAmax)) else torch.Tensor for k in kept)


def _unflatten(tensors: Sequence[torch.Tensor], kinds: Tuple[type, ...]) -> Tuple[Kept, ...]:
    out, i = [], 0
    for kind in kinds:
        if kind is torch.Tensor:
            out.append(tensors[i])
            i += 1
        else:
            out.append(kind(tensors[i], tensors[i + 1]))
            i += 2
    return tuple(out)


class InputGradOnlyLinearFn(torch.autograd.Function):
    """``Y = X W^T + b`` (torch's own linear kernel) whose backward returns the input's gradient only.

    For statistics passes, which back-propagate to the input alone. Plain ``F.linear`` already skips the
    weight gradient there, but under ZeRO-3 DeepSpeed replaces ``F.linear`` with an autograd function that
    always computes it: one wasted GEMM per layer and backward.

    When the layer has an ``input_grad_observer`` at backward time, it is called with the output's gradient
    ``G_Y`` and the layer's own input gradient ``G_Y W`` in FP32 (a low-precision ``G_Y`` is multiplied in FP32
    and the product rounded once to its dtype to propagate; an FP32 one exactly as without an observer).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
                layer: "SnipLinear") -> torch.Tensor:
        ctx.save_for_backward(w)
        ctx.layer = layer
        return torch._C._nn.linear(x, w, bias)

    @staticmethod
    def backward(ctx, g_y: torch.Tensor):
        (w,) = ctx.saved_tensors
        observer = ctx.layer.input_grad_observer
        if not ctx.needs_input_grad[0]:
            g_x = None
        elif observer is None or g_y.dtype == torch.float32:
            g_x = g_y @ w.to(g_y.dtype)
        else:
            g_x = g_y.float() @ w.float()
        if observer is not None:
            observer(g_y, g_x)
        if g_x is not None:
            g_x = g_x.to(g_y.dtype)
        return g_x, None, None, None


class SnipLinear(nn.Linear):
    """A drop-in ``nn.Linear`` whose precision (``bf16``, ``fp8``, ``fp4``) can change between steps.

    Attributes:
        precision: the layer's precision; reading it gives a name when all three GEMMs agree, else a
            ``{gemm: precision}`` dict. Assign either form.
        quant_config: the :class:`~snip_ds.quant_config.QuantConfig` used for quantized GEMMs.
        generator: the ``torch.Generator`` driving stochastic rounding of FP4 gradients (and the random
            Hadamard signs), or None for torch's default generator.
        fqn: the layer's fully qualified name in its model, when it was swapped in by :func:`swap_linears`.
        input_grad_only: at ``bf16``, back-propagate to the input only (no weight or bias gradient); set
            by :func:`snip_ds.stats.collect_statistics` for its passes, False otherwise.
        input_grad_observer: with ``input_grad_only``, None or a callable ``(G_Y, G_X)`` that each backward
            through the layer calls with the output's gradient and the layer's own input gradient ``G_Y W``
            (FP32; None where the input needs no gradient); set by the statistics collection.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 precision: LayerPrecision = "fp8", quant_config: Optional[QuantConfig] = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_snip(precision, quant_config)

    transposed = False  # the weight Parameter is stored [in, out] (Conv1D) and multiplied as its transpose

    @property
    def gemm_form(self) -> str:
        """``"linear"`` (``y = x·Wᵀ + b``) or ``"transposed"`` (``y = x·W + b``, W stored ``[in, out]``), as
        :func:`snip_ds.layouts.linears.linear_form` names them."""
        return "transposed" if self.transposed else "linear"

    @property
    def matrix(self) -> torch.Tensor:
        """The GEMM's ``[out, in]`` matrix: the weight, or a view of its transpose where it is stored ``[in, out]``."""
        return self.weight.t() if self.transposed else self.weight

    @property
    def parameter(self) -> nn.Parameter:
        """The Parameter the GEMM's matrix is (a view of): what the optimizer holds state for."""
        return self.weight

    def slice(self, t: torch.Tensor) -> torch.Tensor:
        """The ``[out, in]`` view of a tensor shaped like :attr:`parameter` (an optimizer state)."""
        return t.t() if self.transposed else t

    def to_storage(self, t: torch.Tensor) -> torch.Tensor:
        """An ``[out, in]`` tensor in :attr:`parameter`'s storage order (the inverse of :meth:`slice`)."""
        return t.t() if self.transposed else t

    def _init_snip(self, precision: LayerPrecision, quant_config: Optional[QuantConfig]) -> None:
        self.precision = precision
        self.quant_config = quant_config or QuantConfig()
        self.generator: Optional[torch.Generator] = None
        self.fqn: str = ""
        self.input_grad_only = False
        self.input_grad_observer: Optional[Callable[[torch.Tensor, Optional[torch.Tensor]], None]] = None
        self.register_op_handle()

    def register_op_handle(self) -> None:
        """Gives this layer its own handle for the custom ops that ``torch.compile`` traces
        (:func:`snip_ds.backend.custom_ops.register_layer`) and its own empty memo of its eager step
        (:class:`~snip_ds.backend.layer_step.StepMemo`): set when the layer is built, copied or unpickled,
        and by whatever turns another module into a SnipLinear by assigning its class."""
        self.op_handle = custom_ops.register_layer(self)
        self.step_memo = layer_step.StepMemo()

    def __setstate__(self, state) -> None:  # copy.deepcopy and pickle: a new layer, a handle of its own
        super().__setstate__(state)
        self.register_op_handle()

    @classmethod
    def from_linear(cls, linear: nn.Module, precision: LayerPrecision = "fp8",
                    quant_config: Optional[QuantConfig] = None, *, transposed: bool = False) -> "SnipLinear":
        """Wraps ``linear`` without copying: the new layer holds the very same weight and bias Parameters.

        Args:
            linear: an ``nn.Linear``, or (``transposed``) a module computing ``y = x·W + b`` with ``weight``
                ``[in, out]`` (:func:`snip_ds.layouts.linears.linear_form` proves which).
        """
        weight = getattr(linear, "weight", None)
        if not isinstance(weight, torch.Tensor) or len(full_shape(weight)) != 2:
            raise TypeError(f"from_linear expects a module with a 2-D weight, got {type(linear).__name__}")
        if not transposed and not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear expects an nn.Linear (or transposed=True), got {type(linear).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        rows, cols = full_shape(weight)
        new.in_features, new.out_features = (rows, cols) if transposed else (cols, rows)
        if transposed:
            new.transposed = True
        new.weight = weight
        new.bias = getattr(linear, "bias", None)
        new.train(linear.training)
        new._init_snip(precision, quant_config)
        return new

    @property
    def precision(self) -> LayerPrecision:
        return self._gemm_precision.to_json()

    @precision.setter
    def precision(self, value: LayerPrecision) -> None:
        self._gemm_precision = GemmPrecision.of(value)

    @property
    def gemm_precision(self) -> GemmPrecision:
        """The precision of each GEMM as a triple."""
        return self._gemm_precision

    # Tensor parallelism (snip_ds.engine.tensor_parallel): which shard of the whole layer this one holds
    # ("column": rows of W; "row": columns of W), or None for a whole layer.
    tp_shard: Optional[str] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.local_linear(x, self.bias)

    def local_linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """``x Wᵀ + bias`` with this layer's own weight (a tensor-parallel shard's: its part of the product) at
        the layer's precision."""
        prec = self._gemm_precision
        w = self.matrix
        if prec.uniform == "bf16":
            if self.input_grad_only:
                return InputGradOnlyLinearFn.apply(x, w, bias, self)
            return F.linear(x, w, bias)
        if torch.compiler.is_compiling():  # dynamo traces the custom op; the same functions run either way
            # per-tensor FP8 on torch._scaled_mm: ordinary ops inductor fuses (the tokens' count checked in the
            # graph too, so that dynamic shapes guard on what _scaled_mm needs)
            spec = custom_ops.op_spec(prec, self.quant_config)
            if x.numel() // x.shape[-1] % 16 == 0 and fp8_traced.applies(spec, self.amax_reduce is not None, x, w):
                return fp8_traced.Fp8Linear.apply(x, w, bias)
            kept = custom_ops.kept_operands(spec, x, w)
            return custom_ops.quantized_linear(x, w, bias, custom_ops.op_spec(prec, self.quant_config, kept),
                                               self.op_handle)[0]
        y = quantized_linear(x, w, bias, prec, self.quant_config, self.generator, self.amax_reduce, self.step_memo)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])

    @property
    def amax_reduce(self) -> Optional[AmaxReduce]:
        """For a tensor-parallel shard, the reduction that turns an operand's amax into the whole tensor's
        (:func:`snip_ds.backend.operands.shared_amax`); None for a whole layer."""
        return None

    def tp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks that hold this layer's shards (a whole layer: ``t`` itself)."""
        return t

    def extra_repr(self) -> str:
        stored = ", stored [in, out]" if self.transposed else ""
        return f"{super().extra_repr()}{stored}, precision={self.precision!r}"
