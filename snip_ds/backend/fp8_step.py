"""A per-tensor FP8 (``fp8_hybrid``) layer's forward and backward where the Triton kernels quantize, decided once.

Per-tensor FP8 quantizes an operand to the same codes with the same scale whatever the GEMM's contraction
axis, so a layer whose three GEMMs are all FP8 needs each operand quantized once, laid out for every GEMM that
reads it: the torch backend's step here is seven launches (without a bias), against the seventeen of
quantizing each GEMM's operands on their own.

* forward: X's and W's amax passes in one launch; then X's E4M3 codes in both layouts (row-major for fprop,
  transposed for wgrad) and W's (row-major: fprop's column-major ``Wᵀ``) in one launch
  (:mod:`snip_ds.backend.kernels.grouped`) -- or X's codes are those of the previous layer where it read the
  very same X, unchanged (the query, key and value projections of one input, gate and up: one amax and one
  cast of X for all of them, and one copy of its codes kept; W's amax pass and quantization are then launches
  of their own); the FP8 GEMM.
  Kept for backward: X's transposed codes and scale (one byte per element, where ``nn.Linear`` keeps X
  itself) and W's amax (four bytes).
* backward: G_Y's amax pass; W's codes again, transposed for dgrad, from the kept amax (no amax pass), and
  G_Y's E5M2 codes in both layouts (row-major for dgrad, transposed for wgrad: no transposed copy) in one
  launch; the two FP8 GEMMs.

Everything that depends only on the layer's shapes, dtypes, device and settings -- the kernels' launch
configurations, the operand dtypes, whether ``torch._scaled_mm`` runs every GEMM -- is worked out once per
such combination (:func:`plan`, cached) when a shape is first seen, so a call decides nothing: a re-plan that
comes back to FP8, a resumed run, a tensor-parallel shard and an expert's pair of linears all reach the same
plan through the same key. Under tensor parallelism (:func:`snip_ds.backend.operands.shared_amax`) the amaxes
are the whole tensor's, taken before each quantization as the other paths take them.

The results are the torch backend's per-GEMM path bit for bit: the same codes, scales and GEMM calls
(``tests/test_torch_backend_kernels.py``).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from snip_ds.backend.base import WithAmax
from snip_ds.backend.operands import whole_amax
from snip_ds.quant import QuantParts

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class Fp8Step(NamedTuple):
    """The decided step of one per-tensor FP8 layer shape (see the module docstring)."""

    kq: Any  # snip_ds.backend.kernels.quantize
    x_cfg: Any  # X: E4M3 codes, both layouts
    w_cfg: Any  # W for fprop: E4M3 codes (or BF16 values where the GEMMs are not FP8), row-major
    scaled: bool  # torch._scaled_mm runs all three GEMMs; else BF16 GEMMs of the same values
    amax_given: bool  # a shared_amax reduction gives the amaxes (tensor parallelism)
    w_dtype: torch.dtype  # W's values for the GEMMs: its E4M3 codes, or BF16
    mm: Any  # the backend's GEMM of grid values, where ``scaled`` is False: ``mm(gemm, a, b, sa, sb, fp8, ...)``
    w_t_cfg: Any  # W again for dgrad, transposed, from the forward's amax
    g_cfgs: Dict[Tuple[bool, bool, bool], Any]  # G_Y's, by (G_Y in BF16, dgrad runs, wgrad runs)
    amax_pair: Any  # X's and W's amax passes in one launch (None where a shared_amax reduction gives them)
    kg: Any  # snip_ds.backend.kernels.grouped
    xw_pair: Any  # X's and W's quantizations in one launch (forward, X not shared)
    wg_pairs: Dict[Tuple[bool, bool], Any]  # W for dgrad and G_Y in one launch, by (G_Y in BF16, wgrad runs)

    def forward(self, x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
                out_dtype: torch.dtype) -> Tuple[torch.Tensor, QuantParts, WithAmax]:
        """``Y`` and what backward keeps: X's codes (a column-major view of their transposed storage) and
        scale, and W with its amax."""
        x, w = _kernel_input(x), _kernel_input(w)
        x_codes, remember = self._shared_x(x)
        if x_codes is None:  # X quantized here, with W in one launch
            x_codes, (w_values, _, w_scale, w_amax) = self._quantize_x_and_w(x, w, remember)
        else:
            w_values, _, w_scale, w_amax = self.kq.launch(self.w_cfg, w, self._amax(w), None)
        x_values, x_t, x_scale = x_codes
        y = self._gemm("fprop", x_values, w_values.t(), x_scale, w_scale, (E4M3, E4M3), bias, out_dtype)
        return y, QuantParts(x_t.t(), x_scale), WithAmax(w, w_amax)

    def backward(self, g: torch.Tensor, x_keep: QuantParts, w_keep: WithAmax, needs: Tuple[bool, bool],
                 generator: Optional[torch.Generator], x_dtype: torch.dtype, w_dtype: torch.dtype
                 ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(G_X, G_W)`` (each None where ``needs`` says it is not wanted) from what :meth:`forward` kept;
        ``generator`` is not drawn from (nothing rounds stochastically): the block step's signature."""
        _LAST_X[0] = None  # (the forward's last X codes: not read again)
        g = _kernel_input(g)
        need_x, need_w = needs
        g_bf16 = g.dtype == torch.bfloat16
        if need_x:  # W for dgrad (from the forward's amax) and G_Y in one launch, after G_Y's amax pass
            (w_t, _, w_scale, _), (g_values, g_t, g_scale, _) = self.kg.launch_pair(
                self.wg_pairs[g_bf16, need_w], _kernel_input(w_keep.tensor), w_keep.amax, g, self._amax(g))
        else:  # the one layout written is the transposed one
            g_t, _, g_scale, _ = self.kq.launch(self.g_cfgs[g_bf16, False, True], g, self._amax(g), None)
        g_x = g_w = None
        if need_x:
            g_x = self._gemm("dgrad", g_values, w_t.t(), g_scale, w_scale, (E5M2, E4M3), None, x_dtype)
            g_values = w_t = None  # (dgrad's operands: not alive beside wgrad's result, at the step's peak)
        if need_w:
            g_w = self._gemm("wgrad", g_t, x_keep.values, g_scale, x_keep.tensor_scale, (E5M2, E4M3), None,
                             w_dtype)
        return g_x, g_w

    def _shared_x(self, x: torch.Tensor) -> Tuple[Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                                                  Optional[tuple]]:
        """X's codes in both layouts and its scale from the previous FP8 layer when it read the very same X (the
        query, key and value projections of one input; gate and up), else None -- and, where X is to be
        quantized here for later layers to share, what :meth:`_quantize_x` records it under."""
        if not _SHARE_X.get():
            return None, None
        source = x if x._base is None else x._base  # (a reshaped view is a new object at every call)
        key = (x.data_ptr(), x.shape, x.stride(), x.dtype, self.x_cfg, self.amax_given)
        last = _LAST_X[0]
        if last is not None and last[0]() is source and last[1] == key and last[2] == source._version:
            return last[3], None
        return None, (source, key)

    def _quantize_x_and_w(self, x: torch.Tensor, w: torch.Tensor, remember: Optional[tuple]):
        """X's codes in both layouts and its scale, and W's quantization for fprop (:meth:`Fp8Step.forward`'s
        ``(values, _, scale, amax)``), in one launch after their amax passes in one (or with the amaxes
        given); X's recorded for the next layer under ``remember`` (:meth:`_shared_x`) where given."""
        x_amax = w_amax = x_partials = w_partials = None
        if self.amax_given:  # (under tensor parallelism W's reduction first, as before X's)
            w_amax, x_amax = self._amax(w), self._amax(x)
        else:  # both amax passes in one launch
            x_partials, w_partials = self.kg.grouped_amax_partials(self.amax_pair, x, w)
        (values, values_t, scale, _), w_parts = self.kg.launch_pair(self.xw_pair, x, x_amax, w, w_amax,
                                                                     a_partials=x_partials, b_partials=w_partials)
        codes = (values, values_t, scale)
        if remember is not None:
            source, key = remember
            _LAST_X[0] = (weakref.ref(source), key, source._version, codes)
        return codes, w_parts

    def _amax(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        return whole_amax(t, "fp8_e4m3") if self.amax_given else None

    def _gemm(self, gemm, a, b, scale_a, scale_b, fp8, bias, out_dtype):
        if self.scaled:
            return scaled_mm(a, b, scale_a, scale_b, bias, out_dtype)
        return self.mm(gemm, a, b, scale_a, scale_b, None, bias, out_dtype)


# The last X quantized by a forward: (a weak reference to X's storage owner, its layout and the step's launch
# configuration, its version counter, the codes). A layer reading the same X, unchanged (same object, version,
# layout), takes them: X's object alive means its memory was not reused, and an in-place write bumps the version.
_LAST_X: List[Optional[tuple]] = [None]
_SHARE_X: ContextVar[bool] = ContextVar("snip_ds_share_x", default=True)


@contextmanager
def unshared():
    """Within this context every layer quantizes its own X (for callers whose results must not alias another
    call's, such as a custom operator's outputs)."""
    token = _SHARE_X.set(False)
    try:
        yield
    finally:
        _SHARE_X.reset(token)


def sharing_x() -> bool:
    """Whether layers reading the same X may share its quantization here (false inside :func:`unshared`)."""
    return _SHARE_X.get()


def scaled_mm(a8: torch.Tensor, b8: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """``(a8 @ b8) * scale_a * scale_b (+ bias)`` in ``out_dtype`` by ``torch._scaled_mm`` (``a8`` row-major,
    ``b8`` column-major: cuBLASLt's layout); a bias in the result's BF16/FP16 is added by the GEMM, any other
    to its FP32 result."""
    fused_bias = bias is not None and bias.dtype == out_dtype and out_dtype in (torch.bfloat16, torch.float16)
    y = torch._scaled_mm(a8, b8, scale_a=scale_a, scale_b=scale_b,
                         out_dtype=out_dtype if fused_bias or bias is None else torch.float32,
                         bias=bias if fused_bias else None)
    if bias is None or fused_bias:
        return y
    return (y + bias.float()).to(out_dtype)


def plan(rows: int, k: int, n: int, x_dtype: torch.dtype, w_dtype: torch.dtype, scaled: bool, mm,
         amax_given: bool) -> Fp8Step:
    """The step of a layer with X ``[rows, k]`` and W ``[n, k]`` (``scaled``: ``torch._scaled_mm`` runs all
    three GEMMs; ``mm``: the backend's GEMM of grid values otherwise; ``amax_given``: a
    :func:`~snip_ds.backend.operands.shared_amax` reduction is in force). The caller caches it."""
    from snip_ds.backend.kernels import grouped as kg, quantize as kq

    x_dtype, w_dtype = _kernel_dtype(x_dtype), _kernel_dtype(w_dtype)

    x_cfg = kq.launch_config(rows, k, "fp8_e4m3", 1, E4M3, False, x_dtype == torch.bfloat16, both=True,
                             amax_given=amax_given)
    values = E4M3 if scaled else torch.bfloat16
    w_bf16 = w_dtype == torch.bfloat16
    w_cfg = kq.launch_config(n, k, "fp8_e4m3", 1, values, False, w_bf16, amax_given=amax_given, write_amax=True)
    # W for dgrad, transposed ([k, n]: dgrad's column-major W); G_Y's E5M2 codes row-major for dgrad and
    # transposed for wgrad, in one pass where both run (G_Y in FP32 or BF16, whichever its dtype turns out)
    w_t_cfg = kq.launch_config(n, k, "fp8_e4m3", 0, values, True, w_bf16, amax_given=True)
    g_cfgs = {(g_bf16, need_x, need_w): kq.launch_config(rows, n, "fp8_e5m2", 1, E5M2, not need_x, g_bf16,
                                                         both=need_x and need_w, amax_given=amax_given)
              for g_bf16 in (False, True) for need_x, need_w in ((True, True), (True, False), (False, True))}
    pair = None if amax_given else kg.grouped_amax_config(x_cfg, w_cfg)
    wg_pairs = {(g_bf16, need_w): kg.quantize_pair_config(w_t_cfg, g_cfgs[g_bf16, True, need_w])
                for g_bf16 in (False, True) for need_w in (False, True)}
    return Fp8Step(kq, x_cfg, w_cfg, scaled, amax_given, values, mm, w_t_cfg, g_cfgs, pair, kg,
                   kg.quantize_pair_config(x_cfg, w_cfg), wg_pairs)


def _kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32


def _kernel_input(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernels read it: FP32 and BF16 as they are, FP16 widened to FP32 (exactly)."""
    return t if t.dtype in (torch.float32, torch.bfloat16) else t.float()

