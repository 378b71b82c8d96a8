"""Triton's CUDA driver for an sm_90 target on a machine without a GPU: kernels compiled by Triton's own compiler
and ptxas, "loaded" without a GPU, launched through Triton's launch path down to a final launch call that only
counts (and, when asked, records what it was handed). Used by :mod:`triton_launch_path` (host time of the launch
path) and ``tests/test_direct_launch.py`` (snip_ds's direct launches reach the driver as ``JITFunction.run``'s do).

The two Triton versions the direct launcher supports launch differently:

* 3.9: ``CudaLauncher`` is Python over one C entry point, ``utils.launch``, handed the arguments with descriptors
  of their kinds (``PyKernelArg``, from the C module): the launcher runs as it is, the descriptors are Python
  stand-ins and ``utils.launch`` is :class:`NoGpuUtils`'s.
* 3.6: ``CudaLauncher`` compiles a C module per kernel against ``libcuda``, which a machine without a GPU lacks:
  :class:`NoGpuLauncher` stands in for it -- the same scratch allocations, the same arguments, each checked as the
  C module's ``PyArg_ParseTuple`` format and pointer reads would (count, and kind per parameter), then handed to
  :class:`NoGpuUtils`'s launch in 3.9's order.
"""
from __future__ import annotations

import collections
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import List, Optional

TARGET = ("cuda", 90, 32)  # backend, compute capability (sm_90: H100), warp size

_KernelArg = collections.namedtuple("_KernelArg", "nested_tuple type")  # the C module's PyKernelArg, in Python


class NoGpuUtils:
    """What ``CudaUtils`` (Triton's C module for CUDA) gives the launch path, without a GPU: a module "loaded"
    with no registers spilled, the device's shared memory, and a ``launch`` that only counts (``launches``) and,
    while ``recorded`` is a list, appends ``(grid, kernel arguments)`` to it."""

    SHARED_MEM = 232448  # an H100's opt-in shared memory per block, bytes

    def __init__(self) -> None:
        self.launches = 0
        self.recorded: Optional[list] = None

    def launch(self, grid_x, grid_y, grid_z, stream, function, cooperative, pdl, kernel_metadata, launch_metadata,
               enter_hook, exit_hook, global_scratch, profile_scratch, arg_annotations, kernel_signature,
               kernel_args) -> None:
        self.launches += 1
        if self.recorded is not None:
            self.recorded.append(((grid_x, grid_y, grid_z), tuple(kernel_args)))

    @staticmethod
    def load_binary(name, kernel, shared, device):
        return 1, 1, 32, 0, 1024  # module, function, registers, spills, max threads per block

    def get_device_properties(self, device) -> dict:
        return {"max_shared_mem": self.SHARED_MEM, "multiprocessor_count": 132, "max_num_regs": 65536,
                "warpSize": 32, "sm_clock_rate": 1, "mem_clock_rate": 1, "mem_bus_width": 1}

    @staticmethod
    def build_signature_metadata(kernel_signature) -> tuple:
        return tuple(kernel_signature)

    @staticmethod
    def unload_module(module) -> None:
        return None


def _device_zero() -> int:
    return 0


def _stream_zero(device=None) -> int:
    return 0


_INT_RANGES = {"i1": (-2 ** 7, 2 ** 7), "i8": (-2 ** 7, 2 ** 7), "i16": (-2 ** 15, 2 ** 15),
               "i32": (-2 ** 31, 2 ** 31), "i64": (-2 ** 63, 2 ** 63), "u1": (0, 2 ** 8), "u8": (0, 2 ** 8),
               "u16": (0, 2 ** 16), "u32": (0, 2 ** 32), "u64": (0, 2 ** 64)}
_FLOATS = ("fp16", "bf16", "fp32", "f32", "fp64")


def _parses(kind: str, value) -> bool:
    """Whether 3.6's C launcher takes ``value`` for a parameter of ``kind`` (its signature's string): a pointer
    is None, an int or has ``data_ptr()``; an integer kind an int in its C type's range (``PyArg_ParseTuple``'s
    ``b``/``h``/``i``/``L``/``B``/``H``/``I``/``K``; the unsigned ones do not check overflow, the range here is
    the stricter reading); a float kind a number; a constexpr anything."""
    if kind == "constexpr":
        return True
    if kind.startswith("*"):
        return value is None or isinstance(value, int) or hasattr(value, "data_ptr")
    if kind in _FLOATS:
        return isinstance(value, (int, float))
    low, high = _INT_RANGES[kind]
    return isinstance(value, int) and low <= value < high


class NoGpuLauncher:
    """Triton 3.6's ``CudaLauncher`` without its C module (which links ``libcuda``): its scratch allocations as
    3.6 makes them, then the arguments checked as the C module parses them (one per parameter of the kernel's
    signature, constexprs included; each of its kind: :func:`_parses`; where the driver records launches, not in
    timed ones, whose C parse is not timed under 3.9 either) and handed to the active driver's
    ``utils.launch`` in 3.9's order -- ``(grid, stream, function, cooperative, pdl, kernel metadata, launch
    metadata, enter hook, exit hook, global scratch, profile scratch, None, the signature's kinds, the
    arguments)``."""

    def __init__(self, src, metadata) -> None:
        self.kinds = tuple(src.signature.values())
        if any(not isinstance(kind, str) or kind.startswith("tensordesc") for kind in self.kinds):
            raise NotImplementedError(f"NoGpuLauncher: tuple and tensor-descriptor parameters ({self.kinds})")
        self.num_ctas = getattr(metadata, "num_ctas", 1)
        self.global_scratch_size = metadata.global_scratch_size
        self.global_scratch_align = metadata.global_scratch_align
        self.profile_scratch_size = metadata.profile_scratch_size
        self.profile_scratch_align = metadata.profile_scratch_align
        self.launch_cooperative_grid = metadata.launch_cooperative_grid
        self.launch_pdl = metadata.launch_pdl
        from triton.runtime import _allocation
        from triton.runtime.driver import driver

        self._allocation, self._driver = _allocation, driver  # (imported once: launches are timed)

    def _scratch(self, size: int, align: int, allocator, grid: int, stream):
        """A scratch buffer as 3.6's launcher allocates one (none where the kernel asks for none)."""
        return allocator.get()(grid * self.num_ctas * size, align, stream) if size > 0 else None

    def __call__(self, grid_x, grid_y, grid_z, stream, function, *args) -> None:
        grid = grid_x * grid_y * grid_z
        global_scratch = self._scratch(self.global_scratch_size, self.global_scratch_align,
                                       self._allocation._allocator, grid, stream)
        profile_scratch = self._scratch(self.profile_scratch_size, self.profile_scratch_align,
                                        self._allocation._profile_allocator, grid, stream)
        kernel_metadata, launch_metadata, enter_hook, exit_hook = args[:4]
        utils = self._driver.active.utils
        if getattr(utils, "recorded", None) is not None:  # (checked where recorded, not in timed launches)
            self.check(args[4:])
        utils.launch(grid_x, grid_y, grid_z, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                     kernel_metadata, launch_metadata, enter_hook, exit_hook, global_scratch, profile_scratch, None,
                     self.kinds, args[4:])

    def check(self, kernel_args) -> None:
        """Raises TypeError where 3.6's C module would not take ``kernel_args``: not one per parameter, or one
        not of its parameter's kind (:func:`_parses`)."""
        if len(kernel_args) != len(self.kinds):
            raise TypeError(f"launch: {len(kernel_args)} kernel arguments for a signature of {len(self.kinds)}")
        for index, (kind, value) in enumerate(zip(self.kinds, kernel_args)):
            if not _parses(kind, value):
                raise TypeError(f"launch: argument {index} ({type(value).__name__}) is not a {kind}")


def _driver_class(launcher_cls):
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver

    class Sm90Driver(CudaDriver):
        """Triton's CUDA driver for an sm_90 target on a machine without a GPU (:class:`NoGpuUtils`)."""

        def __init__(self) -> None:  # (CudaDriver's builds the C module, which needs libcuda)
            self.utils = NoGpuUtils()
            self.launcher_cls = launcher_cls
            self.get_current_device, self.get_current_stream = _device_zero, _stream_zero
            self.set_current_device = lambda device: None
            self.get_device_capability = lambda device: (TARGET[1] // 10, TARGET[1] % 10)

        def get_current_target(self):
            return GPUTarget(*TARGET)

        def get_active_torch_device(self):
            import torch
            return torch.device("cpu")

        @staticmethod
        def is_active() -> bool:
            return True

    return Sm90Driver


@dataclass
class Compile:
    """One kernel specialization compiled (or loaded from Triton's cache), and the seconds it took."""

    kernel: str
    seconds: float


def install(stack: ExitStack) -> "tuple[object, List[Compile]]":
    """Makes an ``Sm90Driver`` Triton's active driver until ``stack`` closes -- under 3.9 with the CUDA
    launcher's C argument descriptors Python stand-ins, under 3.6 with :class:`NoGpuLauncher` for its
    launcher (see the module docstring); returns the driver and the list every compile is appended to. Must come
    before the first launch of a kernel (Triton fixes a kernel's target at its first launch)."""
    import triton.compiler
    from triton.backends.nvidia import driver as nvidia
    from triton.runtime.driver import driver as config

    launcher_cls = NoGpuLauncher
    if hasattr(nvidia, "PyKernelArg"):  # 3.9's launcher: Python over utils.launch
        launcher_cls = nvidia.CudaLauncher
        for name, value in (("PyKernelArg", _KernelArg), ("ARG_CONSTEXPR", "constexpr"), ("ARG_KERNEL", "kernel"),
                            ("ARG_TUPLE", "tuple")):
            stack.callback(setattr, nvidia, name, getattr(nvidia, name))
            setattr(nvidia, name, value)
    compiles: List[Compile] = []
    real_compile = triton.compiler.compile

    def counted_compile(src, *args, **kwargs):
        begin = time.perf_counter()
        try:
            return real_compile(src, *args, **kwargs)
        finally:
            compiles.append(Compile(getattr(src, "name", str(src)), time.perf_counter() - begin))

    stack.callback(setattr, triton.compiler, "compile", real_compile)
    triton.compiler.compile = counted_compile  # (read by each JITFunction at its first launch)
    drv = _driver_class(launcher_cls)()
    stack.callback(config.set_active, config._active)
    config.set_active(drv)
    return drv, compiles
