"""The ``torch`` backend: low-precision GEMMs with plain torch, no extra dependency (CUDA and CPU).

Each operand is quantized along the axes of the emulated backend: on CUDA by the Triton kernels of
``snip_ds.backend.kernels`` when that module exists and says it is available, on the CPU by the fused C++
kernels of :mod:`snip_ds.backend.cpu` when they built, else by :func:`snip_ds.quant.quantize_parts` (same
contract, bit for bit with stochastic rounding off; the kernels draw stochastic rounding from a seed taken
from the generator, :func:`~snip_ds.backend.base.kernel_seed` -- on a CUDA generator a device tensor the
kernel reads, so no quantization waits for the GPU -- the fallback from the generator itself as the
emulated backend does). FP16 operands are widened to FP32 (exactly) for the kernels, which read FP32 and
BF16. On CUDA the kernels write the values in BF16, which holds them exactly, and an operand quantized along
axis 0 transposed, so that every GEMM reads both operands with the contraction axis contiguous, without a
copy. On the CPU the streamed operand of each GEMM (X or G_Y along
rows, both wgrad operands along the tokens) is quantized slice by slice with the whole operand's amax, as the
emulated backend does, which gives the whole operand's values and draws while keeping temporaries small.
Then:

* ``fp8`` with ``fp8_hybrid`` on a CUDA device that has FP8 tensor cores (compute capability >= 8.9) and
  dimensions that are multiples of 16: ``torch._scaled_mm`` on the E4M3 / E5M2 codes with the FP32
  per-tensor scales (dgrad: E5M2 G_Y x E4M3 W, wgrad: E5M2 G_Y^T x E4M3 X; E5M2 x E5M2 never occurs).
* everything else (MXFP8, NVFP4, MXFP4; FP8 elsewhere, including on CPU, whose ``_scaled_mm`` is a scalar
  emulation thousands of times slower than a BF16 GEMM): the operands' exact values ``q * s_b`` in BF16,
  a BF16 GEMM with FP32 accumulation, then the FP32 tensor scales. The operands are exact in BF16 (every
  E4M3 and E5M2 value, and every E2M1 x E4M3 and E2M1 x E8M0 product, has at most 8 significant bits and an
  exponent within BF16's range; the one exception, MXFP8 blocks whose amax is below 2**-116, where E4M3
  subnormals times the block scale fall below BF16's smallest subnormal 2**-133, does not occur in
  training). On CUDA the GEMM returns FP32 (``torch.mm(..., out_dtype=torch.float32)``).
  torch has no such CPU kernel: on CPU an FP32 or FP16 result comes from an FP32 GEMM of the
  same exact values, and a BF16 result, where oneDNN has native BF16 (AVX512-BF16, AMX), from a BF16
  GEMM whose FP32 sum is rounded once to BF16 before the FP32 tensor scales are applied (at most one more
  BF16 rounding than the emulated backend's); without native BF16 (where a BF16 GEMM is many times slower)
  from the FP32 GEMM.
* ``bf16``: a GEMM in the operands' own dtype.

Where the Triton kernels quantize for ``torch._scaled_mm``, they write the FP8 codes themselves, which the GEMM
reads without a cast between them. Per-tensor FP8 (``fp8_hybrid``) quantizes an operand to the same codes with
the same scale in each GEMM that reads it, whatever that GEMM's axis: so a layer whose fprop and wgrad are both
FP8 quantizes X once and keeps its E4M3 codes for wgrad (:meth:`TorchBackend.fprop_and_keep`; one byte per
element kept instead of X's two or four), and one whose dgrad and wgrad are both FP8 quantizes G_Y once for
both (:meth:`TorchBackend.prepare_grad`). The GEMMs multiply the very same values as when each quantizes its
own operands (``tests/test_torch_backend_kernels.py`` checks the layer bit for bit).
"""
from __future__ import annotations

import importlib
import logging
from typing import NamedTuple, Optional, Tuple

import torch

from snip_ds.backend import cpu as cpu_kernels
from snip_ds.backend.base import BackendError, GemmBackend, kernel_seed, recipe_words
from snip_ds.backend import operands
from snip_ds.backend.emulated import reference_operands
from snip_ds.backend.operands import gemm_recipe, hadamard_pair, tensor_amax, whole_amax
from snip_ds.quant_config import QuantConfig
from snip_ds.quant import QuantParts, get_recipe, quantize_parts
from snip_ds.types import GEMM_OPERANDS

log = logging.getLogger("snip_ds.backend")

DEVICES = ("cpu", "cuda")
SCALED_MM_DEVICES = ("cuda",)  # where torch._scaled_mm is a real FP8 GEMM (on CPU it is a slow emulation)
KERNEL_DEVICES = ("cuda",)  # where snip_ds.backend.kernels (Triton) quantizes, when it is available
_FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_said: set = set()
_kernels_module = None
_kernels_checked = False


def _say_once(key, message: str, *args) -> None:
    if key not in _said:
        _said.add(key)
        log.info(message, *args)


def kernels():
    """``snip_ds.backend.kernels`` when it exists and its ``available()`` is true, else None (checked once)."""
    global _kernels_module, _kernels_checked
    if not _kernels_checked:
        _kernels_checked = True
        try:
            module = importlib.import_module("snip_ds.backend.kernels")
            _kernels_module = module if module.available() else None
        except ModuleNotFoundError as err:
            if err.name != "snip_ds.backend.kernels":
                log.warning("snip_ds.backend.kernels does not import (%s); quantizing with torch", err)
        except Exception as err:  # a broken kernel module must not stop training: say so, use plain torch
            log.warning("snip_ds.backend.kernels does not import (%s: %s); quantizing with torch",
                        type(err).__name__, err)
    return _kernels_module


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


class TorchBackend(GemmBackend):
    """Real FP8 GEMMs where the device has them, BF16-exact GEMMs for every other recipe (module docstring)."""

    name = "torch"

    # ---------------- quantization ----------------
    def quantize_parts(self, t: torch.Tensor, recipe: str, axis: int, stochastic: bool = False,
                       generator: Optional[torch.Generator] = None, *, out_dtype: torch.dtype = torch.float32,
                       transpose: bool = False) -> QuantParts:
        """One whole operand, through the fused kernels (Triton on CUDA, C++ on the CPU) when they are
        available, else :func:`snip_ds.quant.quantize_parts`. ``values`` in ``out_dtype`` (FP32 or BF16);
        with ``transpose`` the Triton kernels write them as ``[cols, rows]`` and the result is the transposed
        view of that (``t``'s shape, column-major: the contraction axis contiguous, as GEMMs read it); the
        other quantizers ignore ``transpose``. Inputs other than FP32 and BF16 (FP16) are widened to FP32
        first, exactly."""
        if t.ndim == 2 and t.device.type in KERNEL_DEVICES:
            k = kernels()
        elif t.ndim == 2 and t.device.type == "cpu" and cpu_kernels.available():
            k, transpose = cpu_kernels, False
        else:
            k = None
        if out_dtype in _FP8_DTYPES.values() and (k is None or k is cpu_kernels):  # only Triton writes FP8 codes
            p = self.quantize_parts(t, recipe, axis, stochastic, generator, transpose=transpose)
            return QuantParts(p.values.to(out_dtype), p.tensor_scale)  # exact: the values are on its grid
        amax = whole_amax(t, recipe)  # a shard's: the whole tensor's (operands.shared_amax); else None
        if k is None:
            p = quantize_parts(t, recipe, axis=axis, stochastic=stochastic, generator=generator, tensor_amax=amax)
            return p if out_dtype == torch.float32 else QuantParts(p.values.to(out_dtype), p.tensor_scale)
        t = t if t.dtype in (torch.float32, torch.bfloat16) else t.float()
        seed = kernel_seed(generator, t.device) if stochastic else 0
        kw = dict(stochastic=stochastic, seed=seed, offset=0, out_dtype=out_dtype, tensor_amax=amax)
        if not transpose:
            return k.quantize_parts(t, recipe, axis, **kw)
        p = k.quantize_parts(t, recipe, axis, transpose=True, **kw)
        return QuantParts(p.values.t(), p.tensor_scale)

    def quantized_operands(self, gemm: str, a: torch.Tensor, b: torch.Tensor, precision: str, cfg: QuantConfig,
                           generator: Optional[torch.Generator] = None, *,
                           values_dtype=torch.float32) -> Tuple[QuantParts, QuantParts]:
        """The two operands of ``gemm`` (``(x, w)``, ``(g, w)`` or ``(g, x)``) as this backend's GEMMs
        multiply them: values (in ``values_dtype``, FP32 or BF16, which hold them exactly, or a pair of dtypes,
        one per operand: an FP8 recipe's own codes too) and tensor scales. On CUDA an operand quantized along
        its rows' axis 0 comes back column-major (see :meth:`quantize_parts`), the layout the GEMMs read
        without a copy. An operand given as QuantParts (quantized once already) is taken as it is."""
        if precision == "bf16":
            return reference_operands(gemm, a, b, precision, cfg, generator)  # the operands as they are
        recipe = gemm_recipe(gemm, precision, cfg)
        if recipe.hadamard:
            a, b = hadamard_pair(a, b, generator)
        dtypes = values_dtype if isinstance(values_dtype, tuple) else (values_dtype, values_dtype)
        return tuple(t if isinstance(t, QuantParts) else  # quantized once already (prepare_grad, fprop_and_keep)
                     self.quantize_parts(t, op.recipe, op.axis, op.stochastic, generator if op.stochastic else None,
                                         out_dtype=dtype, transpose=op.axis == 0)
                     for t, op, dtype in zip((a, b), recipe.operands, dtypes))

    def _values(self, gemm: str, a, b, precision: str, cfg: QuantConfig):
        """The dtypes of ``gemm``'s two operand values: FP32 off the kernel devices; there the FP8 codes
        themselves where ``torch._scaled_mm`` will multiply them (no cast pass between the kernel and the
        GEMM), else BF16. ``a``, ``b`` as :meth:`quantized_operands` takes them (QuantParts too)."""
        (ra, ca), (rb, cb) = (tuple((t.values if isinstance(t, QuantParts) else t).shape) for t in (a, b))
        device = (a.values if isinstance(a, QuantParts) else a).device
        if device.type not in KERNEL_DEVICES:
            return torch.float32, torch.float32
        fp8 = self._fp8_pair(*GEMM_OPERANDS[gemm], precision, cfg)
        m, k, n = {"fprop": (ra, ca, rb), "dgrad": (ra, ca, cb), "wgrad": (ca, ra, cb)}[gemm]
        if fp8 is not None and _scaled_mm_ok(gemm, _Dims(device, (m, k)), _Dims(device, (k, n)), fp8):
            return fp8
        return torch.bfloat16, torch.bfloat16

    # ---------------- operands quantized once for two GEMMs ----------------
    def _shared_fp8(self, role: str, gemms: Tuple[str, str], prec, cfg: QuantConfig, t: torch.Tensor
                    ) -> Optional[torch.dtype]:
        """The FP8 dtype in which operand ``role`` can be quantized once for both ``gemms``: where the Triton
        kernels quantize ``t`` and both GEMMs are per-tensor FP8 (``fp8_hybrid``), which quantize it to the
        same values with the same scale whatever their axis, rounding to nearest; else None."""
        if (t.device.type not in KERNEL_DEVICES or t.numel() == 0 or cfg.fp8_recipe != "fp8_hybrid"
                or any(getattr(prec, gemm) != "fp8" for gemm in gemms)):
            return None
        ops = [op for gemm in gemms for op in gemm_recipe(gemm, "fp8", cfg).operands if op.role == role]
        if len(ops) != 2 or len({op.recipe for op in ops}) != 1 or any(op.stochastic for op in ops):
            return None
        return _FP8_DTYPES[ops[0].recipe]

    def kept_x_dtype(self, x, prec, cfg):
        """X's FP8 dtype where :meth:`fprop_and_keep` keeps its codes, else None."""
        return self._shared_fp8("x", ("fprop", "wgrad"), prec, cfg, x)

    def fprop_and_keep(self, x, w, prec, cfg, *, bias=None, out_dtype=torch.float32):
        """Per-tensor FP8 fprop and wgrad quantize X identically: X is quantized once, its E4M3 codes serve
        the forward's GEMM and are kept for wgrad (one byte per element, where ``nn.Linear`` keeps X itself)."""
        fp8 = self._shared_fp8("x", ("fprop", "wgrad"), prec, cfg, x)
        if fp8 is None:
            return super().fprop_and_keep(x, w, prec, cfg, bias=bias, out_dtype=out_dtype)
        px, pw = self.quantized_operands("fprop", x, w, "fp8", cfg,
                                         values_dtype=(fp8, self._values("fprop", x, w, "fp8", cfg)[1]))
        y = self._mm("fprop", px.values, pw.values.t(), px.tensor_scale, pw.tensor_scale,
                     self._fp8_pair("x", "w", "fp8", cfg), bias, out_dtype)
        return y, px, w  # px: X's E4M3 codes

    def prepare_grad(self, g, prec, cfg):
        """Per-tensor FP8 dgrad and wgrad quantize G_Y identically: its E5M2 codes, made once for both."""
        fp8 = self._shared_fp8("g", ("dgrad", "wgrad"), prec, cfg, g)
        if fp8 is None:
            return g
        op = next(op for op in gemm_recipe("dgrad", "fp8", cfg).operands if op.role == "g")
        return self.quantize_parts(g, op.recipe, op.axis, out_dtype=fp8)

    # ---------------- the three GEMMs ----------------
    def fprop(self, x: torch.Tensor, w: torch.Tensor, precision: str, cfg: QuantConfig, *,
              bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if precision == "bf16":
            return _finish(torch.mm(x, w.to(x.dtype).t()), bias, out_dtype)
        if self._streams("fprop", x, w, precision, cfg):
            return self._cpu_fprop(x, w, precision, cfg, bias, out_dtype)
        px, pw = self.quantized_operands("fprop", x, w, precision, cfg, values_dtype=self._values("fprop", x, w,
                                                                                                  precision, cfg))
        return self._mm("fprop", px.values, pw.values.t(), px.tensor_scale, pw.tensor_scale,
                        self._fp8_pair("x", "w", precision, cfg), bias, out_dtype,
                        _unit_scales(*gemm_recipe("fprop", precision, cfg).operands))

    def dgrad(self, g: torch.Tensor, w: torch.Tensor, precision: str, cfg: QuantConfig,
              generator: Optional[torch.Generator] = None, *,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if precision == "bf16":
            return _finish(torch.mm(g, w.to(g.dtype)), None, out_dtype)
        if self._streams("dgrad", g, w, precision, cfg):
            return self._cpu_dgrad(g, w, precision, cfg, generator, out_dtype)
        pg, pw = self.quantized_operands("dgrad", g, w, precision, cfg, generator,
                                         values_dtype=self._values("dgrad", g, w, precision, cfg))
        return self._mm("dgrad", pg.values, pw.values, pg.tensor_scale, pw.tensor_scale,
                        self._fp8_pair("g", "w", precision, cfg), None, out_dtype,
                        _unit_scales(*gemm_recipe("dgrad", precision, cfg).operands))

    def wgrad(self, g: torch.Tensor, x: torch.Tensor, precision: str, cfg: QuantConfig,
              generator: Optional[torch.Generator] = None, *,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if precision == "bf16":
            return _finish(torch.mm(g.t(), x.to(g.dtype)), None, out_dtype)
        if self._streams("wgrad", g, x, precision, cfg) and not _cpu_bf16_gemm(out_dtype):
            return self._cpu_wgrad(g, x, precision, cfg, generator, out_dtype)
        pg, px = self.quantized_operands("wgrad", g, x, precision, cfg, generator,
                                         values_dtype=self._values("wgrad", g, x, precision, cfg))
        return self._mm("wgrad", pg.values.t(), px.values, pg.tensor_scale, px.tensor_scale,
                        self._fp8_pair("g", "x", precision, cfg), None, out_dtype,
                        _unit_scales(*gemm_recipe("wgrad", precision, cfg).operands))

    # ---------------- CPU: operands streamed slice by slice, as the emulated backend does ----------------
    def _streams(self, gemm: str, a: torch.Tensor, b: torch.Tensor, precision: str, cfg: QuantConfig) -> bool:
        """Whether this GEMM takes the CPU path that quantizes its streamed operand slice by slice (never for
        an operand quantized already: those come from the kernel devices)."""
        if isinstance(a, QuantParts) or isinstance(b, QuantParts):
            return False
        if a.device.type != "cpu" or a.device.type in KERNEL_DEVICES or a.numel() == 0 or b.numel() == 0:
            return False
        roles = GEMM_OPERANDS[gemm]
        fp8 = self._fp8_pair(roles[0], roles[1], precision, cfg)
        return fp8 is None or not _scaled_mm_ok(gemm, a, b, fp8)

    def _cpu_fprop(self, x, w, precision, cfg, bias, out_dtype):
        ox, ow = gemm_recipe("fprop", precision, cfg).operands
        op_dtype = torch.bfloat16 if _cpu_bf16_gemm(out_dtype) else torch.float32
        pw = _Streamed(w, ow).whole(op_dtype)
        qx = _Streamed(x, ox)
        y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
        for rows in operands.chunks(x.shape[0], x.shape[1]):
            _mm_into(y[rows], qx.rows(rows, op_dtype).values, pw.values.t())
        return _scaled(y, qx.tensor_scale, pw.tensor_scale, bias, out_dtype, _unit_scales(ox, ow))

    def _cpu_dgrad(self, g, w, precision, cfg, generator, out_dtype):
        og, ow = gemm_recipe("dgrad", precision, cfg).operands
        op_dtype = torch.bfloat16 if _cpu_bf16_gemm(out_dtype) else torch.float32
        pw = _Streamed(w, ow).whole(op_dtype)
        qg = _Streamed(g, og, generator)
        out = torch.empty(g.shape[0], w.shape[1], dtype=torch.float32)
        for rows in operands.chunks(g.shape[0], g.shape[1]):
            _mm_into(out[rows], qg.rows(rows, op_dtype).values, pw.values)
        return _scaled(out, qg.tensor_scale, pw.tensor_scale, None, out_dtype, _unit_scales(og, ow))

    def _cpu_wgrad(self, g, x, precision, cfg, generator, out_dtype):
        recipe = gemm_recipe("wgrad", precision, cfg)
        if recipe.hadamard:
            g, x = hadamard_pair(g, x, generator)
        qg, qx = _Streamed(g, recipe.a, generator), _Streamed(x, recipe.b)
        g_w = torch.zeros(g.shape[1], x.shape[1], dtype=torch.float32)
        for tokens in operands.chunks(g.shape[0], g.shape[1] + x.shape[1]):
            g_w.addmm_(qg.rows(tokens).values.t(), qx.rows(tokens).values)
        return _scaled(g_w, qg.tensor_scale, qx.tensor_scale, None, out_dtype, _unit_scales(recipe.a, recipe.b))

    def check(self, precision: str, cfg: QuantConfig, device: torch.device) -> None:
        if torch.device(device).type not in DEVICES:
            raise BackendError(f"backend 'torch': recipe {recipe_words(precision, cfg)} cannot run on device "
                               f"{device} (the torch backend runs on {' and '.join(DEVICES)}); choose backend "
                               f"'emulated' or 'auto'")

    # ---------------- helpers ----------------
    @staticmethod
    def _fp8_pair(role_a: str, role_b: str, precision: str,
                  cfg: QuantConfig) -> Optional[Tuple[torch.dtype, torch.dtype]]:
        """The FP8 dtypes of a GEMM's two operands when it is a per-tensor FP8 GEMM, else None."""
        if precision != "fp8" or cfg.fp8_recipe != "fp8_hybrid":
            return None
        recipes = operands.operand_recipes(precision, cfg)
        return _FP8_DTYPES[getattr(recipes, role_a)], _FP8_DTYPES[getattr(recipes, role_b)]

    def _mm(self, gemm: str, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
            fp8: Optional[Tuple[torch.dtype, torch.dtype]], bias: Optional[torch.Tensor],
            out_dtype: torch.dtype, unit_scales: bool = False) -> torch.Tensor:
        """``(a @ b) * scale_a * scale_b (+ bias)`` in ``out_dtype``; a: [M, K], b: [K, N] exact grid values;
        ``unit_scales``: both tensor scales are 1 by the recipe (MX), and are not multiplied in."""
        if fp8 is not None and _scaled_mm_ok(gemm, a, b, fp8):
            # row-major first operand, column-major second (cuBLASLt's layout)
            a8 = a.to(fp8[0]).contiguous()
            b8 = b.t().to(fp8[1]).contiguous().t()
            fused_bias = bias is not None and bias.dtype == out_dtype and out_dtype in (torch.bfloat16,
                                                                                        torch.float16)
            y = torch._scaled_mm(a8, b8, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype if fused_bias or
                                 bias is None else torch.float32, bias=bias if fused_bias else None)
            return y if bias is None or fused_bias else _finish(y, bias, out_dtype)
        if a.device.type == "cuda":
            y = _bf16_mm_fp32(a.to(torch.bfloat16), b.to(torch.bfloat16))
        elif not _cpu_bf16_gemm(out_dtype):  # CPU, FP32 result wanted (or no fast BF16 GEMM): the exact values
            y = torch.mm(_fp32(a), _fp32(b))  # in an FP32 GEMM
        else:  # CPU: BF16 GEMM, its FP32 sum rounded once to BF16 (the result is rounded to out_dtype anyway)
            y = torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16)).float()
        return _scaled(y, scale_a, scale_b, bias, out_dtype, unit_scales)


_fast_bf16: Optional[bool] = None


def _cpu_bf16_gemm(out_dtype: torch.dtype) -> bool:
    """Whether a CPU GEMM whose result is wanted in ``out_dtype`` runs in BF16: only for a BF16 result (an
    FP16 result has 3 more significant bits than a BF16 GEMM's) and only where oneDNN has native BF16
    (AVX512-BF16 or AMX); elsewhere a BF16 GEMM is many times slower than FP32, and the FP32 GEMM of the same
    exact values is the more accurate result anyway."""
    global _fast_bf16
    if out_dtype != torch.bfloat16:
        return False
    if _fast_bf16 is None:
        try:
            _fast_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            _fast_bf16 = False
    return _fast_bf16


class _Streamed:
    """One CPU operand quantized slice by slice along its rows with the whole operand's amax (exactly the
    whole operand's quantization, stochastic draws included): through the fused kernels of
    :mod:`snip_ds.backend.cpu` when they are built (stochastic rounding from one seed drawn from
    ``generator``, each slice at its first element's offset), else :func:`snip_ds.quant.quantize_parts`
    (drawing from ``generator`` slice by slice, as the emulated backend does)."""

    def __init__(self, t: torch.Tensor, operand: operands.Operand, generator: Optional[torch.Generator] = None):
        self.fused = cpu_kernels.available()
        self.t = t if not self.fused or t.dtype in (torch.float32, torch.bfloat16) else t.float()
        if self.fused:
            self.t = self.t.contiguous()  # (the kernels' layout; a slice of rows of it stays contiguous)
        self.recipe = get_recipe(operand.recipe)
        self.axis = operand.axis
        stochastic = self.stochastic = operand.stochastic
        self.generator = generator if stochastic else None
        self.seed = kernel_seed(generator, "cpu") if stochastic and self.fused else 0
        self.amax = None
        if self.recipe.scale != "e8m0":  # MX has no tensor-level scale
            self.amax = operands.reduced(cpu_kernels.tensor_amax(self.t)) if self.fused else tensor_amax(self.t)
        self.tensor_scale = None  # the quantizer's, from the first slice (a streamed operand is never empty)

    def rows(self, rows: slice, out_dtype: torch.dtype = torch.float32) -> QuantParts:
        part = self.t[rows]
        if self.fused:  # the arguments are the kernels' already: no second check per slice
            p = cpu_kernels.quantize_checked(part, self.recipe, self.axis % 2, self.amax, self.stochastic, self.seed,
                                             rows.start * self.t.shape[1], out_dtype)
        else:
            p = quantize_parts(part, self.recipe, axis=self.axis, stochastic=self.stochastic,
                               generator=self.generator, tensor_amax=self.amax)
            if out_dtype != torch.float32:
                p = QuantParts(p.values.to(out_dtype), p.tensor_scale)
        self.tensor_scale = p.tensor_scale
        return p

    def whole(self, out_dtype: torch.dtype = torch.float32) -> QuantParts:
        return self.rows(slice(0, self.t.shape[0]), out_dtype)


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b`` (FP32 ``out``; a BF16 product is rounded to BF16 once, then widened exactly)."""
    if a.dtype == torch.float32:
        torch.mm(a, b, out=out)
    else:
        out.copy_(torch.mm(a, b))


def _bf16_mm_fp32(a16: torch.Tensor, b16: torch.Tensor) -> torch.Tensor:
    """BF16 x BF16 -> FP32 on CUDA (``torch.mm``'s ``out_dtype``); where this torch lacks it, the BF16 result
    (one BF16 rounding of the FP32 sum), said once."""
    try:
        return torch.mm(a16, b16, out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError) as err:
        _say_once(("mm_out_dtype",), "torch backend: torch.mm(..., out_dtype=float32) is not available (%s); "
                  "BF16 GEMM results are rounded to BF16", str(err).splitlines()[0] if str(err) else err)
        return torch.mm(a16, b16).float()


def _unit_scales(op_a: operands.Operand, op_b: operands.Operand) -> bool:
    """Whether both operands' tensor scales are 1 by their recipes (MX: block scales only)."""
    return get_recipe(op_a.recipe).scale == "e8m0" and get_recipe(op_b.recipe).scale == "e8m0"


def _scaled(y: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, bias: Optional[torch.Tensor],
            out_dtype: torch.dtype, unit_scales: bool) -> torch.Tensor:
    """``fl(y * fl(scale_a * scale_b)) (+ bias)`` in ``out_dtype`` (``y``: an FP32 GEMM result, written over).
    MX recipes' tensor scales are 1 (``unit_scales``): nothing is multiplied. Without a bias, the product is
    written in ``out_dtype`` in the same pass (the FP32 product rounded once, as ``.to(out_dtype)`` of it
    rounds it): one pass over the result instead of two."""
    if unit_scales:
        return _finish(y, bias, out_dtype)
    scale = scale_a * scale_b
    if bias is None and out_dtype != y.dtype:
        return torch.mul(y, scale, out=torch.empty(y.shape, dtype=out_dtype, device=y.device))
    return _finish(y.mul_(scale), bias, out_dtype)


def _finish(y: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    if bias is not None:
        y = _fp32(y) + bias.float()
    return y.to(out_dtype)


class _Dims(NamedTuple):
    """A GEMM operand's device and shape, all :func:`_scaled_mm_ok` reads of it."""

    device: torch.device
    shape: Tuple[int, int]


def _scaled_mm_ok(gemm: str, a, b, fp8: Tuple[torch.dtype, torch.dtype]) -> bool:
    """Whether ``torch._scaled_mm`` can run this per-tensor FP8 GEMM here (else the BF16-exact path, said
    once per reason)."""
    device = a.device
    if device.type not in SCALED_MM_DEVICES:
        _say_once(("device", device.type), "torch backend: FP8 GEMMs on %s run as exact BF16 GEMMs "
                  "(torch._scaled_mm is not a hardware FP8 GEMM there)", device.type)
        return False
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        _say_once(("capability", device.index), "torch backend: %s has no FP8 tensor cores (compute capability "
                  "< 8.9); FP8 GEMMs run as exact BF16 GEMMs", torch.cuda.get_device_name(device))
        return False
    if fp8 == (torch.float8_e5m2, torch.float8_e5m2):
        return False  # not an operand pair of any GEMM here; cuBLASLt has no E5M2 x E5M2 kernel
    if device.type == "cuda" and any(d % 16 for d in (a.shape[0], a.shape[1], b.shape[1])):
        _say_once(("shape", gemm, tuple(a.shape), tuple(b.shape)), "torch backend: %s %s x %s is not a "
                  "multiple of 16 in every dimension, as torch._scaled_mm needs; it runs as an exact BF16 GEMM",
                  gemm, tuple(a.shape), tuple(b.shape))
        return False
    return True
