"""Eager launches of compiled Triton kernels straight through the kernel Triton compiled for them, without
Triton's per-call argument binding.

``JITFunction.run`` (what ``kernel[grid](*args, **constexprs)`` calls) binds every argument, computes the
specialization of each (dtype and 16-byte alignment of a tensor; of an int: equal to 1, divisible by 16, its
width), builds the cache key and looks the compiled kernel up: about 6-41 µs of host time a launch for snip_ds's
kernels (benchmarks/triton_launch_path.py; more the more arguments). :class:`DirectLauncher` keeps, per
JITFunction, the compiled kernel Triton picked for each class of call, and launches later calls of the same class
through it (``CompiledKernel[grid]``): what is left is computing the class (about 0.2 µs an argument) and the
compiled kernel's own launcher -- the 61-argument grouped quantization about 13-20 µs against 41-69 µs, the
10-argument amax no faster (6 µs, measured on a CPU with Triton 3.9; noisy):

- the class (:meth:`DirectLauncher.key`): the current device; the runtime knobs that enter Triton's key (the debug
  flag, the instrumentation mode, 3.9's FP sanitizer casts); the constexpr keyword arguments (name, type, value:
  ints, bools, strings, None, floats but zero and NaN); and per positional argument a class that is a superset of
  what Triton specializes on: a tensor its dtype and whether ``data_ptr() % 16 == 0``; a bool its value; an int
  whether it is 1, whether divisible by 16, whether it fits int32, whether it fits int64 (else uint64); a float
  nothing (``fp32`` whatever its value); None itself. Anything else (a tensor descriptor, a tuple, a numpy int, a
  float constexpr of 0 or NaN, a keyword that is not a constexpr parameter after the positional ones, a constexpr
  given positionally, a grid that is not a tuple of 1-3 ints) launches through the JITFunction, every time.
- why equal classes mean the same compiled kernel, on the Triton versions in :data:`SUPPORTED` (their
  ``runtime/jit.py``, ``compiler/compiler.py`` and ``knobs.py`` read for this): Triton's cache key is
  ``compute_cache_key(kernel_key_cache, specialization, options)`` in the device's ``device_caches``; the
  specialization of a positional argument is ``native_specialize_impl(backend, arg, is_const, specialize,
  align)``, whose result depends only on the argument's type, a tensor's dtype and ``data_ptr() % 16``, an int's
  value being 1, its divisibility by 16 and its range (i32/i64/u64), a bool's type (``u1``), a float's (``fp32``,
  whatever its value) -- each a function of the class above (3.6's and 3.9's ``libtriton`` called on 1, 0, 16,
  17, -16, 2**31 - 1, 2**31, 2**32, 2**63, -2**31, -2**31 - 1, bools, floats, None, aligned and misaligned
  tensors of three dtypes: the same results; and end to end under both, tests/test_direct_launch.py); ``is_const``,
  ``specialize`` and ``align`` are fixed per parameter; a constexpr's specialization is its value (the class holds
  it, with its type: ``True == 1`` in a dict, not in Triton's key); ``options`` are the keyword arguments (here
  constexprs only, else no direct path) plus ``debug`` (the kernel's own, fixed, or ``knobs.runtime.debug``),
  ``knobs.compilation.instrumentation_mode`` and, in 3.9, ``knobs.compilation.fpsan_homomorphic_casts`` -- in the
  class. ``knobs.runtime.add_stages_inspection_hook`` (3.9) adds to the key: set, no direct path. Pre-run hooks
  (``kernel.pre_run_hooks``) run only in ``JITFunction.run``: any, no direct path.
- what the launch hands the launcher: ``JITFunction.run`` calls ``kernel.run(grid_0, grid_1, grid_2, stream,
  kernel.function, kernel.packed_metadata, launch_metadata, enter_hook, exit_hook, *bound_args.values())`` -- every
  parameter's value in declaration order, constexprs included (the launcher drops them) -- and
  ``CompiledKernel[grid](*args, stream=stream)`` calls ``self.run(grid[0], grid[1], grid[2], stream, self.function,
  self.packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``: the same call when ``args`` are the
  positional arguments followed by the constexprs' values in declaration order (:attr:`Entry.tail`: given, else
  the parameter's default) and the grid is padded to three dimensions with ones, as ``JITFunction.run`` pads it.
  Both build ``launch_metadata`` with ``kernel.launch_metadata(grid, stream, *all values)``: with the enter hook
  knob a ``HookChain`` (never None in 3.6 and 3.9), a dict of the kernel's name, function handle and stream, and
  what a kernel's own ``launch_metadata`` function makes of the grid, which ``JITFunction.run`` passes as given and
  the runner padded (no direct path for a kernel with such a function). A hook installed (a ``HookChain`` with
  calls): no direct path. The check that the globals a kernel read have not changed since it was compiled
  (``used_global_vals``) is made here too, before each direct launch (:meth:`DirectLauncher._check_globals`).
- 3.6's ``JITFunction.run`` may hold a future where compiles are asynchronous (``kernel.result()``); it returns
  the ``CompiledKernel``, which is all that is kept (anything else: no direct path for that class).

snip_ds's call sites launch through :func:`launch` (``quantize.run_kernel``): the constexprs come as read-only
mappings made once per launch configuration, so their part of the class (names, values, types; whether the
tail can be made) is fixed per :class:`Bound` and a launch computes only the positional arguments' classes (in a
form that hashes fast), reads the knobs, device and stream, and calls the compiled kernel's launcher as its
``__getitem__``'s runner calls it (:func:`run_entry`): 3.2-6 µs a launch (10 to 61 arguments; triton_launch_path's
``bound_us``) against 4.9-11 µs through ``DirectLauncher[grid]`` (6-13 µs before :func:`run_entry`) and 0.5-1.1
µs for ``CompiledKernel[grid]`` alone -- most of what is left is reading each tensor's dtype and data pointer
(about 0.15 µs a tensor; the classes computed with ``map`` and ``operator``'s getters, or the globals checked
per module with an ``itemgetter``, were slower).

Triton 3.2 (which CI installs for interpreter runs, where nothing here engages) hands the launcher the
non-constexpr values only and keeps its hooks on ``CompiledKernel``: not supported, its kernels launch through
the JITFunction, as do those of any version not in :data:`SUPPORTED`.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Dict, Iterator, Mapping, Optional, Tuple

import torch
import triton
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from snip_ds.backend.kernels.switches import direct_switched_on

try:  # (3.6 and later; older versions are not supported anyway)
    from triton import knobs
except ImportError:  # pragma: no cover
    knobs = None

SUPPORTED = ((3, 6), (3, 9))  # (major, minor) of the Triton versions whose sources the docstring's argument holds for


def supported(version: str = triton.__version__) -> bool:
    """Whether the direct path may engage under Triton ``version`` (``"3.9.0"``, ``"3.6.0+git..."``)."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) in SUPPORTED


ENGAGED = supported() and knobs is not None and direct_switched_on()
_state = {"enabled": True}  # :func:`disabled` turns it off (benchmarks: Triton's own path, for comparison)
_LAUNCHERS: Dict[int, "DirectLauncher"] = {}  # by id (hashing a JITFunction takes its lock): each holds its kernel


def launcher(kernel: JITFunction):
    """``kernel``'s :class:`DirectLauncher` (made once), or ``kernel`` itself where the direct path does not
    engage (a Triton not in :data:`SUPPORTED`, or inside :func:`disabled`). For eager launches only: under a
    trace, ``torch.library.wrap_triton`` (see ``quantize.launchable``)."""
    if not ENGAGED or not _state["enabled"]:
        return kernel
    found = _LAUNCHERS.get(id(kernel))
    if found is None:
        found = _LAUNCHERS[id(kernel)] = DirectLauncher(kernel)
    return found


@contextmanager
def disabled() -> Iterator[None]:
    """Every launch through Triton's own ``JITFunction.run`` inside the block (what the direct path is measured
    against, and how every launch can be recorded there)."""
    before = _state["enabled"]
    _state["enabled"] = False
    try:
        yield
    finally:
        _state["enabled"] = before


@dataclass(frozen=True)
class Entry:
    """What one class of call launches: the kernel Triton compiled for it, and the values of the parameters
    after the positional ones (constexprs, in declaration order), appended to each launch's arguments."""

    compiled: object
    tail: tuple


def _int_class(value: int) -> tuple:
    """An int's class: whether it is 1, whether divisible by 16, whether it fits int32, whether int64."""
    return ("i", value == 1, value % 16 == 0, -2 ** 31 <= value < 2 ** 31, -2 ** 63 <= value < 2 ** 63)


_SMALL_INTS = {value: _int_class(value) for value in range(-16, 8193)}  # (a dict look-up: faster than the above)
_Tensor = torch.Tensor


def _arg_class(arg):
    """The class of one positional argument (see the module's docstring); ``_UNKNOWN`` where it has none."""
    kind = type(arg)
    if kind is bool:
        return ("b", arg)
    if kind is int:
        return _int_class(arg)
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if kind is float:
        return "f"
    if arg is None:
        return None
    return _UNKNOWN


def _arg_classes(args: tuple) -> tuple:
    """:func:`_arg_class` of each positional argument, plain tensors and ints inline (the common case: this
    runs on every launch)."""
    return tuple([(a.dtype, not a.data_ptr() & 15) if type(a) is _Tensor else
                  _SMALL_INTS.get(a) or _int_class(a) if type(a) is int else _arg_class(a) for a in args])


_UNKNOWN = object()
_CONSTEXPR_TYPES = (int, bool, str, type(None))


def _constexpr_ok(value) -> Optional[bool]:
    """Whether equal values of this constexpr's type are one specialization: True for ints, bools, strings,
    None and floats but zero and NaN; False for zero floats and other types (the class is kept, and always
    launches through the JITFunction: ``0.0 == -0.0``); None for NaN (not kept: ``nan != nan`` would add a
    class on every call)."""
    kind = type(value)
    if kind is float:
        return None if value != value else value != 0
    return kind in _CONSTEXPR_TYPES


def _hook_quiet(hook) -> bool:
    """Whether a launch hook knob calls nothing: None, or an empty ``HookChain``."""
    return hook is None or (type(hook).__name__ == "HookChain" and not hook.calls)


def _knob_state():
    """The runtime knobs that enter Triton's cache key, or ``_UNKNOWN`` where a knob set changes the launch
    (hooks installed, a stages inspection hook)."""
    runtime, compilation = knobs.runtime, knobs.compilation
    if not (_hook_quiet(runtime.launch_enter_hook) and _hook_quiet(runtime.launch_exit_hook)) or \
            getattr(runtime, "add_stages_inspection_hook", None) is not None:
        return _UNKNOWN
    return (runtime.debug, compilation.instrumentation_mode,
            getattr(compilation, "fpsan_homomorphic_casts", None))


def _grid3(grid) -> Optional[Tuple[int, int, int]]:
    """``grid`` padded to three dimensions as ``JITFunction.run`` pads it, or None (not a tuple of 1-3 ints)."""
    if type(grid) is tuple:
        size = len(grid)
        if size == 1 and type(grid[0]) is int:
            return grid + (1, 1)
        if size == 2 and type(grid[0]) is int and type(grid[1]) is int:
            return grid + (1,)
        if size == 3 and type(grid[0]) is int and type(grid[1]) is int and type(grid[2]) is int:
            return grid
    return None


class DirectLauncher:
    """A JITFunction launched as ``launcher[grid](*args, **constexprs)``: the first call of each class of
    arguments through the JITFunction (which compiles or finds the kernel, and launches it), later ones through
    the compiled kernel it returned. ``jit_calls`` counts the calls that went through the JITFunction."""

    def __init__(self, kernel: JITFunction) -> None:
        self.kernel = kernel
        self.entries: Dict[tuple, Optional[Entry]] = {}  # class -> entry (None: no direct path for it)
        self.bounds: Dict[Tuple[int, int], Bound] = {}  # (id of the constants, id of the extra) -> Bound
        self.jit_calls = 0
        self._own_metadata = getattr(kernel, "launch_metadata", None) is not None
        self._globals_seen: list = []  # (globals, name, the object there when last checked)
        self._globals_count = -1  # len(kernel.used_global_vals) when last checked

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            return self.launch(grid, args, constexprs)
        return launch

    @staticmethod
    def key(device, args: tuple, constexprs: dict):
        """The class of a call (the module's docstring), or ``_UNKNOWN``: the constexprs as their names, values
        and the values' types (``True == 1``), checked when the class is first seen (:meth:`_through_jit`)."""
        knob_state = _knob_state()
        if knob_state is _UNKNOWN:
            return _UNKNOWN
        classes = _arg_classes(args)
        if _UNKNOWN in classes:
            return _UNKNOWN
        values = tuple(constexprs.values())
        return (device, knob_state, tuple(constexprs), values, tuple(map(type, values)), classes)

    def launch(self, grid, args: tuple, constexprs: dict):
        """One launch: direct where its class has an entry, else through the JITFunction."""
        grid3 = _grid3(grid)
        if grid3 is None or self.kernel.pre_run_hooks or self._own_metadata:
            return self._through_jit(grid, args, constexprs, None)
        device = driver.active.get_current_device()
        key = self.key(device, args, constexprs)
        if key is _UNKNOWN:
            return self._through_jit(grid, args, constexprs, None)
        try:
            entry = self.entries.get(key, _UNKNOWN)
        except TypeError:  # an unhashable constexpr
            return self._through_jit(grid, args, constexprs, None)
        if entry is _UNKNOWN:
            return self._through_jit(grid, args, constexprs, key)
        if entry is None:
            return self._through_jit(grid, args, constexprs, None)
        self._check_globals()
        runtime = knobs.runtime
        run_entry(entry, grid3, driver.active.get_current_stream(device), runtime.launch_enter_hook,
                  runtime.launch_exit_hook, args)
        return entry.compiled

    def bound(self, constants: Mapping, extra: Mapping) -> "Bound":
        """The :class:`Bound` launches of this kernel with the constexprs ``extra`` and ``constants``: made once
        per pair of read-only mappings (``MappingProxyType``: the same objects, so the same values; kept by
        identity), else made for this call alone."""
        key = (id(constants), id(extra))  # (each kept Bound holds both objects: their ids are not reused)
        found = self.bounds.get(key)
        if found is None:
            found = Bound(self, constants, extra)
            if type(constants) is MappingProxyType and type(extra) is MappingProxyType:
                if len(self.bounds) >= MAX_BOUND:  # (mappings made per call: not kept for ever)
                    self.bounds.clear()
                self.bounds[key] = found
        return found

    def _through_jit(self, grid, args: tuple, constexprs: Mapping, key, entries: Optional[dict] = None):
        """Triton's own launch; where ``key`` is given (a class seen first), what later calls of it launch, kept
        in ``entries`` (:attr:`entries` unless given)."""
        self.jit_calls += 1
        compiled = self.kernel[grid](*args, **constexprs)
        if key is None:
            return compiled
        usable = [_constexpr_ok(value) for value in constexprs.values()]
        if None in usable:
            return compiled
        tail = self.tail(len(args), constexprs) if all(usable) else None
        ok = tail is not None and isinstance(compiled, triton.compiler.CompiledKernel)
        (self.entries if entries is None else entries)[key] = Entry(compiled, tail) if ok else None
        return compiled

    def tail(self, positional: int, constexprs: dict) -> Optional[tuple]:
        """The values of the parameters after the first ``positional`` ones, in declaration order: each a
        constexpr given in ``constexprs`` or defaulted; None where one is not (or a keyword names no such
        parameter, or a constexpr is given positionally: its class would not hold its value)."""
        params = self.kernel.params
        rest = params[positional:]
        if set(constexprs) - {p.name for p in rest} or any(p.is_constexpr for p in params[:positional]):
            return None
        values = []
        for param in rest:
            if not param.is_constexpr:
                return None
            if param.name in constexprs:
                values.append(constexprs[param.name])
            elif param.default is not inspect.Parameter.empty:
                values.append(param.default)
            else:
                return None
        return tuple(values)

    def _check_globals(self) -> None:
        """``JITFunction.run``'s check that the globals the kernel read have not changed since it compiled. Its
        values are deep copies, which compare slowly (``tl.constexpr``'s ``!=`` builds a constexpr): once they
        compared equal, the objects then in the globals are kept, and while each global is still that object
        (and no specialization compiled since read more globals) nothing is compared again."""
        for globals_dict, name, seen in self._globals_seen:
            if globals_dict.get(name, _UNKNOWN) is not seen:
                break
        else:
            if self._globals_count == len(self.kernel.used_global_vals):
                return
        seen = []
        for (name, _), (value, globals_dict) in self.kernel.used_global_vals.items():
            if (now := globals_dict.get(name, _UNKNOWN)) is not value and now != value:
                raise RuntimeError(f"Global variable {name} has changed since we compiled this kernel, from "
                                   f"{value} to {'(deleted)' if now is _UNKNOWN else now}")
            seen.append((globals_dict, name, now))
        self._globals_seen, self._globals_count = seen, len(seen)


MAX_BOUND = 4096  # Bound objects kept per kernel (one per launch configuration a run uses)


def run_entry(entry: Entry, grid3: Tuple[int, int, int], stream, enter_hook, exit_hook, args: tuple) -> None:
    """``entry.compiled[grid3](*args, *entry.tail, stream=stream)`` without the runner's closure: what that
    runner does (Triton 3.6 and 3.9's ``CompiledKernel.__getitem__``), with the hook knobs' values the caller
    read in this launch (the runner reads them again; nothing runs in between that could set them). The launch
    metadata takes no arguments: they are read only by a kernel's own ``launch_metadata`` function (no direct
    path for such a kernel)."""
    compiled = entry.compiled
    compiled._init_handles()  # (__getitem__'s: returns at once once the kernel is loaded)
    compiled.run(grid3[0], grid3[1], grid3[2], stream, compiled.function, compiled.packed_metadata,
                 compiled.launch_metadata(grid3, stream), enter_hook, exit_hook, *args, *entry.tail)


_HookChain = getattr(knobs, "HookChain", None)
NO_EXTRA = MappingProxyType({})


def launch(kernel: JITFunction, grid, args: tuple, constants: Mapping, extra: Mapping = NO_EXTRA) -> None:
    """``kernel[grid](*args, **extra, **constants)``, eager (as :func:`launcher`): through its :class:`Bound`
    launches where the direct path engages -- the constexprs' part of the class worked out once per pair of
    mappings where both are read-only (``MappingProxyType``: a launch configuration's constants, a call
    site's fixed extra constexprs), else per call."""
    if not ENGAGED or not _state["enabled"]:
        kernel[grid](*args, **extra, **constants)
        return
    found = _LAUNCHERS.get(id(kernel))
    if found is None:
        found = _LAUNCHERS[id(kernel)] = DirectLauncher(kernel)
    found.bound(constants, extra).launch(grid, args)


class Bound:
    """A kernel's launches with one set of constexprs, ``extra`` and ``constants`` (keyword arguments, not
    one given twice): their names, values and types fixed, so a launch's class is the current device, the
    knob state and the positional arguments' classes alone, each an object that hashes fast (a tensor its
    dtype where ``data_ptr() % 16 == 0``, else ``(dtype, 1)``; an int a code of its four facts, see
    :func:`_int_code`; anything else :func:`_arg_class`). The same facts as :meth:`DirectLauncher.key`, so
    the same argument holds: equal classes, the same compiled kernel."""

    __slots__ = ("launcher", "constants", "extra", "constexprs", "entries")

    def __init__(self, launcher: DirectLauncher, constants: Mapping, extra: Mapping) -> None:
        twice = set(constants) & set(extra)
        if twice:
            raise TypeError(f"{launcher.kernel.fn.__name__}: got multiple values for the constexprs {sorted(twice)}")
        self.launcher, self.constants, self.extra = launcher, constants, extra
        self.constexprs = {**extra, **constants}  # (the order the keyword arguments of kernel[grid] bind in)
        self.entries: Dict[tuple, Optional[Entry]] = {}

    def launch(self, grid, args: tuple) -> None:
        """One launch: direct where its class has an entry, else through the JITFunction (which, for a class
        seen first, makes the entry)."""
        launcher = self.launcher
        runtime = knobs.runtime
        enter_hook, exit_hook = runtime.launch_enter_hook, runtime.launch_exit_hook
        grid3 = _grid3(grid)
        if grid3 is None or launcher.kernel.pre_run_hooks or launcher._own_metadata or \
                not (enter_hook is None or type(enter_hook) is _HookChain and not enter_hook.calls) or \
                not (exit_hook is None or type(exit_hook) is _HookChain and not exit_hook.calls) or \
                getattr(runtime, "add_stages_inspection_hook", None) is not None:
            launcher._through_jit(grid, args, self.constexprs, None)
            return
        compilation = knobs.compilation
        device = driver.active.get_current_device()
        try:
            classes = tuple([(a.dtype if not a.data_ptr() & 15 else (a.dtype, 1)) if type(a) is _Tensor else
                             _INT_CODES.get(a) or _int_code(a) if type(a) is int else _other_class(a) for a in args])
        except _Unclassed:
            launcher._through_jit(grid, args, self.constexprs, None)
            return
        key = (device, runtime.debug, compilation.instrumentation_mode,
               getattr(compilation, "fpsan_homomorphic_casts", None), classes)
        entry = self.entries.get(key, _UNKNOWN)
        if entry is None or entry is _UNKNOWN:
            launcher._through_jit(grid, args, self.constexprs, None if entry is None else key, self.entries)
            return
        launcher._check_globals()
        run_entry(entry, grid3, driver.active.get_current_stream(device), enter_hook, exit_hook, args)


def _int_code(value: int) -> int:
    """An int's class (:func:`_int_class`) as a small int: 16 + its four facts as bits (never 0)."""
    one, by16, i32, i64 = _int_class(value)[1:]
    return 16 | one | by16 << 1 | i32 << 2 | i64 << 3


_INT_CODES = {value: _int_code(value) for value in range(-16, 8193)}


class _Unclassed(Exception):
    """A positional argument with no class (see the module's docstring): the launch goes through Triton."""


def _other_class(arg):
    """The class of an argument that is neither a plain tensor nor an int, in :class:`Bound`'s form (a tensor
    subclass as a plain tensor: ``(dtype, True)`` would equal a misaligned tensor's ``(dtype, 1)``); raises
    :class:`_Unclassed` where it has none."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype if not arg.data_ptr() & 15 else (arg.dtype, 1)
    found = _arg_class(arg)
    if found is _UNKNOWN:
        raise _Unclassed
    return found
