"""The ``te`` backend: the quantized GEMMs through NVIDIA Transformer Engine's quantizers and GEMM (CUDA only).

Written for Transformer Engine 2.9 up to (not including) 2.20, from its source (github.com/NVIDIA/
TransformerEngine, tags v2.9 ... v2.18 and branch release_v2.19; the file named at each use). It has **not
been run on any hardware yet**: no GPU and no Transformer Engine were available when it was written. It
uses TE's public quantizer classes and its GEMM entry on the tensors DeepSpeed owns, never ``te.Linear``
(which creates its own weights). The operands, the axes they are quantized along and the GEMM layouts are
te.Linear's (transformer_engine/pytorch/module/linear.py, v2.9):

====== ============================== ================================ ======
GEMM   ``general_gemm(A, B, ...)``    quantized usage of A, B          layout
====== ============================== ================================ ======
fprop  ``Y = X W^T``: A = W, B = X    W rowwise (k), X rowwise (k)     TN
dgrad  ``G_X = G_Y W``: A = W, B = G  W columnwise (n), G rowwise (n)  NN
wgrad  ``G_W = G_Y^T X``: A = X, B = G X columnwise (T), G columnwise (T) NT
====== ============================== ================================ ======

(TE's GEMM is column-major: ``general_gemm(A, B, layout="TN")`` returns ``B @ A^T`` in row-major terms.)

Our recipes on TE's quantizers (transformer_engine/pytorch/tensor/{float8,mxfp8,nvfp4}_tensor.py):

* ``fp8`` ``fp8_hybrid``: ``Float8CurrentScalingQuantizer``, E4M3 for X and W, E5M2 for G_Y, one scale per
  tensor from its current amax. TE multiplies by ``448 / amax`` (FP32, transformer_engine/common/recipe/
  recipe_common.cuh) where the reference divides by ``amax / 448``: the two agree except when ``x / s`` lies
  within one FP32 rounding of a rounding boundary of the grid.
* ``fp8`` ``mxfp8``: ``MXFP8Quantizer`` (E4M3, blocks of 32, E8M0 scales) for all three operands. **Differs
  from the reference**: TE rounds the block scale up, ``2**ceil(log2(amax_b / 448))`` (``float_to_e8m0`` in
  transformer_engine/common/util/ptx.cuh), so no element saturates; the reference follows OCP MX v1.0,
  ``2**(floor(log2 amax_b) - 8)``, which saturates the elements above ``448 * scale``. The two differ in the
  blocks whose amax has a significand above 1.75 (one in five for log-uniform amaxes), where TE's scale is
  twice the reference's.
* ``fp4`` ``nvfp4``: ``NVFP4Quantizer`` (E2M1, blocks of 16, E4M3 block scale, FP32 tensor scale);
  ``with_2d_quantization`` for W when ``weight_2d`` (16x16 tiles); ``stochastic_rounding`` for G_Y when
  ``stochastic_rounding``; TE's own Hadamard transform off (``with_rht=False``). The scales are the
  reference's formula with other FP32 roundings: TE computes ``s_b = E4M3(amax_b / 6 * (448 * 6 / amax))``
  and multiplies by ``1 / (s_b * amax / 2688)`` (transformer_engine/common/util/nvfp4_transpose.cuh), the
  reference ``s_b = E4M3(amax_b / (6 * amax / 2688))`` and divides by ``s_b * amax / 2688``; a block scale or
  an element differs only when an operand lies within a few FP32 roundings of a rounding boundary.
* ``hadamard`` (fp4 wgrad): the reference's transform, applied here before TE quantizes: a 16x16 Hadamard
  along the tokens with random signs drawn from the layer's generator at every call. (TE's own transform,
  ``with_rht``, uses one fixed sign vector, so it is not this recipe.)
* ``fp4`` ``mxfp4``: Transformer Engine has no MXFP4 quantizer; :meth:`TEBackend.check` refuses it.
* ``bf16``: a GEMM in the operands' dtype (torch), as the torch backend runs it.

Stochastic rounding: TE's NVFP4 quantizer takes its Philox seed and offset from torch's default CUDA
generator of the current device (``NVFP4Quantizer::quantize_impl`` in transformer_engine/pytorch/csrc/
quantizer.cpp, 2.9 - 2.19). This backend hands that generator the state of the layer's generator (a CUDA
generator on the same device, as :func:`snip_ds.swap.swap_linears` makes them: no host synchronisation) or
seeds it from the layer's generator (:func:`~snip_ds.backend.base.seed_offset`, any other generator) for the one
quantization, and restores its state afterwards, so the rounding follows the layer's generator (restored from
checkpoints) like every other backend's, and the global CUDA random state (dropout and so on) is left as it
was. TE's draws are not the reference's: the same
generator state gives the same rounding under ``te`` (same GPU and TE version), not the emulated backend's.

Accumulation is FP32 (``use_split_accumulator=True`` for every GEMM, also fprop where te.Linear's default on
Hopper is the faster reduced-precision accumulation). TE's quantizers need both dimensions of an operand to
be multiples of 32 (``nvfp4_transpose.cuh``; MXFP8 blocks of 32; FP8 GEMMs multiples of 16): operands are
zero-padded to that and the result cropped, which is exact (zeros change no amax and add nothing to a
product; the reference pads a partial last block with zeros too).
Non-finite operands: TE does not make a whole tensor NaN when one element is NaN or Inf (the reference
does): TE's per-tensor FP8 scale is 1 when the amax is not finite.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from snip_ds.backend.base import BackendError, GemmBackend, recipe_words, seed_offset
from snip_ds.backend.operands import hadamard_pair, hadamard_wgrad, operand_recipes
from snip_ds.quant_config import QuantConfig

log = logging.getLogger("snip_ds.backend")

MIN_VERSION = "2.9"  # the first release whose quantizers and general_gemm this module follows
BELOW_VERSION = "2.20"  # the first release not read (release_v2.19 was the newest branch)
SUPPORTED = f">={MIN_VERSION},<{BELOW_VERSION}"
ALIGN = 32  # every operand dimension is padded to a multiple of this (module docstring)
_GENERIC_CHOICE = "choose backend 'torch', 'emulated' or 'auto'"
_backend: Optional["TEBackend"] = None


def version_problem(version: Optional[str]) -> Optional[str]:
    """Why Transformer Engine ``version`` cannot be used (None when it is in the supported range)."""
    from packaging.version import InvalidVersion, Version
    if version is None:
        return (f"the installed Transformer Engine has no version number; this backend supports "
                f"Transformer Engine {SUPPORTED}")
    try:
        parsed = Version(version)
    except InvalidVersion:
        return (f"the installed Transformer Engine reports the version {version!r}, which is not a version "
                f"number; this backend supports Transformer Engine {SUPPORTED}")
    if not Version(MIN_VERSION) <= parsed < Version(BELOW_VERSION):
        return (f"the installed Transformer Engine is version {version}; this backend supports Transformer "
                f"Engine {SUPPORTED} (pip install -e \".[te]\" installs one)")
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else 'no message'}"


def load(prefix: str = "backend 'te'") -> "TEBackend":
    """The backend, built on first use: imports Transformer Engine and checks its version.

    Raises:
        BackendError: ``prefix`` followed by why: Transformer Engine does not import (the import failure),
            or its version is outside :data:`SUPPORTED`.
    """
    global _backend
    if _backend is not None:
        return _backend
    try:
        te_root = importlib.import_module("transformer_engine")
    except Exception as err:  # ImportError, or a broken install raising anything else
        raise BackendError(f"{prefix}: Transformer Engine does not import ({_first_line(err)}); install it with "
                           f"pip install -e \".[te]\" (Transformer Engine {SUPPORTED}) or "
                           f"{_GENERIC_CHOICE}") from None
    problem = version_problem(getattr(te_root, "__version__", None))
    if problem:
        raise BackendError(f"{prefix}: {problem}; or {_GENERIC_CHOICE}")
    try:
        modules = _TEModules()
    except Exception as err:
        raise BackendError(f"{prefix}: Transformer Engine {te_root.__version__} does not import "
                           f"({_first_line(err)}); {_GENERIC_CHOICE}") from None
    _backend = TEBackend(modules, te_root.__version__)
    log.info("backend te: Transformer Engine %s", te_root.__version__)
    return _backend


class _TEModules:
    """What this backend uses from Transformer Engine (imported here, so that a missing piece is one error)."""

    def __init__(self) -> None:
        import transformer_engine.pytorch as te  # noqa: PLC0415
        import transformer_engine_torch as tex  # noqa: PLC0415
        from transformer_engine.pytorch.cpp_extensions import general_gemm  # noqa: PLC0415
        self.Float8CurrentScalingQuantizer = te.Float8CurrentScalingQuantizer
        self.MXFP8Quantizer = te.MXFP8Quantizer
        self.NVFP4Quantizer = te.NVFP4Quantizer
        self.available = {"fp8_hybrid": te.is_fp8_available, "mxfp8": te.is_mxfp8_available,
                          "nvfp4": te.is_nvfp4_available}
        self.E4M3, self.E5M2 = tex.DType.kFloat8E4M3, tex.DType.kFloat8E5M2
        self.general_gemm = general_gemm
        # v2.9: general_gemm(A, B, workspace, ...) with the workspace from module/base.py's get_workspace();
        # from v2.10 on it takes no workspace (cpp_extensions/gemm.py allocates its own).
        self.get_workspace = None
        if "workspace" in inspect.signature(general_gemm).parameters:
            from transformer_engine.pytorch.module.base import get_workspace  # noqa: PLC0415
            self.get_workspace = get_workspace


# Our recipe name -> the TE quantizer that computes it: (kind, FP8 format) or (kind, 2-D blocks); an NVFP4
# quantizer's spec gets the operand's stochastic rounding appended. mxfp4 has no TE quantizer.
_TE_SPECS = {"fp8_e4m3": ("fp8_current", "e4m3"), "fp8_e5m2": ("fp8_current", "e5m2"), "mxfp8": ("mxfp8", "e4m3"),
             "nvfp4": ("nvfp4", False), "nvfp4_2d": ("nvfp4", True)}


class TEBackend(GemmBackend):
    """The three GEMMs through Transformer Engine (module docstring). Build it with :func:`load`."""

    name = "te"

    def __init__(self, modules: _TEModules, version: str) -> None:
        self._te = modules
        self.version = version
        self._quantizers: Dict[tuple, object] = {}
        self._checked: set = set()

    # ---------------- what runs where ----------------
    def check(self, precision: str, cfg: QuantConfig, device: torch.device) -> None:
        device = torch.device(device)
        recipe = recipe_words(precision, cfg)
        key = (precision, recipe, device)
        if key in self._checked:
            return
        if device.type != "cuda":
            raise BackendError(f"backend 'te' cannot run {recipe} on {device}: Transformer Engine runs on CUDA "
                               f"devices only; {_GENERIC_CHOICE}")
        if precision == "fp4" and cfg.fp4_recipe == "mxfp4":
            raise BackendError(f"backend 'te' cannot run mxfp4 on {device}: Transformer Engine "
                               f"{self.version} has no MXFP4 quantizer; choose fp4_recipe 'nvfp4', or backend "
                               f"'torch', 'emulated' or 'auto'")
        if precision != "bf16":
            te_recipe = cfg.fp8_recipe if precision == "fp8" else cfg.fp4_recipe
            with _on(device):
                ok, reason = self._te.available[te_recipe](return_reason=True)
                gpu = torch.cuda.get_device_name(device)
            if not ok:
                raise BackendError(f"backend 'te' cannot run {recipe} on {device} ({gpu}): Transformer Engine "
                                   f"{self.version} says: {reason or 'not supported'}; {_GENERIC_CHOICE}")
        self._checked.add(key)

    # ---------------- the three GEMMs ----------------
    def fprop(self, x: torch.Tensor, w: torch.Tensor, precision: str, cfg: QuantConfig, *,
              bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if precision == "bf16" or _empty(x, w):
            return _finish(torch.mm(x, w.to(x.dtype).t()), bias, out_dtype)
        tokens, n = x.shape[0], w.shape[0]
        xq = self.quantize(x, precision, cfg, "x", rowwise=True)
        wq = self.quantize(w, precision, cfg, "w", rowwise=True)
        # te.Linear fuses a bias of the activation dtype into the GEMM (it is added to the FP32 sum)
        fused = bias is not None and bias.dtype == out_dtype and out_dtype in (torch.bfloat16, torch.float16)
        y = self._gemm(wq, xq, "TN", out_dtype if fused or bias is None else torch.float32, x.device,
                       bias=_pad(bias, 0) if fused else None)
        y = _crop(y, tokens, n)
        return y if fused or bias is None else _finish(y, bias, out_dtype)

    def dgrad(self, g: torch.Tensor, w: torch.Tensor, precision: str, cfg: QuantConfig,
              generator: Optional[torch.Generator] = None, *,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if precision == "bf16" or _empty(g, w):
            return _finish(torch.mm(g, w.to(g.dtype)), None, out_dtype)
        tokens, k = g.shape[0], w.shape[1]
        gq = self.quantize(g, precision, cfg, "g", rowwise=True, generator=generator)
        wq = self.quantize(w, precision, cfg, "w", rowwise=False)
        return _crop(self._gemm(wq, gq, "NN", out_dtype, g.device, grad=True), tokens, k)

    def wgrad(self, g: torch.Tensor, x: torch.Tensor, precision: str, cfg: QuantConfig,
              generator: Optional[torch.Generator] = None, *,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if precision == "bf16" or _empty(g, x):
            return _finish(torch.mm(g.t(), x.to(g.dtype)), None, out_dtype)
        n, k = g.shape[1], x.shape[1]
        if hadamard_wgrad(precision, cfg):  # the reference's transform and draws (signs first)
            g, x = hadamard_pair(g, x, generator)
        gq = self.quantize(g, precision, cfg, "g", rowwise=False, generator=generator)
        xq = self.quantize(x, precision, cfg, "x", rowwise=False)
        return _crop(self._gemm(xq, gq, "NT", out_dtype, g.device, grad=True), n, k)

    # ---------------- quantization ----------------
    def quantize(self, t: torch.Tensor, precision: str, cfg: QuantConfig, role: str, *, rowwise: bool,
                 generator: Optional[torch.Generator] = None):
        """``t`` (2-D, zero-padded to multiples of :data:`ALIGN`) quantized by TE for ``role`` (``x``, ``w``,
        ``g``): along its rows' last axis (``rowwise``) or along its first axis (column-wise usage). Returns
        TE's quantized tensor (its ``dequantize()`` gives the values, row-wise usage only)."""
        quantizer, stochastic = self._quantizer(t.device, precision, cfg, role, rowwise)
        t = _pad(t.contiguous(), 0, 1)
        with torch.no_grad(), _on(t.device):
            if not stochastic:
                return quantizer(t)
            with _seeded_cuda_rng(t.device, generator):
                return quantizer(t)

    def _quantizer(self, device: torch.device, precision: str, cfg: QuantConfig, role: str,
                   rowwise: bool) -> Tuple[object, bool]:
        """TE's quantizer for one operand role and usage, and whether it rounds stochastically. Cached by
        device and by every setting the quantizer is built from, so a plan or recipe change picks the
        quantizer of the new setting (a TE quantizer never changes its recipe)."""
        index = _index(device)
        recipes = operand_recipes(precision, cfg)  # the recipe each operand gets (snip_ds.backend.operands)
        recipe, stochastic = getattr(recipes, role), role == "g" and recipes.stochastic_g
        spec = _TE_SPECS.get(recipe)
        if spec is not None and spec[0] == "nvfp4":
            spec = spec + (stochastic,)
        if spec is None:
            raise BackendError(f"backend 'te' cannot run {recipe_words(precision, cfg)} on {device}: "
                               f"Transformer Engine {self.version} has no quantizer for it; {_GENERIC_CHOICE}")
        key = (index, rowwise) + spec
        quantizer = self._quantizers.get(key)
        if quantizer is None:
            te, usage = self._te, dict(rowwise=rowwise, columnwise=not rowwise)
            with _on(torch.device("cuda", index)):
                if spec[0] == "fp8_current":
                    quantizer = te.Float8CurrentScalingQuantizer(te.E5M2 if spec[1] == "e5m2" else te.E4M3,
                                                                  device=torch.device("cuda", index), **usage)
                elif spec[0] == "mxfp8":
                    quantizer = te.MXFP8Quantizer(te.E4M3, **usage)
                else:
                    quantizer = te.NVFP4Quantizer(with_rht=False, with_post_rht_amax=False,
                                                  with_2d_quantization=spec[1], stochastic_rounding=spec[2],
                                                  **usage)
            quantizer.internal = True  # TE's storage classes (te.Linear's choice): no autograd wrapper
            self._quantizers[key] = quantizer
        return quantizer, spec[0] == "nvfp4" and spec[2]

    def _gemm(self, a, b, layout: str, out_dtype: torch.dtype, device: torch.device, *,
              bias: Optional[torch.Tensor] = None, grad: bool = False) -> torch.Tensor:
        """``general_gemm`` as te.Linear calls it (transformer_engine/pytorch/cpp_extensions/gemm.py), with FP32
        accumulation; returns its output tensor."""
        with _on(device):
            args = (a, b) if self._te.get_workspace is None else (a, b, self._te.get_workspace())
            out = self._te.general_gemm(*args, out_dtype=out_dtype, layout=layout, bias=bias,
                                        use_split_accumulator=True, grad=grad)
        return out[0]


@contextlib.contextmanager
def _seeded_cuda_rng(device: torch.device, generator: Optional[torch.Generator]):
    """Torch's default CUDA generator of ``device``, drawing from ``generator`` for the block, its previous state
    restored afterwards (module docstring: stochastic rounding). A generator on that CUDA device lends its
    state (seed and Philox offset, held on the host: no device synchronisation) and takes back the advanced
    one; another generator (a CPU one, or None: torch's default CPU generator) seeds it
    (:func:`seed_offset`, a read of host memory)."""
    cuda_gen = torch.cuda.default_generators[_index(device)]
    saved = cuda_gen.get_state()
    lent = generator is not None and generator.device.type == "cuda" and _index(generator.device) == _index(device)
    if lent:
        cuda_gen.set_state(generator.get_state())
    else:
        seed, offset = seed_offset(generator)
        cuda_gen.manual_seed(seed)
        if offset:
            cuda_gen.set_offset(offset)
    try:
        yield
        if lent:
            generator.set_state(cuda_gen.get_state())
    finally:
        cuda_gen.set_state(saved)


def _on(device: torch.device):
    """``device`` made the current CUDA device for a block: TE's calls use the current device."""
    return torch.cuda.device(device)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _empty(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() == 0 or b.numel() == 0


def _pad(t: Optional[torch.Tensor], *dims: int) -> Optional[torch.Tensor]:
    """``t`` zero-padded along ``dims`` to multiples of :data:`ALIGN` (``t`` itself when it already is)."""
    if t is None:
        return None
    pad = [0, 0] * t.ndim
    for d in dims:
        pad[2 * (t.ndim - 1 - d) + 1] = -t.shape[d] % ALIGN
    return F.pad(t, pad) if any(pad) else t


def _crop(y: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return y if y.shape == (rows, cols) else y[:rows, :cols].contiguous()


def _finish(y: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    if bias is not None:
        y = y.float() + bias.float()
    return y.to(out_dtype)
