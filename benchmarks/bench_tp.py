"""Tensor parallelism against data parallelism on the same ranks: TP 2 x DP 1 and TP 1 x DP 2, side by side.

    python benchmarks/bench_tp.py                        # launches both shapes (2 ranks each), writes results
    python benchmarks/bench_tp.py --output /tmp/tp       # elsewhere

Both shapes train the same Llama (``--hidden``, 4 blocks, SwiGLU 2x, 8 heads / 4 KV heads) on the same global
batch (4 sequences of ``--seq`` tokens: TP 1 x DP 2 two per rank, TP 2 x DP 1 all four on both ranks) through
snip_ds's own engine (:func:`snip_ds.initialize`, ZeRO-1, FP32, a fixed ``--plan``, ``backend: auto``), one
after the other on the same machine, each under the deepspeed launcher. Per shape:

1. two warm-up steps, then ``--steps`` timed steps (median);
2. one statistics collection on one micro-batch per rank (:func:`snip_ds.stats.collect_statistics`, the ``ones``
   preconditioner), timed: its step equivalents are its time over the median step;
3. the bytes every collective moves during that collection and during one training step, counted at
   ``torch.distributed``'s ``all_reduce``, ``all_gather``, ``all_gather_into_tensor`` and
   ``reduce_scatter_tensor`` (each call's tensor bytes as the calling rank passes them; DeepSpeed's own collectives
   included), and how many of the collection's calls there were.

Also written, **computed, not measured**: the bytes a collection at Llama-2-70B widths, TP 8 x DP 64, all-reduces
over each tensor-parallel group (what :mod:`snip_ds.stats` adds for shards: the amax of every quantized operand,
the FLD's per-sequence sums, and each row-parallel layer's per-channel projections of the drift), beside the
data-parallel all-reduce of the per-layer scalars.

On a 2-core CPU with gloo these are plumbing figures, not a statement about GPUs: tensor parallelism adds two
all-reduces of the activations per block and halves each rank's GEMMs, and here communication costs more than
the GEMMs it splits. Writes ``bench_tp.json`` and ``bench_tp.md`` to ``--output`` (default benchmarks/results).
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VOCAB, BLOCKS = 256, 4


def _count_collectives(counter: dict) -> None:
    """Wraps torch.distributed's collectives so that each call adds its tensor bytes to ``counter[mode]``."""
    import torch.distributed as dist

    def wrap(name, tensor_of):
        orig = getattr(dist, name)

        def counted(*args, **kwargs):
            mode = counter.get("mode")
            if mode is not None:
                t = tensor_of(args, kwargs)
                counter[mode] = counter.get(mode, 0) + t.numel() * t.element_size()
                counter[mode + "_calls"] = counter.get(mode + "_calls", 0) + 1
            return orig(*args, **kwargs)
        setattr(dist, name, counted)

    wrap("all_reduce", lambda a, k: a[0] if a else k["tensor"])
    wrap("all_gather", lambda a, k: (a[1] if len(a) > 1 else k["tensor"]))
    wrap("all_gather_into_tensor", lambda a, k: a[1] if len(a) > 1 else k["input_tensor"])
    wrap("reduce_scatter_tensor", lambda a, k: a[1] if len(a) > 1 else k["input"])


def worker(args) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import snip_ds
    from snip_ds.runtime import distributed as sdist
    from snip_ds.engine import init_distributed
    from snip_ds.stats import CollectSettings, collect_statistics

    torch.set_num_threads(1)
    init_distributed()
    rank, world = sdist.rank(), sdist.world_size()
    dp = world // args.tp
    micro = 4 // dp
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                         num_hidden_layers=BLOCKS, num_attention_heads=8, num_key_value_heads=4,
                                         max_position_embeddings=args.seq, tie_word_embeddings=False))
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1},
              "steps_per_print": 10 ** 9, "snip": {"plan": args.plan, "train": {"seed": 0}}}
    if args.tp > 1:
        config["tensor_parallel"] = {"autotp_size": args.tp}
    engine = snip_ds.initialize(model, config, tokens_per_step=micro * args.seq)
    counter: dict = {}
    _count_collectives(counter)
    gen = torch.Generator().manual_seed(1)
    dp_rank = rank // args.tp

    def batch():
        ids = torch.randint(0, VOCAB, (4, args.seq), generator=gen)[dp_rank * micro:][:micro]
        return {"input_ids": ids, "labels": ids}

    for _ in range(2):
        engine.train_step([batch()])
    times = []
    for i in range(args.steps):
        counter["mode"] = "step" if i == 0 else None
        t0 = time.perf_counter()
        engine.train_step([batch()])
        times.append(time.perf_counter() - t0)
    counter["mode"] = "collect"
    t0 = time.perf_counter()
    collect_statistics(engine.ds.module, [batch()], CollectSettings(precond_fallback="ones"), lr=1e-3,
                       reduce=sdist.dist_sum, world_size=dp, layers=list(engine.layers))
    collect_s = time.perf_counter() - t0
    counter["mode"] = None
    step_s = statistics.median(times)
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps({
            "tp": args.tp, "dp": dp, "micro_batch": micro, "step_s": step_s, "steps": times,
            "collect_s": collect_s, "collect_step_equivalents": collect_s / step_s,
            "collect_bytes": counter.get("collect", 0), "collect_calls": counter.get("collect_calls", 0),
            "step_bytes": counter.get("step", 0), "step_calls": counter.get("step_calls", 0)}))
    torch.distributed.barrier()


def computed_70b(tokens: int = 4096, tp: int = 8, probes: int = 1, sequences: int = 1) -> dict:
    """Bytes one collection all-reduces at Llama-2-70B widths (80 blocks, hidden 8192, intermediate 28672,
    64 heads / 8 KV heads), TP ``tp``, ``tokens`` per rank in one micro-batch of ``sequences`` sequences, fp8 and
    fp4 measured (fp4's G_Y rounded stochastically), FP32 sums. Over each tensor-parallel group:

    * the amax of each quantized operand (one FP32 scalar per call): per layer and precision two in the probe's
      FLD (X, W) and two in the BWD (G_Y, X);
    * the FLD's per-sequence sums: ``sequences x probes x 2`` per layer, in one call for all layers;
    * per row-parallel layer (o_proj, down_proj) and precision, the drift's projections ``[tokens, 8192]``; for
      fp4 also the noise's ``[tokens, |S|]`` (|S| = max(256, 8192 / 4) sampled tokens) and two ``[8192]``
      vectors.

    Over the data-parallel group: the per-layer scalars (bench_collect's count: 12 per layer, 2 global). Beside
    them, for scale, a training step's own tensor-parallel all-reduces of its BF16 activations."""
    blocks, hidden, n_out = 80, 8192, 8192
    layers = 7 * blocks
    amax = layers * 2 * (2 * probes + 2) * 4
    fld = layers * sequences * probes * 2 * 4
    sample = max(256, n_out // 4)
    row = 2 * blocks * (2 * tokens * n_out * 4 + tokens * sample * 4 + 2 * n_out * 4)
    dp = (12 * layers + 2) * 8
    # beside it, a training step's own tensor-parallel all-reduces of BF16 activations [tokens, hidden]: per block
    # the two row-parallel outputs in forward and the five column-parallel inputs' gradients in backward
    step = blocks * (2 + 5) * tokens * hidden * 2
    return {"model": "Llama-2-70B widths, 80 blocks", "tensor_parallel": tp, "tokens_per_rank": tokens,
            "tp_amax_bytes": amax, "tp_amax_calls": layers * 2 * (2 * probes + 2), "tp_fld_bytes": fld,
            "tp_row_projection_bytes": row, "tp_total_bytes": amax + fld + row, "dp_scalar_bytes": dp,
            "tp_step_activation_bytes": step,
            "hidden": hidden}


def driver(args) -> None:
    import torch

    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for tp in (1, 2):
        tmp = out_dir / f".bench_tp_{tp}.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", str(Path(__file__).resolve()),
               "--worker", "--tp", str(tp), "--plan", args.plan, "--hidden", str(args.hidden), "--seq",
               str(args.seq), "--steps", str(args.steps), "--worker_out", str(tmp)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"TP {tp} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        rows.append(json.loads(tmp.read_text()))
        tmp.unlink()
    one, two = rows
    record = {"benchmark": "bench_tp", "machine": f"{platform.platform()}, {os.cpu_count()} CPUs",
              "torch": torch.__version__, "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "model": {"hidden": args.hidden, "blocks": BLOCKS, "seq": args.seq, "global_batch": 4},
              "plan": args.plan, "shapes": rows,
              "tp2_over_tp1": {"step_time": two["step_s"] / one["step_s"],
                               "collect_step_equivalents": [one["collect_step_equivalents"],
                                                            two["collect_step_equivalents"]]},
              "computed_llama70b_tp8": computed_70b()}
    (out_dir / "bench_tp.json").write_text(json.dumps(record, indent=1) + "\n")
    c = record["computed_llama70b_tp8"]
    lines = [
        "# Tensor parallelism: TP 2 x DP 1 against TP 1 x DP 2 (benchmarks/bench_tp.py)", "",
        f"Machine: {record['machine']}, torch {record['torch']}, gloo; run started {record['started']}. Llama "
        f"hidden {args.hidden}, {BLOCKS} blocks, {args.seq} tokens x 4 sequences per step, plan `{args.plan}`, "
        f"ZeRO-1, FP32. The same 2 ranks either way; CPU plumbing figures, not GPU ones.", "",
        "| shape | median step (s) | collection (s) | collection (step equivalents) | bytes per collection "
        "(calls) | bytes per step |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| TP {r['tp']} x DP {r['dp']} | {r['step_s']:.3f} | {r['collect_s']:.3f} | "
                     f"{r['collect_step_equivalents']:.2f} | {r['collect_bytes']:,} ({r['collect_calls']}) | "
                     f"{r['step_bytes']:,} |")
    lines += ["", f"TP 2's step takes {record['tp2_over_tp1']['step_time']:.2f}x TP 1's. Bytes are every collective "
              f"of the calling rank, DeepSpeed's included: at TP 2 most of a collection's are the activation "
              f"all-reduces of its own forward and backward passes, the rest the row-parallel layers' projections "
              f"(below).", "",
              "## Llama-2-70B widths, TP 8 x DP 64: computed, not measured", "",
              f"One collection, {c['tokens_per_rank']} tokens per rank, fp8 and fp4: over each tensor-parallel "
              f"group {c['tp_total_bytes'] / 2 ** 30:.1f} GiB per rank ({c['tp_row_projection_bytes'] / 2 ** 30:.1f} "
              f"GiB the row-parallel layers' projections, {c['tp_amax_calls']} amax all-reduces of 4 bytes, "
              f"{c['tp_fld_bytes']:,} bytes of per-sequence FLD sums), next to "
              f"{c['tp_step_activation_bytes'] / 2 ** 30:.1f} GiB of a training step's own activation all-reduces "
              f"(BF16, computed alike); over the data-parallel group "
              f"{c['dp_scalar_bytes']:,} bytes of per-layer scalars. The ILP (560 layers) solves in 0.09 s on a "
              f"CPU core (bench_planner.md); tensor parallelism does not change it."]
    (out_dir / "bench_tp.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--plan", default="fp4")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--worker_out", help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        sys.stdout.flush()
        os._exit(0)
    driver(args)


if __name__ == "__main__":
    main()
