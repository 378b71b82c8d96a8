"""What a piece of eager torch code dispatches: every operator it runs, and every read of a tensor's value on the host.

A training step that reads a tensor's value on the host (``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``,
``t.cpu()`` of a device tensor, an operator whose output size depends on the values, such as ``nonzero``)
makes the host wait for the device there, and cannot be captured in a CUDA graph. On a CPU nothing waits, so
such a read goes unnoticed -- unless it is looked for where it is made. :class:`HostReads` looks on any
device, at both levels where a read can be asked for:

* the Python level (a ``TorchFunctionMode``): ``Tensor.item``, ``tolist``, ``numpy``, ``__bool__``,
  ``__int__``, ``__float__``, ``__index__``, and ``cpu``/``to`` of a tensor that is not on the CPU;
* the operator level (a ``TorchDispatchMode``): ``aten::_local_scalar_dense`` (what every scalar read
  dispatches), the operators whose output shape depends on the values (``nonzero``, ``masked_select``,
  ``unique``, ...), indexing with a boolean mask, ``aten::equal``, and copies from a device to the CPU.

A kernel that reads a value itself (a Triton kernel reading its seed from device memory, a CPU kernel reading
an amax from CPU memory) is not a host read: it reads where the data lives, and runs in stream order.

:class:`OpCounter` counts the operators a piece of code dispatches, split into those that run a kernel and
those that only make a view or read metadata -- on CUDA about one launch per kernel-running operator -- plus
the launches of snip_ds's Triton kernels, which are not dispatched operators. Both are for tests and
benchmarks; nothing in training uses them.
"""
from __future__ import annotations

import traceback
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# operators whose output size (or result) depends on the values they read: the host must wait for them
_VALUE_DEPENDENT_OPS = frozenset({
    "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal", "aten::allclose",
    "aten::nonzero", "aten::nonzero_static", "aten::masked_select", "aten::_unique", "aten::_unique2",
    "aten::unique_dim", "aten::unique_consecutive", "aten::unique_dim_consecutive", "aten::bincount",
    "aten::repeat_interleave", "aten::histc", "aten::_assert_async",
})
_PY_SCALAR_READS = frozenset({"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__",
                              "__complex__", "__array__"})
_PY_MOVES = frozenset({"cpu", "to"})


@dataclass
class HostRead:
    """One read of a tensor's value on the host: what asked for it and where (the innermost frames of
    snip_ds and of the caller)."""

    what: str
    where: str

    def __str__(self) -> str:
        return f"{self.what} at {self.where}"


def _where() -> str:
    frames = [f for f in traceback.extract_stack()[:-3]
              if "torch/" not in f.filename and "dispatch_audit" not in f.filename]
    return " <- ".join(f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno} {f.name}"
                       for f in reversed(frames[-3:])) or "?"


def _name(func) -> str:
    schema = getattr(func, "_schema", None)
    return schema.name if schema is not None else str(func)


def _leaves_device(args, kwargs) -> bool:
    """Whether a ``cpu()``/``to(...)`` call moves a non-CPU tensor to the CPU."""
    if not args or not isinstance(args[0], torch.Tensor) or args[0].device.type == "cpu":
        return False
    target = kwargs.get("device")
    rest = [a for a in args[1:] if isinstance(a, (str, torch.device))]
    if target is None and rest:
        target = rest[0]
    if target is None and args[1:] and isinstance(args[1], torch.Tensor):
        target = args[1].device
    return target is None or torch.device(target).type == "cpu"


class _FunctionLevel(TorchFunctionMode):
    def __init__(self, reads: List[HostRead]) -> None:
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _PY_SCALAR_READS:
            self.reads.append(HostRead(f"Tensor.{name}", _where()))
        elif name == "cpu" and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
            self.reads.append(HostRead("Tensor.cpu of a device tensor", _where()))
        elif name == "to" and _leaves_device(args, kwargs):
            self.reads.append(HostRead("Tensor.to(cpu) of a device tensor", _where()))
        return func(*args, **kwargs)


class _DispatchLevel(TorchDispatchMode):
    def __init__(self, reads: List[HostRead]) -> None:
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if name in _VALUE_DEPENDENT_OPS:
            self.reads.append(HostRead(name, _where()))
        elif name == "aten::index" and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                           for i in (args[1] if len(args) > 1 else ()) or ()):
            self.reads.append(HostRead("aten::index with a boolean mask", _where()))
        elif name in ("aten::_to_copy", "aten::copy_"):
            src = args[1] if name == "aten::copy_" else args[0]
            dst_device = args[0].device if name == "aten::copy_" else kwargs.get("device")
            if (isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst_device is not None
                    and torch.device(dst_device).type == "cpu"):
                self.reads.append(HostRead(f"{name} from {src.device} to the CPU", _where()))
        return func(*args, **kwargs)


class HostReads:
    """Records every host read of a tensor's value made inside the ``with`` block (see the module docstring);
    ``reads`` lists them after. Not for code under ``torch.compile`` (it would graph-break)."""

    def __init__(self) -> None:
        self.reads: List[HostRead] = []
        self._stack: Optional[ExitStack] = None

    def __enter__(self) -> "HostReads":
        self._stack = ExitStack()
        self._stack.enter_context(_FunctionLevel(self.reads))
        self._stack.enter_context(_DispatchLevel(self.reads))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


@dataclass
class OpCounts:
    """What :class:`OpCounter` saw: ``kernels`` (operator -> calls) of the operators that run a kernel,
    ``views`` of those that only alias or read metadata, ``triton`` (kernel -> launches) of snip_ds's Triton
    kernels."""

    kernels: Counter = field(default_factory=Counter)
    views: Counter = field(default_factory=Counter)
    triton: Counter = field(default_factory=Counter)
    inside_launch: int = 0  # > 0 while a Triton kernel runs: its interpreter's own operators are not counted

    @property
    def launches(self) -> int:
        """Operators that run a kernel plus Triton launches: on CUDA about the kernel launches."""
        return sum(self.kernels.values()) + sum(self.triton.values())

    def as_dict(self) -> Dict[str, object]:
        return {"launches": self.launches, "kernel_ops": sum(self.kernels.values()),
                "view_ops": sum(self.views.values()), "triton_launches": sum(self.triton.values()),
                "by_op": dict(sorted((self.kernels + self.triton).items(), key=lambda kv: (-kv[1], kv[0])))}


_NO_KERNEL = frozenset({"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::detach", "aten::alias",
                        "aten::lift_fresh", "aten::_reshape_alias", "aten::set_", "aten::resize_"})


def _is_view(func) -> bool:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    if _name(func) in _NO_KERNEL:
        return True
    returns = schema.returns
    # a view: every output aliases an input without writing to it (Tensor(a) returned from Tensor(a) input)
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class _Counting(TorchDispatchMode):
    def __init__(self, counts: OpCounts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.counts.inside_launch:
            (self.counts.views if _is_view(func) else self.counts.kernels)[_name(func)] += 1
        return func(*args, **(kwargs or {}))


class _CountedKernel:
    """A Triton kernel whose launches (``kernel[grid](...)``) are counted."""

    def __init__(self, kernel, name: str, counts: OpCounts) -> None:
        self.kernel, self.name, self.counts = kernel, name, counts

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def counted(*args, **kwargs):
            self.counts.triton[f"triton::{self.name}"] += 1
            self.counts.inside_launch += 1  # (under the interpreter the kernel itself runs torch operators)
            try:
                return launch(*args, **kwargs)
            finally:
                self.counts.inside_launch -= 1
        return counted


class OpCounter:
    """Counts what the ``with`` block dispatches (:class:`OpCounts` in ``counts``): operators, and launches of
    snip_ds's Triton quantization kernels when their module is imported."""

    def __init__(self) -> None:
        self.counts = OpCounts()
        self._stack: Optional[ExitStack] = None

    def __enter__(self) -> "OpCounter":
        import sys

        self._stack = ExitStack()
        kq = sys.modules.get("snip_ds.backend.kernels.quantize")
        if kq is not None:
            for attr in ("_quantize_kernel", "_amax_kernel"):
                original = getattr(kq, attr)
                setattr(kq, attr, _CountedKernel(original, attr.strip("_"), self.counts))
                self._stack.callback(setattr, kq, attr, original)
        self._stack.enter_context(_Counting(self.counts))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
