"""A block-scaled (MXFP8, NVFP4, MXFP4) layer's forward and backward where the Triton kernels quantize.

The torch backend quantizes each GEMM's operands along that GEMM's contraction axis. A layer whose three GEMMs
are the same block recipe (without the Hadamard transform of wgrad's operands, which makes them other tensors)
needs X along k (fprop) and along the tokens (wgrad), G_Y along n (dgrad) and along the tokens (wgrad), W along
k (fprop) and along n (dgrad). Here:

* forward: X's and W's amax passes (NVFP4) in one launch; then, in one launch
  (:mod:`snip_ds.backend.kernels.grouped`), X's values in both layouts, each in blocks along its own axis, and
  W's values for fprop, the amax written out and kept for dgrad (four bytes), and fprop's product of the tensor
  scales (NVFP4) -- or X's values are those of the previous layer where it read the very same X, unchanged (the
  query, key and value projections of one input, gate and up: one quantization and one kept copy for all of
  them, as :mod:`.fp8_step` shares X's codes; W's amax pass and quantization are then launches of their own);
  the GEMM. Kept for backward: X's values in wgrad's layout and its tensor scale (where the per-GEMM path keeps
  X itself: the same bytes for BF16 X) and W with its amax.
* backward: G_Y's amax pass (NVFP4); W's values for dgrad from the kept amax (no amax pass) and G_Y's values in
  both layouts in one launch, each layout of G_Y rounded stochastically from its own seed (drawn from the
  generator in the order dgrad, wgrad, as the per-GEMM path draws them), writing dgrad's and wgrad's products
  of tensor scales; the two GEMMs.

Per operand this is one amax pass (the per-GEMM path takes two; X's and W's share a launch) and, for X and
G_Y, one quantization (two), two of them in each launch, and the GEMMs multiply by products the kernels wrote (no
``scale_a * scale_b`` launch). The values, scales, draws and GEMM calls are the per-GEMM path's, so the
results are bit for bit the same (``tests/test_torch_backend_kernels.py``). Under tensor parallelism
(:func:`snip_ds.backend.operands.shared_amax`) each operand's amax is the whole tensor's, taken once.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from snip_ds.backend import fp8_step
from snip_ds.backend.base import WithAmax, kernel_seed
from snip_ds.backend.operands import gemm_recipe, whole_amax
from snip_ds.quant import QuantParts, get_recipe

VALUES = torch.bfloat16  # the GEMMs' operand values (exact in BF16: torch_native's module docstring)


class BlockStep(NamedTuple):
    """The decided step of one block-scaled layer shape (see the module docstring)."""

    kq: Any  # snip_ds.backend.kernels.quantize
    x: str  # the recipes of X, W and G_Y
    w: str
    g: str
    stochastic_g: bool  # G_Y rounds stochastically
    x_cfg: Any  # X: both layouts (along k for fprop, along the tokens, transposed, for wgrad)
    w_cfg: Any  # W for fprop, its amax written out, and fprop's product of tensor scales
    unit_scales: bool  # MX: tensor scales are 1, nothing is multiplied
    amax_given: bool  # a shared_amax reduction gives the amaxes (tensor parallelism)
    mm: Any  # the backend's GEMM of grid values: ``mm(gemm, a, b, sa, sb, None, bias, out_dtype, unit, scale)``
    device: torch.device  # where the products of tensor scales are written
    amax_pair: Any  # X's and W's amax passes in one launch, where both take one here (NVFP4), else None
    kg: Any  # snip_ds.backend.kernels.grouped
    xw_pair: Any  # X's and W's quantizations in one launch (forward, X not shared)
    wg_pairs: Dict[Tuple[bool, bool], Any]  # W for dgrad and G_Y in one launch, by (G_Y in BF16, wgrad runs)
    g_cfgs: Dict[bool, Any]  # G_Y for wgrad alone (dgrad does not run), by G_Y in BF16

    def forward(self, x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
                out_dtype: torch.dtype) -> Tuple[torch.Tensor, QuantParts, WithAmax]:
        """``Y`` and what backward keeps: X's values for wgrad (a column-major view of their transposed
        storage) and tensor scale, and W with its amax."""
        x, w = _kernel_input(x), _kernel_input(w)
        shared, remember = self._shared_x(x)
        product = self._products(1)
        if shared is None:  # X quantized here, with W in one launch
            (x_values, x_t, x_scale), (w_values, _, w_scale, w_amax) = self._quantize_x_and_w(x, w, product,
                                                                                             remember)
        else:
            x_values, x_t, x_scale = shared
            w_values, _, w_scale, w_amax = self.kq.launch(self.w_cfg, w, self._amax(w, self.w), None,
                                                          **self._partners((x_scale,), product))
        y = self.mm("fprop", x_values, w_values.t(), x_scale, w_scale, None, bias, out_dtype, self.unit_scales,
                    None if product is None else product[0])
        return y, QuantParts(x_t.t(), x_scale), WithAmax(w, w_amax)

    def backward(self, g: torch.Tensor, x_keep: QuantParts, w_keep: WithAmax, needs: Tuple[bool, bool],
                 generator: Optional[torch.Generator], x_dtype: torch.dtype, w_dtype: torch.dtype
                 ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        _LAST_X[0] = None  # (the forward's last X values: not read again)
        g = _kernel_input(g)
        need_x, need_w = needs
        seed_x = seed_w = None
        if self.stochastic_g:  # dgrad's, then wgrad's: the per-GEMM path's order
            seed_x = self.kq.seed_tensor(kernel_seed(generator, g.device), g.device) if need_x else None
            seed_w = self.kq.seed_tensor(kernel_seed(generator, g.device), g.device) if need_w else None
        g_bf16 = g.dtype == torch.bfloat16
        if need_x:  # W for dgrad (from the forward's amax) and G_Y in one launch; its products' first partner W's
            products = self._products(1 + need_w)
            partner2 = x_keep.tensor_scale if need_w and products is not None else None
            (w_t, _, w_scale, _), (first, g_t, g_scale, _) = self.kg.launch_pair(
                self.wg_pairs[g_bf16, need_w], _kernel_input(w_keep.tensor), w_keep.amax, g, self._amax(g, self.g),
                b_seed=seed_x, b_seed2=seed_w, partner2=partner2, products=products)
        else:  # G_Y for wgrad alone, transposed
            products = self._products(1)
            first, g_t, g_scale, _ = self.kq.launch(self.g_cfgs[g_bf16], g, self._amax(g, self.g), seed_w,
                                                    **self._partners((x_keep.tensor_scale,), products))
        g_x = g_w = None
        if need_x:
            g_x = self.mm("dgrad", first, w_t.t(), g_scale, w_scale, None, None, x_dtype, self.unit_scales,
                          None if products is None else products[0])
            del w_t  # (dgrad's operands are not needed for wgrad)
        if need_w:
            g_t, first = (g_t if need_x else first), None
            g_w = self.mm("wgrad", g_t, x_keep.values, g_scale, x_keep.tensor_scale, None, None, w_dtype,
                          self.unit_scales, None if products is None else products[-1])
        return g_x, g_w

    def _shared_x(self, x: torch.Tensor) -> Tuple[Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                                                  Optional[tuple]]:
        """X's values in both layouts and its tensor scale from the previous block-recipe layer when it read the
        very same X with the same recipe (the query, key and value projections of one input; gate and up), else
        None -- and, where X is to be quantized here for later layers to share, what :meth:`_quantize_x_and_w`
        records it under (as :mod:`.fp8_step` shares X's codes; not inside its ``unshared()``)."""
        if not fp8_step.sharing_x():
            return None, None
        source = x if x._base is None else x._base  # (a reshaped view is a new object at every call)
        key = (x.data_ptr(), x.shape, x.stride(), x.dtype, self.x_cfg, self.amax_given)
        last = _LAST_X[0]
        if last is not None and last[0]() is source and last[1] == key and last[2] == source._version:
            return last[3], None
        return None, (source, key)

    def _quantize_x_and_w(self, x: torch.Tensor, w: torch.Tensor, product: Optional[torch.Tensor],
                          remember: Optional[tuple]):
        """X's values in both layouts and its tensor scale, and W's quantization for fprop (``(values, _, scale,
        amax)``, fprop's product of tensor scales written into ``product`` where given), in one launch -- after
        X's and W's amax passes in one where both take one (``amax_pair``), else each its own where it takes
        one. X's recorded for the next layer under ``remember`` (:meth:`_shared_x`) where given."""
        x_amax = self._amax(x, self.x)  # (under tensor parallelism X's reduction first, as before W's)
        w_amax = self._amax(w, self.w)
        x_partials = w_partials = None
        if self.amax_pair is not None:
            x_partials, w_partials = self.kg.grouped_amax_partials(self.amax_pair, x, w)
        (values, values_t, scale, _), w_parts = self.kg.launch_pair(self.xw_pair, x, x_amax, w, w_amax,
                                                                     a_partials=x_partials, b_partials=w_partials,
                                                                     products=product)
        found = (values, values_t, scale)
        if remember is not None:
            source, key = remember
            _LAST_X[0] = (weakref.ref(source), key, source._version, found)
        return found, w_parts

    def _amax(self, t: torch.Tensor, recipe: str) -> Optional[torch.Tensor]:
        """The whole tensor's amax under a shared_amax reduction (as the kernels read it: 0-d FP32 on ``t``'s
        device), else None: the kernels take ``t``'s own."""
        amax = whole_amax(t, recipe) if self.amax_given else None
        return None if amax is None else amax.detach().to(device=t.device, dtype=torch.float32).reshape(())

    def _products(self, count: int) -> Optional[torch.Tensor]:
        """The buffer a kernel writes ``count`` products of tensor scales into (None for MX recipes)."""
        if self.unit_scales or not count:
            return None
        return torch.empty(count, dtype=torch.float32, device=self.device)

    @staticmethod
    def _partners(partners, products) -> dict:
        return {} if products is None else dict(partners=partners, products=products)


# The last X quantized by a forward, as fp8_step keeps its own: (a weak reference to X's storage owner, its
# layout and the step's launch configuration, its version counter, the values and scale).
_LAST_X: List[Optional[tuple]] = [None]


def block_recipes(prec, cfg) -> Optional[Tuple[str, str, str, bool]]:
    """``(x, w, g, stochastic_g)``: the recipes of a layer whose three GEMMs are one block-scaled recipe
    without the Hadamard transform of wgrad's operands, else None."""
    precision = prec.uniform
    if precision not in ("fp8", "fp4") or (precision == "fp8" and cfg.fp8_recipe == "fp8_hybrid"):
        return None
    fprop, dgrad, wgrad = (gemm_recipe(gemm, precision, cfg) for gemm in ("fprop", "dgrad", "wgrad"))
    if wgrad.hadamard or any(get_recipe(op.recipe).block_size == 0 for r in (fprop, dgrad, wgrad)
                             for op in r.operands):
        return None
    return fprop.a.recipe, fprop.b.recipe, dgrad.a.recipe, dgrad.a.stochastic


def plan(rows: int, k: int, n: int, x_dtype: torch.dtype, w_dtype: torch.dtype, recipes, mm,
         amax_given: bool, device: torch.device) -> BlockStep:
    """The step of a layer with X ``[rows, k]`` and W ``[n, k]`` under ``recipes`` (:func:`block_recipes`);
    ``mm``: the backend's GEMM of grid values; ``amax_given``: a
    :func:`~snip_ds.backend.operands.shared_amax` reduction is in force. The caller caches it."""
    from snip_ds.backend.kernels import grouped as kg, quantize as kq

    x, w, g, stochastic_g = recipes
    unit = get_recipe(x).scale == "e8m0" and get_recipe(w).scale == "e8m0"
    x_bf16, w_bf16 = _kernel_dtype(x_dtype) == torch.bfloat16, _kernel_dtype(w_dtype) == torch.bfloat16
    x_cfg = kq.launch_config(rows, k, x, 1, VALUES, False, x_bf16, both=True, amax_given=amax_given)
    w_cfg = kq.launch_config(n, k, w, 1, VALUES, False, w_bf16, amax_given=amax_given, write_amax=True,
                             products=0 if unit else 1)
    pair = kg.grouped_amax_config(x_cfg, w_cfg) if kq.takes_amax_pass(x_cfg) and kq.takes_amax_pass(w_cfg) else None
    # backward's launches, G_Y in FP32 or BF16, whichever its dtype turns out; products of tensor scales for dgrad
    # and, where it runs, wgrad (none for MX recipes)
    wg_pairs = {(g_bf16, need_w): _wg_pair(n, k, w_bf16, w, rows, n, g_bf16, g, need_w, amax_given,
                                           0 if unit else 1 + need_w)
                for g_bf16 in (False, True) for need_w in (False, True)}
    g_cfgs = {g_bf16: _g_config(rows, n, g_bf16, g, False, True, amax_given, 0 if unit else 1)
              for g_bf16 in (False, True)}
    return BlockStep(kq, x, w, g, stochastic_g, x_cfg, w_cfg, unit, amax_given, mm, device, pair, kg,
                     kg.quantize_pair_config(x_cfg, w_cfg), wg_pairs, g_cfgs)


def _kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32


def _kernel_input(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernels read it: FP32 and BF16 as they are, FP16 widened to FP32 (exactly)."""
    return t if t.dtype in (torch.float32, torch.bfloat16) else t.float()


@functools.lru_cache(maxsize=1024)
def _g_config(rows: int, n: int, in_bf16: bool, recipe: str, need_x: bool, need_w: bool, amax_given: bool,
              products: int):
    """G_Y along n for dgrad and along the tokens, transposed, for wgrad: in one launch where both run."""
    from snip_ds.backend.kernels import quantize as kq

    return kq.launch_config(rows, n, recipe, 1 if need_x else 0, VALUES, not need_x, in_bf16,
                            both=need_x and need_w, amax_given=amax_given, products=products)


@functools.lru_cache(maxsize=1024)
def _w_t_config(n: int, k: int, in_bf16: bool, recipe: str):
    """W again for dgrad, along n, transposed (``[k, n]``: dgrad's column-major ``W``), from the forward's
    amax."""
    from snip_ds.backend.kernels import quantize as kq

    return kq.launch_config(n, k, recipe, 0, VALUES, True, in_bf16, amax_given=True)


@functools.lru_cache(maxsize=1024)
def _wg_pair(n: int, k: int, w_bf16: bool, w_recipe: str, rows: int, g_cols: int, g_bf16: bool, g_recipe: str,
             need_w: bool, amax_given: bool, products: int):
    """W for dgrad (:func:`_w_t_config`) and G_Y (:func:`_g_config`, dgrad's layout and, where ``need_w``,
    wgrad's) in one launch, G_Y's first product of scales with W's."""
    from snip_ds.backend.kernels import grouped as kg

    return kg.quantize_pair_config(_w_t_config(n, k, w_bf16, w_recipe),
                                   _g_config(rows, g_cols, g_bf16, g_recipe, True, need_w, amax_given, products))
