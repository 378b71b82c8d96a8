"""What one linear's and one decoder block's training step cost beyond their arithmetic, per recipe and torchao.

Launches, host time, host reads, bytes kept for backward, peak bytes:

    python benchmarks/bench_layer_host.py                  # writes benchmarks/results/bench_layer_host.{json,md}
    python benchmarks/bench_layer_host.py --device cuda    # on a GPU: bench_layer_host_cuda.{json,md}
    python benchmarks/bench_layer_host.py --steps 3 --variants fp8_hybrid --modes eager --output_dir DIR  # a quick look

Variants: ``bf16`` (``nn.Linear``), snip_ds's ``fp8_hybrid``, ``mxfp8``, ``nvfp4`` and ``mxfp4`` (SnipLinear on the
``torch`` backend, what ``backend: auto`` runs on a GPU), and torchao's float8 training (``Float8Linear``,
``torchao_tensorwise`` and ``torchao_rowwise``), each ``eager`` and ``compiled`` (``torch.compile``, inductor), in
two scopes: ``layer`` (one linear, 32 tokens, 64 x 64, forward + backward) and ``block`` (one Llama decoder block of
the default model's family at a small width -- RMSNorms, attention with RoPE and GQA, SwiGLU MLP -- its seven linears
at the variant, swapped by snip_ds's own ``swap_linears`` or torchao's ``convert_to_float8_training``; forward +
backward, BF16 input). All in BF16.

Without a GPU the rows are the CUDA code path run on CPU tensors (:func:`cuda_path_on_cpu`: snip_ds's Triton
kernels under Triton's interpreter, the FP8 GEMMs as the CPU's ``torch._scaled_mm``): what a GPU would launch,
counted without one. Per row:

* ``launches``: kernels per step. Eager: the dispatch counter (``snip_ds.backend.dispatch_audit.OpCounter``):
  operators that run a kernel -- inside tensor subclasses too (torchao's) -- plus Triton launches; views not.
  Compiled: the same from a profile (``profiled_kernels``): inductor's generated kernels (C++ on a CPU, where a
  GPU would run Triton kernels), the operators the compiled code calls, plus snip_ds's Triton launches inside
  its custom ops. On CUDA: the device kernels in the profile.
* ``step_us``: the median CPU time of one thread over ``--steps`` steps (``time.process_time``), the rows of a
  scope and mode taking their steps in turn, so that a shared machine's changing load falls on all alike; the
  GPU idle before each step on CUDA. On a CPU snip_ds's Triton
  launches are replaced by empty ones (the host's work up to the launch; the interpreter's run of the kernel is
  not timed), but the CPU operators run.
* ``host_us``: on a CPU a step's time less ``arithmetic_us``, the arithmetic of its matrix and attention
  operators (GEMMs, the CPU's ``_scaled_mm`` -- a slow emulation here --, SDPA), recorded from an eager step of
  the same module and replayed alone right after each timed step, each operator's time less a 1 x 1 ``mm``'s
  (one dispatch, which a GPU launch pays too); the median over the steps of these paired differences. What is
  left is the host's work: Python, autograd, dispatch, and the element-wise operators' small arithmetic at
  these shapes. On CUDA ``step_us`` itself (the kernels run on the GPU).
* ``triton_launch_us`` (CPU only): the host time of Triton's own launch path for the step's snip_ds launches,
  which ``step_us`` leaves out: in a process of its own (:mod:`triton_launch_path`) the kernels compiled for sm_90
  by Triton's compiler and ptxas, launched as snip_ds launches them eagerly (its direct launcher,
  ``snip_ds.backend.kernels.direct``) through Triton's ``CudaLauncher`` by a driver whose C launch call does nothing
  (the kernels never run); the median over
  ``--steps`` paired steps of a step's time through that path less its time with empty launches. 0 where the
  step launches none; None, the reason in ``triton_launch_not_measured``, where it could not be measured
  (compiled rows that launch snip_ds kernels: inductor launches them its own way; Triton cannot compile here).
  ``triton_launch`` holds the step through ``JITFunction.run`` (``jit_function_us``), each launch's kernel,
  arguments and µs replayed alone four ways (direct, ``JITFunction.run``, ``wrap_triton``'s operator, the compiled
  kernel's launcher) and the compiles.
  ``host_with_triton_us``: ``host_us`` plus it.
* ``syncs``: host reads of a tensor's value in a step (``HostReads``; compiled: the value-dependent operators in
  the profile).
* ``saved_bytes``: bytes autograd keeps between forward and backward (``saved_tensors_hooks``; each storage once,
  parameters' storages not counted, a subclass by its inner tensors); eager, ``saved_linear_only_bytes``: those
  only the linear layers keep (:func:`where_bytes.saved_by_owner`), the rest being what the recipe leaves alone.
* ``peak_bytes``: the peak of the bytes allocated during a step above what was allocated before it, parameters
  not counted, their gradients counted. Eager on a CPU: the live tensors' bytes (:class:`where_bytes.PeakLive`;
  ``peak_op``, the operator whose outputs reached it; ``peak_held``, what was live then and what made it).
  Compiled on a CPU: ``peak_alloc_bytes``, the CPU allocator's records in a memory profile, its kernels' scratch
  included; ``peak_alloc_outliving_bytes`` the same without the bytes an ``aten::`` operator allocates and frees
  inside its own call (:func:`where_bytes.allocator_peaks`; eager, it equals the live tensors' peak),
  ``peak_alloc_scratch_bytes`` that scratch at the peak, ``peak_alloc_in`` the operators whose call reached it.
  On CUDA: ``max_memory_allocated``.
* ``*_ratio_vs_bf16``: over ``bf16``'s in the same scope and mode, the same run.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
from collections import Counter
from contextlib import ExitStack, nullcontext
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

if "--device" not in sys.argv or "cpu" in sys.argv[sys.argv.index("--device") + 1:][:1]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the CUDA path's kernels on CPU tensors (read at triton's import)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from snip_ds.backend import torch_native  # noqa: E402
from snip_ds.runtime.fileio import atomic_write_text  # noqa: E402
from snip_ds.backend.dispatch_audit import (HostReads, OpCounter, OpCounts,  # noqa: E402
                                            patch_triton_launches, profiled_host_reads, profiled_kernels)
from snip_ds.linear import SnipLinear  # noqa: E402
from snip_ds.quant_config import QuantConfig  # noqa: E402

from where_bytes import PeakLive, allocator_peaks, is_linear, saved_by_owner  # noqa: E402
from where_bytes import markdown as where_bytes_markdown  # noqa: E402

SNIP = {  # name: (precision, config)
    "fp8_hybrid": ("fp8", QuantConfig(backend="torch")),
    "mxfp8": ("fp8", QuantConfig(backend="torch", fp8_recipe="mxfp8")),
    "nvfp4": ("fp4", QuantConfig(backend="torch")),
    "mxfp4": ("fp4", QuantConfig(backend="torch", fp4_recipe="mxfp4")),
}
TORCHAO = {"torchao_tensorwise": "tensorwise", "torchao_rowwise": "rowwise"}
VARIANTS = ("bf16", *SNIP, *TORCHAO)
FLOOR = "fp8_gemms_only"  # fp8_hybrid's three GEMMs alone (gemms_only.py): a layer eager row beside fp8_hybrid's
SCOPES = ("layer", "block")
MODES = ("eager", "compiled")
BLOCK = dict(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
TARGETS = [  # (what, the figure): for the Markdown's check list
    "fp8_hybrid layer launches, eager <= 10; mxfp8 / nvfp4 / mxfp4 <= 12",
    "fp8_hybrid layer host ratio, eager <= 1.6x; block host ratio, eager and compiled <= 1.3x",
    "fp8_hybrid block launches, compiled <= bf16 block compiled + 21",
    "fp8_hybrid block saved_bytes_ratio <= 0.75x; peak_bytes_ratio <= 1.0x; syncs 0 in every row",
    "every fp8_hybrid row below torchao's rows of the same scope and mode in launches and host ratio",
]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return f"{cpu}, {os.cpu_count()} CPUs" + (f"; {gpu}" if gpu else "")


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=REPO, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out, dirty = "", ""
    out = out or os.environ.get("SNIP_DEVICE_COMMIT", "unknown")[:12]
    return out + (" (tracked files modified)" if dirty else "")


def torchao_version() -> str:
    try:
        import torchao
        return torchao.__version__
    except Exception as err:  # not installed, or not importable with this torch
        return f"not available ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"


def cuda_path_on_cpu(stack: ExitStack, interpreted: bool = True) -> str:
    """Sends the torch backend down its CUDA code path on CPU tensors (restored when ``stack`` closes); returns
    what the FP8 GEMMs run as there. ``interpreted``: the kernels run under Triton's interpreter (this process);
    False: they are compiled for a GPU and launched through a driver that launches nothing
    (:mod:`triton_launch_path`, in a process of its own)."""
    from snip_ds.backend import kernels

    def restore(name, value):
        stack.callback(setattr, torch_native, name, value)

    for name in ("KERNEL_DEVICES", "SCALED_MM_DEVICES", "_kernels_checked", "_kernels_module"):
        restore(name, getattr(torch_native, name))
    torch_native.KERNEL_DEVICES = ("cpu", "cuda")
    torch_native._kernels_checked, torch_native._kernels_module = False, None
    if torch_native.kernels() is not kernels or kernels.interpreting() != interpreted:
        raise RuntimeError("the cuda path on a CPU needs triton and TRITON_INTERPRET=1 before triton is imported"
                           if interpreted else "the kernels compiled: TRITON_INTERPRET unset before triton's import")
    try:  # oneDNN's FP8 matmul, where this CPU has it: the GEMMs of the GPU path
        a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(()), scale_b=torch.ones(()), out_dtype=torch.float32)
        torch_native.SCALED_MM_DEVICES = ("cpu", "cuda")
        return "torch._scaled_mm"
    except (RuntimeError, NotImplementedError):
        return "BF16-exact GEMMs (no FP8 matmul in this CPU's oneDNN)"


# ------------------------------------------------------------------------------------------------ the modules

def _torchao(module: torch.nn.Module, recipe: str) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name(recipe))


def make_layer(variant: str, args, device: str):
    """(module, input, output gradient, extra forward kwargs) of one linear."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(args.k, args.n, bias=False, device=device, dtype=torch.bfloat16)
    module = linear
    if variant in SNIP:
        module = SnipLinear.from_linear(linear, *SNIP[variant])
        module.generator = torch.Generator(device=device).manual_seed(0)
    elif variant in TORCHAO:
        module = torch.nn.Sequential(linear)
        _torchao(module, TORCHAO[variant])
    x = torch.randn(args.tokens, args.k, device=device).bfloat16()
    g = (torch.randn(args.tokens, args.n, device=device) * 1e-3).bfloat16()
    if variant == FLOOR:
        from gemms_only import Fp8GemmsOnly
        module = Fp8GemmsOnly(linear, x, g)
    return module, x, g, {}


def block_config(tokens: int):
    """The default model's config (snip_ds.run.model.default_model_config) at a small width, one block."""
    from snip_ds.run.model import default_model_config

    config = default_model_config(vocab_size=64, block_size=tokens)
    for key, value in {**BLOCK, "num_hidden_layers": 1}.items():
        setattr(config, key, value)
    config._attn_implementation = "sdpa"
    return config


def make_block(variant: str, args, device: str):
    """(decoder block, hidden states, their gradient, position embeddings) of the default model's family."""
    from transformers import AutoModelForCausalLM

    from snip_ds.swap import swap_linears

    torch.manual_seed(0)
    config = block_config(args.tokens)
    model = AutoModelForCausalLM.from_config(config).to(device=device, dtype=torch.bfloat16)
    if variant in SNIP:
        swap_linears(model, *SNIP[variant])
    block = model.model.layers[0]
    if variant in TORCHAO:
        _torchao(block, TORCHAO[variant])
    x = torch.randn(1, args.tokens, config.hidden_size, device=device).bfloat16()
    g = (torch.randn(1, args.tokens, config.hidden_size, device=device) * 1e-3).bfloat16()
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(x, torch.arange(args.tokens, device=device)[None])
    return block, x, g, {"position_embeddings": (cos, sin)}


class Step:
    """One forward + backward of ``fn`` (the module, or its compiled form) on a fresh leaf input; the
    parameters' gradients are dropped after it."""

    def __init__(self, module, fn, x, g, kwargs):
        self.params = list(module.parameters())
        self.fn, self.x, self.g, self.kwargs = fn, x, g, kwargs

    def __call__(self, forward_context=None):
        xi = self.x.detach().requires_grad_(True)
        with forward_context if forward_context is not None else nullcontext():
            out = self.fn(xi, **self.kwargs)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(self.g)
        for p in self.params:
            p.grad = None


# ------------------------------------------------------------------------------------------------ the figures

def peak_bytes(step: Step, device: str) -> dict:
    """Peak bytes allocated during one step above what was allocated before it (``peak_bytes``): on CUDA the
    caching allocator's; on a CPU the CPU allocator's records in a memory profile (its kernels' scratch included),
    with the peak of what outlives the operator calls that allocated it
    (:func:`where_bytes.allocator_peaks`)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return {"peak_bytes": torch.cuda.max_memory_allocated() - before}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return allocator_peaks(prof)


def profiled(step: Step, device: str, steps: int) -> dict:
    """From a profile of ``steps`` steps: kernels per step, by name, and host reads per step."""
    from torch.profiler import ProfilerActivity, profile

    counts = OpCounts()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with ExitStack() as stack:
        if device == "cpu":
            patch_triton_launches(stack, counts, run=False)
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            if device == "cuda":
                torch.cuda.synchronize()
    events = prof.events()
    if device == "cuda":
        kernels = Counter(e.name[:80] for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    else:
        kernels = profiled_kernels(events) + counts.triton
    return {"launches": sum(kernels.values()) / steps,
            "by_op": {k: v / steps for k, v in sorted(kernels.items(), key=lambda kv: (-kv[1], kv[0]))},
            "syncs": sum(profiled_host_reads(events).values()) / steps}


class _RecordMatrixOps(TorchDispatchMode):
    """Records the matrix and attention operators a step dispatches (inside tensor subclasses too), each
    with copies of its arguments, to replay them alone."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(t, torch.Tensor) and type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__
               for t in pytree.tree_leaves((args, kwargs))):
            return NotImplemented  # a subclass: its own operators come next
        name = func._schema.name
        if "mm" in name or "scaled_dot_product" in name:
            copy = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))
            self.calls.append((func, *copy))
        return func(*args, **kwargs)


def _call_us(call) -> float:
    begin = time.process_time()
    call()
    return (time.process_time() - begin) * 1e6


def dispatch_floor_us(device: str) -> float:
    """The median CPU time of a 1 x 1 ``mm`` on ``device``, timed as :func:`replay_us` times each operator: one
    dispatch (which a GPU launch pays too) and the timer's own cost."""
    one = torch.ones(1, 1, dtype=torch.bfloat16, device=device)
    return statistics.median(_call_us(lambda: torch.ops.aten.mm.default(one, one)) for _ in range(200))


def record_matrix_ops(module, x, g, kwargs) -> list:
    """The matrix and attention operators (GEMMs, ``_scaled_mm``, SDPA; what dominates the arithmetic at these
    shapes) of one eager step of ``module``, each with copies of its arguments, run once more (their one-off
    set-up) so that :func:`replay_us` times their arithmetic alone."""
    recorder = _RecordMatrixOps()
    with recorder:
        Step(module, module, x, g, kwargs)()
    for func, args, kw in recorder.calls:
        func(*args, **kw)
    return recorder.calls


def replay_us(calls: list, floor_us: float) -> Counter:
    """Each recorded operator replayed once, its CPU time less ``floor_us`` (one dispatch), by operator."""
    per_op = Counter()
    for func, args, kw in calls:
        per_op[func._schema.name] += max(0.0, _call_us(lambda: func(*args, **kw)) - floor_us)
    return per_op


def python_profile(step: Step, steps: int, top: int = 12) -> list:
    """The Python functions with the most own time over ``steps`` steps (cProfile), µs per step."""
    prof = cProfile.Profile(time.process_time)  # CPU time: what other processes barely move
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{Path(f).name}:{line} {name}", "calls": nc / steps, "own_us": tt / steps * 1e6}
            for (f, line, name), (_, nc, tt, _, _) in rows]


_MATRIX_OPS: dict = {}  # (scope, variant): record_matrix_ops's result, from the eager module (both modes)


def measure(scope: str, variant: str, mode: str, args, device: str):
    """One row's figures but its times, and the step that :func:`time_steps` times with the other rows'."""
    build = make_layer if scope == "layer" else make_block
    module, x, g, kwargs = build(variant, args, device)
    fn = module
    if mode == "compiled":
        fn = torch.compile(module, backend="inductor")
    step = Step(module, fn, x, g, kwargs)
    begin = time.perf_counter()
    with ExitStack() as stack:
        if mode == "compiled" and device == "cpu":  # (nothing counts the compiled rows' kernels by running them)
            patch_triton_launches(stack, None, run=False)
        step()  # compiles (inductor), builds and launches the kernels once
    warmup_s = time.perf_counter() - begin
    row = {"scope": scope, "variant": variant, "mode": mode, "warmup_s": warmup_s}
    started = time.perf_counter()
    if mode == "eager" and device == "cpu":
        with OpCounter() as counter:  # the kernels run (Triton's interpreter): the step as it is
            step()
        row["launches"] = counter.counts.launches
        row["by_op"] = counter.counts.as_dict()["by_op"]
        row["views"] = sum(counter.counts.views.values())
        row["subclass_ops"] = sum(counter.counts.subclass.values())
    with ExitStack() as stack:
        if device == "cpu":
            patch_triton_launches(stack, None, run=False)  # the launch's host work, not the interpreted kernel
        for _ in range(2):
            step()
        prof = profiled(step, device, max(3, args.steps // 20))
        if "launches" not in row:
            row["launches"], row["by_op"] = prof["launches"], prof["by_op"]
        else:
            row["launches_profiled"] = prof["launches"]
        if mode == "eager":
            with HostReads() as reads:
                step()
            row["syncs"] = len(reads.reads)
            row["sync_sites"] = sorted({str(r) for r in reads.reads})
        else:
            row["syncs"] = prof["syncs"]
        linears = [m for m in module.modules() if is_linear(m)] if mode == "eager" else []
        kept = saved_by_owner(step, step.params, linears)  # (compiled: no hooks on the compiled modules)
        row["saved_bytes"], row["saved"] = kept["bytes"], kept["tensors"]
        if linears:
            row["saved_linear_only_bytes"] = kept["linear_only_bytes"]
        alloc = peak_bytes(step, device)
        row["peak_alloc_bytes"] = alloc["peak_bytes"]
        if "outliving_peak_bytes" in alloc:
            row["peak_alloc_outliving_bytes"] = alloc["outliving_peak_bytes"]
            row["peak_alloc_scratch_bytes"], row["peak_alloc_in"] = alloc["scratch_at_peak_bytes"], alloc["peak_in"]
        if device == "cpu" and mode == "eager":
            with PeakLive() as mem:
                step()
            row["peak_bytes"], row["peak_method"] = mem.peak, "tensors"
            row["peak_op"], row["peak_held"] = mem.peak_op, mem.at_peak
        else:
            row["peak_bytes"], row["peak_method"] = row["peak_alloc_bytes"], "allocator"
        if device == "cpu" and (scope, variant) not in _MATRIX_OPS:  # (recorded once: the same for both modes)
            _MATRIX_OPS[scope, variant] = record_matrix_ops(module, x, g, kwargs)
        if args.python_profile and mode == "eager" and variant in ("bf16", "fp8_hybrid"):
            row["python_top"] = python_profile(step, max(5, args.steps // 10))
    row["measure_s"] = time.perf_counter() - started
    return row, step


def time_steps(group: list, device: str, steps: int) -> None:
    """Each row's ``step_us`` (the median CPU time of its steps), ``arithmetic_us`` and ``host_us``, the rows'
    steps taken in turn (one step of each, ``steps`` times), so that a machine's changing load falls on all of
    them alike. On a CPU each step is followed by one replay of its matrix and attention operators
    (:func:`replay_us`): ``host_us`` is the median over the steps of a step's time less its replay's, a paired
    difference that the load of the moment moves little."""
    times = {id(row): [] for row, _ in group}
    arith = {id(row): [] for row, _ in group}
    floor = dispatch_floor_us(device) if device == "cpu" else 0.0
    with ExitStack() as stack:
        if device == "cpu":
            patch_triton_launches(stack, None, run=False)  # the launch's host work, not the interpreted kernel
        for _ in range(steps):
            for row, step in group:
                if device == "cuda":
                    torch.cuda.synchronize()
                begin = time.process_time()
                step()
                times[id(row)].append((time.process_time() - begin) * 1e6)
                if device == "cpu":
                    arith[id(row)].append(replay_us(_MATRIX_OPS[row["scope"], row["variant"]], floor))
    if device == "cuda":
        torch.cuda.synchronize()
    for row, _ in group:
        row["step_us"] = statistics.median(times[id(row)])
        if device == "cpu":
            samples = arith[id(row)]
            ops = sorted({op for sample in samples for op in sample})
            row["arithmetic_by_op"] = {op: statistics.median(sample[op] for sample in samples) for op in ops}
            totals = [sum(sample.values()) for sample in samples]
            row["arithmetic_us"] = statistics.median(totals)
            row["host_us"] = max(statistics.median(t - a for t, a in zip(times[id(row)], totals)), 0.0)
            row["dispatch_floor_us"] = floor
        else:
            row["arithmetic_us"], row["host_us"] = 0.0, row["step_us"]


def add_ratios(rows: list) -> None:
    base = {(r["scope"], r["mode"]): r for r in rows if r["variant"] == "bf16" and "error" not in r}
    for r in rows:
        b = base.get((r["scope"], r["mode"]))
        if b is None or "error" in r:
            continue
        for key in ("host_us", "step_us", "saved_bytes", "peak_bytes", "host_with_triton_us",
                    "peak_alloc_outliving_bytes"):
            if key not in r:
                continue
            name = key.replace("_us", "") + "_ratio_vs_bf16"
            if r[key] is None or b.get(key) is None:
                r[name] = None
            else:
                r[name] = r[key] / b[key] if b[key] else float("nan")


COMPILED_TRITON_PATH = ("a compiled step's snip_ds kernels are launched by inductor's generated code "
                        "(its own launcher for the triton_op's kernels), not through JITFunction.run; that launcher "
                        "is not driven without a GPU here")


def _triton_launches(row: dict) -> float:
    """snip_ds's Triton launches per step in a row."""
    return sum(c for op, c in row["by_op"].items() if op.startswith("triton::"))


def add_triton_launch_path(res: dict, args, timeout_s: float) -> None:
    """Each row's ``triton_launch_us``: the host time of Triton's own launch path for its step's snip_ds launches
    (:mod:`triton_launch_path`, in a process of its own: the kernels compiled for sm_90, launched as snip_ds
    launches them eagerly, through ``CudaLauncher`` by a driver whose C launch does nothing), 0 where
    the step launches none; None where not measured, why in ``triton_launch_not_measured``. And
    ``host_with_triton_us``, ``host_us`` plus it."""
    from triton_launch_path import measure_in_subprocess

    rows = [r for r in res["rows"] if "error" not in r]
    eager = [r for r in rows if r["mode"] == "eager" and _triton_launches(r)]
    specs = [f"{r['scope']}:{r['variant']}" for r in eager]
    began = time.perf_counter()
    measured = measure_in_subprocess(specs, args.tokens, args.k, args.n, args.steps, args.launch_repeats,
                                     timeout_s) if specs else {"rows": {}}
    res["triton_launch_path"] = {**{k: v for k, v in measured.items() if k != "rows"},
                                 "wall_s": time.perf_counter() - began}
    for r in rows:
        spec, reason = f"{r['scope']}:{r['variant']}", None
        if not _triton_launches(r):
            r["triton_launch_us"] = 0.0  # no snip_ds Triton launch in the step: nothing to time
        elif r["mode"] == "compiled":
            reason = COMPILED_TRITON_PATH
        elif "not_measured" in measured:
            reason = measured["not_measured"]
        elif measured["rows"][spec]["launches"] != _triton_launches(r):
            reason = (f"the measuring process's step launched {measured['rows'][spec]['launches']} "
                      f"kernels, the interpreted one {_triton_launches(r):g}")
        else:
            r["triton_launch"] = measured["rows"][spec]
            r["triton_launch_us"] = r["triton_launch"]["triton_launch_us"]
        if reason:
            r["triton_launch_us"], r["triton_launch_not_measured"] = None, reason
        r["host_with_triton_us"] = None if reason else r["host_us"] + r["triton_launch_us"]
        print(f"{r['scope']:>5} {r['mode']:>8} {r['variant']:>18}: Triton's launch path "
              + (f"not measured: {reason}" if reason else f"{r['triton_launch_us']:.0f} us"), flush=True)


def cpu_path_launches(args) -> dict:
    """The layer's eager launches on the CPU's own code path (snip_ds's C++ kernels, streamed slices)."""
    out = {}
    for variant in ("bf16", *SNIP):
        module, x, g, kwargs = make_layer(variant, args, "cpu")
        step = Step(module, module, x, g, kwargs)
        step()
        with OpCounter() as counter:
            step()
        out[variant] = {"launches": counter.counts.launches, "by_op": counter.counts.as_dict()["by_op"]}
    return out


def run(args) -> dict:
    device = args.device
    torch.set_num_threads(1)  # one thread: its CPU time is what other processes on a shared machine barely move
    if device == "cpu":
        import torch._inductor.config as inductor_config
        inductor_config.cpp.enable_kernel_profile = True  # inductor's C++ kernels as profiler events: counted
    for limit in ("cache_size_limit", "recompile_limit"):  # every variant of a group compiled side by side
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    res = {"benchmark": "bench_layer_host", "commit": commit(), "machine": machine(), "torch": torch.__version__,
           "torchao": torchao_version(), "device": device, "threads": torch.get_num_threads(),
           "tokens": args.tokens, "k": args.k, "n": args.n, "block": BLOCK, "steps": args.steps, "rows": []}
    res["not_reached"] = []
    start = time.perf_counter()
    with ExitStack() as stack:
        if device == "cpu":
            res["cuda_path_gemms"] = cuda_path_on_cpu(stack)
            import triton
            res["triton"] = triton.__version__
        for mode in args.modes:  # eager first: the compiled rows' compilations take most of the time
            for scope in args.scopes:
                torch._dynamo.reset()
                group = []
                floor = [FLOOR] if (scope, mode) == ("layer", "eager") and "fp8_hybrid" in args.variants else []
                for variant in args.variants + floor:
                    if time.perf_counter() - start > args.deadline_s:
                        res["not_reached"].append(f"{scope} {mode} {variant}")
                        continue
                    try:
                        group.append(measure(scope, variant, mode, args, device))
                    except Exception as err:  # a variant that cannot run here: the reason, in its row
                        res["rows"].append({"scope": scope, "variant": variant, "mode": mode,
                                            "error": f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"})
                        print(_line(res["rows"][-1]), flush=True)
                time_steps(group, device, args.steps)
                for row, _ in group:
                    res["rows"].append(row)
                    print(_line(row), flush=True)
                add_ratios(res["rows"])
                res["wall_s"] = time.perf_counter() - start
                write(res, args.output_dir)  # what is measured so far, should the run be cut short
    if device == "cpu" and args.triton_launch_path:
        add_triton_launch_path(res, args, max(60.0, min(600.0, args.deadline_s - (time.perf_counter() - start))))
        add_ratios(res["rows"])
        write(res, args.output_dir)
    if device == "cpu" and "layer" in args.scopes and "eager" in args.modes:
        res["cpu_path"] = cpu_path_launches(args)
    res["wall_s"] = time.perf_counter() - start
    return res


def write(res: dict, output_dir: Path) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    stem = output_dir / ("bench_layer_host" + ("_cuda" if res["device"] == "cuda" else ""))
    atomic_write_text(stem.with_suffix(".json"), json.dumps(res, indent=1) + "\n")
    atomic_write_text(stem.with_suffix(".md"), markdown(res))
    return stem.with_suffix(".md")


def _line(r: dict) -> str:
    """One row as a progress line."""
    what = f"{r['scope']:>5} {r['mode']:>8} {r['variant']:>18}:"
    if "error" in r:
        return f"{what} error {r['error'][:200]}"
    figures = [f"{r['launches']:5.0f} launches", f"{r['host_us']:7.0f} us host", f"{r['syncs']} syncs",
               f"saved {r['saved_bytes']} B", f"peak {r['peak_bytes']} B", f"(warm-up {r['warmup_s']:.1f} s)"]
    return " ".join([what] + figures)


# ------------------------------------------------------------------------------------------------ the report

def _f(value, fmt="{:.2f}"):
    return "" if value is None else fmt.format(value)


def _order(r: dict):
    return SCOPES.index(r["scope"]), MODES.index(r["mode"]), (VARIANTS + (FLOOR,)).index(r["variant"])


def _triton_cell(r: dict, key: str, fmt: str) -> str:
    """A Triton launch path column's cell: the figure, "n/m" where not measured, blank where not taken."""
    if key not in r:
        return ""
    return "n/m" if r[key] is None else fmt.format(r[key])


def _triton_launch_section(res: dict) -> list:
    """The Markdown on Triton's own launch path: how it was taken, what was not measured and why, each
    row's launches by kernel."""
    path = res.get("triton_launch_path")
    if path is None:
        return []
    lines = ["", "## Triton's own launch path (eager)", ""]
    if "not_measured" in path:
        return lines + [f"Not measured: {path['not_measured']}."]
    lines += [f"Triton {path.get('triton', '?')}, the kernels compiled for {path.get('target', '?')} (ptxas) in a "
              "process without Triton's interpreter and launched with CPU tensors as snip_ds launches them eagerly "
              "(`snip_ds.backend.kernels.direct`: per launch configuration, the first launch of each kind of call "
              "through `JITFunction.run`, the later ones through the kernel it compiled) and Triton's "
              "`CudaLauncher`, by a driver whose C launch "
              "(`utils.launch`: the arguments' pointers, `cuLaunchKernelEx`) does nothing; the kernels never run "
              "(their outputs stay uninitialised: host time only). Triton launch µs: the median over "
              f"{res['steps']} paired steps of a step's CPU time through that path less the same step's with "
              "empty launches (the host µs above), which cost 2-4 µs a launch themselves, about what the real path "
              "now costs: near 0, below it by noise; host + Triton µs: their sum, what a GPU's host does short of "
              "the C launcher. Not timed: the C launcher itself, a real current-device and current-stream query. "
              f"Kernel specializations compiled: {len(path.get('compiles', []))} "
              f"({sum(c['s'] for c in path.get('compiles', [])):.1f} s), of which in the timed steps: "
              f"{sum(r['triton_launch']['compiles_timed'] for r in res['rows'] if 'triton_launch' in r)}; the "
              f"measuring process took {path['wall_s']:.0f} s.", ""]
    notes = sorted({r["triton_launch_not_measured"] for r in res["rows"] if r.get("triton_launch_not_measured")})
    lines += [f"n/m, not measured: {note}." for note in notes] + ([""] if notes else [])
    measured = [r for r in res["rows"] if r.get("triton_launch") and r["mode"] == "eager"]
    lines += ["Per step: Triton launch µs as above (as snip_ds launches), and the same step with every launch "
              "through `JITFunction.run` (`direct.disabled()`, or `SNIP_DS_TRITON_DIRECT=0`).", "",
              "| scope | variant | Triton launches | Triton launch µs | through JITFunction.run µs | "
              "compiles in warm-up |", "|---|---|---|---|---|---|"]
    for r in measured:
        launch = r["triton_launch"]
        lines.append(f"| {r['scope']} | {r['variant']} | {launch['launches']} | {launch['triton_launch_us']:.0f} | "
                     f"{_f(launch.get('jit_function_us'), '{:.0f}')} | {launch['compiles_warmup']} |")
    lines += ["", "Each launch replayed alone, by kernel (the median over a step's launches of the median of paired "
              "replays, µs): as snip_ds launches it eagerly (`direct.launch`, its launch configuration's constexprs "
              "one read-only mapping: only the positional arguments' classes computed); through the direct "
              "launcher's generic entry (`launcher(kernel)[grid](*args, **constexprs)`: the constexprs' class too); "
              "through `JITFunction.run` "
              "(`kernel[grid]`); through `torch.library.wrap_triton`'s higher-order operator, as every eager launch "
              "went before the direct launcher; and the compiled kernel's launcher alone (`CompiledKernel[grid]`: "
              "no binding, specialization key, cache lookup or class).", "",
              "| scope | variant | kernel | launches | arguments (constexpr) | snip_ds µs | direct[grid] µs | "
              "JITFunction.run µs | "
              "wrap_triton µs | CompiledKernel µs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in measured:
        by_kernel = {}
        for one in r["triton_launch"]["per_launch"]:
            by_kernel.setdefault(one["kernel"], []).append(one)
        for name, ones in by_kernel.items():
            lines.append(f"| {r['scope']} | {r['variant']} | `{name}` | {len(ones)} | {ones[0]['args']} "
                         f"({ones[0]['constexprs']}) | {_median(ones, 'bound_us')} | {_median(ones, 'direct_us')} | "
                         f"{_median(ones, 'without_wrap_triton_us')} | {_median(ones, 'us')} | "
                         f"{_median(ones, 'compiled_kernel_us')} |")
    return lines


def _median(ones: list, key: str) -> str:
    values = [o[key] for o in ones if o.get(key) is not None]
    return f"{statistics.median(values):.1f}" if values else "n/m"


def markdown(res: dict) -> str:
    cpu = res["device"] == "cpu"
    res = {**res, "rows": sorted(res["rows"], key=_order)}
    lines = ["# bench_layer_host: what a layer's and a block's step costs beyond its arithmetic", "",
             f"Commit {res['commit']}; {res['machine']}; torch {res['torch']}, torchao {res['torchao']}"
             + (f", Triton {res['triton']} (interpreter)" if cpu else "") + f"; {res['threads']} thread. "
             f"Layer: {res['tokens']} tokens, {res['k']} x {res['n']}; block: one Llama decoder block (the default "
             f"model's family), hidden {res['block']['hidden_size']}, SwiGLU {res['block']['intermediate_size']}, "
             f"{res['block']['num_attention_heads']} heads of {res['block']['head_dim']}, "
             f"{res['block']['num_key_value_heads']} KV heads, {res['tokens']} tokens; BF16, forward + backward.", ""]
    if cpu:
        lines += [f"**The CUDA code path on CPU tensors**: snip_ds's Triton kernels under Triton's interpreter, FP8 "
                  f"GEMMs as {res['cuda_path_gemms']}. Launches are what a GPU would launch (compiled: inductor's "
                  "C++ kernels, where a GPU would launch its Triton kernels). Step µs: one thread's CPU time of a "
                  "step, snip_ds's Triton launches replaced by empty ones (the host's work up to the launch call; "
                  "neither the interpreted kernel nor Triton's own launcher), the CPU operators run; arith µs: the "
                  "arithmetic of its matrix and attention operators (recorded from an eager step, replayed alone "
                  "after each timed step, less one dispatch: a 1 x 1 mm); host µs: the median of each step's time "
                  "less its replay's -- Python, autograd, dispatch and the small element-wise arithmetic. Peak B: eager, the live "
                  "tensors' bytes (LiveBytes); compiled, the CPU allocator's records (its kernels' scratch "
                  "included). Syncs, compiled: value-dependent operators in the profile.", ""]
    else:
        lines += ["On the GPU: launches are the device kernels in a profile; host µs = step µs, the CPU time of "
                  "issuing a step with the GPU idle before it (Triton's launcher included); peak B from "
                  "`torch.cuda.max_memory_allocated`.", ""]
    lines += [f"Median of {res['steps']} steps, the rows of a scope and mode taken in turn. Ratios against bf16 of "
              "the same scope and mode."
              + (f" {FLOOR} (layer, eager): fp8_hybrid's three FP8 GEMMs alone, on operands quantized beforehand, in "
                 "a Python autograd function keeping what fp8_hybrid keeps -- the floor under any eager FP8 linear "
                 "written in Python; fp8_hybrid's host time above it is its quantizations' (benchmarks/gemms_only.py)."
                 if any(r["variant"] == FLOOR for r in res["rows"]) else ""), "",
              "| scope | mode | variant | launches | host µs | host × bf16 | Triton launch µs | host + Triton µs | "
              "host + Triton × bf16 | step µs | step × bf16 | arith µs | syncs | saved B | saved × bf16 | peak B | "
              "peak × bf16 |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        head = f"| {r['scope']} | {r['mode']} | {r['variant']} |"
        if "error" in r:
            lines.append(f"{head} not run: {r['error'][:160]} | | | | | | | | | | | | | |")
            continue
        lines.append(f"{head} {r['launches']:.0f} | {r['host_us']:.0f} | {_f(r.get('host_ratio_vs_bf16'))} | "
                     f"{_triton_cell(r, 'triton_launch_us', '{:.0f}')} | "
                     f"{_triton_cell(r, 'host_with_triton_us', '{:.0f}')} | "
                     f"{_triton_cell(r, 'host_with_triton_ratio_vs_bf16', '{:.2f}')} | "
                     f"{r['step_us']:.0f} | {_f(r.get('step_ratio_vs_bf16'))} | "
                     f"{r['arithmetic_us']:.0f} | {r['syncs']:.0f} | {r['saved_bytes']} | "
                     f"{_f(r.get('saved_bytes_ratio_vs_bf16'))} | {r['peak_bytes']} | "
                     f"{_f(r.get('peak_bytes_ratio_vs_bf16'))} |")
    lines += _triton_launch_section(res)
    lines += ["", "Targets: " + "; ".join(TARGETS) + ".", "", "## Launches by operator, per step", "",
              "| scope | mode | variant | kernels (calls per step) |", "|---|---|---|---|"]
    for r in res["rows"]:
        if "error" not in r:
            ops = ", ".join(f"`{op}` {c:g}" for op, c in r["by_op"].items())
            lines.append(f"| {r['scope']} | {r['mode']} | {r['variant']} | {ops} |")
    lines += ["", "## What autograd keeps for backward (eager)", "",
              "| scope | variant | tensors kept (shape dtype bytes; (linear): kept only by the linears, (both): by them "
              "and another operator), parameters not counted |", "|---|---|---|"]
    for r in res["rows"]:
        if "error" not in r and r["mode"] == "eager":
            kept = ", ".join(f"{shape} {dtype} {nbytes}{'' if who == 'other' else f' ({who})'}"
                             for nbytes, shape, dtype, who in r["saved"])
            lines.append(f"| {r['scope']} | {r['variant']} | {kept} |")
    lines += where_bytes_markdown(res["rows"])
    tops = [r for r in res["rows"] if "python_top" in r]
    if tops:
        lines += ["", "## Python functions with the most own time (cProfile, µs per step, eager)", ""]
        for r in tops:
            lines.append(f"- {r['scope']} {r['variant']}: " + "; ".join(
                f"`{e['function']}` {e['own_us']:.0f} ({e['calls']:g} calls)" for e in r["python_top"][:8]))
    if "cpu_path" in res:
        lines += ["", "## The CPU's own code path (the layer, eager)", "",
                  "What a CPU run launches (snip_ds's C++ kernels, streamed slices), not a GPU.", "",
                  "| variant | launches | kernels |", "|---|---|---|"]
        for v, r in res["cpu_path"].items():
            ops = ", ".join(f"`{op}` {c}" for op, c in r["by_op"].items())
            lines.append(f"| {v} | {r['launches']} | {ops} |")
    if res.get("not_reached"):
        lines += ["", "Not reached before the deadline: " + ", ".join(res["not_reached"]) + "."]
    lines += ["", f"Run time {res['wall_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--steps", type=int, default=100, help="timed steps per row (default 100)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--scopes", nargs="+", choices=SCOPES, default=list(SCOPES))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--no_python_profile", dest="python_profile", action="store_false",
                   help="skip the cProfile of bf16 and fp8_hybrid eager")
    p.add_argument("--deadline_s", type=float, default=3600.0,
                   help="no row starts after this many seconds (default 3600); the rows not reached are listed")
    p.add_argument("--no_triton_launch_path", dest="triton_launch_path", action="store_false",
                   help="skip timing Triton's own launch path (a subprocess compiling the kernels for sm_90)")
    p.add_argument("--launch_repeats", type=int, default=100,
                   help="paired replays of each Triton launch alone (default 100)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--output_dir", type=Path, default=REPO / "benchmarks" / "results")
    args = p.parse_args(argv)
    for field in ("tokens", "k", "n", "steps", "launch_repeats"):
        if getattr(args, field) < 1:
            p.error(f"--{field} must be at least 1, got {getattr(args, field)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_layer_host: --device cuda needs a CUDA GPU (none is visible)", file=sys.stderr)
        return 2
    args.variants = ["bf16"] + [v for v in args.variants if v != "bf16"]  # the ratios' base, always measured
    res = run(args)
    path = write(res, args.output_dir)
    print(f"bench_layer_host: {len(res['rows'])} rows, {len(res['not_reached'])} not reached, in "
          f"{res['wall_s']:.0f} s -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
