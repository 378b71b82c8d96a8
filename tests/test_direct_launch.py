"""The direct launch path (snip_ds/backend/kernels/direct.py): a compiled kernel launched through the kernel
Triton compiled for its class of arguments hands the driver exactly what Triton's own ``JITFunction.run`` hands it.

In a subprocess where Triton is not interpreted, on benchmarks/triton_launch_path.py's sm_90 driver (the kernels
compiled by Triton and ptxas, never run), whose utilities here give every loaded kernel a function handle of its
own (one per ``load_binary`` call: one per compiled specialization, even where two compile to the same bytes) and
record each launch's grid, function handle and arguments. Each launch of snip_ds's four kernels (quantize,
amax, grouped amax, grouped quantize) in several configurations, with aligned and misaligned tensors (views at an
odd element offset) and ints of each class Triton tells apart (1, 16, 17, 2**31), is captured as snip_ds makes
it, then replayed with the same arguments: direct (first call of its class), through ``JITFunction.run``, and
direct again -- the three must reach the driver alike; the second direct call must not enter
``JITFunction.run`` nor compile. A misaligned tensor after an aligned one of the same configuration must go
through ``JITFunction.run`` and launch a kernel of its own.
"""

import pytest

from triton_mode import compile_check

DIRECT = r"""
import sys
try:
    import triton.backends.nvidia.driver  # noqa: F401
except ImportError as err:
    print("skip:", err)
    sys.exit(0)
sys.path.insert(0, "benchmarks")
from contextlib import ExitStack
import collections
import itertools
from types import MappingProxyType
import torch
import triton
from triton.runtime.jit import JITFunction
import no_gpu_driver
from snip_ds.backend.kernels import direct, grouped as kg, quantize as kq
from snip_ds.backend.kernels.switches import direct_switched_on

assert not kq.INTERPRETED
if not direct.supported() or not direct_switched_on():
    print("skip: the direct path does not engage under Triton", triton.__version__, "(or is switched off)")
    sys.exit(0)
assert direct.ENGAGED, triton.__version__  # (a supported version, switched on: it must engage)


class HandleUtils(no_gpu_driver.NoGpuUtils):
    # every loaded kernel its own function handle; every launch recorded: (grid, function, arguments)
    handles = itertools.count(1)

    def load_binary(self, name, kernel, shared, device):
        return 1, next(self.handles), 32, 0, 1024

    def launch(self, grid_x, grid_y, grid_z, stream, function, cooperative, pdl, kernel_metadata, launch_metadata,
               enter_hook, exit_hook, *rest):
        args = tuple(("t", a.data_ptr(), a.dtype) if isinstance(a, torch.Tensor) else a for a in rest[-1])
        self.recorded.append(((grid_x, grid_y, grid_z), function, args, stream, cooperative, pdl, kernel_metadata,
                              type(launch_metadata).__name__, id(enter_hook), id(exit_hook)))


jit_runs = []
real_run = JITFunction.run


def counted_run(self, *args, **kwargs):
    jit_runs.append(self.fn.__name__)
    return real_run(self, *args, **kwargs)


JITFunction.run = counted_run


def capture(make):
    # the launches make() makes, as (kernel, grid, args, kwargs), through Triton's own path
    made = []

    def spy(self, *args, grid, warmup, **kwargs):
        made.append((self, grid, args, kwargs))
        return counted_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    with direct.disabled():
        JITFunction.run = spy
        try:
            make()
        finally:
            JITFunction.run = counted_run
    return made


def launched(utils, call):
    utils.recorded = []
    runs, compiled = len(jit_runs), len(compiles)
    call()
    (record,) = utils.recorded
    return record, len(jit_runs) - runs, len(compiles) - compiled


def replay(utils, launch):
    # the launch direct (first of its class or not), through JITFunction.run, direct again: alike at the driver;
    # then through a Bound (direct.launch, the constexprs a read-only mapping, as the call sites pass them):
    # first of its class and again, alike too
    kernel, grid, args, kwargs = launch
    first, first_runs, _ = launched(utils, lambda: direct.launcher(kernel)[grid](*args, **kwargs))
    own, own_runs, own_compiles = launched(utils, lambda: kernel[grid](*args, **kwargs))
    again, again_runs, again_compiles = launched(utils, lambda: direct.launcher(kernel)[grid](*args, **kwargs))
    name = kernel.fn.__name__
    assert own_runs == 1 and own_compiles == 0, (name, own_runs, own_compiles)
    assert first == own, (name, "first direct call", first, own)
    assert again == own, (name, "second direct call", again, own)
    assert again_runs == 0 and again_compiles == 0, (name, "second direct call entered JITFunction.run")
    constants = MappingProxyType(dict(kwargs))
    for call in ("first", "again"):
        bound, bound_runs, bound_compiles = launched(utils, lambda: direct.launch(kernel, grid, args, constants))
        assert bound == own, (name, call, "bound call", bound, own)
        assert bound_compiles == 0 and bound_runs == (call == "first"), (name, call, bound_runs, bound_compiles)
    return first, first_runs


def normalised(records):
    # a step's launches with each tensor as its dtype and address mod 16 (its outputs are new on every call)
    return [(grid, function, tuple(("t", a[1] % 16, a[2]) if type(a) is tuple and a[:1] == ("t",) else a
                                   for a in args), *rest) for grid, function, args, *rest in records]


def step_alike(utils, make):
    # make() as snip_ds launches it (the call sites' Bound launches) and through JITFunction.run: alike at the
    # driver; a second call enters JITFunction.run nowhere and compiles nothing
    utils.recorded = []
    with direct.disabled():
        make()
    own, utils.recorded = normalised(utils.recorded), []
    make()
    first, utils.recorded = normalised(utils.recorded), []
    runs, compiled = len(jit_runs), len(compiles)
    make()
    again, utils.recorded = normalised(utils.recorded), []
    assert first == own and again == own, ("step", first, own, again)
    assert (len(jit_runs), len(compiles)) == (runs, compiled), ("second step entered JITFunction.run", jit_runs[runs:])
    return len(own)


def tensor(shape, dtype=torch.float32, misaligned=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = shape[0] * shape[1]
    flat = torch.randn(n + 1, generator=gen).to(dtype)
    t = (flat[1:] if misaligned else flat[:n]).view(shape)
    assert (t.data_ptr() % 16 == 0) != misaligned
    return t


def cfg(t, recipe, axis=1, **kw):
    return kq.launch_config(*t.shape, recipe, axis, torch.float8_e4m3fn if "fp8" in recipe else torch.float32, False,
                            t.dtype == torch.bfloat16, **kw)


SEED = kq.seed_tensor(7, torch.device("cpu"))


def quantize(shape, recipe="fp8_e4m3", dtype=torch.float32, misaligned=False, offset=0, seed=None):
    x = tensor(shape, dtype, misaligned)
    return lambda: kq.launch(cfg(x, recipe), x, None, seed, offset)


def amax(shape, dtype=torch.float32, misaligned=False):
    x = tensor(shape, dtype, misaligned)
    return lambda: kq._amax(kq.bit_view(x), dtype == torch.bfloat16, 16, 32, 2)


def pair(a_shape, b_shape, a_recipe="fp8_e4m3", b_recipe="fp8_e4m3", misaligned=False, grouped_amax=True):
    a, b = tensor(a_shape, seed=1), tensor(b_shape, torch.bfloat16, misaligned, seed=2)
    a_cfg, b_cfg = cfg(a, a_recipe, both=True), cfg(b, b_recipe, write_amax=True)

    def make():
        partials = (kg.grouped_amax_partials(kg.grouped_amax_config(a_cfg, b_cfg), a, b) if grouped_amax
                    else (None, None))
        kg.launch_pair(kg.quantize_pair_config(a_cfg, b_cfg), a, None, b, None, a_partials=partials[0],
                       b_partials=partials[1])
    return make


with ExitStack() as stack:
    drv, compiles = no_gpu_driver.install(stack)
    utils = drv.utils = HandleUtils()
    utils.recorded = []
    CASES = [("quantize", quantize((48, 64))), ("quantize", quantize((48, 64), misaligned=True)),
             ("quantize", quantize((48, 64), offset=1, seed=SEED)),
             ("quantize", quantize((48, 64), offset=16, seed=SEED)),
             ("quantize", quantize((48, 64), offset=17, seed=SEED)),
             ("quantize", quantize((48, 64), offset=2 ** 31, seed=SEED)),
             ("quantize", quantize((1, 17), "nvfp4", torch.bfloat16)),
             ("quantize", quantize((33, 64), "mxfp8", misaligned=True)),
             ("amax", amax((40, 64))), ("amax", amax((40, 64), misaligned=True)),
             ("amax", amax((1, 16), torch.bfloat16)), ("amax", amax((17, 33), torch.bfloat16, misaligned=True)),
             ("pair", pair((32, 64), (64, 64))), ("pair", pair((32, 64), (64, 64), misaligned=True)),
             ("pair", pair((1, 64), (16, 64), "nvfp4", "nvfp4")),
             ("pair", pair((32, 64), (48, 64), "mxfp8", "fp8_e4m3", grouped_amax=False))]
    seen, replayed = {}, collections.Counter()
    for name, make in CASES:
        for launch in capture(make):
            record, runs = replay(utils, launch)
            replayed[launch[0].fn.__name__] += 1
            kernel = launch[0].fn.__name__
            if record[1] not in seen.setdefault(kernel, set()):
                assert runs == 1, (name, kernel, "a kernel not launched before, yet no JITFunction.run")
            seen[kernel].add(record[1])
    assert len(replayed) == 4, replayed  # the four kernels
    assert sum(step_alike(utils, make) for _, make in CASES) == sum(replayed.values())
    print({kernel: (replayed[kernel], len(handles)) for kernel, handles in seen.items()})  # launches, kernels

    # a new class after a known one: misaligned after aligned, same configuration -> its own kernel
    for make_aligned, make_misaligned in ((quantize((24, 32)), quantize((24, 32), misaligned=True)),
                                          (amax((24, 32)), amax((24, 32), misaligned=True)),
                                          (pair((16, 32), (16, 32)), pair((16, 32), (16, 32), misaligned=True))):
        for aligned, misaligned in zip(capture(make_aligned), capture(make_misaligned)):
            handle_aligned = replay(utils, aligned)[0][1]
            (_, handle, *_), runs = replay(utils, misaligned)
            assert (handle != handle_aligned) == (runs == 1), (aligned[0].fn.__name__, handle, handle_aligned, runs)
            if any(isinstance(a, torch.Tensor) and a.data_ptr() % 16 for a in misaligned[2]):
                assert runs == 1 and handle != handle_aligned, (aligned[0].fn.__name__, "misaligned reused aligned")

    # a constexpr given positionally: its class does not hold its value (BR 16 and 32: one int class), so every
    # such call goes through JITFunction.run
    (amax_kernel, grid, args, kwargs), = capture(amax((32, 64)))
    rest = {k: v for k, v in kwargs.items() if k not in ("IN_BF16", "BR")}
    for br in (16, 32, 16, 32):
        call = (args + (kwargs["IN_BF16"], br))
        own, _, _ = launched(utils, lambda: amax_kernel[grid](*call, **rest))
        for _ in range(2):
            record, runs, _ = launched(utils, lambda: direct.launcher(amax_kernel)[grid](*call, **rest))
            assert record == own and runs == 1, ("positional constexpr", br, runs)

    # a global the kernel read changed since it compiled: Triton's error, direct or not; restored: launches again
    checked = set()
    for kernel, grid, args, kwargs in capture(quantize((48, 64))) + capture(pair((32, 64), (64, 64))):
        constants = MappingProxyType(dict(kwargs))
        calls = (lambda: kernel[grid](*args, **kwargs), lambda: direct.launch(kernel, grid, args, constants),
                 lambda: direct.launcher(kernel)[grid](*args, **kwargs))
        for call in calls[1:]:
            launched(utils, call)
        checked.update(kernel.fn.__name__ for _ in kernel.used_global_vals)
        for (name, _), (value, globals_dict) in kernel.used_global_vals.items():
            before = globals_dict[name]
            globals_dict[name] = triton.language.constexpr(12345)
            try:
                for call in calls:
                    try:
                        call()
                    except RuntimeError as err:
                        assert "has changed since" in str(err), err
                    else:
                        raise AssertionError((kernel.fn.__name__, name, "changed, yet launched"))
            finally:
                globals_dict[name] = before
            for call in calls[1:]:
                assert launched(utils, call)[1:] == (0, 0), (kernel.fn.__name__, name, "after the global's restored")
    # (the amax kernels read none; which others Triton records the globals of differs: 3.9 both quantization
    # kernels, 3.6 the grouped one here -- JITFunction.run and the direct path read the same record)
    assert checked == ({"_quantize_kernel", "_grouped_quantize_kernel"} if triton.__version__.startswith("3.9")
                       else {"_grouped_quantize_kernel"}), checked

    # under a trace, or disabled: not the direct launcher
    with direct.disabled():
        assert direct.launcher(kq._amax_kernel) is kq._amax_kernel
    assert isinstance(kq.launchable(kq._amax_kernel), direct.DirectLauncher)
print("ok")
"""


def test_direct_launches_reach_the_driver_as_triton_launches_them():
    """Every replayed launch reaches the driver alike, direct or through ``JITFunction.run``; later calls of a
    class skip ``JITFunction.run`` and compile nothing; a misaligned tensor gets its own kernel."""
    compile_check(DIRECT, timeout=600)  # (about 25 s here with Triton's kernel cache cold, 5 s warm)


def test_supported_versions():
    """The direct path engages only on the Triton versions whose launch code was read (3.6, 3.9)."""
    from snip_ds.backend.kernels import direct

    assert direct.supported("3.9.0") and direct.supported("3.6.0") and direct.supported("3.6.1+git1234")
    assert not direct.supported("3.2.0") and not direct.supported("3.7.0") and not direct.supported("4.0.0")
    assert not direct.supported("nightly")


def test_the_environment_switch_turns_the_direct_path_off_and_a_bad_value_is_an_error():
    """``SNIP_DS_TRITON_DIRECT=0`` sends every eager launch through Triton's own ``JITFunction.run`` (the way back
    should the direct path misbehave on a GPU); unset or 1 keeps it; any other value is an error naming it."""
    from snip_ds.backend.kernels.switches import direct_switched_on

    assert direct_switched_on({}) and direct_switched_on({"SNIP_DS_TRITON_DIRECT": "1"})
    assert not direct_switched_on({"SNIP_DS_TRITON_DIRECT": "0"})
    with pytest.raises(ValueError, match="SNIP_DS_TRITON_DIRECT='yes'"):
        direct_switched_on({"SNIP_DS_TRITON_DIRECT": "yes"})


SWITCHED_OFF = r"""
import sys
try:
    import triton.backends.nvidia.driver  # noqa: F401
except ImportError as err:
    print("skip:", err)
    sys.exit(0)
from types import MappingProxyType
from triton.runtime.jit import JITFunction
from snip_ds.backend.kernels import direct, quantize as kq
assert not direct.ENGAGED and kq.launchable(kq._amax_kernel) is kq._amax_kernel
calls = []
JITFunction.run = lambda self, *args, grid, warmup, **kwargs: calls.append((self, grid, args, kwargs))
kq.run_kernel(kq._amax_kernel, (1,), (1, 2), MappingProxyType({"BR": 16}), kq.STOCHASTIC[True])
assert calls == [(kq._amax_kernel, (1,), (1, 2), {"STOCHASTIC": True, "BR": 16})], calls
assert not direct._LAUNCHERS
print("ok")
"""


def test_switched_off_eager_launches_are_the_kernels_own(monkeypatch):
    """With ``SNIP_DS_TRITON_DIRECT=0`` in the environment of a process (compiled kernels), an eager launch is the
    JITFunction itself: ``launchable`` hands it back, and ``run_kernel``'s launches enter ``JITFunction.run``."""
    monkeypatch.setenv("SNIP_DS_TRITON_DIRECT", "0")
    compile_check(SWITCHED_OFF, timeout=300)


class _Kernel:
    """A stand-in kernel: ``kernel[grid](*args, **kwargs)`` records ``(grid, args, kwargs)``."""

    def __init__(self) -> None:
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def test_launch_off_the_direct_path_is_the_kernels_own_call():
    """Inside ``disabled()`` (as with ``SNIP_DS_TRITON_DIRECT=0``, where nothing engages) ``direct.launch`` is
    ``kernel[grid](*args, **extra, **constants)``, the extra constexprs and the constants both passed."""
    from types import MappingProxyType

    from snip_ds.backend.kernels import direct

    kernel = _Kernel()
    with direct.disabled():
        direct.launch(kernel, (3,), (1, 2), MappingProxyType({"A": 1, "B": 2.5}), MappingProxyType({"S": True}))
    assert kernel.calls == [((3,), (1, 2), {"S": True, "A": 1, "B": 2.5})]


def test_bound_launches_are_kept_per_pair_of_read_only_mappings():
    """One ``Bound`` per pair of ``MappingProxyType`` objects (kept by identity: equal mappings that are other
    objects get their own); a plain dict's made for the call alone; a constexpr given twice is Python's error."""
    from types import MappingProxyType

    from snip_ds.backend.kernels import direct, quantize as kq

    launcher = direct.DirectLauncher(kq._amax_kernel)
    constants, extra = MappingProxyType({"BR": 16}), MappingProxyType({"IN_BF16": False})
    kept = launcher.bound(constants, extra)
    assert launcher.bound(constants, extra) is kept and kept.constexprs == {"IN_BF16": False, "BR": 16}
    assert launcher.bound(MappingProxyType({"BR": 16}), extra) is not kept
    assert launcher.bound({"BR": 16}, extra) is not launcher.bound({"BR": 16}, extra)
    assert len(launcher.bounds) == 2
    with pytest.raises(TypeError, match="multiple values"):
        launcher.bound(constants, MappingProxyType({"BR": 32}))


def test_int_codes_tell_apart_what_the_int_classes_tell_apart():
    """``_int_code`` (the Bound's class of an int) is equal for two ints exactly where ``_int_class`` is, the
    table of small ints agrees with it, and no code is 0 (the look-up's ``or`` falls through on 0)."""
    from snip_ds.backend.kernels import direct

    values = [1, 0, 16, 17, -16, -1, 2 ** 31 - 1, 2 ** 31, 2 ** 32, 2 ** 63, -2 ** 31, -2 ** 31 - 1, 8192, 8191, 48]
    for a in values:
        for b in values:
            assert (direct._int_code(a) == direct._int_code(b)) == (direct._int_class(a) == direct._int_class(b))
    assert all(direct._INT_CODES[v] == direct._int_code(v) != 0 for v in range(-16, 8193))


def test_launch_configurations_constants_are_read_only():
    """The constants of a launch configuration (and of a grouped one) are read-only mappings, one object per
    configuration: what the direct launches key their kept work by."""
    from types import MappingProxyType

    import torch

    from snip_ds.backend.kernels import grouped as kg, quantize as kq

    a = kq.launch_config(32, 64, "fp8_e4m3", 1, torch.float8_e4m3fn, False, False, both=True)
    b = kq.launch_config(64, 64, "fp8_e4m3", 1, torch.float8_e4m3fn, False, True, write_amax=True)
    assert a is kq.launch_config(32, 64, "fp8_e4m3", 1, torch.float8_e4m3fn, False, False, both=True)
    for mapping in (a.constants, a.amax_constants, kg.grouped_amax_config(a, b).constants,
                    kg.quantize_pair_config(a, b).constants):
        assert type(mapping) is MappingProxyType
        with pytest.raises(TypeError):
            mapping["BR"] = 1
    assert dict(a.amax_constants) == dict(IN_BF16=False, BR=a.br, BC=a.bc, TILES_PER_PROGRAM=a.amax_tiles)
