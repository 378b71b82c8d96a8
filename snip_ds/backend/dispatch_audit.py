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

Both look inside tensor subclasses (torchao's ``Float8TrainingTensor``, any wrapper subclass with its own
``__torch_dispatch__``): an operator called on a subclass is handed on to the subclass (the mode returns
``NotImplemented``), which runs its own operators on plain tensors with the mode still active, so those are
what is counted and checked -- the operator on the subclass itself runs no kernel of its own and is listed
apart (:attr:`OpCounts.subclass`). Whether an operator ran a kernel is decided from what it did, not from its
schema alone: one that writes an argument (in place, ``out=``) or returns a tensor in new memory ran one; one
whose every output shares an input's storage (a view; ``aten::contiguous``, ``reshape`` or ``_unsafe_view``
of a tensor that needed no copy) did not, whatever its schema says -- ``aten::contiguous`` is annotated as
an alias yet copies a non-contiguous tensor.
"""
from __future__ import annotations

import traceback
import weakref
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.utils._pytree as pytree
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


def _is_subclass(t) -> bool:
    """A tensor subclass with a ``__torch_dispatch__`` of its own (torch.Tensor and Parameter have none)."""
    return isinstance(t, torch.Tensor) and type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


def _subclass_call(args, kwargs) -> bool:
    """Whether an operator's arguments hold a tensor subclass: then a mode hands the call on to it
    (``NotImplemented``) and sees the operators it runs on plain tensors."""
    return any(_is_subclass(t) for t in pytree.tree_leaves((args, kwargs)))


class _DispatchLevel(TorchDispatchMode):
    def __init__(self, reads: List[HostRead]) -> None:
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _subclass_call(args, kwargs):
            return NotImplemented  # the subclass's own operators, on plain tensors, come here next
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
    subclass: Counter = field(default_factory=Counter)  # operators called on tensor subclasses (no kernel)
    inside_launch: int = 0  # > 0 while a Triton kernel runs: its interpreter's own operators are not counted

    @property
    def launches(self) -> int:
        """Operators that run a kernel plus Triton launches: on CUDA about the kernel launches."""
        return sum(self.kernels.values()) + sum(self.triton.values())

    def as_dict(self) -> Dict[str, object]:
        return {"launches": self.launches, "kernel_ops": sum(self.kernels.values()),
                "view_ops": sum(self.views.values()), "triton_launches": sum(self.triton.values()),
                "subclass_ops": sum(self.subclass.values()),
                "by_op": dict(sorted((self.kernels + self.triton).items(), key=lambda kv: (-kv[1], kv[0])))}


_NO_KERNEL = frozenset({"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
                        "aten::new_empty_strided", "aten::detach", "aten::alias", "aten::lift_fresh",
                        "aten::_reshape_alias", "aten::set_", "aten::resize_"})


def _storage(t: torch.Tensor) -> Optional[int]:
    """The address of ``t``'s storage, or None where it has none to compare (empty, meta, a subclass)."""
    try:
        if t.numel() == 0 or t.device.type == "meta" or _is_subclass(t):
            return None
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def runs_kernel(func, args, kwargs, out) -> bool:
    """Whether the call ``func(*args, **kwargs) -> out`` ran a kernel: it wrote an argument (in place,
    ``out=``) or returned a tensor outside its inputs' storages, or returned no tensor at all (a scalar read,
    a check); not an allocation without a fill (``empty``), nor a view -- every output in an input's storage,
    whatever the schema's alias annotation says (``aten::contiguous`` of a non-contiguous tensor copies)."""
    name = _name(func)
    if name in _NO_KERNEL:
        return False
    schema = getattr(func, "_schema", None)
    if schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return True
    outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    if not outs:
        return True
    inputs = {_storage(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    inputs.discard(None)
    fresh = [t for t in outs if t.numel() > 0 and _storage(t) not in inputs]
    return bool(fresh)


class _Counting(TorchDispatchMode):
    def __init__(self, counts: OpCounts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counts.inside_launch:
            return func(*args, **kwargs)
        if _subclass_call(args, kwargs):
            self.counts.subclass[_name(func)] += 1
            return NotImplemented  # the subclass runs its own operators on plain tensors: counted next
        out = func(*args, **kwargs)
        (self.counts.kernels if runs_kernel(func, args, kwargs, out) else self.counts.views)[_name(func)] += 1
        return out


class _CountedKernel:
    """A Triton kernel whose launches (``kernel[grid](...)``) are counted (``counts``) and, unless ``run``,
    not run: the launch returns at once, its outputs left as allocated -- the host's work up to the launch,
    without the kernel (what a benchmark times when the kernel's arithmetic would run on the host, under
    Triton's interpreter)."""

    def __init__(self, kernel, name: str, counts: Optional[OpCounts], run: bool = True) -> None:
        self.kernel, self.name, self.counts, self.run = kernel, name, counts, run

    def __getitem__(self, grid):
        if not self.run:
            def skipped(*args, **kwargs):
                if self.counts is not None:
                    self.counts.triton[f"triton::{self.name}"] += 1
            return skipped
        launch = self.kernel[grid]

        def counted(*args, **kwargs):
            if self.counts is None:
                return launch(*args, **kwargs)
            self.counts.triton[f"triton::{self.name}"] += 1
            self.counts.inside_launch += 1  # (under the interpreter the kernel itself runs torch operators)
            try:
                return launch(*args, **kwargs)
            finally:
                self.counts.inside_launch -= 1
        return counted


def _triton_kernels() -> List[Tuple[object, str]]:
    """(module, attribute) of every Triton kernel launched from the host in snip_ds's imported kernel modules
    (``snip_ds.backend.kernels.*``): the jitted functions whose names end in ``kernel`` (the others are device
    functions, called from kernels)."""
    import sys

    found = []
    for mod_name, module in list(sys.modules.items()):
        if not mod_name.startswith("snip_ds.backend.kernels.") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            kind = type(value).__name__
            if attr.endswith("kernel") and kind in ("JITFunction", "InterpretedFunction", "_CountedKernel"):
                found.append((module, attr))
    return found


def patch_triton_launches(stack: ExitStack, counts: Optional[OpCounts], run: bool = True) -> int:
    """Wraps every launch of snip_ds's Triton kernels (:func:`_triton_kernels`) until ``stack`` closes: counted
    into ``counts`` (None: not counted), and run only if ``run``. Returns how many kernels were wrapped."""
    kernels = _triton_kernels()
    for module, attr in kernels:
        original = getattr(module, attr)
        setattr(module, attr, _CountedKernel(original, attr.strip("_"), counts, run))
        stack.callback(setattr, module, attr, original)
    return len(kernels)


class OpCounter:
    """Counts what the ``with`` block dispatches (:class:`OpCounts` in ``counts``): operators, and launches of
    snip_ds's Triton quantization kernels when their module is imported."""

    def __init__(self) -> None:
        self.counts = OpCounts()
        self._stack: Optional[ExitStack] = None

    def __enter__(self) -> "OpCounter":
        self._stack = ExitStack()
        patch_triton_launches(self._stack, self.counts)
        self._stack.enter_context(_Counting(self.counts))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


# ---------------------------------------------------------------------------------------------------------
# the same count from a torch.profiler trace: for compiled code, which runs no Python dispatch mode
# ---------------------------------------------------------------------------------------------------------

_VIEW_NAMES: Dict[str, bool] = {}


def _view_by_name(name: str) -> bool:
    """Whether the operator ``name`` (``aten::t``) only aliases by its schema (its default overload's, else
    its first), or allocates without a fill (:data:`_NO_KERNEL`)."""
    if name not in _VIEW_NAMES:
        view = name in _NO_KERNEL
        if not view and name.startswith("aten::"):
            packet = getattr(torch.ops.aten, name[len("aten::"):], None)
            overloads = packet.overloads() if packet is not None else []
            if overloads:
                schema = getattr(packet, "default" if "default" in overloads else overloads[0])._schema
                writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
                view = (not writes and bool(schema.returns)
                        and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns))
        _VIEW_NAMES[name] = view
    return _VIEW_NAMES[name]


_COMPOSITE: Dict[str, bool] = {}


def _composite(name: str) -> bool:
    """Whether the operator ``name`` decomposes before it reaches a dispatch mode (a CompositeImplicitAutograd
    kernel in any overload: ``aten::contiguous``, ``aten::matmul``, ``aten::item``): a dispatch mode sees the
    operators it calls, not it. A profile's event names no overload; the named-tensor overloads (dimensions by
    name: ``sum.dim_DimnameList``, composite where a torch still ships them, 2.11's) are left out, as no
    training step calls them -- else ``aten::sum`` would count as composite, and its kernel's own ``fill_`` as
    what ran."""
    if name not in _COMPOSITE:
        found = False
        packet = getattr(torch.ops.aten, name[len("aten::"):], None) if name.startswith("aten::") else None
        for overload in (packet.overloads() if packet is not None else []):
            if "dimname" in overload.lower() or "names" in overload.lower():
                continue
            full = name if overload == "default" else f"{name}.{overload}"
            try:
                found = found or torch._C._dispatch_has_kernel_for_dispatch_key(full, "CompositeImplicitAutograd")
            except RuntimeError:
                continue
        _COMPOSITE[name] = found
    return _COMPOSITE[name]


def _dispatched(events) -> List[object]:
    """The events of a ``torch.profiler`` trace that a dispatch mode would have seen as operators (the
    outermost operator calls, through composite ones), and inductor's generated kernels (``cpp_fused_*`` with
    ``torch._inductor.config.cpp.enable_kernel_profile``, ``triton_*``): what a CPU operator does inside
    (``aten::_scaled_mm``'s casts and host reads of its scales on a CPU) is not what a GPU launches."""
    found = []

    def visit(ev) -> None:
        name = ev.name
        if "cpp_fused" in name or name.startswith(("triton_", "snip_ds_cpu::")) or (
                name.startswith(("aten::", "prims::")) and not _composite(name)):
            found.append(ev)
            return
        for child in ev.cpu_children:
            visit(child)

    for ev in events:
        if ev.cpu_parent is None and ev.device_type == torch.autograd.DeviceType.CPU:
            visit(ev)
    return found


def profiled_kernels(events) -> Counter:
    """Kernel-running operators in a finished ``torch.profiler`` trace's CPU events (``prof.events()``), by
    name: what :class:`OpCounter` counts, for code it cannot see (a compiled graph runs its kernels without
    dispatching operators to Python) -- the operators a dispatch mode would see (:func:`_dispatched`) less
    those that only alias or allocate by their schema, and each call of an inductor-generated kernel. Triton
    kernels launched from Python (snip_ds's) are not profiler events: count them with
    :func:`patch_triton_launches`. Two things only the counter sees: a copy that an aliasing operator makes
    (the profile has no storages), and the operators a tensor subclass runs (the profile shows the operator
    on the subclass as one; a compiled graph has none left, dynamo traces through them)."""
    return Counter(ev.name for ev in _dispatched(events) if not _view_by_name(ev.name))


def profiled_host_reads(events) -> Counter:
    """The operators a dispatch mode would see in a ``torch.profiler`` trace that read a value on the host
    (:data:`_VALUE_DEPENDENT_OPS`; a copy to the CPU is not told apart there): for compiled code, which
    :class:`HostReads` cannot watch."""
    return Counter(ev.name for ev in _dispatched(events) if ev.name in _VALUE_DEPENDENT_OPS)


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes of live tensors that operators inside the ``with`` block allocated (``peak``,
    ``live`` now): each output in new memory (not an input's storage: views and in-place results are not
    allocations) counts its storage's bytes until that storage is freed (a finalizer on it), inside tensor
    subclasses too. What the tensors hold, not what the allocator reserves (a CPU kernel's own scratch
    buffers are not counted); storages that existed before the block (parameters, inputs) never are."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._held: Dict[int, int] = {}

    def _free(self, ptr: int) -> None:
        self.live -= self._held.pop(ptr, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _subclass_call(args, kwargs):
            return NotImplemented
        out = func(*args, **kwargs)
        inputs = {_storage(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            ptr = _storage(t) if isinstance(t, torch.Tensor) else None
            if ptr is None or ptr in inputs or ptr in self._held:
                continue
            storage = t.untyped_storage()
            self._held[ptr] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, ptr)
        return out
