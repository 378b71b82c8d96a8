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
copy. On the CPU the streamed operand of each GEMM is quantized slice by slice with the whole operand's amax
(:mod:`.cpu_stream`). Then:

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
FP8 quantizes X once, in both layouts, and keeps its E4M3 codes for wgrad (:meth:`TorchBackend.fprop_and_keep`;
one byte per element kept instead of X's two or four), and one whose dgrad and wgrad are both FP8 quantizes G_Y
once for both (:meth:`TorchBackend.prepare_grad`); a layer all of whose GEMMs are per-tensor FP8 runs a step
decided once per shape (:mod:`.fp8_step`: seven launches, W quantized for dgrad from the forward's amax). A
layer all of whose GEMMs are one block recipe (MXFP8, NVFP4, MXFP4, without wgrad's Hadamard transform)
runs :mod:`.block_step`: each operand's amax once, X's and G_Y's two block layouts from one launch each (two
independent quantizations of a step share a launch: :mod:`.kernels.grouped`), and
its X's wgrad values kept instead of X. The GEMMs multiply the very same values as when each quantizes its
own operands (``tests/test_torch_backend_kernels.py`` checks the layer bit for bit).
"""
from __future__ import annotations

import functools
import importlib
import logging
from typing import NamedTuple, Optional, Tuple

import torch

from snip_ds.backend import cpu as cpu_kernels
from snip_ds.backend.base import BackendError, GemmBackend, WithAmax, kernel_seed, recipe_words
from snip_ds.backend import block_step, cpu_stream, fp8_step, operands
from snip_ds.backend.emulated import reference_operands
from snip_ds.backend.operands import amax_shared, gemm_recipe, hadamard_pair, whole_amax
from snip_ds.quant_config import QuantConfig
from snip_ds.quant import QuantParts, quantize_parts
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
        if (t.device.type not in KERNEL_DEVICES or t.numel() == 0 or cfg.fp8_recipe != "fp8_hybrid" or kernels() is None
                or any(getattr(prec, gemm) != "fp8" for gemm in gemms)):
            return None
        ops = [op for gemm in gemms for op in gemm_recipe(gemm, "fp8", cfg).operands if op.role == role]
        if len(ops) != 2 or len({op.recipe for op in ops}) != 1 or any(op.stochastic for op in ops):
            return None
        return _FP8_DTYPES[ops[0].recipe]

    def kept_x_dtype(self, x, prec, cfg):
        """X's FP8 dtype where :meth:`fprop_and_keep` keeps its codes, BF16 where it keeps a block recipe's
        values for wgrad (:mod:`.block_step`), else None."""
        if self._block_recipes(x, prec, cfg) is not None:
            return block_step.VALUES
        return self._shared_fp8("x", ("fprop", "wgrad"), prec, cfg, x)

    def fprop_and_keep(self, x, w, prec, cfg, *, bias=None, out_dtype=torch.float32):
        """Per-tensor FP8 fprop and wgrad quantize X identically: X is quantized once, its E4M3 codes serve
        the forward's GEMM and are kept for wgrad (one byte per element, where ``nn.Linear`` keeps X itself),
        written transposed in the same pass (:attr:`QuantParts.values` a column-major view: wgrad's layout).
        A layer all of whose GEMMs are FP8 runs the step decided for its shape (:mod:`.fp8_step`), which also
        keeps W's amax for dgrad."""
        step = self.decided_fp8_step(x, w, prec, cfg) or self.decided_block_step(x, w, prec, cfg)
        if step is not None:
            return step.forward(x, w, bias, out_dtype)
        fp8 = self._shared_fp8("x", ("fprop", "wgrad"), prec, cfg, x)
        if fp8 is None:
            return super().fprop_and_keep(x, w, prec, cfg, bias=bias, out_dtype=out_dtype)
        ox, ow = gemm_recipe("fprop", "fp8", cfg).operands
        px = self.quantize_parts(x, ox.recipe, ox.axis, out_dtype=fp8, transpose=True)  # [T, k] column-major
        pw = self.quantize_parts(w, ow.recipe, ow.axis, out_dtype=self._values("fprop", x, w, "fp8", cfg)[1])
        y = self._mm("fprop", px.values, pw.values.t(), px.tensor_scale, pw.tensor_scale,
                     self._fp8_pair("x", "w", "fp8", cfg), bias, out_dtype)
        return y, px, w  # px: X's E4M3 codes

    def backward_gemms(self, g, x_keep, w_keep, prec, cfg, generator, needs, x_dtype, w_dtype):
        """The backward of :meth:`fprop_and_keep`'s decided per-tensor FP8 step where it ran (W kept with its
        amax), else :meth:`GemmBackend.backward_gemms`."""
        if isinstance(w_keep, WithAmax):
            if not any(needs):
                return None, None
            x = x_keep.values
            step = self.decided_fp8_step(x, w_keep.tensor, prec, cfg, x_dtype=x_dtype)  # the forward's step,
            if step is not None:  # asked in the forward's order
                return step.backward(g, x_keep, w_keep, needs, generator, x_dtype, w_dtype)
            block = self.decided_block_step(x, w_keep.tensor, prec, cfg, x_dtype=x_dtype)
            return block.backward(g, x_keep, w_keep, needs, generator, x_dtype, w_dtype)
        return super().backward_gemms(g, x_keep, w_keep, prec, cfg, generator, needs, x_dtype, w_dtype)

    def step_settings(self) -> tuple:
        """The device lists and the kernels module its decided steps depend on (tests and benchmarks widen the
        lists to run the CUDA path on CPU tensors)."""
        return KERNEL_DEVICES, SCALED_MM_DEVICES, kernels()

    def keeps_w_amax(self, x, w, prec, cfg) -> bool:
        return ((prec.uniform == "fp8" and cfg.fp8_recipe == "fp8_hybrid" and x.device.type in KERNEL_DEVICES
                 and kernels() is not None and x.numel() != 0 and w.numel() != 0)
                or (self._block_recipes(x, prec, cfg) is not None and w.numel() != 0))

    @staticmethod
    def _block_recipes(x, prec, cfg):
        """:func:`block_step.block_recipes` where the Triton kernels quantize a non-empty ``x``, else None."""
        if x.device.type not in KERNEL_DEVICES or x.numel() == 0 or kernels() is None:
            return None
        return block_step.block_recipes(prec, cfg)

    def decided_block_step(self, x, w, prec, cfg, x_dtype=None) -> Optional[block_step.BlockStep]:
        """The decided step of a layer whose three GEMMs are one block-scaled recipe where the Triton kernels
        quantize (:mod:`.block_step`), else None; decided once per shape, dtypes, device and recipe
        (``x_dtype``: X's own dtype where ``x`` is its kept values)."""
        recipes = self._block_recipes(x, prec, cfg)
        if recipes is None or w.numel() == 0:
            return None
        return _block_plan(tuple(x.shape), tuple(w.shape), x_dtype or x.dtype, w.dtype, x.device, recipes,
                           amax_shared(), self._mm)

    def decided_fp8_step(self, x, w, prec, cfg, x_dtype=None) -> Optional[fp8_step.Fp8Step]:
        """The decided step of a layer whose three GEMMs are per-tensor FP8 where the Triton kernels quantize
        (:mod:`.fp8_step`), else None; decided once per shape, dtypes, device and kernel setting (``x_dtype``:
        X's own dtype where ``x`` is its kept codes, so that backward finds the forward's step)."""
        if prec.uniform != "fp8" or cfg.fp8_recipe != "fp8_hybrid" or x.device.type not in KERNEL_DEVICES:
            return None
        return _fp8_plan(tuple(x.shape), tuple(w.shape), x_dtype or x.dtype, w.dtype, x.device, kernels(),
                         SCALED_MM_DEVICES, amax_shared(), self._mm)

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
            return cpu_stream.finish(torch.mm(x, w.to(x.dtype).t()), bias, out_dtype)
        if self._streams("fprop", x, w, precision, cfg):
            return cpu_stream.fprop(x, w, precision, cfg, bias, out_dtype)
        px, pw = self.quantized_operands("fprop", x, w, precision, cfg, values_dtype=self._values("fprop", x, w,
                                                                                                  precision, cfg))
        return self._mm("fprop", px.values, pw.values.t(), px.tensor_scale, pw.tensor_scale,
                        self._fp8_pair("x", "w", precision, cfg), bias, out_dtype,
                        cpu_stream.unit_scales(*gemm_recipe("fprop", precision, cfg).operands))

    def dgrad(self, g: torch.Tensor, w: torch.Tensor, precision: str, cfg: QuantConfig,
              generator: Optional[torch.Generator] = None, *,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if precision == "bf16":
            return cpu_stream.finish(torch.mm(g, w.to(g.dtype)), None, out_dtype)
        if self._streams("dgrad", g, w, precision, cfg):
            return cpu_stream.dgrad(g, w, precision, cfg, generator, out_dtype)
        pg, pw = self.quantized_operands("dgrad", g, w, precision, cfg, generator,
                                         values_dtype=self._values("dgrad", g, w, precision, cfg))
        return self._mm("dgrad", pg.values, pw.values, pg.tensor_scale, pw.tensor_scale,
                        self._fp8_pair("g", "w", precision, cfg), None, out_dtype,
                        cpu_stream.unit_scales(*gemm_recipe("dgrad", precision, cfg).operands))

    def wgrad(self, g: torch.Tensor, x: torch.Tensor, precision: str, cfg: QuantConfig,
              generator: Optional[torch.Generator] = None, *,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if precision == "bf16":
            return cpu_stream.finish(torch.mm(g.t(), x.to(g.dtype)), None, out_dtype)
        if self._streams("wgrad", g, x, precision, cfg) and not cpu_stream.cpu_bf16_gemm(out_dtype):
            return cpu_stream.wgrad(g, x, precision, cfg, generator, out_dtype)
        pg, px = self.quantized_operands("wgrad", g, x, precision, cfg, generator,
                                         values_dtype=self._values("wgrad", g, x, precision, cfg))
        return self._mm("wgrad", pg.values.t(), px.values, pg.tensor_scale, px.tensor_scale,
                        self._fp8_pair("g", "x", precision, cfg), None, out_dtype,
                        cpu_stream.unit_scales(*gemm_recipe("wgrad", precision, cfg).operands))

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
            out_dtype: torch.dtype, unit_scales: bool = False, scale: Optional[torch.Tensor] = None
            ) -> torch.Tensor:
        """``(a @ b) * scale_a * scale_b (+ bias)`` in ``out_dtype``; a: [M, K], b: [K, N] exact grid values;
        ``unit_scales``: both tensor scales are 1 by the recipe (MX), and are not multiplied in; ``scale``:
        ``scale_a * scale_b`` where a quantization kernel wrote it (BF16-exact GEMMs)."""
        if fp8 is not None and _scaled_mm_ok(gemm, a, b, fp8):  # row-major a, column-major b (cuBLASLt's)
            return fp8_step.scaled_mm(a.to(fp8[0]).contiguous(), b.t().to(fp8[1]).contiguous().t(), scale_a,
                                      scale_b, bias, out_dtype)
        if a.device.type == "cuda":
            y = _bf16_mm_fp32(a.to(torch.bfloat16), b.to(torch.bfloat16))
        elif not cpu_stream.cpu_bf16_gemm(out_dtype):  # CPU, FP32 result wanted (or no fast BF16 GEMM):
            y = torch.mm(cpu_stream.fp32(a), cpu_stream.fp32(b))  # the exact values in an FP32 GEMM
        else:  # CPU, BF16 result: a BF16 GEMM, its FP32 sum rounded once to BF16, taken by scaled() in BF16 (no
            y = torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16))  # widening to FP32 and narrowing back)
        return cpu_stream.scaled(y, scale_a, scale_b, bias, out_dtype, unit_scales, scale)


def _bf16_mm_fp32(a16: torch.Tensor, b16: torch.Tensor) -> torch.Tensor:
    """BF16 x BF16 -> FP32 on CUDA (``torch.mm``'s ``out_dtype``); where this torch lacks it, the BF16 result
    (one BF16 rounding of the FP32 sum), said once."""
    try:
        return torch.mm(a16, b16, out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError) as err:
        _say_once(("mm_out_dtype",), "torch backend: torch.mm(..., out_dtype=float32) is not available (%s); "
                  "BF16 GEMM results are rounded to BF16", str(err).splitlines()[0] if str(err) else err)
        return torch.mm(a16, b16).float()


@functools.lru_cache(maxsize=1024)
def _fp8_plan(x_shape, w_shape, x_dtype, w_dtype, device, kernels_module, scaled_devices, amax_given, mm):
    """:func:`fp8_step.plan` for these operands (None without the kernels, or for an empty operand); the
    per-call arguments that decide it are the cache's key (``scaled_devices``: :data:`SCALED_MM_DEVICES`,
    which :func:`_scaled_mm_ok` reads)."""
    (rows, k), (n, _) = x_shape, w_shape
    if kernels_module is None or not rows * k * n:
        return None
    e4m3, e5m2 = _FP8_DTYPES["fp8_e4m3"], _FP8_DTYPES["fp8_e5m2"]
    scaled = (_scaled_mm_ok("fprop", _Dims(device, (rows, k)), _Dims(device, (k, n)), (e4m3, e4m3))
              and _scaled_mm_ok("dgrad", _Dims(device, (rows, n)), _Dims(device, (n, k)), (e5m2, e4m3))
              and _scaled_mm_ok("wgrad", _Dims(device, (n, rows)), _Dims(device, (rows, k)), (e5m2, e4m3)))
    return fp8_step.plan(rows, k, n, x_dtype, w_dtype, scaled, mm, amax_given)


@functools.lru_cache(maxsize=1024)
def _block_plan(x_shape, w_shape, x_dtype, w_dtype, device, recipes, amax_given, mm):
    """:func:`block_step.plan` for these operands; the arguments that decide it are the cache's key."""
    (rows, k), (n, _) = x_shape, w_shape
    return block_step.plan(rows, k, n, x_dtype, w_dtype, recipes, mm, amax_given, device)


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
