"""Fused CPU quantization of GEMM operands: a C++ extension of this package, compiled on first use.

:func:`quantize_parts` is :func:`snip_ds.quant.quantize_parts` (and :func:`fake_quantize`
:func:`snip_ds.quant.fake_quantize` with round-to-nearest) for 2-D CPU operands in at most two passes
over memory (the tensor amax, then one pass computing block amaxes and scales, rounding and writing the
values), bit for bit equal to the reference with stochastic rounding off. Stochastic rounding draws
Philox-4x32-10 from a (seed, offset) pair, the draws of the Triton kernels (``_draw``) for the same
element index, so a tensor quantized slice by slice gets the draws it would get at once.

The source (``quantize.cpp``, shipped in the package) is compiled by ``torch.utils.cpp_extension.load``
(``-O3 -fopenmp``, no fast-math and no floating-point contraction, so FP32 arithmetic is torch's) the first
time :func:`available` is asked, and loaded afterwards; ``python launch/warm_ops.py`` pays the compile ahead
of time. Each environment builds into its own folder, :func:`build_directory`:
``$TORCH_EXTENSIONS_DIR/pyXY_cpu/snip_ds_cpu_quant-<key>`` (default root ``~/.cache/torch_extensions``), the
key a hash of everything that makes a build incompatible (:func:`build_key`: the Python executable and prefix,
torch's version and C++ ABI, the compiler, the flags, the source's bytes and path), so two virtual
environments or checkouts on one machine never rebuild over each other and a changed source builds anew; the
folders of this checkout's earlier builds, which it never loads again, are then removed (:func:`build_identity`,
:func:`snip_ds.runtime.jit_builds.prune_superseded_builds`). When
there is no compiler or the build fails, :func:`available` is false after one logged warning and callers
quantize with :mod:`snip_ds.quant` instead (the same values with stochastic rounding off).
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, Optional, Union

import torch

from snip_ds.formats import E2M1, E4M3
from snip_ds.quant import QuantParts, Recipe, get_recipe
from snip_ds.backend.base import check_kernel_arguments, check_kernel_input

log = logging.getLogger("snip_ds.backend")

EXTENSION_NAME = "snip_ds_cpu_quant"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "quantize.cpp")
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-fast-math", "-std=c++17"]
LDFLAGS = ["-fopenmp"]
_NVFP4_TENSOR_DIVISOR = E4M3.max_normal * E2M1.max_normal  # S = amax / (448 * 6)
_ISA = {"AVX512": 2, "AVX2": 1}  # torch.backends.cpu.get_cpu_capability() -> the kernels' variant

_ops = None
_error: Optional[str] = None
_build_seconds: Optional[float] = None


def build_key(source: str = SOURCE) -> str:
    """16 hex digits identifying a compatible build: a hash of the Python executable and prefix (a virtual
    environment), the Python and torch versions, torch's C++ ABI, the machine, the C++ compiler (``$CXX`` or
    ``c++`` as found on ``PATH``), the compile and link flags, and the bytes and path of ``source``.

    Raises:
        OSError: ``source`` cannot be read.
    """
    with open(source, "rb") as f:
        source_hash = hashlib.sha256(f.read()).hexdigest()
    compiler = os.environ.get("CXX") or "c++"
    parts = {
        "python": os.path.realpath(sys.executable), "prefix": os.path.realpath(sys.prefix),
        "python_version": sys.version, "torch": torch.__version__,
        "cxx11_abi": torch.compiled_with_cxx11_abi(), "machine": platform.machine(),
        "compiler": [compiler, os.path.realpath(shutil.which(compiler) or compiler)],
        "cflags": CFLAGS, "ldflags": LDFLAGS, "source": source_hash,
        "source_path": os.path.realpath(source),  # in the build's commands: two checkouts would rebuild in turn
    }
    return hashlib.sha256(repr(sorted(parts.items())).encode()).hexdigest()[:16]


def build_directory() -> str:
    """The folder this environment's build lives in (see :func:`build_key`); not created here."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return os.path.join(root, f"{python}_cpu", f"{EXTENSION_NAME}-{build_key()}")


def load(verbose: bool = False) -> bool:
    """Compile (first time) or load the extension; True when its ops are ready. A failure is logged once
    as a warning and remembered: later calls return False at once."""
    global _ops, _error, _build_seconds
    if _ops is not None or _error is not None:
        return _ops is not None
    start = time.perf_counter()
    try:
        from torch.utils import cpp_extension

        from snip_ds.runtime import jit_builds
        jit_builds.prepare()
        folder = build_directory()
        os.makedirs(folder, exist_ok=True)
        cpp_extension.load(name=EXTENSION_NAME, sources=[SOURCE], extra_cflags=list(CFLAGS),
                           extra_ldflags=list(LDFLAGS),
                           build_directory=folder, is_python_module=False, verbose=verbose)
        _ops = torch.ops.snip_ds_cpu
        _ops.supported_isa()  # the library answers
        _register_fakes()
    except Exception as err:  # no compiler, a failed build, a stale or broken cached library
        _ops = None
        first = str(err).strip().splitlines()[0] if str(err).strip() else "no message"
        _error = f"{type(err).__name__}: {first}"
        log.warning("snip_ds CPU quantization kernels are unavailable (%s); the torch backend quantizes with "
                    "plain torch ops on CPU (same values, slower)", _error)
        return False
    _build_seconds = time.perf_counter() - start
    try:  # the folders of this checkout's earlier builds: never loaded again (one line says what went)
        jit_builds.record_build(Path(folder), build_identity())
        jit_builds.prune_superseded_builds(Path(folder), build_identity(), "snip_ds's CPU kernels",
                                           legacy=_built_here_before_records)
    except OSError as err:  # a read-only extensions folder: the kernels are loaded all the same
        log.warning("snip_ds: the CPU kernels' build folders under %s were not tidied (%s)",
                    os.path.dirname(folder), err)
    return True


def build_identity() -> Dict[str, str]:
    """The environment and checkout a build belongs to (the parts of :func:`build_key` a new version of the
    kernels, of torch, of the compiler or of the flags leaves as they are): the Python executable and prefix, and
    the source's path. Recorded in each build folder, so that :func:`load` removes this checkout's earlier
    builds and never another environment's or checkout's (:func:`snip_ds.runtime.jit_builds.prune_superseded_builds`)."""
    return {"python": os.path.realpath(sys.executable), "prefix": os.path.realpath(sys.prefix),
            "source_path": os.path.realpath(SOURCE)}


def _built_here_before_records(folder: Path) -> bool:
    """Whether ``folder``, a build folder written before builds recorded their :func:`build_identity`, is this
    checkout's with this torch: its ``build.ninja`` compiles this :data:`SOURCE` against this torch's headers
    (another checkout compiles its own source, another environment's torch has its own headers)."""
    try:
        text = (folder / "build.ninja").read_text()
    except (OSError, UnicodeDecodeError):
        return False
    compiled = re.findall(r"^build \S+: compile (\S+)$", text, flags=re.M)
    headers = re.findall(r"-isystem (\S+)", text)
    torch_include = os.path.realpath(os.path.join(os.path.dirname(torch.__file__), "include"))
    return ([os.path.realpath(s) for s in compiled] == [os.path.realpath(SOURCE)]
            and torch_include in {os.path.realpath(h) for h in headers})


_fakes_registered = False


def _register_fakes() -> None:
    """Shape functions of the kernels' ops, so that ``torch.compile`` traces calls of them (once a process)."""
    global _fakes_registered
    if _fakes_registered:
        return
    _fakes_registered = True

    @torch.library.register_fake("snip_ds_cpu::tensor_amax")
    def _amax_fake(x, isa):
        return x.new_empty((), dtype=torch.float32)

    @torch.library.register_fake("snip_ds_cpu::quantize")
    def _quantize_fake(x, amax, kind, axis, block, mbits, emin, emax, max_normal, divisor, stochastic, seed, offset,
                       out_bf16, dequantize, isa):
        values = x.new_empty(x.shape, dtype=torch.bfloat16 if out_bf16 else torch.float32)
        return values, x.new_empty((), dtype=torch.float32)


def available() -> bool:
    """Whether the fused kernels run here (compiling them on the first call)."""
    return load()


def unavailable_reason() -> Optional[str]:
    """Why the last :func:`load` failed (None: it did not, or was not tried)."""
    return _error


def load_seconds() -> Optional[float]:
    """Seconds the successful :func:`load` took (the compile, when nothing was cached); None before."""
    return _build_seconds


_isa_level: Optional[int] = None


def isa_level() -> int:
    """The instruction-set variant the kernels run: 2 AVX-512, 1 AVX2, 0 baseline -- torch's own CPU
    capability (``ATEN_CPU_CAPABILITY`` limits both, read at start-up), within what the CPU supports; asked
    once, so a compiled graph reads a constant."""
    global _isa_level
    if _isa_level is None or _ops is None:
        level = _ISA.get(torch.backends.cpu.get_cpu_capability(), 0)
        if _ops is None:
            return level
        _isa_level = min(level, int(_ops.supported_isa()))
    return _isa_level


def _require() -> None:
    if not load():
        raise RuntimeError(f"CPU quantization kernels: unavailable ({_error})")


def _kind(recipe: Recipe) -> int:
    if recipe.block_size == 0:
        return 0
    if recipe.scale == "e8m0":
        return 1
    return 3 if recipe.block_2d else 2


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """``x.abs().amax()`` as a 0-d FP32 tensor (NaN if ``x`` holds one; 0 when empty), in one parallel pass;
    ``x``: 2-D FP32 or BF16 on the CPU."""
    _require()
    check_kernel_input(x, "CPU", "cpu")
    return _ops.tensor_amax(x.contiguous(), isa_level())


def quantize_parts(x: torch.Tensor, recipe: Union[str, Recipe], axis: int = -1, *,
                   tensor_amax: Optional[torch.Tensor] = None, stochastic: bool = False, seed: int = 0,
                   offset: int = 0, out_dtype: torch.dtype = torch.float32) -> QuantParts:
    """:func:`snip_ds.quant.quantize_parts` for a 2-D CPU ``x`` (FP32 or BF16), fused.

    With ``stochastic=False`` the values (converted to ``out_dtype``) and the tensor scale equal the
    reference's bit for bit. Stochastic rounding of element ``(i, j)`` draws Philox-4x32-10 at index
    ``offset + i * cols + j`` with key ``seed`` (the Triton kernels' stream): reproducible from
    ``(seed, offset)``, and a slice of rows from ``r0`` quantized with ``offset = r0 * cols`` and the whole
    tensor's ``tensor_amax`` gets the draws of the whole. Scales are always round-to-nearest-even.

    Args:
        x: 2-D FP32 or BF16 CPU tensor (a non-contiguous one is copied first).
        recipe: a :data:`snip_ds.quant.RECIPES` name or a :class:`~snip_ds.quant.Recipe`.
        axis: the block axis, 0 or 1 (or -2, -1).
        tensor_amax: amax of the whole tensor ``x`` is a slice of (per-tensor FP8, NVFP4); None: ``x``'s own.
        stochastic, seed, offset: stochastic element rounding.
        out_dtype: ``torch.float32`` or ``torch.bfloat16`` (the FP32 values rounded to nearest even).

    Raises:
        RuntimeError: the kernels are unavailable (see :func:`available`).
        ValueError / TypeError: a bad argument; the message names it.
    """
    return _quantize(x, recipe, axis, tensor_amax, stochastic, seed, offset, out_dtype, False)


def fake_quantize(x: torch.Tensor, recipe: Union[str, Recipe], axis: int = -1, *,
                  tensor_amax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`snip_ds.quant.fake_quantize` of ``x`` (as FP32) with round-to-nearest, fused: the FP32
    dequantized tensor, bit for bit, its tensor-level scale multiplied in as the reference multiplies it
    (NVFP4: ``fl(q * fl(s_b * S))``, not the split's ``fl((q * s_b) * S)``). ``x``, ``recipe``, ``axis`` and
    ``tensor_amax`` as in :func:`quantize_parts`; raises as it does."""
    return _quantize(x, recipe, axis, tensor_amax, False, 0, 0, torch.float32, True).values


def _quantize(x, recipe, axis, tensor_amax, stochastic, seed, offset, out_dtype, dequantize) -> QuantParts:
    _require()
    recipe = recipe if isinstance(recipe, Recipe) else get_recipe(recipe)
    check_kernel_input(x, "CPU", "cpu")
    check_kernel_arguments(axis, tensor_amax, seed, offset, out_dtype)
    if isinstance(seed, torch.Tensor) and seed.device.type != "cpu":
        raise ValueError(f"seed: the CPU quantizer takes an int or a one-element int64 CPU tensor, got a tensor on "
                         f"{seed.device}")
    return quantize_checked(x.contiguous(), recipe, axis % 2, tensor_amax, stochastic, seed, offset, out_dtype,
                            dequantize)


_CONSTANTS: dict = {}  # read-only 0-d tensors the kernels are passed where they read nothing from them


def _constant(name: str, dtype: torch.dtype) -> torch.Tensor:
    t = _CONSTANTS.get(name)
    if t is None:
        t = _CONSTANTS[name] = torch.zeros((), dtype=dtype)
    return t


def quantize_checked(x: torch.Tensor, recipe: Recipe, axis: int, tensor_amax: Optional[torch.Tensor],
                     stochastic: bool, seed: Union[int, torch.Tensor], offset: int, out_dtype: torch.dtype,
                     dequantize: bool = False) -> QuantParts:
    """:func:`quantize_parts` for arguments that are known to be valid (the torch backend's own calls: a
    contiguous 2-D FP32/BF16 CPU ``x``, a :class:`~snip_ds.quant.Recipe`, ``axis`` 0 or 1, a 0-d FP32 CPU
    ``tensor_amax`` or None, ``seed`` an int or a 0-d int64 CPU tensor), without checking them again: the
    kernels' own checks still refuse a wrong tensor."""
    kind = _kind(recipe)
    if kind == 1 or x.numel() == 0:
        amax = _constant("amax", torch.float32)  # unused (MX), or nothing to quantize
    elif tensor_amax is not None:
        amax = tensor_amax
        if amax.dtype != torch.float32 or amax.device.type != "cpu" or amax.dim() or amax.requires_grad:
            amax = amax.detach().to(device="cpu", dtype=torch.float32).reshape(())
    else:
        amax = _ops.tensor_amax(x, isa_level())
    if not stochastic:
        seed = _constant("seed", torch.int64)  # not read
    elif not isinstance(seed, torch.Tensor):
        seed = torch.full((), seed, dtype=torch.int64)
    element = recipe.element
    values, scale = _ops.quantize(
        x, amax, kind, axis, recipe.block_size, element.mbits, element.emin, element.emax,
        element.max_normal, _NVFP4_TENSOR_DIVISOR if kind in (2, 3) else element.max_normal, bool(stochastic),
        seed, offset, out_dtype == torch.bfloat16, dequantize, isa_level())
    if x.numel() == 0:
        scale = torch.ones((), dtype=torch.float32)
    return QuantParts(values, scale)


def philox_draws(seed: int, offset: int, n: int) -> torch.Tensor:
    """The 32-bit draws (int64 tensor) that stochastic rounding uses at indices ``offset .. offset + n - 1``."""
    _require()
    return _ops.philox_draws(seed, offset, n)
