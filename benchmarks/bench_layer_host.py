"""What one SnipLinear forward+backward costs the host: operators dispatched, kernel launches, host time per step.

    python benchmarks/bench_layer_host.py [--tokens 32] [--k 64] [--n 64] [--steps 200] [--output_dir DIR]
    python benchmarks/bench_layer_host.py --device cuda ...        # on a GPU: the real CUDA path

For BF16-shaped ``nn.Linear`` and SnipLinear on the ``torch`` backend (``fp8_hybrid``, ``mxfp8``, ``nvfp4``,
``mxfp4``), one forward+backward step:

* **launches per step** from a dispatch counter (snip_ds.backend.dispatch_audit.OpCounter): the operators that
  run a kernel, the views (no kernel) and the launches of snip_ds's Triton kernels, for two code paths. ``cpu``:
  the torch backend as a CPU runs it (the fused C++ kernels, streamed slices). ``cuda``: the torch backend's
  CUDA code path -- the Triton kernels, X's FP8 codes kept for wgrad, G_Y quantized once, ``torch._scaled_mm``
  for per-tensor FP8 -- run on CPU tensors (the kernels under Triton's interpreter, ``_scaled_mm`` on the CPU
  where oneDNN has it), so the count is the GPU's without a GPU. With ``--device cuda`` the ``cuda`` path runs
  on the GPU itself.
* **host time per step**, eager and compiled (``torch.compile``, inductor), at a shape small enough that the
  arithmetic is a small part of it (default 32 tokens, 64 x 64): the median wall time of a step, and from
  ``torch.profiler`` the CPU self time of every dispatched operator; the rest -- Python, autograd, the
  backends' bookkeeping -- is the ``python`` column. On the CPU this is the ``cpu`` path; on a GPU the
  ``cuda`` path, each step synchronised, so the time is what the host spends issuing a step that the GPU
  finishes at once. On the CPU the step runs in one thread and its time is that thread's CPU time (what other
  processes on a shared machine barely move); on a GPU, wall time.

Writes ``bench_layer_host.json`` and ``.md`` into ``--output_dir`` (default: print only), naming the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import torch

if not torch.cuda.is_available() and "--device" not in " ".join(sys.argv):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the cuda path's kernels run on CPU tensors

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from snip_ds.backend import torch_native  # noqa: E402
from snip_ds.backend.dispatch_audit import OpCounter  # noqa: E402
from snip_ds.linear import SnipLinear  # noqa: E402
from snip_ds.quant_config import QuantConfig  # noqa: E402

VARIANTS = {  # name: (precision, config); None: BF16 nn.Linear
    "bf16": None,
    "fp8_hybrid": ("fp8", QuantConfig(backend="torch")),
    "mxfp8": ("fp8", QuantConfig(backend="torch", fp8_recipe="mxfp8")),
    "nvfp4": ("fp4", QuantConfig(backend="torch")),
    "mxfp4": ("fp4", QuantConfig(backend="torch", fp4_recipe="mxfp4")),
}


def machine() -> str:
    if torch.cuda.is_available() and torch.cuda.device_count():
        gpu = torch.cuda.get_device_name()
    else:
        gpu = None
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} CPUs" + (f"; {gpu}" if gpu else "")


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1], timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cuda_path_on_cpu(stack: ExitStack) -> str:
    """Sends the torch backend down its CUDA code path on CPU tensors (restored when ``stack`` closes); returns
    what the FP8 GEMMs run as there."""
    from snip_ds.backend import kernels

    def restore(name, value):
        stack.callback(setattr, torch_native, name, value)

    for name in ("KERNEL_DEVICES", "SCALED_MM_DEVICES", "_kernels_checked", "_kernels_module"):
        restore(name, getattr(torch_native, name))
    torch_native.KERNEL_DEVICES = ("cpu", "cuda")
    torch_native._kernels_checked, torch_native._kernels_module = False, None
    if torch_native.kernels() is not kernels or not kernels.interpreting():
        raise RuntimeError("the cuda path on a CPU needs triton and TRITON_INTERPRET=1 before triton is imported")
    try:  # oneDNN's FP8 matmul, where this CPU has it: the GEMMs of the GPU path
        a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(()), scale_b=torch.ones(()), out_dtype=torch.float32)
        torch_native.SCALED_MM_DEVICES = ("cpu", "cuda")
        return "torch._scaled_mm"
    except (RuntimeError, NotImplementedError):
        return "BF16-exact GEMMs (no FP8 matmul in this CPU's oneDNN)"


def make_layer(name: str, k: int, n: int, device: str):
    torch.manual_seed(0)
    layer = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    spec = VARIANTS[name]
    if spec is not None:
        layer = SnipLinear.from_linear(layer, spec[0], spec[1])
        layer.generator = torch.Generator(device=device).manual_seed(0)
    return layer


def make_step(fn, layer, tokens: int, k: int, n: int, device: str):
    x = torch.randn(tokens, k, device=device).bfloat16()
    g = (torch.randn(tokens, n, device=device) * 1e-3).bfloat16()

    def step():
        xi = x.detach().requires_grad_(True)
        fn(xi).backward(g)
        layer.weight.grad = None
    return step


def count_ops(name: str, tokens: int, k: int, n: int, device: str) -> dict:
    layer = make_layer(name, k, n, device)
    step = make_step(layer, layer, tokens, k, n, device)
    step()  # one-off set-up outside the count
    with OpCounter() as counter:
        step()
    return counter.counts.as_dict()


def host_time(fn_of_layer, name: str, tokens: int, k: int, n: int, steps: int, device: str) -> dict:
    """The median time of a step (CPU: the thread's CPU time; CUDA: wall time, synchronised), and from a
    profiled run of the same steps the share of its time that the dispatched operators take themselves."""
    layer = make_layer(name, k, n, device)
    step = make_step(fn_of_layer(layer), layer, tokens, k, n, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    clock = time.perf_counter if device == "cuda" else time.process_time  # CPU: the one thread's CPU time
    for _ in range(5):  # warm-ups: compiles (torch.compile, Triton), kernel selection
        step()
    sync()
    times = []
    for _ in range(steps):
        begin = clock()
        step()
        sync()
        times.append((clock() - begin) * 1e6)
    from torch.profiler import ProfilerActivity, profile
    profiled = max(10, steps // 5)
    begin = clock()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(profiled):
            step()
        sync()
    profiled_us = (clock() - begin) * 1e6
    ops = sum(ev.self_cpu_time_total for ev in prof.events() if ev.name.split("::", 1)[0] in _OPERATOR_NAMESPACES)
    share = min(ops / profiled_us, 1.0) if profiled_us > 0 else 0.0
    wall = statistics.median(times)
    return {"step_us": wall, "operator_share": share, "operators_us": wall * share, "rest_us": wall * (1 - share)}


_OPERATOR_NAMESPACES = ("aten", "snip_ds_cpu", "prims")  # (snip_ds::* ops hold Python: not counted)


def compiled(layer):
    return torch.compile(layer, backend="inductor")


def run(args) -> dict:
    device = args.device
    if device == "cpu":
        torch.set_num_threads(1)  # host time is one thread's; its CPU time is what other processes barely move
    result = {"benchmark": "bench_layer_host", "machine": machine(), "commit": commit(), "torch": torch.__version__,
              "device": device, "tokens": args.tokens, "k": args.k, "n": args.n, "steps": args.steps,
              "threads": torch.get_num_threads(), "launches": {}, "host": {}}
    paths = ["cuda"] if device == "cuda" else ["cpu", "cuda"]
    for path in paths:
        with ExitStack() as stack:
            if device == "cpu" and path == "cuda":
                result["cuda_path_gemms"] = cuda_path_on_cpu(stack)
            result["launches"][path] = {name: count_ops(name, args.tokens, args.k, args.n, device)
                                        for name in VARIANTS}
        print(f"launches ({path} path): " + ", ".join(f"{name} {r['launches']}"
                                                     for name, r in result["launches"][path].items()), flush=True)
    for mode, fn in (("eager", lambda layer: layer), ("compiled", compiled)):
        result["host"][mode] = {}
        for name in VARIANTS:
            torch._dynamo.reset()
            result["host"][mode][name] = r = host_time(fn, name, args.tokens, args.k, args.n, args.steps, device)
            print(f"host {mode} {name}: {r['step_us']:.0f} us/step (operators {r['operators_us']:.0f}, the rest "
                  f"{r['rest_us']:.0f})", flush=True)
    return result


def write_markdown(r: dict, path: Path) -> None:
    host_path = "cuda" if r["device"] == "cuda" else "cpu"
    lines = [f"# bench_layer_host: one SnipLinear forward+backward, what it costs the host", "",
             f"Machine: {r['machine']}; torch {r['torch']}, {r['threads']} threads; commit {r['commit']}. "
             f"{r['tokens']} tokens, k = {r['k']}, n = {r['n']}, BF16, the torch backend.", "",
             "## Launches per step (dispatch counter)", "",
             "Operators that run a kernel plus Triton launches (on CUDA: about the kernel launches); views in "
             "brackets."]
    if "cuda_path_gemms" in r:
        lines.append(f"The cuda path ran on CPU tensors: Triton's interpreter, FP8 GEMMs as {r['cuda_path_gemms']}.")
    paths = list(r["launches"])
    lines += ["", "| variant | " + " | ".join(f"{p} path" for p in paths) + " |", "|---|" + "---|" * len(paths)]
    for name in VARIANTS:
        cells = [f"{r['launches'][p][name]['launches']} ({r['launches'][p][name]['view_ops']})" for p in paths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for p in paths:
        lines += ["", f"### {p} path, by operator", "", "| variant | operators (calls per step) |", "|---|---|"]
        for name in VARIANTS:
            ops = ", ".join(f"`{op}` {c}" for op, c in r["launches"][p][name]["by_op"].items())
            lines.append(f"| {name} | {ops} |")
    lines += ["", f"## Host time per step ({host_path} path)", "",
              f"Median {'wall time' if r['device'] == 'cuda' else 'CPU time (one thread)'} of {r['steps']} steps"
              f"{', each synchronised' if r['device'] == 'cuda' else ''}; "
              "operators: the share of a profiled run's time that the dispatched operators (aten, the CPU kernels) take "
              "themselves (torch.profiler self time), applied to the step; the rest: Python, autograd, the "
              "dispatcher and the profiler's own cost per operator, which makes this split an upper bound for "
              "the operators.", "",
              "| variant | eager µs | operators | the rest | compiled µs | operators | the rest |",
              "|---|---|---|---|---|---|---|"]
    for name in VARIANTS:
        e, c = r["host"]["eager"][name], r["host"]["compiled"][name]
        lines.append(f"| {name} | {e['step_us']:.0f} | {e['operators_us']:.0f} | {e['rest_us']:.0f} | "
                     f"{c['step_us']:.0f} | {c['operators_us']:.0f} | {c['rest_us']:.0f} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--output_dir", type=Path)
    args = p.parse_args(argv)
    for field in ("tokens", "k", "n", "steps"):
        if getattr(args, field) < 1:
            p.error(f"--{field} must be at least 1, got {getattr(args, field)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_layer_host: --device cuda needs a CUDA GPU (none is visible)", file=sys.stderr)
        return 2
    result = run(args)
    if args.output_dir is not None:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        stem = "bench_layer_host" + ("_cuda" if args.device == "cuda" else "")
        (args.output_dir / f"{stem}.json").write_text(json.dumps(result, indent=1))
        write_markdown(result, args.output_dir / f"{stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
