"""What one whole training step through snip_ds's engine costs the host: launches, host reads and host time.

    python benchmarks/bench_step_host.py                       # writes benchmarks/results/bench_step_host.{json,md}
    python benchmarks/bench_step_host.py --stages 0 --plans bf16 fp8 --steps 5 --output_dir DIR   # a quick look

``bench_layer_host.py`` counts one linear and one decoder block outside the engine; this counts what
``SnipEngine.train_step`` (``snip_ds.initialize``'s engine, ``launch/train.py``'s path) adds around them: DeepSpeed's
forward, backward and step (ZeRO stage 0 and 3, ``ds_configs/zero3.json``'s shape, DeepSpeed's bf16), the
non-finite guard, the loss read-back, the plan/state hooks. One process, one rank on gloo, the default model's
family at a small width (``bench_layer_host.BLOCK``, ``--layers`` blocks), a fixed plan (``bf16``, ``fp8``,
``fp4``), the layers on the CUDA code path on CPU tensors (``bench_layer_host.cuda_path_on_cpu``: snip_ds's Triton
kernels under Triton's interpreter, the FP8 GEMMs as the CPU's ``torch._scaled_mm``). Per (stage, plan), after
``--warmup`` steps:

* ``launches``: operators that run a kernel plus Triton launches in one step (``OpCounter``'s rule), split by where
  they come from: ``linear`` (inside the SnipLinears' forward, and in backward the autograd nodes their forward
  made), ``guard`` (snip_ds/engine/nonfinite.py), ``deepspeed``, ``model`` (the model's own operators outside its
  linears: embedding, norms, attention, loss, in forward and backward), ``optimizer``, ``engine`` (the rest of
  snip_ds/engine) and ``other``. Exact counts.
* ``reads``: host reads of a tensor's value (``HostReads``, each once: at the operator level), and by site
  (file:line) where Python asked for them (``item``, ``float(t)``, ``bool(t)``, ...), counted at
  ``gradient_accumulation_steps`` 1 and ``--ga``: a site whose count grows with the micro-batches is read per
  micro-batch. ``moves``: ``Tensor.cpu()`` / ``.to(cpu)`` by site (the batch's own moves left out): on a CPU
  they read nothing, on a GPU each is a host read where its tensor is on the device. Exact counts.
* ``step_us``: the median CPU time of one thread (``time.process_time``) over ``--steps`` whole steps, the plans of
  a stage taking their steps in turn, less the CPU time of snip_ds's Triton kernels' runs under the interpreter
  (the kernels run, so that the step's values stay finite: with empty launches the guard stops the step). An
  upper bound: the interpreter's runs evict the CPU's caches, and the operators after each run slower (a GEMM
  of this model about 2x); FP8/FP4 rows, which run kernels, pay it, BF16 rows do not. ``host_us``: the same less
  the step's matrix and attention operators (GEMMs, the CPU's slow ``_scaled_mm``, SDPA) replayed alone after
  each step, as bench_layer_host's ``host_us``.
* ``fwd_bwd_us``: the median CPU time of the step's forwards and backwards through DeepSpeed alone (the guard's
  hooks armed; no check, read or update) with snip_ds's Triton launches empty
  (``patch_triton_launches(..., run=False)``, as bench_layer_host times them; the values garbage, which nothing
  there reads): the linears' host cost in the engine without the interpreter's cache effect, arithmetic included.
  Compare rows of a stage, not ``step_us``: without the steps' updates, ZeRO-3's backwards accumulate into its
  partitions, which costs more than a step's first backward does.
* ``*_per_linear_vs_bf16``: ``(row - bf16's row) / linears``, the same stage.
* Host times are noisy on a shared machine (+-20 %); counts are exact.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import bench_layer_host as blh  # noqa: E402  (sets TRITON_INTERPRET before triton's import)

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from snip_ds.backend.dispatch_audit import (_PY_SCALAR_READS, HostReads, OpCounter, OpCounts,  # noqa: E402
                                            _subclass_call, _triton_kernels, patch_triton_launches, runs_kernel)
from snip_ds.runtime.fileio import atomic_write_text  # noqa: E402

REPO = blh.REPO
PLANS = ("bf16", "fp8", "fp4")
STAGES = (0, 3)
SOURCES = ("linear", "guard", "deepspeed", "model", "optimizer", "engine", "other")
_SKIPPED_FILES = ("/torch/", "dispatch_audit.py", "bench_step_host.py", "/contextlib.py", "/functools.py")


# ------------------------------------------------------------------------------------------------ the engine

def ds_config(stage: int, plan: str, ga: int) -> dict:
    """``ds_configs/zero3.json`` at ZeRO ``stage`` (0: no ZeRO section's options), one sequence a micro-batch,
    ``ga`` micro-batches a step, DeepSpeed's bf16 on (what ``"auto"`` gives on a GPU), the fixed ``plan``."""
    cfg = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    if stage < 3:
        cfg["zero_optimization"] = {"stage": stage}
    cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=ga, gradient_clipping=1.0)
    cfg["bf16"] = {"enabled": True}
    cfg["optimizer"]["params"] = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}
    cfg["snip"].update(plan=plan)
    cfg["snip"]["train"] = {"max_steps": 1000, "seed": 0}
    return cfg


def make_engine(stage: int, plan: str, ga: int, args):
    """A fresh engine of the default model's family at ``bench_layer_host``'s block width, ``args.layers``
    blocks, and its step's micro-batches."""
    import snip_ds
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = blh.block_config(args.tokens)
    config.num_hidden_layers = args.layers
    model = AutoModelForCausalLM.from_config(config)
    engine = snip_ds.initialize(model, ds_config(stage, plan, ga), tokens_per_step=args.tokens * ga, seed=0)
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(ga):
        ids = torch.randint(0, config.vocab_size, (1, args.tokens), generator=gen)
        batches.append({"input_ids": ids, "labels": ids})
    return engine, batches


# ------------------------------------------------------------------------------------------------ where from

def _frames():
    """The Python frames of the caller, innermost first, without torch's and this module's."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if not any(s in name for s in _SKIPPED_FILES) or "/torch/optim/" in name:
            yield f
        f = f.f_back


def _source(frame, node) -> str:
    """Which of :data:`SOURCES` an operator dispatched at ``frame`` during autograd node ``node`` belongs to."""
    name = frame.f_code.co_filename if frame is not None else ""
    if "snip_ds/engine/nonfinite.py" in name:
        return "guard"
    if node is not None and frame is not None and frame.f_code.co_name == "backward":
        return "model"  # an autograd node the engine runs outside Python, not a hook
    if "/deepspeed/" in name:
        return "deepspeed"
    if "/torch/optim/" in name:
        return "optimizer"
    if "/transformers/" in name:
        return "model"
    if "snip_ds/" in name:
        return "engine"
    return "other"


class _Attributing(TorchDispatchMode):
    """Counts kernel-running operators (``OpCounter``'s rule) by source: ``linear`` where a Python frame is in
    snip_ds's linear or backend (ZeRO-3 runs a linear's GEMM in its own function), or the autograd node running is
    one the SnipLinears' forwards made; else by the innermost frame (:func:`_source`)."""

    def __init__(self, linear_nodes: set, launches: OpCounts) -> None:
        super().__init__()
        self.linear_nodes, self.launches = linear_nodes, launches
        self.counts: Counter = Counter()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.launches.inside_launch:  # a Triton kernel under the interpreter: not operators a GPU runs
            return func(*args, **kwargs)
        if _subclass_call(args, kwargs):
            return NotImplemented
        out = func(*args, **kwargs)
        if runs_kernel(func, args, kwargs, out):
            node = torch._C._current_autograd_node()
            frames = list(_frames())
            inside = (node is not None and node in self.linear_nodes) or any(
                "snip_ds/linear.py" in f.f_code.co_filename or "snip_ds/backend/" in f.f_code.co_filename
                for f in frames)
            src = "linear" if inside else _source(frames[0] if frames else None, node)
            self.counts[src] += 1
            self.ops[src, func._schema.name] += 1
        return out


def _linear_nodes(engine, found: set) -> list:
    """Forward hooks on every SnipLinear that add, to ``found``, the autograd nodes between its output and its
    input (its backward's; DeepSpeed's module wrappers and the parameters' accumulators left out)."""
    from snip_ds.linear import SnipLinear

    def hook(module, inputs, output):
        stop = {t.grad_fn for t in inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        todo = [output.grad_fn] if isinstance(output, torch.Tensor) and output.grad_fn is not None else []
        while todo:
            node = todo.pop()
            if node is None or node in stop or node in found:
                continue
            name = node.name()
            if name != "torch::autograd::AccumulateGrad" and "BackwardFunction" not in name:
                found.add(node)
            todo.extend(n for n, _ in node.next_functions)
    return [m.register_forward_hook(hook) for m in engine.ds.module.modules() if isinstance(m, SnipLinear)]


def count_launches(engine, batches) -> dict:
    """One step's launches by source (:data:`SOURCES`) and by operator."""
    found: set = set()
    handles = _linear_nodes(engine, found)
    try:
        with OpCounter() as counter:  # Triton launches (all inside the linears), and the total
            with _Attributing(found, counter.counts) as mode:
                engine.train_step(batches)
    finally:
        for h in handles:
            h.remove()
    counts, ops = mode.counts, mode.ops
    counts["linear"] += sum(counter.counts.triton.values())
    total = counter.counts.launches
    assert sum(counts.values()) == total, (dict(counts), total)
    by_source = {s: counts[s] for s in SOURCES}
    top = {s: dict(sorted(((op, n) for (src, op), n in ops.items() if src == s), key=lambda kv: -kv[1])[:8])
           for s in SOURCES if counts[s]}
    return {"launches": total, "by_source": by_source, "top_ops": top,
            "triton": sum(counter.counts.triton.values())}


# ------------------------------------------------------------------------------------------------ reads, moves

class _Sites(TorchFunctionMode):
    """By site (:func:`_site`): the Python-level reads of a value (``item``, ``float(t)``, ``bool(t)``, ...), and
    ``Tensor.cpu()`` / ``.to(<cpu>)`` calls but those of ``skip``'s tensors (the batch's)."""

    def __init__(self, skip: set) -> None:
        super().__init__()
        self.skip, self.reads, self.moves = skip, Counter(), Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _PY_SCALAR_READS:
            self.reads[f"Tensor.{name} at {_site()}"] += 1
        elif name in ("cpu", "to") and args and isinstance(args[0], torch.Tensor) and id(args[0]) not in self.skip:
            target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
            if name == "cpu" or (target is not None and torch.device(target).type == "cpu"):
                self.moves[f"Tensor.{name} at {_site()}"] += 1
        return func(*args, **kwargs)


def _site() -> str:
    """The innermost three frames of the caller outside torch (and this module): ``dir/file.py:line function``."""
    return " <- ".join(f"{'/'.join(f.f_code.co_filename.split('/')[-2:])}:{f.f_lineno} {f.f_code.co_name}"
                       for f in itertools.islice(_frames(), 3)) or "?"


def count_reads(engine, batches) -> dict:
    """One step's host reads (``HostReads``' operator-level ones: each read once) and, by site, its Python-level
    reads and its moves to the CPU (:class:`_Sites`)."""
    skip = {id(t) for b in batches for t in b.values()}
    with _Sites(skip) as sites, HostReads() as reads:
        engine.train_step(batches)
    return {"reads": sum(1 for r in reads.reads if not r.what.startswith("Tensor.")),
            "read_sites": dict(sites.reads), "moves": sum(sites.moves.values()), "move_sites": dict(sites.moves)}


# ------------------------------------------------------------------------------------------------ the rows

def measure(stage: int, plan: str, args) -> tuple:
    """One (stage, plan) row but its time, and the engine and batches the timing steps."""
    row = {"stage": stage, "plan": plan, "ga": args.ga}
    begin = time.perf_counter()
    if args.ga != 1:
        engine1, batches1 = make_engine(stage, plan, 1, args)
        for _ in range(args.warmup):
            engine1.train_step(batches1)
        row["reads_ga1"] = count_reads(engine1, batches1)
        launches = count_launches(engine1, batches1)
        row["launches_ga1"], row["by_source_ga1"] = launches["launches"], launches["by_source"]
        del engine1
    engine, batches = make_engine(stage, plan, args.ga, args)
    row["linears"] = len(engine.layers)
    row["parameters"] = sum(1 for p in engine.ds.module.parameters() if p.requires_grad)
    for _ in range(args.warmup):
        engine.train_step(batches)
    row.update(count_launches(engine, batches))
    row.update(count_reads(engine, batches))
    if "reads_ga1" not in row:
        row["reads_ga1"] = {k: row[k] for k in ("reads", "read_sites", "moves", "move_sites")}
        row["launches_ga1"], row["by_source_ga1"] = row["launches"], row["by_source"]
    row["measure_s"] = time.perf_counter() - begin
    return row, engine, batches


class _TimedKernel:
    """A Triton kernel whose launches run (the step's values stay real: a step on empty outputs goes non-finite
    and the guard stops it) and whose run's CPU time is added to ``spent[0]``, to be taken off the step's."""

    def __init__(self, kernel, spent: list) -> None:
        self.kernel, self.spent = kernel, spent

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def timed(*args, **kwargs):
            begin = time.process_time()
            try:
                return launch(*args, **kwargs)
            finally:
                self.spent[0] += time.process_time() - begin
        return timed


def time_kernels_apart(stack: ExitStack, spent: list) -> None:
    """Wraps every launch of snip_ds's Triton kernels in :class:`_TimedKernel` until ``stack`` closes."""
    for module, attr in _triton_kernels():
        original = getattr(module, attr)
        setattr(module, attr, _TimedKernel(original, spent))
        stack.callback(setattr, module, attr, original)


def record_matrix_ops(engine, batches) -> list:
    """The matrix and attention operators of one step (``bench_layer_host._RecordMatrixOps``), with copies of
    their arguments, run once more (their one-off set-up) for :func:`bench_layer_host.replay_us`."""
    recorder = blh._RecordMatrixOps()
    with recorder:
        engine.train_step(batches)
    for func, args, kw in recorder.calls:
        func(*args, **kw)
    return recorder.calls


def forward_backward(engine, batches) -> None:
    """A step's forwards and backwards through DeepSpeed, the guard armed, without its checks, reads or update
    (timed with the Triton launches empty: the values are garbage, which nothing here reads)."""
    guard = engine.state.guard
    for batch in batches:
        loss = engine._forward_loss(batch)
        guard.arm()
        try:
            engine.ds.backward(loss)
        finally:
            guard.disarm()


def time_steps(group: list, steps: int) -> None:
    """Each row's times, the rows taking their steps in turn (:data:`__doc__`): ``step_us`` (whole steps, the
    kernels run, their runs' CPU time taken off), ``host_us`` (the same less the step's matrix and attention
    operators replayed right after it, ``bench_layer_host.replay_us``, a 1 x 1 ``mm``'s dispatch taken off each),
    then ``fwd_bwd_us`` (:func:`forward_backward` with empty launches, ``patch_triton_launches(..., run=False)``,
    as bench_layer_host times; last, for it leaves garbage in the gradients)."""
    times = {id(row): [] for row, *_ in group}
    arith = {id(row): [] for row, *_ in group}
    fwd_bwd = {id(row): [] for row, *_ in group}
    floor = blh.dispatch_floor_us("cpu")
    spent = [0.0]
    with ExitStack() as stack:
        time_kernels_apart(stack, spent)
        for _ in range(steps):
            for row, engine, batches, calls in group:
                spent[0] = 0.0
                begin = time.process_time()
                engine.train_step(batches)
                times[id(row)].append((time.process_time() - begin - spent[0]) * 1e6)
                arith[id(row)].append(sum(blh.replay_us(calls, floor).values()))
    with ExitStack() as stack:
        patch_triton_launches(stack, None, run=False)  # the launch's host work, not the interpreted kernel
        for _ in range(steps):
            for row, engine, batches, calls in group:
                begin = time.process_time()
                forward_backward(engine, batches)
                fwd_bwd[id(row)].append((time.process_time() - begin) * 1e6)
    for row, *_ in group:
        row["step_us"] = statistics.median(times[id(row)])
        row["arithmetic_us"] = statistics.median(arith[id(row)])
        row["host_us"] = max(statistics.median(t - a for t, a in zip(times[id(row)], arith[id(row)])), 0.0)
        row["fwd_bwd_us"] = statistics.median(fwd_bwd[id(row)])


def add_per_linear(rows: list) -> None:
    base = {r["stage"]: r for r in rows if r["plan"] == "bf16" and "step_us" in r}
    for r in rows:
        b = base.get(r["stage"])
        if b is not None and "step_us" in r:
            r["per_linear_host_us_vs_bf16"] = (r["host_us"] - b["host_us"]) / r["linears"]
            r["per_linear_fwd_bwd_us_vs_bf16"] = (r["fwd_bwd_us"] - b["fwd_bwd_us"]) / r["linears"]
            r["launches_vs_bf16"] = r["launches"] - b["launches"]


def run(args) -> dict:
    torch.set_num_threads(1)  # one thread: its CPU time is what other processes on a shared machine barely move
    res = {"benchmark": "bench_step_host", "commit": blh.commit(), "machine": blh.machine(),
           "torch": torch.__version__, "device": "cpu", "threads": torch.get_num_threads(), "tokens": args.tokens,
           "layers": args.layers, "block": blh.BLOCK, "ga": args.ga, "warmup": args.warmup, "steps": args.steps,
           "rows": []}
    start = time.perf_counter()
    with ExitStack() as stack:
        res["cuda_path_gemms"] = blh.cuda_path_on_cpu(stack)
        for stage in args.stages:
            group = [(*measure(stage, plan, args),) for plan in args.plans]
            group = [(row, engine, batches, record_matrix_ops(engine, batches)) for row, engine, batches in group]
            time_steps(group, args.steps)
            res["rows"].extend(row for row, *_ in group)
            add_per_linear(res["rows"])
            for row, *_ in group:
                print(_line(row), flush=True)
            res["wall_s"] = time.perf_counter() - start
            write(res, args.output_dir)  # what is measured so far, should the run be cut short
    res["wall_s"] = time.perf_counter() - start
    return res


def write(res: dict, output_dir: Path) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    stem = output_dir / "bench_step_host"
    atomic_write_text(stem.with_suffix(".json"), json.dumps(res, indent=1) + "\n")
    atomic_write_text(stem.with_suffix(".md"), markdown(res))
    return stem.with_suffix(".json")


def _line(r: dict) -> str:
    src = " ".join(f"{s} {n}" for s, n in r["by_source"].items() if n)
    return (f"zero {r['stage']} {r['plan']:>4}: {r['launches']} launches ({src}), {r['reads']} reads, "
            f"{r['moves']} moves, {r['step_us']:.0f} us/step ({r['host_us']:.0f} host), "
            f"fwd+bwd {r['fwd_bwd_us']:.0f} us; "
            f"vs bf16 a linear {r.get('per_linear_host_us_vs_bf16', 0):+.0f} host us, "
            f"{r.get('per_linear_fwd_bwd_us_vs_bf16', 0):+.0f} fwd+bwd us")


def _per(sites: dict, sites_ga1: dict, ga: int, params: int) -> list:
    """(site, count at ga 1, count at ``ga``, how often: per micro-batch or per step, per parameter where the
    count is a multiple of the trainable parameters')."""
    out = []
    for site in sorted(set(sites) | set(sites_ga1)):
        one, many = sites_ga1.get(site, 0), sites.get(site, 0)
        per = "per micro-batch" if ga > 1 and many == one * ga else "per step"
        if one and one % params == 0:
            per = f"{one // params} per parameter {per}" if one > params else f"per parameter {per}"
        out.append((site, one, many, per))
    return out


def markdown(res: dict) -> str:
    ga = res["ga"]
    lines = [f"# bench_step_host ({res['commit']})", "",
             f"{res['machine']}; torch {res['torch']}, {res['threads']} thread; the CUDA code path on CPU tensors "
             f"(FP8 GEMMs: {res.get('cuda_path_gemms')}). One rank, DeepSpeed on gloo, DeepSpeed's bf16; the "
             f"default model's family, {res['layers']} blocks of width {res['block']['hidden_size']}, "
             f"{res['tokens']} tokens a micro-batch, {ga} micro-batches a step; {res['warmup']} warm-up steps, "
             f"{res['steps']} timed. Launches, reads and moves are exact counts; times are CPU time of one thread "
             f"(noisy, +-20 %), the CPU's arithmetic included (see the script's docstring for each column).", "",
             "Reads are the host's reads of a value on this CPU; a GPU reads there too, and at each move to the "
             "CPU of a tensor on the device (``.cpu()``, ``.to(cpu)``: on a CPU every ``.to`` toward the CPU is "
             "listed, also those that on a GPU stay on the device).", "",
             "| ZeRO | plan | linears | params | launches | " + " | ".join(SOURCES) +
             f" | reads (ga 1) | reads (ga {ga}) | moves (ga {ga}) | step us | host us | fwd+bwd us | "
             f"host us/linear vs bf16 | fwd+bwd us/linear vs bf16 |", "|" + "---|" * (12 + len(SOURCES))]
    for r in res["rows"]:
        lines.append(f"| {r['stage']} | {r['plan']} | {r['linears']} | {r['parameters']} | {r['launches']} | "
                     + " | ".join(str(r["by_source"][s]) for s in SOURCES)
                     + f" | {r['reads_ga1']['reads']} | {r['reads']} | {r['moves']} | {r['step_us']:.0f} | "
                     f"{r['host_us']:.0f} | {r['fwd_bwd_us']:.0f} | {r.get('per_linear_host_us_vs_bf16', 0):+.0f} | "
                     f"{r.get('per_linear_fwd_bwd_us_vs_bf16', 0):+.0f} |")
    for r in res["rows"]:
        lines += ["", f"## ZeRO {r['stage']}, {r['plan']}: host reads and moves to the CPU by site", "",
                  f"| what and where | ga 1 | ga {ga} | |", "|---|---|---|---|"]
        for site, one, many, per in _per(r["read_sites"], r["reads_ga1"]["read_sites"], ga, r["parameters"]):
            lines.append(f"| read: {site} | {one} | {many} | {per} |")
        for site, one, many, per in _per(r["move_sites"], r["reads_ga1"]["move_sites"], ga, r["parameters"]):
            lines.append(f"| move: {site} | {one} | {many} | {per} |")
        lines += ["", "Most frequent launching operators by source: " + "; ".join(
            f"{s}: " + ", ".join(f"{op} {n}" for op, n in ops.items()) for s, ops in r["top_ops"].items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", nargs="+", type=int, choices=STAGES, default=list(STAGES))
    p.add_argument("--plans", nargs="+", choices=PLANS, default=list(PLANS))
    p.add_argument("--layers", type=int, default=2, help="decoder blocks (default 2)")
    p.add_argument("--tokens", type=int, default=32, help="tokens a micro-batch (default 32)")
    p.add_argument("--ga", type=int, default=2, help="micro-batches a step (default 2; reads also counted at 1)")
    p.add_argument("--warmup", type=int, default=2, help="steps before the counts (default 2)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per row (default 6)")
    p.add_argument("--output_dir", type=Path, default=REPO / "benchmarks" / "results")
    args = p.parse_args(argv)
    for field in ("layers", "tokens", "ga", "warmup", "steps"):
        if getattr(args, field) < 1:
            p.error(f"--{field} must be at least 1, got {getattr(args, field)}")
    args.plans = ["bf16"] + [x for x in args.plans if x != "bf16"]  # the per-linear figures' base
    res = run(args)
    path = write(res, args.output_dir)
    print(f"bench_step_host: {len(res['rows'])} rows in {res['wall_s']:.0f} s -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
