"""Triton's own launch path for snip_ds's kernels, timed on a CPU: what a GPU's host does between snip_ds's
``launchable(kernel)[grid](...)`` and the CUDA driver's launch call, which bench_layer_host's CPU rows leave out
(their launches are empty: :func:`snip_ds.backend.dispatch_audit.patch_triton_launches` with ``run=False``).

On a GPU every eager launch of a snip_ds kernel goes through ``torch.library.wrap_triton`` -- which outside a
trace dispatches the higher-order operator ``triton_kernel_wrapper_mutation`` (flattening every argument) unless
``set_wrap_triton_enabled(False)`` is in force, as it is inside a ``triton_op`` called eagerly -- and Triton's
``JITFunction.run`` (argument binding, the specialization key, the kernel-cache lookup, the grid, the launch
metadata), then ``CudaLauncher.__call__`` (scratch buffers) and the C launcher ``utils.launch``. All but the last
run here, in a process of their own (Triton must not be in interpreter mode there), with :mod:`no_gpu_driver`'s
``Sm90Driver``: Triton's CUDA driver for an sm_90 target (``GPUTarget("cuda", 90, 32)``) whose C module's pieces
are stand-ins: the kernels are compiled for sm_90 by Triton's own compiler and ptxas (the first launch of each
specialization), "loaded" without a GPU, and launched through Triton's real ``CudaLauncher`` (3.9; under 3.6,
whose launcher is a C module built against libcuda, a Python stand-in for it that hands on the same arguments),
whose final C call (``utils.launch``: reading the arguments' pointers and ``cuLaunchKernelEx``) does nothing but
count -- and, when asked, record the arguments it was handed. The kernels never run: their outputs stay as allocated (uninitialised), which host
timing does not read. Left out, and so not in the figures: the C launcher's own work, and the cost of a real
``torch.cuda.current_device``/current-stream query (stand-ins return device 0, stream 0).

Eager launches of a compiled kernel go through snip_ds's direct launcher where the Triton version supports it
(:mod:`snip_ds.backend.kernels.direct`: the first call of each class of arguments through ``JITFunction.run``,
later ones through the kernel it compiled), else through ``JITFunction.run`` itself.

Per step (``--rows scope:variant``, eager): ``triton_launch_us``, the median over paired steps of a step's CPU time
with its launches through that path less the same step's with empty launches (the pair's order alternates; an
empty launch is dispatch_audit's wrapper, reached as ``launchable(wrapper)[grid](*args, **constexprs)``: its own
2-4 µs -- the constexprs merged into keyword arguments, a closure -- are in both steps, so the difference is what
the real path costs beyond them, and ``host_us + triton_launch_us`` the step's whole host time);
``jit_function_us``, the same with the direct launcher off (every launch through ``JITFunction.run``, as before
it); ``jit_runs_per_step``, how many of a warm step's launches entered ``JITFunction.run`` (exact: 0 where every
launch went direct); per launch (replayed alone, paired the same way): the kernel, its arguments, the µs of the
path through ``wrap_triton``, without it (``JITFunction.run``), through the direct launcher (``direct_us``:
``launcher(kernel)[grid](*args, **constexprs)``; ``bound_us``: ``direct.launch`` with the constexprs one read-only
mapping made once, as snip_ds's call sites launch) and of the compiled kernel's own launcher alone
(``CompiledKernel[grid]``). Compiles are counted (in warm-up, and in the timed steps: none expected).
bench_layer_host runs this as a subprocess (:func:`measure_in_subprocess`); standalone::

    python benchmarks/triton_launch_path.py --rows layer:fp8_hybrid block:nvfp4 --steps 50 --output x.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Callable, List

from no_gpu_driver import TARGET, Compile, install

HERE = Path(__file__).resolve().parent


# ------------------------------------------------------------------------------------------------ snip_ds on it

def widen_snip_ds(stack: ExitStack) -> str:
    """Sends the torch backend down its CUDA code path on CPU tensors with the kernels compiled (not
    interpreted) until ``stack`` closes: the kernels count as available without a CUDA device, their argument
    check takes CPU tensors (what it does under the interpreter), and the CUDA devices' paths take CPU tensors
    (bench_layer_host's ``cuda_path_on_cpu``). Returns what the FP8 GEMMs run as."""
    import bench_layer_host as bench
    from snip_ds.backend import kernels
    from snip_ds.backend.kernels import quantize

    if quantize.INTERPRETED:
        raise RuntimeError("Triton's launch path needs the kernels compiled: TRITON_INTERPRET unset (or 0) before "
                           "triton is imported")
    check = quantize._check_args

    def check_any_device(x, axis, tensor_amax, seed, offset, out_dtype, transpose, interpreting):
        check(x, axis, tensor_amax, seed, offset, out_dtype, transpose, True)

    for module, name, value in ((kernels, "available", lambda: True), (quantize, "_check_args", check_any_device)):
        stack.callback(setattr, module, name, getattr(module, name))
        setattr(module, name, value)
    return bench.cuda_path_on_cpu(stack, interpreted=False)


@dataclass
class Launch:
    """One launch of a snip_ds kernel as a step makes it: ``kernel[grid](*args, **kwargs)``, reached through
    ``torch.library.wrap_triton`` (what ``launchable`` gives a compiled kernel)."""

    name: str
    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict
    compiled: object = None  # the CompiledKernel JITFunction.run launched
    launched: tuple = ()  # (3-D grid, the arguments) its launcher handed the driver's launch call
    constants: object = None  # ``kwargs`` as one read-only mapping, made once (as a launch configuration's)

    def through_triton(self) -> None:
        import torch
        torch.library.wrap_triton(self.kernel)[self.grid](*self.args, **self.kwargs)

    def without_wrap_triton(self) -> None:
        self.kernel[self.grid](*self.args, **self.kwargs)

    def direct(self) -> None:
        """The launch through snip_ds's direct launcher (the kernel itself where it does not engage)."""
        from snip_ds.backend.kernels import direct
        direct.launcher(self.kernel)[self.grid](*self.args, **self.kwargs)

    def bound(self) -> None:
        """The launch as snip_ds's call sites make it (``quantize.run_kernel``): through the direct launcher's
        ``Bound`` launches, whose constexprs' part of the class was worked out once for this mapping."""
        from snip_ds.backend.kernels import direct
        direct.launch(self.kernel, self.grid, self.args, self.constants)

    def compiled_kernel(self) -> None:
        """The compiled kernel launched by Triton's own lowest entry (``CompiledKernel[grid](*args)``): no
        argument binding, specialization key or cache lookup -- what a launcher kept per configuration would
        call."""
        grid, args = self.launched
        self.compiled[grid](*args)

    def empty(self) -> None:
        """The launch as bench_layer_host times it: the same call, to a launch that does nothing."""
        from snip_ds.backend.dispatch_audit import _CountedKernel
        _CountedKernel(self.kernel, self.name, None, run=False)[self.grid](*self.args, **self.kwargs)


def recorded_launches(step: Callable[[], None]) -> List[Launch]:
    """The kernel launches (``JITFunction.run``, whatever called it) that one call of ``step`` makes, in
    order, each with what reached the driver's launch call (:class:`NoGpuUtils`); each is launched, too, through
    ``JITFunction.run`` (the direct launcher off, so that every launch is seen there)."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from snip_ds.backend.kernels import direct

    launches: List[Launch] = []
    run = JITFunction.run
    utils = driver.active.utils

    def recording(self, *args, grid, warmup, **kwargs):
        compiled = run(self, *args, grid=grid, warmup=warmup, **kwargs)
        if not warmup:
            launches.append(Launch(self.fn.__name__.strip("_"), self, tuple(grid), args, kwargs, compiled,
                                   constants=MappingProxyType(dict(kwargs))))
        return compiled

    JITFunction.run, utils.recorded = recording, []
    try:
        with direct.disabled():
            step()
    finally:
        JITFunction.run, (recorded, utils.recorded) = run, (utils.recorded, None)
    if len(recorded) != len(launches):
        raise RuntimeError(f"{len(launches)} launches reached JITFunction.run, {len(recorded)} the driver")
    for launch, launched in zip(launches, recorded):
        launch.launched = launched
    return launches


def _cpu_us(call: Callable[[], None]) -> float:
    begin = time.process_time()
    call()
    return (time.process_time() - begin) * 1e6


def paired_us(through: Callable[[], None], empty: Callable[[], None], pairs: int) -> float:
    """The median over ``pairs`` pairs of ``through``'s CPU time less ``empty``'s, the order within a pair
    alternating (a drift of the machine's load falls on both alike)."""
    diffs = []
    for i in range(pairs):
        if i % 2:
            b = _cpu_us(empty)
            a = _cpu_us(through)
        else:
            a = _cpu_us(through)
            b = _cpu_us(empty)
        diffs.append(a - b)
    return statistics.median(diffs)


def _paired_steps(step: Callable[[], None], steps: int, wrap_triton: bool = True, direct: bool = True) -> float:
    """:func:`paired_us` of whole steps: through Triton's launch path less with empty launches, each timed
    inside its patches (entering and leaving them is in neither time). ``wrap_triton=False``: the launches
    skip ``torch.library.wrap_triton``'s dispatch of a higher-order operator (``set_wrap_triton_enabled``,
    what a ``triton_op`` called eagerly does). ``direct=False``: snip_ds's direct launcher off, every launch
    through ``JITFunction.run``."""
    from torch._library.triton import set_wrap_triton_enabled

    from snip_ds.backend.dispatch_audit import patch_triton_launches
    from snip_ds.backend.kernels import direct as direct_path

    diffs = []
    for i in range(steps):
        times = {}
        for through in ((True, False) if i % 2 == 0 else (False, True)):
            with ExitStack() as stack:
                if not through:
                    patch_triton_launches(stack, None, run=False)
                elif not wrap_triton:
                    stack.enter_context(set_wrap_triton_enabled(False))
                if not direct:
                    stack.enter_context(direct_path.disabled())
                times[through] = _cpu_us(step)
        diffs.append(times[True] - times[False])
    return statistics.median(diffs)


def _kernel_params(kernel) -> "tuple[int, int]":
    """(parameters, of which constexpr) of a JITFunction's signature."""
    params = getattr(kernel, "params", [])
    return len(params), sum(1 for p in params if p.is_constexpr)


def _jit_runs(step: Callable[[], None]) -> int:
    """How many launches of one call of ``step`` enter ``JITFunction.run``."""
    from triton.runtime.jit import JITFunction

    runs = [0]
    run = JITFunction.run

    def counting(self, *args, **kwargs):
        runs[0] += 1
        return run(self, *args, **kwargs)

    JITFunction.run = counting
    try:
        step()
    finally:
        JITFunction.run = run
    return runs[0]


def measure_step(step: Callable[[], None], drv, compiles: List[Compile], steps: int, repeats: int) -> dict:
    """``triton_launch_us`` of one step (:func:`_paired_steps`; ``jit_function_us`` with the direct launcher
    off), each of its launches replayed alone (:func:`paired_us`), how many reach the driver's launch in a step
    and how many of them ``JITFunction.run``, and the compiles: in warm-up (one per kernel specialization) and in
    the timed steps (none, if the kernel cache holds)."""
    first = len(compiles)
    step()  # compiles every kernel specialization the step launches (and the direct launcher learns its classes)
    warmup = len(compiles) - first
    launches = recorded_launches(step)
    counted = drv.utils.launches
    jit_runs = _jit_runs(step)
    driver_launches = drv.utils.launches - counted
    row_us = _paired_steps(step, steps) if launches else 0.0
    direct_us = _paired_steps(step, steps, wrap_triton=False) if launches else 0.0
    jit_us = _paired_steps(step, steps, direct=False) if launches else 0.0
    per_launch = []
    for launch in launches:
        params, constexprs = _kernel_params(launch.kernel)
        per_launch.append({"kernel": launch.name, "args": len(launch.args) + len(launch.kwargs),
                           "params": params, "constexprs": constexprs, "grid": list(launch.grid),
                           "us": paired_us(launch.through_triton, launch.empty, repeats),
                           "without_wrap_triton_us": paired_us(launch.without_wrap_triton, launch.empty, repeats),
                           "direct_us": paired_us(launch.direct, launch.empty, repeats),
                           "bound_us": paired_us(launch.bound, launch.empty, repeats),
                           "compiled_kernel_us": paired_us(launch.compiled_kernel, launch.empty, repeats)})
    return {"triton_launch_us": row_us, "without_wrap_triton_us": direct_us, "jit_function_us": jit_us,
            "launches": len(launches), "driver_launches": driver_launches, "jit_runs_per_step": jit_runs,
            "per_launch": per_launch, "compiles_warmup": warmup,
            "compile_s_warmup": sum(c.seconds for c in compiles[first:first + warmup]),
            "compiles_timed": len(compiles) - first - warmup}


# ------------------------------------------------------------------------------------------------ the process

def measure_rows(rows: List[str], tokens: int, k: int, n: int, steps: int, repeats: int) -> dict:
    """Each ``scope:variant`` row's eager step measured (:func:`measure_step`) on bench_layer_host's module."""
    import torch
    import triton

    import bench_layer_host as bench

    torch.set_num_threads(1)  # as bench_layer_host
    res = {"triton": triton.__version__, "target": "sm_%d" % TARGET[1], "steps": steps, "repeats": repeats,
           "rows": {}}
    shapes = argparse.Namespace(tokens=tokens, k=k, n=n)
    with ExitStack() as stack:
        drv, compiles = install(stack)
        res["cuda_path_gemms"] = widen_snip_ds(stack)
        for spec in rows:
            scope, variant = spec.split(":")
            build = bench.make_layer if scope == "layer" else bench.make_block
            module, x, g, kwargs = build(variant, shapes, "cpu")
            step = bench.Step(module, module, x, g, kwargs)
            res["rows"][spec] = measure_step(step, drv, compiles, steps, repeats)
        res["compiles"] = [{"kernel": c.kernel, "s": c.seconds} for c in compiles]
    return res


def subprocess_env(cache_dir: str) -> dict:
    """The environment of the measuring process: Triton not interpreting (bench_layer_host, imported there,
    leaves a set TRITON_INTERPRET alone), Triton's kernel cache in ``cache_dir`` (so every specialization is
    compiled there, and counted as such), FP fusion as Triton 3.9 defaults it (stated, which silences a
    warning), the repository importable."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": cache_dir}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    return env


def measure_in_subprocess(rows: List[str], tokens: int, k: int, n: int, steps: int, repeats: int,
                          timeout_s: float) -> dict:
    """:func:`measure_rows` in a process of its own (this one has Triton in interpreter mode): its result, or
    ``{"not_measured": why}`` -- no ptxas, a Triton whose CUDA backend differs, a timeout -- never an estimate."""
    with tempfile.TemporaryDirectory(prefix="snip_ds_triton_cache_") as cache, \
            tempfile.TemporaryDirectory(prefix="snip_ds_triton_launch_") as out:
        path = Path(out) / "triton_launch_path.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--rows", *rows, "--tokens", str(tokens), "--k",
               str(k), "--n", str(n), "--steps", str(steps), "--repeats", str(repeats), "--output", str(path)]
        try:
            proc = subprocess.run(cmd, env=subprocess_env(cache), capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"not_measured": f"the measuring process ran past {timeout_s:.0f} s"}
        if proc.returncode != 0 or not path.exists():
            lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
            return {"not_measured": f"the measuring process failed: {lines[-1][:300] if lines else proc.returncode}"}
        return json.loads(path.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", required=True, help="scope:variant, e.g. layer:fp8_hybrid block:nvfp4")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--steps", type=int, default=100, help="paired steps per row")
    p.add_argument("--repeats", type=int, default=200, help="paired replays per launch")
    p.add_argument("--output", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        res = measure_rows(args.rows, args.tokens, args.k, args.n, args.steps, args.repeats)
    except Exception as err:  # Triton's CUDA backend cannot compile here (no ptxas, another Triton): why, in full
        res = {"not_measured": f"{type(err).__name__}: {' '.join(str(err).split())[:400]}"}
    import bench_layer_host as bench
    import torch

    res = {"commit": bench.commit(), "machine": bench.machine(), "torch": torch.__version__, **res}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "0")  # (else bench_layer_host, imported first, sets it to 1)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated: no warning
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    sys.exit(main())
