"""One SNIP statistics collection at Llama-70B widths: two decoder blocks under ZeRO-3, BF16, one GPU.

    python benchmarks/bench_scale.py                                  # CUDA: full widths, results written
    python benchmarks/bench_scale.py --scale 64 --output /tmp/scale   # CPU: widths / 64, a plumbing run

The model is a Llama with Llama-2-70B's block widths (hidden 8192, SwiGLU intermediate 28672, 64 query heads, 8
KV heads) but two decoder blocks and a small vocabulary (``--vocab``, 32000 by default), trained from scratch on
the embedded stdlib corpus through snip_ds's own engine (:func:`snip_ds.engine.initialize`: the shipped
``ds_configs/zero3.json``, ZeRO-3, one rank, BF16 where CUDA is, ``backend: auto``, the adaptive plan with
re-planning left to this script). Sequence:

1. the engine's first step, which (adaptive) collects statistics and solves the first plan before updating
   (a cold collection: no Adam state yet, first-call compiles);
2. ``--steps`` training steps under that plan, each timed (synchronised) and its peak memory taken
   (``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``);
3. one collection as a re-plan runs it (:meth:`AdaptivePlanner.collect`: the private stream's next batch, the
   ZeRO-3 optimizer's Adam state as preconditioner), timed and its peak memory taken the same way; the bytes it
   all-reduces counted at the reduce call (as benchmarks/bench_collect.py counts them: every all-reduced
   tensor as float64), then the ILP solve on its statistics.

4. with ``--profile``, one more collection under ``torch.profiler``: its kernel launches, the shares of GEMM,
   quantization and other kernels, and the 15 most expensive kernels (where the step equivalents go);
5. with ``--chunk_elements N [N ...]``, one more timed collection per value with the statistics' operand slices
   (:data:`snip_ds.backend.operands.CUDA_CHUNK_ELEMENTS` on CUDA, 48 Mi elements; ``CHUNK_ELEMENTS`` on the CPU,
   3 Mi, sized for its caches) set to N elements, side by side with the default in the same process;
6. with ``--ieee_collection``, one more timed collection with ``collect_tf32`` off: its FP32 products in IEEE
   FP32 instead of on TF32 tensor cores (CUDA only; the same numbers on a CPU).

Reported: the collection in training-step equivalents (its time over the median step), its peak memory over a
step's, the all-reduced bytes (and, from the per-layer scalar count, bench_collect's on-paper figure for 80
blocks, Llama-2-70B's 560 linears), and the plan: FP4 share of the linears' FLOPs and which layers are FP4.
On the CPU (no CUDA) the peak-memory figures are not taken (null): the run checks the code path at scaled-down
widths (``--scale N`` divides hidden, intermediate and vocabulary; the head counts stay) and its times are not
GPU figures. Writes ``bench_scale.json`` and ``.md`` to ``--output`` (default benchmarks/results; a CPU run
writes ``bench_scale_cpu.*``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_collect import _GLOBAL_KEYS, LLAMA_LINEARS  # noqa: E402  the collection's scalar layout, on paper
from bench_train import llama_parameters  # noqa: E402
from profile_gpu_gemm import kernel_table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHIPPED_CONFIG = REPO / "ds_configs" / "zero3.json"
RESULTS = Path(__file__).resolve().parent / "results"
LLAMA_70B = {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8}


def model_config(scale: int, vocab: int, layers: int, block: int) -> dict:
    cfg = {"model_type": "llama", "vocab_size": vocab, "num_hidden_layers": layers,
           "max_position_embeddings": max(block, 128), "tie_word_embeddings": False,
           "hidden_size": LLAMA_70B["hidden_size"] // scale,
           "intermediate_size": LLAMA_70B["intermediate_size"] // scale,
           "num_attention_heads": LLAMA_70B["num_attention_heads"],
           "num_key_value_heads": LLAMA_70B["num_key_value_heads"]}
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    if cfg["hidden_size"] % cfg["num_attention_heads"] or head_dim % 2:
        raise ValueError(f"--scale {scale}: hidden {cfg['hidden_size']} must split into 64 heads of an even width")
    return cfg


def run_config(micro_batch: int, block: int, steps: int, out_dir: Path) -> dict:
    """The shipped zero3.json with this benchmark's batch, length and output; adaptive, re-planned by hand."""
    cfg = json.loads(SHIPPED_CONFIG.read_text())
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    cfg["gradient_accumulation_steps"] = 1
    snip = cfg["snip"]
    snip.update(plan="adaptive", replan_every=10 ** 6, additional_bf16_fwd_every_n_steps=0)
    snip["quant"]["backend"] = "auto"
    snip["train"].update(max_steps=steps + 1, block_size=block, output_dir=str(out_dir), save_steps=0)
    return cfg


class _Sync:
    """Wall time and CUDA peak memory of a region (synchronised; memory only on CUDA)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.seconds = math.nan
        self.peak = self.before = None

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        self.seconds = time.perf_counter() - self.start


def bench(scale: int, vocab: int, layers: int, micro_batch: int, block: int, steps: int, profile: bool = False,
          chunk_elements: tuple = (), ieee_collection: bool = False) -> dict:
    from snip_ds.runtime import distributed as sdist
    from snip_ds.run.data import DataStream, load_dataset_blocks
    from snip_ds.engine import initialize
    from snip_ds.run.model import build_model
    from snip_ds.config.settings import parse_snip_section

    cuda = torch.cuda.is_available()
    torch.set_flush_denormal(True)  # as launch/train.py does
    train, _, data_vocab, _ = load_dataset_blocks(None, block, max_bytes=2_000_000, max_validation_bytes=64 * block)
    cfg = model_config(scale, max(vocab, data_vocab), layers, block)
    with tempfile.TemporaryDirectory() as tmp:
        ds_cfg = run_config(micro_batch, block, steps, Path(tmp) / "out")
        settings = parse_snip_section(ds_cfg["snip"], source=str(SHIPPED_CONFIG))
        start = time.perf_counter()
        # On CUDA the weights are created on the GPU (seconds, not the minute a 2.2B-parameter CPU init takes).
        with torch.device("cuda" if cuda else "cpu"):
            model = build_model(model_config=cfg, vocab_size=data_vocab, seed=0,
                                dtype=torch.bfloat16 if cuda else torch.float32, block_size=block)
        stream = DataStream(train, micro_batch, seed=0)
        private = DataStream(train, micro_batch, seed=7919)
        engine = initialize(model, ds_cfg, settings, tokens_per_step=micro_batch * block, seed=0,
                            statistics_stream=private)
        setup_s = time.perf_counter() - start
        planner = engine.planner
        with _Sync(cuda) as first:  # step 0: the first collection and solve, then the update
            engine.train_step([stream.next_batch()])
        first_plan = dict(engine.plan.assignment)
        step_times, step_peaks, step_added = [], [], []
        for _ in range(steps):
            batch = [stream.next_batch()]
            with _Sync(cuda) as s:
                loss = engine.train_step(batch)
            step_times.append(s.seconds)
            if cuda:
                step_peaks.append(s.peak)
                step_added.append(s.peak - s.before)
        reduced: list = []
        original = sdist.dist_sum

        def counting(t, group=None):
            reduced.append(t.numel() * 8)  # all-reduced as float64 (snip_ds.runtime.distributed.dist_sum)
            return original(t, group)

        sdist.dist_sum = counting
        try:
            with _Sync(cuda) as c:
                stats = planner.collect()
        finally:
            sdist.dist_sum = original
        start = time.perf_counter()
        plan = planner.solve(stats)
        solve_s = time.perf_counter() - start
        if plan is None:
            raise RuntimeError(f"the ILP found no plan for the collected statistics: {planner.last_error}")
        collection_profile = _profiled_collection(planner, cuda) if profile else None
        chunked = _chunked_collections(planner, cuda, chunk_elements)
        ieee_s = _ieee_collection(planner, cuda) if ieee_collection else None
    flops = {fqn: info.flops(micro_batch * block) for fqn, info in engine.infos.items()}
    fp4 = sorted(f for f, p in plan.assignment.items() if p == "fp4")
    n_layers = len(stats["layers"])
    per_layer = (sum(reduced) / 8 - len(_GLOBAL_KEYS)) / n_layers
    step = statistics.median(step_times)
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "dtype": "bfloat16" if cuda else "float32", "zero_stage": engine.zero_stage,
        "model": cfg, "parameters": llama_parameters(cfg), "linears": n_layers,
        "micro_batch": micro_batch, "block_size": block, "tokens_per_step": micro_batch * block,
        "setup_s": setup_s, "first_step_with_collection_s": first.seconds,
        "step_s": step_times, "median_step_s": step, "last_loss": loss,
        "collect_s": c.seconds, "collect_step_equivalents": c.seconds / step, "solve_s": solve_s,
        "peak_bytes": {"step": max(step_peaks) if cuda else None, "collect": c.peak,
                       "first_step_with_collection": first.peak},
        "added_bytes": {"step": max(step_added) if cuda else None,
                        "collect": (c.peak - c.before) if cuda else None},
        "memory_ratio": (c.peak / max(step_peaks)) if cuda else None,
        "allreduce_bytes": sum(reduced), "allreduce_calls": len(reduced), "scalars_per_layer": per_layer,
        "allreduce_bytes_on_paper": {name: int(round(per_layer * n + len(_GLOBAL_KEYS))) * 8
                                     for name, n in LLAMA_LINEARS.items()},
        "precond_source": stats.get("precond_source"),
        "plan": {"fp4_share": plan.fp4_share, "status": plan.status, "fp4_layers": fp4,
                 "assignment": dict(plan.assignment), "changed_from_first_plan":
                     sorted(f for f in plan.assignment if plan.assignment[f] != first_plan.get(f))},
        "fp4_flops_share_check": sum(flops[f] for f in fp4) / sum(flops.values()),
        "collection_profile": collection_profile,
        "chunk_elements_default": _slice_default(cuda),
        "collect_by_chunk_elements": [{"chunk_elements": n, "collect_s": t, "collect_step_equivalents": t / step}
                                      for n, t in chunked],
        "collect_ieee_fp32": (None if ieee_s is None
                              else {"collect_s": ieee_s, "collect_step_equivalents": ieee_s / step}),
    }
    return result


def _operands():
    from snip_ds.backend import operands
    return operands


def _profiled_collection(planner, cuda: bool) -> dict:
    """One more collection under torch.profiler: kernel launches, GEMM / quantize / other shares, top kernels."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        planner.collect()
        if cuda:
            torch.cuda.synchronize()
    return kernel_table(prof, "cuda" if cuda else "cpu", 1, top_n=15)


def _slice_attr(cuda: bool) -> str:
    return "CUDA_CHUNK_ELEMENTS" if cuda else "CHUNK_ELEMENTS"


def _slice_default(cuda: bool) -> int:
    return getattr(_operands(), _slice_attr(cuda))


def _chunked_collections(planner, cuda: bool, sizes) -> list:
    """``(elements, seconds)`` of one timed collection per operand-slice size, the default restored after."""
    operands, attr = _operands(), _slice_attr(cuda)
    default, out = getattr(operands, attr), []
    try:
        for n in sizes:
            setattr(operands, attr, n)
            with _Sync(cuda) as c:
                planner.collect()
            out.append((n, c.seconds))
    finally:
        setattr(operands, attr, default)
    return out


def _ieee_collection(planner, cuda: bool) -> float:
    """Seconds of one timed collection as ``collect_tf32: false`` runs it (FP32 products in IEEE FP32)."""
    from snip_ds.stats import collector

    tf32 = collector.fp32_matmuls
    collector.fp32_matmuls = lambda device, _: tf32(device, False)
    try:
        with _Sync(cuda) as c:
            planner.collect()
    finally:
        collector.fp32_matmuls = tf32
    return c.seconds


def markdown(r: dict) -> str:
    gib = lambda n: "n/a" if n is None else f"{n / 2 ** 30:.2f} GiB"  # noqa: E731
    m = r["model"]
    lines = [f"# bench_scale: one SNIP collection at Llama-70B widths ({r['device']})", "",
             f"{m['num_hidden_layers']} decoder blocks, hidden {m['hidden_size']}, intermediate "
             f"{m['intermediate_size']}, {m['num_attention_heads']}/{m['num_key_value_heads']} heads, vocabulary "
             f"{m['vocab_size']}: {r['parameters'] / 1e6:,.1f}M parameters, {r['linears']} quantizable linears. ZeRO-"
             f"{r['zero_stage']}, one rank, {r['dtype']}, micro-batch {r['micro_batch']} x {r['block_size']} tokens, "
             f"torch {r['torch']}. Step: median of {len(r['step_s'])} synchronised training steps under the first "
             "adaptive plan; collection: one re-plan's collection after them (private stream, Adam-state "
             "preconditioner).", "",
             "| measure | value |", "|---|---|",
             f"| training step (median) | {r['median_step_s']:.3f} s |",
             f"| collection | {r['collect_s']:.3f} s = **{r['collect_step_equivalents']:.2f} step equivalents** |",
             f"| ILP solve | {r['solve_s']:.3f} s |",
             f"| first step (cold collection + solve + update) | {r['first_step_with_collection_s']:.2f} s |",
             f"| peak memory, training step | {gib(r['peak_bytes']['step'])} |",
             f"| peak memory, collection | {gib(r['peak_bytes']['collect'])} |",
             f"| collection peak / step peak | "
             f"{'n/a' if r['memory_ratio'] is None else format(r['memory_ratio'], '.2f') + 'x'} |",
             f"| added over the resident state: step / collection | {gib(r['added_bytes']['step'])} / "
             f"{gib(r['added_bytes']['collect'])} |",
             f"| all-reduced per collection ({r['allreduce_calls']} calls) | {r['allreduce_bytes'] / 1024:.1f} KiB |",
             f"| ... on paper, Llama-2-70B (560 linears) | "
             f"{r['allreduce_bytes_on_paper']['Llama-2-70B'] / 1024:.1f} KiB |",
             f"| plan: FP4 share of the linears' FLOPs | {r['plan']['fp4_share']:.3f} ({r['plan']['status']}) |",
             "", f"FP4 layers ({len(r['plan']['fp4_layers'])} of {r['linears']}): "
             + (", ".join(f"`{f}`" for f in r["plan"]["fp4_layers"]) or "none")]
    if r.get("collect_by_chunk_elements"):
        lines += ["", "Collection time by the statistics' operand slice (same process, same model):", "",
                  "| slice elements | collection | step equivalents |", "|---|---|---|",
                  f"| {r['chunk_elements_default']:,} (default) | {r['collect_s']:.3f} s | "
                  f"{r['collect_step_equivalents']:.2f} |"]
        lines += [f"| {c['chunk_elements']:,} | {c['collect_s']:.3f} s | {c['collect_step_equivalents']:.2f} |"
                  for c in r["collect_by_chunk_elements"]]
    if r.get("collect_ieee_fp32"):
        c = r["collect_ieee_fp32"]
        lines += ["", f"The same collection with `collect_tf32: false` (FP32 products in IEEE FP32, not on TF32 tensor "
                      f"cores): {c['collect_s']:.3f} s = {c['collect_step_equivalents']:.2f} step equivalents "
                      f"(default: {r['collect_s']:.3f} s)."]
    prof = r.get("collection_profile")
    if prof:
        s = prof["share"]
        lines += ["", f"One collection under torch.profiler: {prof['step_us'] / 1e3:.1f} ms of "
                      f"{'device' if r['device'] != 'cpu' else 'CPU operator'} time, "
                      f"{prof['launches_per_step']:.0f} kernel launches; GEMM {s['gemm']:.0%}, quantize "
                      f"{s['quantize']:.0%}, other {s['other']:.0%}.", "",
                  "| kernel | class | ms | calls |", "|---|---|---|---|"]
        lines += [f"| `{t['kernel']}` | {t['class']} | {t['us_per_step'] / 1e3:.2f} | {t['calls_per_step']:.0f} |"
                  for t in prof["top"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=int, default=None,
                   help="divide hidden, intermediate and vocabulary by this (default: 1 on CUDA, 64 on the CPU)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary before --scale (default 32000)")
    p.add_argument("--layers", type=int, default=2, help="decoder blocks (default 2)")
    p.add_argument("--micro_batch", type=int, default=1)
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3, help="timed training steps after the first (default 3)")
    p.add_argument("--output", type=Path, default=RESULTS, help="folder for bench_scale.{json,md}")
    p.add_argument("--profile", action="store_true", help="profile one more collection, kernel by kernel")
    p.add_argument("--chunk_elements", type=int, nargs="*", default=[],
                   help="time one more collection per statistics operand-slice size (elements)")
    p.add_argument("--ieee_collection", action="store_true",
                   help="time one more collection with collect_tf32 off (FP32 products in IEEE FP32)")
    args = p.parse_args(argv)
    for n in args.chunk_elements:
        if n < 1:
            p.error(f"--chunk_elements must be at least 1, got {n}")
    cuda = torch.cuda.is_available()
    scale = args.scale if args.scale is not None else (1 if cuda else 64)
    for name in ("scale", "vocab", "layers", "micro_batch", "block_size", "steps"):
        value = scale if name == "scale" else getattr(args, name)
        if value < 1:
            p.error(f"--{name} must be at least 1, got {value}")
    if not cuda and scale < 16:
        p.error(f"--scale {scale}: without CUDA use --scale 16 or more (full widths need a GPU)")
    try:
        result = bench(scale, max(args.vocab // scale, 1), args.layers, args.micro_batch, args.block_size,
                       args.steps, args.profile, tuple(args.chunk_elements), args.ieee_collection)
    except ValueError as err:
        print(f"bench_scale: error: {err}", file=sys.stderr)
        return 2
    result["scale"] = scale
    args.output.mkdir(parents=True, exist_ok=True)
    name = "bench_scale" if cuda else "bench_scale_cpu"
    (args.output / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.output / f"{name}.md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {args.output / name}.json and .md")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # After a DeepSpeed engine, leave without the interpreter's teardown, as launch/train.py does (gloo's threads).
    os._exit(code)
