"""The GEMM backend interface, the registry of backends, and the choice behind ``backend: auto``.

A backend computes a linear layer's three GEMMs at one precision (linear ``Y = X W^T``, ``X: [T, k]``,
``W: [n, k]``), each operand quantized along the GEMM's contraction axis:

====== ================== =========== ==========================================
GEMM   math               contraction operands (block axis)
====== ================== =========== ==========================================
fprop  ``Y = X W^T``      k           X along k, W along k
dgrad  ``G_X = G_Y W``    n           G_Y along n, W along n
wgrad  ``G_W = G_Y^T X``  T           G_Y and X along T, from the high-precision copies
====== ================== =========== ==========================================

Only this package knows how a GEMM is computed: :class:`~snip_ds.linear.SnipLinear` asks
:func:`layer_backends` for the backend of each of its GEMMs and calls them. Backends:

* ``emulated`` (:mod:`.emulated`): quantize->dequantize in FP32, FP32 GEMM. Any device; the reference.
* ``torch`` (:mod:`.torch_native`): real FP8 GEMMs (``torch._scaled_mm``) where the device has them, else the
  exact grid values in BF16 GEMMs with FP32 accumulation (on a CPU: FP32 GEMMs for FP32 results). CUDA and
  CPU; quantization through fused kernels (Triton on CUDA, :mod:`.cpu`'s C++ on the CPU).
* ``te`` (:mod:`.te`, a :class:`LazyBackend`: imported on first use): Transformer Engine's quantizers and GEMM,
  CUDA only; needs
  Transformer Engine 2.9 - 2.19 (``pip install -e ".[te]"``). Not run on any hardware yet.
* ``auto``: per precision, the fastest backend that exists for the device (see :func:`resolve`): ``torch``
  on CUDA and on the CPU.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Callable, Dict, NamedTuple, Optional, Tuple, Union

import torch

from snip_ds.quant import QuantParts
from snip_ds.quant_config import BACKENDS, QuantConfig
from snip_ds.types import GemmPrecision

class WithAmax(NamedTuple):
    """An operand kept for backward with the tensor amax its forward quantization found (0-d FP32): a
    per-tensor-scaled recipe quantizes it again along another axis from that amax, without an amax pass
    (the weight, whose values do not change between a forward and its backward)."""

    tensor: torch.Tensor
    amax: torch.Tensor


# what a layer keeps of an operand for backward: the tensor itself, its quantized parts, or it and its amax
Kept = Union[torch.Tensor, QuantParts, WithAmax]

log = logging.getLogger("snip_ds.backend")


class BackendError(ValueError):
    """A backend that cannot run a recipe on a device (or does not exist here); the message names the
    backend, the recipe and the device."""


class GemmBackend(ABC):
    """One way of computing the three GEMMs of a quantized linear layer.

    Every GEMM takes the high-precision operands, the precision (``bf16``, ``fp8``, ``fp4``) and the
    :class:`~snip_ds.quant_config.QuantConfig`, and returns its result in ``out_dtype`` (accumulated in FP32).
    ``generator`` is the source of stochastic rounding (FP4 G_Y) and of the random Hadamard signs: a backend
    whose kernels take a seed and an offset draws them from it (:func:`seed_offset`), so the generator's
    state, which checkpoints save, fixes the rounding of a resumed run in every backend.
    """

    name = "base"

    @abstractmethod
    def fprop(self, x: torch.Tensor, w: torch.Tensor, precision: str, cfg: QuantConfig, *,
              bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``Y = Q(X) Q(W)^T + b``. x: [T, k], w: [n, k] -> [T, n]."""

    @abstractmethod
    def dgrad(self, g: torch.Tensor, w: torch.Tensor, precision: str, cfg: QuantConfig,
              generator: Optional[torch.Generator] = None, *,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``G_X = Q(G_Y) Q(W)``. g: [T, n], w: [n, k] -> [T, k]."""

    @abstractmethod
    def wgrad(self, g: torch.Tensor, x: torch.Tensor, precision: str, cfg: QuantConfig,
              generator: Optional[torch.Generator] = None, *,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``G_W = Q(G_Y)^T Q(X)``, both quantized along the tokens. g: [T, n], x: [T, k] -> [n, k]."""

    def fprop_and_keep(self, x: torch.Tensor, w: torch.Tensor, prec: GemmPrecision, cfg: QuantConfig, *,
                       bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.float32
                       ) -> Tuple[torch.Tensor, Kept, Kept]:
        """:meth:`fprop` at ``prec.fprop``, and what the layer keeps from the forward for wgrad (``x``) and
        dgrad (``w``); they are passed back to :meth:`wgrad` and :meth:`dgrad` as their ``x`` and ``w``. The
        default keeps the high-precision tensors (what ``nn.Linear`` keeps), re-quantized in backward; a
        backend may keep an operand as the :class:`~snip_ds.quant.QuantParts` its backward GEMM would make
        of it, when the forward already made exactly that."""
        return self.fprop(x, w, prec.fprop, cfg, bias=bias, out_dtype=out_dtype), x, w

    def kept_x_dtype(self, x: torch.Tensor, prec: GemmPrecision, cfg: QuantConfig) -> Optional[torch.dtype]:
        """The dtype of the values :meth:`fprop_and_keep` keeps of ``x`` as :class:`~snip_ds.quant.QuantParts`
        instead of ``x`` itself, or None where it keeps ``x``; decided from ``x``'s device, shape and dtype
        alone, never its values (the shape functions of :mod:`snip_ds.backend.custom_ops` ask it). A backend
        that overrides :meth:`fprop_and_keep` overrides this too."""
        return None

    def keeps_w_amax(self, x: torch.Tensor, w: torch.Tensor, prec: GemmPrecision, cfg: QuantConfig) -> bool:
        """Whether :meth:`fprop_and_keep` keeps ``w`` as :class:`WithAmax`; decided from the operands' devices,
        shapes and dtypes alone, as :meth:`kept_x_dtype`."""
        return False

    def prepare_grad(self, g: torch.Tensor, prec: GemmPrecision, cfg: QuantConfig) -> Kept:
        """``G_Y`` as :meth:`dgrad` and :meth:`wgrad` (both of this backend) take it in one backward: by
        default ``g`` itself, which each quantizes; a backend may quantize it once, as
        :class:`~snip_ds.quant.QuantParts`, where both GEMMs quantize it identically without random draws
        (so the generator's stream is unchanged)."""
        return g

    def backward_gemms(self, g: torch.Tensor, x_keep: Kept, w_keep: Kept, prec: GemmPrecision, cfg: QuantConfig,
                       generator: Optional[torch.Generator], needs: Tuple[bool, bool], x_dtype: torch.dtype,
                       w_dtype: torch.dtype) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(G_X, G_W)`` of one backward whose dgrad and wgrad both run on this backend (each None where
        ``needs`` says it is not wanted), from what :meth:`fprop_and_keep` kept. The default quantizes G_Y
        once for both where :meth:`prepare_grad` can, then runs :meth:`dgrad` and :meth:`wgrad` in that order
        (the order their random draws come from ``generator``); a backend may run both its own way where it
        gives the same results."""
        g_q = self.prepare_grad(g, prec, cfg) if needs[0] and needs[1] else g
        g_x = self.dgrad(g_q, w_keep, prec.dgrad, cfg, generator, out_dtype=x_dtype) if needs[0] else None
        g_w = self.wgrad(g_q, x_keep, prec.wgrad, cfg, generator, out_dtype=w_dtype) if needs[1] else None
        return g_x, g_w

    def check(self, precision: str, cfg: QuantConfig, device: torch.device) -> None:
        """Raises :class:`BackendError` if this backend cannot run ``precision`` under ``cfg`` on
        ``device``; the default runs everything everywhere."""

    def step_settings(self) -> tuple:
        """What, beside a layer's precision, config, operand shapes, dtypes and device, decides the step this
        backend runs the layer with (its device lists, its kernels): a layer that remembers its step
        (:class:`~snip_ds.backend.layer_step.StepMemo`) takes it again only while these compare equal. The
        default: nothing."""
        return ()


class LazyBackend:
    """A registered backend built on first use, because building it imports something large or optional
    (``te``: Transformer Engine). ``load(prefix)`` builds it or raises :class:`BackendError` starting with
    ``prefix``; ``devices`` are the device types it can run on at all, so that :func:`resolve` refuses another
    device before importing anything, with ``device_note`` as the reason."""

    def __init__(self, name: str, devices: Tuple[str, ...], device_note: str,
                 load: Callable[[str], GemmBackend]) -> None:
        self.name, self.devices, self.device_note, self.load = name, devices, device_note, load


_REGISTRY: Dict[str, Union[GemmBackend, LazyBackend]] = {}
_LAYER_BACKENDS: Dict[tuple, Tuple[GemmBackend, GemmBackend, GemmBackend]] = {}
_REGISTRATIONS = [0]  # how many times register() ran: what anything remembered of the registry is checked against


def register(backend: Union[GemmBackend, LazyBackend]) -> Union[GemmBackend, LazyBackend]:
    """Adds ``backend`` (or a :class:`LazyBackend`) to the registry under its ``name``, replacing one of the
    same name."""
    _REGISTRY[backend.name] = backend
    _LAYER_BACKENDS.clear()
    _REGISTRATIONS[0] += 1
    return backend


def registrations() -> int:
    """How many times :func:`register` ran: a decision taken from the registry (which backend runs a layer) holds
    while this number is unchanged (:class:`~snip_ds.backend.layer_step.StepMemo` checks it)."""
    return _REGISTRATIONS[0]


def _entry(name: str) -> Union[GemmBackend, LazyBackend]:
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        valid = ", ".join(b for b in BACKENDS if b != "auto")
        raise ValueError(f"backend: unknown backend {name!r}; valid: {valid}") from None


def get_backend(name: str = "emulated") -> GemmBackend:
    """The backend registered under ``name`` (not ``auto``: see :func:`resolve`); a ValueError lists the valid
    names. A :class:`LazyBackend` (``te``) is built on first use: a :class:`BackendError` says why it cannot
    be (for ``te``: Transformer Engine does not import, or its version is not supported)."""
    entry = _entry(name)
    return entry.load(f"backend {name!r}") if isinstance(entry, LazyBackend) else entry


def recipe_words(precision: str, cfg: QuantConfig) -> str:
    """The recipe a precision runs under ``cfg``, as the error messages name it."""
    if precision == "fp8":
        return cfg.fp8_recipe
    if precision == "fp4":
        return cfg.fp4_recipe + ("" if cfg.fp4_recipe != "nvfp4" or not cfg.weight_2d else " (2-D weight blocks)")
    return precision


# ------------------------------------------------------------------------------------------------------
# auto: what runs fastest where
# ------------------------------------------------------------------------------------------------------

# CUDA: the torch backend (FP8 tensor cores through torch._scaled_mm, BF16 tensor cores for the block
# recipes; not measured yet). CPU: the torch backend with the fused CPU quantization kernels
# (benchmarks/results/bench_backends*.md).
_AUTO_TORCH_DEVICES = ("cuda", "cpu")
_logged: set = set()


def resolve(name: str, precision: str, cfg: QuantConfig, device: Union[str, torch.device]) -> GemmBackend:
    """The backend that runs ``precision`` on ``device`` for the setting ``name``.

    ``auto``: ``torch`` for ``fp8`` and ``fp4`` on CUDA and on the CPU, ``emulated`` on other devices and for
    ``bf16`` (an FP32 GEMM of the high-precision operands either way). On the CPU the torch backend quantizes
    with the fused kernels of :mod:`snip_ds.backend.cpu` and streams its operands as the emulated backend does:
    benchmarks/results/bench_backends*.md measure it faster than the emulated backend for every recipe, at the
    same peak memory. The rule depends on the device type and the precision only -- not on a timing taken at
    start-up, nor on whether the fused kernels built -- so every rank and every resumed run pick the same
    backend; where the kernels did not build, the torch backend quantizes with :mod:`snip_ds.quant` (the same
    values with stochastic rounding off; stochastic rounding then draws from the layer's generator as the
    emulated backend does, instead of the kernels' Philox stream).
    The choice is logged once per device and precision. A named backend is checked, never swapped.

    Raises:
        BackendError: the backend cannot run this recipe on this device (naming all three).
    """
    device = torch.device(device)
    if name == "auto":
        if precision == "bf16":
            chosen = "emulated"  # an FP32 GEMM of the high-precision operands either way
        elif device.type in _AUTO_TORCH_DEVICES:
            chosen = "torch"
        else:
            chosen = "emulated"
        key = (device.type, precision, recipe_words(precision, cfg), chosen)
        if precision != "bf16" and key not in _logged:
            _logged.add(key)
            log.info("backend auto: %s (%s) runs on the %r backend on %s", precision,
                     recipe_words(precision, cfg), chosen, device.type)
        name = chosen
    entry = _entry(name)
    if isinstance(entry, LazyBackend):
        where = f"backend {name!r} cannot run {recipe_words(precision, cfg)} on {device}"
        if device.type not in entry.devices:  # before building it: the device rules it out anyway
            raise BackendError(f"{where}: {entry.device_note}; choose backend 'torch', 'emulated' or 'auto'")
        entry = entry.load(where)
    entry.check(precision, cfg, device)
    return entry


def check_backend(cfg: QuantConfig, device: Union[str, torch.device]) -> None:
    """Raises :class:`BackendError` unless ``cfg.backend`` can run every precision on ``device``; called
    before training starts so that a wrong choice is one clear error, not a failure mid-run."""
    for precision in ("fp8", "fp4"):
        resolve(cfg.backend, precision, cfg, device)


def layer_backends(prec: GemmPrecision, cfg: QuantConfig,
                   device: Union[str, torch.device]) -> Tuple[GemmBackend, GemmBackend, GemmBackend]:
    """The backends of a layer's fprop, dgrad and wgrad: resolved once per (precisions, config, device) --
    every argument is immutable and :func:`resolve` depends on nothing else -- and remembered, so a forward
    does not resolve again (:func:`register` forgets the answers)."""
    key = (prec, cfg, torch.device(device))
    found = _LAYER_BACKENDS.get(key)
    if found is None:
        found = _LAYER_BACKENDS[key] = (resolve(cfg.backend, prec.fprop, cfg, device),
                                        resolve(cfg.backend, prec.dgrad, cfg, device),
                                        resolve(cfg.backend, prec.wgrad, cfg, device))
    return found


def seed_offset(generator: Optional[torch.Generator]) -> Tuple[int, int]:
    """A (seed, offset) pair for kernels that take their randomness that way, drawn from ``generator`` (or
    torch's default generator): the generator advances, so consecutive calls get fresh randomness and a
    restored generator state gives the same pairs again."""
    device = generator.device if generator is not None else "cpu"
    seed = int(torch.randint(0, 2 ** 62, (), generator=generator, device=device))
    return seed, 0


def kernel_seed(generator: Optional[torch.Generator],
                device: Union[str, torch.device, None] = None) -> Union[int, torch.Tensor]:
    """The seed of a fused quantization kernel's stochastic rounding, drawn from ``generator`` (or torch's
    default CPU generator) as :func:`seed_offset` draws it. Where the generator lives on the kernel's
    ``device`` (None: on the generator's own), a one-element int64 tensor there, which the kernel reads itself:
    drawing the seed reads no tensor on the host and never waits for a device (and a CUDA graph replays the
    draw). A generator on another device than the kernel's (a CPU generator for CUDA kernels) gives an int: a
    read of host memory. The generator advances either way: a restored state gives the same seed."""
    gen_device = generator.device if generator is not None else torch.device("cpu")
    if device is not None and torch.device(device).type != gen_device.type:
        return seed_offset(generator)[0]
    return torch.randint(0, 2 ** 62, (), generator=generator, device=gen_device)


def check_kernel_input(x, quantizer: str, device: Optional[str]) -> None:
    """The input of a fused quantization kernel: a 2-D float32 or bfloat16 tensor on ``device`` (None: any),
    else TypeError/ValueError naming ``x`` and the ``quantizer`` ("CPU", "Triton")."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"x: the {quantizer} quantizer takes float32 or bfloat16, got {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"x: the {quantizer} quantizer takes a 2-D tensor, got shape {tuple(x.shape)}")
    if device is not None and x.device.type != device:
        raise ValueError(f"x: the {quantizer} quantizer needs a {device.upper()} tensor, got device {x.device}")


def check_kernel_arguments(axis, tensor_amax, seed, offset, out_dtype) -> None:
    """The arguments the fused quantization kernels (CPU and Triton) share, checked alike: ValueError naming
    the field."""
    if isinstance(axis, bool) or not isinstance(axis, int) or not -2 <= axis <= 1:
        raise ValueError(f"axis: expected 0 or 1 (or -2, -1) for a 2-D tensor, got {axis!r}")
    if tensor_amax is not None and (not isinstance(tensor_amax, torch.Tensor) or tensor_amax.numel() != 1
                                    or not tensor_amax.is_floating_point()):
        raise ValueError(f"tensor_amax: expected a one-element floating-point tensor, got {tensor_amax!r}")
    if isinstance(seed, torch.Tensor):  # its value is not read here: that would wait for a GPU
        if seed.dtype != torch.int64 or seed.numel() != 1:
            raise ValueError(f"seed: expected an int or a one-element int64 tensor, got a tensor of dtype "
                             f"{seed.dtype} and shape {tuple(seed.shape)}")
    elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63:
        raise ValueError(f"seed: expected an int in [0, 2**63), got {seed!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < 2 ** 63:
        raise ValueError(f"offset: expected an int in [0, 2**63), got {offset!r}")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out_dtype: expected torch.float32 or torch.bfloat16, got {out_dtype!r}")
