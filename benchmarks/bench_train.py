"""Training throughput and peak memory of the default model under bf16, fp8 and fp4 plans, side by side.

    python benchmarks/bench_train.py [--steps 3] [--threads 1] [--quick]

One rank, the shipped configs' shapes: the embedded default Llama (~9.6M parameters, FP32 master weights),
micro-batch 4 x 256 tokens of the stdlib corpus, all decoder linears swapped for SnipLinear at one precision,
torch AdamW (the configs' hyper-parameters) with gradient clipping at 1.0, on 1 CPU thread by default (on a
shared 2-core box, 2 threads oversubscribed by other jobs made step times swing 5x). What is measured:

* tokens/s: 1024 tokens / the median time of one optimizer step (forward, backward, clip, AdamW step). The
  three plans start from the same weights, see the same batches and run round-robin in this process, so
  machine load hits them alike.
* peak memory per rank: in a fresh process per plan (glibc's mmap threshold pinned at 128 KiB, so freed
  tensors leave resident memory and RSS follows the live tensors), after one warm-up step: VmHWM over one
  more step, i.e. the peak resident set of a rank (Python, torch and transformers included), and what that
  step adds on top of the resident memory before it (gradients, activations, quantization temporaries,
  AdamW's update); the parameters plus AdamW moments are counted exactly from the tensors.

On a CPU the FP8/FP4 GEMMs are emulated in FP32 (quantize, dequantize, FP32 matmul), so these numbers show
the cost of the emulation, not the speed-up or memory saving of FP8/FP4 hardware.
Results go to benchmarks/results/bench_train.{json,md}.

    python benchmarks/bench_train.py --device cuda [--quick] [--steps 30 --replan_every 10] [--output_dir DIR]

On a CUDA GPU: tokens/s of a ~1.0B-parameter Llama (22 blocks, hidden 2048, SwiGLU 5632, GQA 32/4 heads,
TinyLlama-1.1B's shape with the byte-level vocabulary) under the bf16, fp8, fp4 and adaptive plans, each a
training run (``snip_ds.run.trainer.main``, what launch/train.py runs) on one GPU with the shipped
ds_configs/zero3.json (ZeRO-3, BF16, ``backend: auto``), micro-batch 8 x 1024 tokens. The four runs go one
after another in this one process (Python, torch, CUDA and the JIT-built ops start once; each run builds its own model and engine in the one process group, and the GPU's peak memory is read per run);
``--separate_launches`` makes each a launch/train.py process of its own through the deepspeed launcher instead. only the model, the batch, the run's length, the
re-planning cadence of the adaptive run, evaluation (once, at the end) and the output directory differ from
the shipped file. From each run's TensorBoard: the median step time (the first two steps left out as warm-up,
and the steps carrying the extra BF16 forward that measures the plan's divergence), and for the adaptive run
the medians of the collection and the solve, from which SNIP's share of training time follows at the shipped
``replan_every`` (see :func:`summarize_run`). Results go to benchmarks/results/bench_train_cuda.{json,md}.
``--steps`` and ``--replan_every`` shorten the runs (at least 5 steps: two warm-up steps are left out) and
``--output_dir`` writes elsewhere (gpu/run_device.sh does both to fit its time budget); ``--plans`` runs some of
the plans (bf16 first: the ratios are against it). The results are rewritten after every plan's run, with
``"complete": false`` until the last, so a run cut short keeps the plans it finished.
``--torch_compile`` runs the same plans compiled (``launch/train.py --torch_compile``, inductor), under ZeRO-1
(ds_configs/zero1.json: launch/train.py compiles under ZeRO 0-2 only), into bench_train_cuda_compiled.{json,md}.
Without CUDA, ``--device cuda`` is an error (exit 2); ``--plumbing`` runs the same code on a 2-block, 64-wide
Llama on this machine's device and writes nothing (gpu/run_device.sh's dry run).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from snip_ds.run.data import DataStream, load_dataset_blocks  # noqa: E402
from snip_ds.runtime.fileio import atomic_write_text  # noqa: E402
from snip_ds.run.model import build_model  # noqa: E402
from snip_ds.swap import swap_linears  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PLANS = ("bf16", "fp8", "fp4")
MICRO_BATCH, BLOCK = 4, 256  # ds_configs/*.json: train_micro_batch_size_per_gpu, snip.train.block_size
ADAMW = dict(lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)  # ds_configs/*.json: optimizer.params

REPO = Path(__file__).resolve().parents[1]
SHIPPED_CONFIG = REPO / "ds_configs" / "zero3.json"
COMPILED_CONFIG = REPO / "ds_configs" / "zero1.json"  # --torch_compile: launch/train.py compiles under ZeRO 0-2 only
GPU_PLANS = ("bf16", "fp8", "fp4", "adaptive")
GPU_MODEL = {"model_type": "llama", "vocab_size": 264, "hidden_size": 2048, "intermediate_size": 5632,
             "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
             "max_position_embeddings": 2048, "tie_word_embeddings": False}
GPU_MICRO_BATCH, GPU_BLOCK = 8, 1024
GPU_STEPS, GPU_REPLAN_EVERY = 30, 10  # the adaptive run collects at steps 0, 10 and 20


def build(precision: str, micro_batch: int = MICRO_BATCH):
    """The default model with every decoder linear at ``precision``, its AdamW, and a batch source."""
    model = build_model(seed=0, dtype=torch.float32, block_size=BLOCK)
    swap_linears(model, precision, seed=0)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    train, _, _, _ = load_dataset_blocks(None, BLOCK, seed=0, max_bytes=400_000, max_validation_bytes=BLOCK * 64)
    return model, opt, DataStream(train, micro_batch, seed=0)


def train_step(model, opt, batch) -> float:
    loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def state_bytes(model, opt) -> int:
    """Bytes of the parameters and the optimizer's state tensors (AdamW: two moments per parameter)."""
    tensors = list(model.parameters()) + [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _status_bytes(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+) kB", text).group(1)) * 1024


def _memory_child(precision: str, micro_batch: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    model, opt, stream = build(precision, micro_batch)
    train_step(model, opt, stream.next_batch())  # warm-up: AdamW state and first-touch costs are not the step's
    batch = stream.next_batch()
    before = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    train_step(model, opt, batch)
    peak = _status_bytes("VmHWM")
    return {"peak_rss_bytes": peak, "step_added_bytes": peak - before, "state_bytes": state_bytes(model, opt)}


def peak_memory(precision: str, micro_batch: int, threads: int) -> dict:
    """:func:`_memory_child` in a fresh process with glibc's mmap threshold pinned (see the module docstring)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    out = subprocess.run([sys.executable, __file__, "--_memory", precision, str(micro_batch), str(threads)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench(steps: int, micro_batch: int, threads: int) -> dict:
    runs = {p: build(p, micro_batch) for p in PLANS}
    times = {p: [] for p in PLANS}
    losses = {p: [] for p in PLANS}
    for p, (model, opt, stream) in runs.items():  # warm-up
        losses[p].append(train_step(model, opt, stream.next_batch()))
    for _ in range(steps):
        for p, (model, opt, stream) in runs.items():
            batch = stream.next_batch()
            start = time.perf_counter()
            losses[p].append(train_step(model, opt, batch))
            times[p].append(time.perf_counter() - start)
    n_params = sum(t.numel() for t in runs["bf16"][0].parameters())
    del runs
    tokens = micro_batch * BLOCK
    rows = {}
    for p in PLANS:
        step_s = statistics.median(times[p])
        rows[p] = {"step_time_s": step_s, "step_times_s": times[p], "tokens_per_s": tokens / step_s,
                   "losses": losses[p], **peak_memory(p, micro_batch, threads)}
    for p in PLANS:
        rows[p]["time_ratio_vs_bf16"] = rows[p]["step_time_s"] / rows["bf16"]["step_time_s"]
        rows[p]["tokens_per_s_ratio_vs_bf16"] = rows[p]["tokens_per_s"] / rows["bf16"]["tokens_per_s"]
        for key in ("peak_rss_bytes", "step_added_bytes"):
            rows[p][key.replace("_bytes", "_ratio_vs_bf16")] = rows[p][key] / rows["bf16"][key]
    return {"parameters": n_params, "tokens_per_step": tokens, "rows": rows}


# ------------------------------------------------------------------------------------------------------
# --device cuda: launch/train.py runs through the deepspeed launcher, read back from their TensorBoard
# ------------------------------------------------------------------------------------------------------

def llama_parameters(cfg: dict) -> int:
    """Parameters of a Llama config (q, k, v, o; gate, up, down; two RMSNorms per block; untied embeddings and
    head; the final norm)."""
    h, inter, layers, vocab = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"],
                               cfg["vocab_size"])
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    per_block = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h
    return layers * per_block + 2 * vocab * h + h


def gpu_run_config(plan: str, model_config: Path, out_dir: Path, steps: int = GPU_STEPS,
                   replan_every: int = GPU_REPLAN_EVERY, micro_batch: int = GPU_MICRO_BATCH,
                   block: int = GPU_BLOCK, compiled: bool = False) -> dict:
    """The shipped ds_configs/zero3.json (``compiled``: zero1.json with ``snip.train.torch_compile``) with the
    benchmark's model, batch, plan and run length (module docstring); BF16 and ``backend: auto`` stated
    explicitly."""
    cfg = json.loads((COMPILED_CONFIG if compiled else SHIPPED_CONFIG).read_text())
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    cfg["gradient_accumulation_steps"] = 1
    cfg["bf16"] = {"enabled": True}
    snip = cfg["snip"]
    snip["plan"] = plan
    snip["replan_every"] = replan_every
    snip["quant"]["backend"] = "auto"
    snip["train"].update(model_config=str(model_config), block_size=block, max_steps=steps, eval_steps=steps,
                         eval_batches=1, save_steps=0, logging_steps=1, output_dir=str(out_dir),
                         torch_compile=compiled)
    return cfg


def summarize_run(series: dict, tokens_per_step: int, measure_every: int, shipped_replan_every: int) -> dict:
    """One run's figures from its TensorBoard series (``{tag: {step: value}}``).

    Step time: the median of ``perf/step_time_s`` (which leaves out a re-plan's collection and solve) over the
    steps after the second, without the steps ``s`` with ``s % measure_every == 0``, which carry the extra
    no-grad BF16 forward that measures the plan's divergence (logged at the step it precedes). tokens/s follows
    from it. With a collection in the series (adaptive): SNIP's overhead per ``K = shipped_replan_every`` steps
    is one collection, one solve (with its broadcast) and ``K / measure_every`` BF16 forwards, and its share of
    training time is ``overhead / (K * step + overhead)``.
    """
    times = series["perf/step_time_s"]
    n = measure_every
    plain = [v for s, v in times.items() if s > 2 and not (n and s % n == 0)]
    measured = [v for s, v in times.items() if s > 2 and n and s % n == 0]
    step = statistics.median(plain)
    row = {"step_time_s": step, "tokens_per_s": tokens_per_step / step, "steps_timed": len(plain)}
    if series.get("snip/collect_time_s"):
        k = shipped_replan_every
        collect = statistics.median(series["snip/collect_time_s"].values())
        solve = statistics.median(series["snip/solve_time_s"].values())
        bf16_forward = statistics.median(measured) - step if measured else 0.0
        overhead = collect + solve + (k / n if n else 0) * bf16_forward
        row.update(collect_s=collect, solve_s=solve, bf16_measure_forward_s=bf16_forward,
                   collections=len(series["snip/collect_time_s"]), snip_overhead_share=overhead / (k * step + overhead),
                   tokens_per_s_with_snip=k * tokens_per_step / (k * step + overhead))
    return row


PLUMBING_MODEL = {**GPU_MODEL, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
PLUMBING_MICRO_BATCH, PLUMBING_BLOCK = 2, 128


def _read_series(tensorboard: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tensorboard), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in
            ("perf/step_time_s", "snip/collect_time_s", "snip/solve_time_s") if tag in tags}


def _write_run_config(tmp: Path, plan: str, steps: int, replan_every: int, model_cfg: Optional[dict],
                      micro_batch: Optional[int], block: Optional[int], compiled: bool = False) -> Path:
    """The run's model and DeepSpeed configs in ``tmp`` (None: the GPU model, micro-batch and block)."""
    model_cfg = GPU_MODEL if model_cfg is None else model_cfg
    micro_batch = GPU_MICRO_BATCH if micro_batch is None else micro_batch
    block = GPU_BLOCK if block is None else block
    model = tmp / "model.json"
    model.write_text(json.dumps(model_cfg))
    path = tmp / f"bench_{plan}.json"
    path.write_text(json.dumps(gpu_run_config(plan, model, tmp / "out", steps, replan_every, micro_batch, block,
                                              compiled)))
    return path


def _launch_run(plan: str, steps: int, replan_every: int, model_cfg: Optional[dict] = None,
                micro_batch: Optional[int] = None, block: Optional[int] = None, compiled: bool = False) -> dict:
    """One launch/train.py run on one GPU, a process of its own through the deepspeed launcher; its
    TensorBoard series."""
    with tempfile.TemporaryDirectory() as tmp:
        path = _write_run_config(Path(tmp), plan, steps, replan_every, model_cfg, micro_batch, block, compiled)
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", str(REPO / "launch" / "train.py"),
               "--deepspeed", str(path), "--no_progress"]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"plan {plan}: launch/train.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return _read_series(Path(tmp) / "out" / "tensorboard")


def _in_process_run(plan: str, steps: int, replan_every: int, model_cfg: Optional[dict] = None,
                    micro_batch: Optional[int] = None, block: Optional[int] = None, compiled: bool = False) -> dict:
    """The same run as :func:`_launch_run`, but ``snip_ds.run.trainer.main`` called in this process (one rank; the
    first run makes the process group, the later ones reuse it): the interpreter, torch, CUDA and the JIT-built ops start
    once for every plan. Its TensorBoard series, and the GPU's peak memory over the run."""
    import gc

    from snip_ds.run.trainer import main as train_main

    with tempfile.TemporaryDirectory() as tmp:
        path = _write_run_config(Path(tmp), plan, steps, replan_every, model_cfg, micro_batch, block, compiled)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        code = train_main(["--deepspeed", str(path), "--no_progress"], keep_process_group=True)
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if code != 0:
            raise RuntimeError(f"plan {plan}: snip_ds.run.trainer.main returned {code}")
        series = _read_series(Path(tmp) / "out" / "tensorboard")
    series["peak_memory_bytes"] = peak
    return series


def bench_cuda(steps: int, replan_every: int, plans=GPU_PLANS, on_row=None, in_process: bool = True,
               plumbing: bool = False, compiled: bool = False) -> dict:
    """One run per plan (``bf16`` first: the others' ratios are against it), all in this process
    (``in_process``) or each through the deepspeed launcher; after each run, ``on_row(result so far)``, so that
    a run cut short still leaves the rows it finished. ``plumbing``: a 2-block, 64-wide Llama on whatever device
    is here (a check of the code, not a measurement)."""
    shipped = json.loads(SHIPPED_CONFIG.read_text())["snip"]
    model_cfg, micro_batch, block = ((PLUMBING_MODEL, PLUMBING_MICRO_BATCH, PLUMBING_BLOCK) if plumbing
                                     else (GPU_MODEL, GPU_MICRO_BATCH, GPU_BLOCK))
    res = {"parameters": llama_parameters(model_cfg), "tokens_per_step": micro_batch * block,
           "replan_every_shipped": shipped["replan_every"], "plans": list(plans), "rows": {},
           "runs": "in one process" if in_process else "one deepspeed-launcher process per plan",
           "compiled": compiled}
    run = _in_process_run if in_process else _launch_run
    try:
        for plan in plans:
            _one_plan(res, plan, run(plan, steps, replan_every, model_cfg, micro_batch, block, compiled), shipped,
                      on_row)
    finally:
        if in_process:
            from snip_ds.engine import destroy_distributed

            destroy_distributed()
    return res


def _one_plan(res: dict, plan: str, series: dict, shipped: dict, on_row) -> None:
    """Adds ``plan``'s row (from its run's series) to ``res``, then calls ``on_row(res)``."""
    rows = res["rows"]
    rows[plan] = row = summarize_run(series, res["tokens_per_step"], shipped["additional_bf16_fwd_every_n_steps"],
                                     shipped["replan_every"])
    if series.get("peak_memory_bytes") is not None:
        row["peak_memory_bytes"] = series["peak_memory_bytes"]
        row["peak_memory_ratio_vs_bf16"] = series["peak_memory_bytes"] / rows["bf16"]["peak_memory_bytes"]
    row["tokens_per_s_ratio_vs_bf16"] = row["tokens_per_s"] / rows["bf16"]["tokens_per_s"]
    print(f"{plan:>8}: {row['tokens_per_s']:.0f} tokens/s", flush=True)
    if on_row is not None:
        on_row(res)


def cuda_report(res: dict, steps: int, gpu: str) -> list:
    """The Markdown lines of a (possibly partial) ``bench_cuda`` result."""
    rows = res["rows"]
    missing = [p for p in res["plans"] if p not in rows]
    setup = ("ZeRO-1, torch.compile", "ds_configs/zero1.json with --torch_compile (inductor)") if res.get("compiled") \
        else ("ZeRO-3", "ds_configs/zero3.json")
    lines = [f"# bench_train --device cuda: {res['parameters'] / 1e9:.2f}B-parameter Llama, {setup[0]}, BF16, one GPU",
             "", f"{gpu}, torch {torch.__version__}, micro-batch {GPU_MICRO_BATCH} x {GPU_BLOCK} tokens, "
             f"{steps} steps per plan (launch/train.py, {setup[1]}, backend auto). tokens/s: median step "
             "time after two warm-up steps, the steps with the plan-divergence BF16 forward left out.", "",
             f"Runs: {res.get('runs', 'one deepspeed-launcher process per plan')}.", "",
             "| plan | step time (s) | tokens/s | vs bf16 | peak GPU memory | vs bf16 |", "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        peak = (f"{r['peak_memory_bytes'] / 2 ** 30:.1f} GiB | {r['peak_memory_ratio_vs_bf16']:.2f}x"
                if "peak_memory_bytes" in r else "not measured | ")
        lines.append(f"| {name} | {r['step_time_s']:.3f} | {r['tokens_per_s']:.0f} | "
                     f"{r['tokens_per_s_ratio_vs_bf16']:.2f}x | {peak} |")
    lines += [f"| {name} | not measured (the run stopped before it) | | | | |" for name in missing]
    a = rows.get("adaptive", {})
    if "snip_overhead_share" in a:
        lines += ["", f"SNIP (adaptive): collection {a['collect_s']:.2f} s, solve {a['solve_s']:.2f} s (medians of "
                  f"{a['collections']}), BF16 measuring forward {a['bf16_measure_forward_s']:.3f} s; at replan_every "
                  f"{res['replan_every_shipped']}: {100 * a['snip_overhead_share']:.1f} % of training time, "
                  f"{a['tokens_per_s_with_snip']:.0f} tokens/s with it."]
    return lines


def main_cuda(quick: bool, steps: int | None = None, replan_every: int | None = None,
              output_dir: Path = RESULTS, plans=GPU_PLANS, in_process: bool = True, plumbing: bool = False,
              compiled: bool = False) -> int:
    steps = steps or (8 if quick or plumbing else GPU_STEPS)
    replan_every = replan_every or (4 if quick or plumbing else GPU_REPLAN_EVERY)
    quick = quick or plumbing  # a plumbing check writes nothing
    start = time.perf_counter()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (plumbing check, not a measurement)"

    def write(res: dict) -> None:  # after every plan: a run cut short keeps what it measured
        lines = cuda_report(res, steps, gpu)
        if quick:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        meta = {"gpu": gpu, "torch": torch.__version__, "steps": steps, "replan_every": replan_every,
                "micro_batch": GPU_MICRO_BATCH, "block_size": GPU_BLOCK, "model": GPU_MODEL,
                "complete": len(res["rows"]) == len(res["plans"]), "wall_s": time.perf_counter() - start}
        atomic_write_text(output_dir / f"{name}.json", json.dumps({"meta": meta, **res}, indent=2) + "\n")
        atomic_write_text(output_dir / f"{name}.md", "\n".join(lines) + "\n")

    name = "bench_train_cuda_compiled" if compiled else "bench_train_cuda"
    res = bench_cuda(steps, replan_every, plans, write, in_process, plumbing, compiled)
    print("\n".join(cuda_report(res, steps, gpu)) + f"\n({time.perf_counter() - start:.0f} s)")
    if not quick:
        print(f"wrote {output_dir / name}.json and .md")
    return 0


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, help=f"cpu: timed steps per plan after one warm-up step (default 3); cuda: "
                   f"steps of each run (default {GPU_STEPS}, at least 5)")
    p.add_argument("--replan_every", type=int, help=f"cuda: the adaptive run's re-planning cadence (default "
                   f"{GPU_REPLAN_EVERY})")
    p.add_argument("--output_dir", type=Path, default=RESULTS, help="cuda: where bench_train_cuda.{json,md} go "
                   "(default benchmarks/results)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (here and in the memory probes)")
    p.add_argument("--quick", action="store_true", help="micro-batch 1, 1 timed step, results not written (cuda: 8 "
                   "steps per plan)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: the default model (below); cuda: a ~1B Llama under ZeRO-3 on one GPU (module docstring)")
    p.add_argument("--plans", nargs="+", choices=GPU_PLANS, default=list(GPU_PLANS),
                   help="cuda: the plans to run, in this order (default all; bf16 first: the ratios are against it)")
    p.add_argument("--separate_launches", action="store_true",
                   help="cuda: each plan a launch/train.py process of its own through the deepspeed launcher (default: "
                        "every plan in this process, started once)")
    p.add_argument("--plumbing", action="store_true",
                   help="the --device cuda code path (every plan, in one process) on a 2-block 64-wide Llama on this "
                        "machine's device, 8 steps: a check of the script, nothing written")
    p.add_argument("--torch_compile", action="store_true",
                   help="cuda: the runs compiled (launch/train.py --torch_compile, inductor) under ZeRO-1 "
                        "(ds_configs/zero1.json), into bench_train_cuda_compiled.{json,md}")
    p.add_argument("--_memory", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.plans != list(GPU_PLANS) and (not (args.device == "cuda" or args.plumbing) or args.plans[0] != "bf16"
                                         or len(set(args.plans)) != len(args.plans)):
        p.error(f"--plans: with --device cuda only, bf16 first, each plan once (got {' '.join(args.plans)})")
    if args.steps is not None and args.steps < (5 if args.device == "cuda" else 1):
        p.error(f"--steps must be at least {5 if args.device == 'cuda' else 1} with --device {args.device}, "
                f"got {args.steps}")
    if args.torch_compile and not (args.device == "cuda" or args.plumbing):
        p.error("--torch_compile: with --device cuda or --plumbing only")
    if args.replan_every is not None and (args.device != "cuda" or args.replan_every < 1):
        p.error(f"--replan_every: a positive number, with --device cuda only (got {args.replan_every})")
    if args.plumbing:
        return main_cuda(True, args.steps, args.replan_every, args.output_dir, tuple(args.plans),
                         not args.separate_launches, plumbing=True, compiled=args.torch_compile)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("error: --device cuda: torch finds no CUDA device here (torch.cuda.is_available() is False); "
                  "run on a machine with a GPU, or without --device for the CPU benchmark", file=sys.stderr)
            return 2
        return main_cuda(args.quick, args.steps, args.replan_every, args.output_dir, tuple(args.plans),
                         not args.separate_launches, compiled=args.torch_compile)
    if args._memory:
        print(json.dumps(_memory_child(args._memory[0], int(args._memory[1]), int(args._memory[2]))))
        return 0
    micro_batch, steps = (1, 1) if args.quick else (MICRO_BATCH, args.steps or 3)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    res = bench(steps, micro_batch, args.threads)
    rows = res["rows"]
    print(f"default model, {res['parameters'] / 1e6:.2f}M parameters, {res['tokens_per_step']} tokens/step, 1 rank, "
          f"{args.threads} thread(s)")
    print(f"{'plan':>5} | {'tokens/s':>9} | {'vs bf16':>7} | {'peak RSS':>9} | {'vs bf16':>7} | "
          f"{'step adds':>9} | {'vs bf16':>7}")
    for name, r in rows.items():
        print(f"{name:>5} | {r['tokens_per_s']:9.1f} | {r['tokens_per_s_ratio_vs_bf16']:6.2f}x | "
              f"{_mib(r['peak_rss_bytes']):>9} | {r['peak_rss_ratio_vs_bf16']:6.2f}x | "
              f"{_mib(r['step_added_bytes']):>9} | {r['step_added_ratio_vs_bf16']:6.2f}x")
    print(f"parameters + AdamW moments: {_mib(rows['bf16']['state_bytes'])} for every plan; "
          f"{time.perf_counter() - start:.0f} s")
    if args.quick:
        return 0
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cores": os.cpu_count(),
            "cpu": platform.processor() or platform.machine(), "master_dtype": "float32", "steps": steps,
            "micro_batch": micro_batch, "block_size": BLOCK, "load_average": os.getloadavg(),
            "wall_s": time.perf_counter() - start}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_train.json").write_text(json.dumps({"meta": meta, **res}, indent=2) + "\n")
    lines = ["# bench_train: default model, one rank, bf16 / fp8 / fp4 plans (FP32 master weights, CPU)", "",
             f"{res['parameters'] / 1e6:.2f}M parameters, micro-batch {micro_batch} x {BLOCK} tokens, torch AdamW, "
             f"clip 1.0. torch {meta['torch']}, {meta['threads']} threads, {meta['cores']} cores, load average "
             f"{meta['load_average'][0]:.1f} at the end. tokens/s: median of {steps} round-robin steps. Peak RSS: "
             "VmHWM of a fresh process over one step after a warm-up (glibc mmap threshold pinned so freed tensors "
             "leave resident memory); step adds: that peak minus the resident memory before the step. FP8/FP4 "
             "GEMMs are emulated in FP32 on a CPU: these ratios are the emulation's cost, not hardware FP8/FP4.",
             "", "| plan | step time (s) | tokens/s | vs bf16 | peak RSS | vs bf16 | step adds | vs bf16 |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['step_time_s']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s_ratio_vs_bf16']:.2f}x | {_mib(r['peak_rss_bytes'])} | "
                     f"{r['peak_rss_ratio_vs_bf16']:.2f}x | {_mib(r['step_added_bytes'])} | "
                     f"{r['step_added_ratio_vs_bf16']:.2f}x |")
    lines += ["", f"Parameters + AdamW moments: {_mib(rows['bf16']['state_bytes'])} in every plan (the emulation "
              "keeps FP32 weights)."]
    (RESULTS / "bench_train.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS / 'bench_train.json'} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
