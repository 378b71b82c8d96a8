"""What one SNIP statistics collection costs, against a training step, on the default model.

    python benchmarks/bench_collect.py [--repeats 3] [--quick]
    python benchmarks/bench_collect.py --threads 1 --clock cpu    # one thread's CPU time: steady under load
    python benchmarks/bench_collect.py --model moe --threads 1 --clock cpu    # a small Mixtral (MoE)

- time: one collection (collect_batches = 1 and 2) in training-step equivalents; the step is forward +
  backward + AdamW of the same micro-batch under a uniform fp8 plan (backend ``auto``: on the CPU the torch
  backend with the fused CPU quantization kernels, which the collection's round-to-nearest quantization uses
  too), measured side by side, round-robin.
  A training re-plan's collection records only what the plan is solved from; the same collection with every
  study field (``study_fields``: what a collection computed before they became optional, and what the
  studies ask for) is timed beside it on the same batches.
- memory: peak resident memory a collection adds, against what a training step adds (fresh process each,
  VmHWM with glibc's mmap threshold pinned as in bench_linear).
- communication: bytes a collection all-reduces (counted at the reduce call), and the same count for the
  layer shapes of Llama-2-7B (224 linears) and Llama-2-70B (560 linears) computed on paper: after each batch
  the per-channel vectors are folded into a fixed number of scalars per layer, so the payload is
  (scalars per layer x layers + global scalars) x 8 bytes, independent of the layers' widths.
- overhead: the share of training time that collection + solve take at replan_every steps
  (collection + solve) / (replan_every x step + collection + solve), at the shipped default and wider K; and
  all of SNIP's own work (collections at the shipped schedule's early re-plans too, solves, measuring forwards)
  over a long run and over the 120-step default run.
- the default run (``--default_run``, on by default): the shipped ``ds_configs/zero3.json`` itself through the
  deepspeed launcher on 1 rank (ZeRO-3, the adaptive plan's mixed FP8/FP4 steps, the collection's ZeRO-3
  path), re-planning every DEFAULT_RUN_K steps so that one short run holds several collections; its own
  TensorBoard gives the collection, solve + broadcast and step times from which the same share follows.
- ``--model moe``: the same time and memory measures on a small Mixtral (MOE_CONFIG: the default model's
  attention, 8 experts of width 512 with top-2 routing in each of the 6 blocks; every (expert, projection)
  pair measured as a layer of its own, its FLOPs from the tokens routed to it), swapped with ``swap_model``
  and measured over ``model_layers``. The all-reduced bytes are this model's own (no figures on paper), and the
  default run (the shipped config trains the dense default model) is left out.
Results: benchmarks/results/bench_collect.{json,md}; with ``--clock cpu``, bench_collect_cpu{threads}.{json,md}
(process CPU time instead of wall time, so other processes on the machine barely move the figures; the default
run, timed by its own TensorBoard in wall time, is left out); with ``--model moe``, bench_collect_moe.{json,md}
and bench_collect_moe_cpu{threads}.{json,md}. Targets (both models): <= 3 step equivalents, <= 1.3x memory,
< 1 MB at 70B; <= 2 % overhead at the default replan_every.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from snip_ds.stats import STUDY_FIELDS, CollectSettings, adam_precond, collect_statistics  # noqa: E402
from snip_ds.run.data import DataStream, load_dataset_blocks  # noqa: E402
from snip_ds.run.model import build_model  # noqa: E402
from snip_ds.runtime.omp import preserve_torch_threads  # noqa: E402
from snip_ds.planner import solve_baseline  # noqa: E402
from snip_ds.engine.schedule import measure_due, replan_steps  # noqa: E402
from snip_ds.config.settings import parse_snip_section  # noqa: E402
from snip_ds.swap import model_layers, swap_linears, swap_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
_GLOBAL_KEYS = ("n_tokens", "n_rows", "loss_sum")  # the collection's model-wide scalars (mc_fisher)
LLAMA_LINEARS = {"Llama-2-7B": 32 * 7, "Llama-2-70B": 80 * 7}
REPO = Path(__file__).resolve().parents[1]
SHIPPED_CONFIG = REPO / "ds_configs" / "zero3.json"
SHIPPED_REPLAN_EVERY = json.loads(SHIPPED_CONFIG.read_text())["snip"]["replan_every"]
DEFAULT_RUN_STEPS, DEFAULT_RUN_K = 40, 10  # the measured default run: 4 collections (steps 0, 10, 20, 30)
DEFAULT_RUN_MEASURE = 5  # ... with the plan's divergence measured every 5 steps (and after each re-plan), to time it
LONG_RUN_STEPS = 20_000  # "a long run" for the share of SNIP's own work at the shipped settings
# --model moe: a Mixtral with the default model's attention (6 blocks, hidden 384, 6 heads, 2 KV heads) and, in
# each block, 8 experts of SwiGLU width 512, 2 per token (a token's MLP FLOPs are those of the default model's
# width-1024 MLP); 24 attention linears + 6 x 8 x 2 (expert, projection) pairs = 120 planned layers.
MOE_CONFIG = {"model_type": "mixtral", "hidden_size": 384, "intermediate_size": 512, "num_hidden_layers": 6,
              "num_attention_heads": 6, "num_key_value_heads": 2, "num_local_experts": 8,
              "num_experts_per_tok": 2, "bos_token_id": 1, "eos_token_id": 256, "pad_token_id": 256}


def shipped_share(median_s: dict, steps) -> dict:
    """SNIP's own work (collections, solves + broadcasts, measuring forwards) as a share of training time for a
    run of ``steps`` steps (None: the shipped run's ``train.max_steps``) under the shipped ``"snip"`` section's
    schedule, from one run's median times: every collection and measurement the schedule makes is counted."""
    settings = parse_snip_section(json.loads(SHIPPED_CONFIG.read_text())["snip"], str(SHIPPED_CONFIG))
    steps = steps or settings.train.max_steps
    replans = replan_steps(steps, settings.replan_every, settings.early_replan_steps)
    planned = set(replans)
    n = settings.additional_bf16_fwd_every_n_steps
    measures = sum(measure_due(s, n, s in planned) for s in range(steps))
    work = (len(replans) * (median_s["collect"] + median_s["solve_and_broadcast"])
            + measures * median_s["bf16_measure_forward"])
    return {"steps": steps, "replan_every": settings.replan_every, "early_replan_steps": list(settings.early_replan_steps),
            "measure_every": n, "collections": len(replans), "measurements": measures,
            "share": work / (steps * median_s["step"] + work)}


def default_run(max_steps: int = DEFAULT_RUN_STEPS, replan_every: int = DEFAULT_RUN_K,
                study_fields: tuple = ()) -> dict:
    """Times of the shipped zero3.json run through the deepspeed launcher (1 rank), read from its TensorBoard.

    Only the run's length, its re-planning cadence, evaluation/saving (once, at the end), the output
    directory and (``study_fields``, for the comparison) ``snip.research.study_fields`` differ from the
    shipped file. Returns the medians of ``snip/collect_time_s``,
    ``snip/solve_time_s`` (solve on rank 0 + broadcast) and ``perf/step_time_s`` (the first step left out:
    warm-up), and the counts they come from.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = json.loads(SHIPPED_CONFIG.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        cfg["snip"].update(replan_every=replan_every, early_replan_steps=[],
                           additional_bf16_fwd_every_n_steps=DEFAULT_RUN_MEASURE)
        if study_fields:
            cfg["snip"].setdefault("research", {})["study_fields"] = list(study_fields)
        cfg["snip"]["train"].update(max_steps=max_steps, eval_steps=max_steps, save_steps=0,
                                    output_dir=str(Path(tmp) / "out"))
        path = Path(tmp) / "zero3_bench.json"
        path.write_text(json.dumps(cfg))
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", str(REPO / "launch" / "train.py"),
               "--deepspeed", str(path), "--no_progress"]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"default run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        acc = EventAccumulator(str(Path(tmp) / "out" / "tensorboard"), size_guidance={"scalars": 0})
        acc.Reload()
        series = {tag: {e.step: e.value for e in acc.Scalars(tag)}
                  for tag in ("snip/collect_time_s", "snip/solve_time_s", "perf/step_time_s")}
    # Steps whose time includes the extra no-grad forwards that measure the plan's divergence: the step logged
    # as s follows the measurement made before it (at s - 1). The first step is left out (warm-up).
    n = cfg["snip"]["additional_bf16_fwd_every_n_steps"]
    times = series["perf/step_time_s"]
    replans = set(replan_steps(max_steps, replan_every))
    measured_at = {s for s in times if measure_due(s - 1, n, s - 1 in replans)}
    measured = [v for s, v in times.items() if s > 1 and s in measured_at]
    plain = [v for s, v in times.items() if s > 1 and s not in measured_at]
    return {"max_steps": max_steps, "replan_every": replan_every, "wall_s": wall,
            "collections": len(series["snip/collect_time_s"]), "steps_timed": len(plain),
            "measure_every": n,
            "median_s": {"collect": statistics.median(series["snip/collect_time_s"].values()),
                         "solve_and_broadcast": statistics.median(series["snip/solve_time_s"].values()),
                         "step": statistics.median(plain),
                         "bf16_measure_forward": (statistics.median(measured) - statistics.median(plain))
                         if measured else 0.0}}


def _moe_config(vocab: int, block: int):
    from transformers import MixtralConfig

    fields = {k: v for k, v in MOE_CONFIG.items() if k != "model_type"}
    return MixtralConfig(vocab_size=-(-vocab // 8) * 8, max_position_embeddings=block, **fields)


def _setup(micro_batch: int, block: int, model_kind: str = "default"):
    torch.set_flush_denormal(True)  # as launch/train.py does
    train, _, vocab, _ = load_dataset_blocks(None, block, max_bytes=1_000_000, max_validation_bytes=64 * block)
    if model_kind == "moe":
        model = build_model(model_config=_moe_config(vocab, block), vocab_size=vocab)
        swap_model(model, "fp8")  # decoder linears and every (expert, projection) pair
    else:
        model = build_model(vocab_size=vocab, block_size=block)
        swap_linears(model, "fp8")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stream = DataStream(train, micro_batch, seed=0)
    return model, opt, stream


def _train_step(model, opt, batch) -> None:
    opt.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    opt.step()


def _collect(model, opt, batches, counter=None, study=()):
    pre = adam_precond(model, opt)
    def counting(t):
        counter.append(t.numel() * 8)  # all-reduced as float64 (snip_ds.runtime.distributed.dist_sum)
        return t
    return collect_statistics(model, batches, CollectSettings(lam=100.0, study_fields=study), lr=pre.lr,
                              precond=pre.precond or None, reduce=counting if counter is not None else None,
                              layers=list(model_layers(model)))


def _status_bytes(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def _memory_child(what: str, micro_batch: int, block: int, model_kind: str = "default") -> int:
    model, opt, stream = _setup(micro_batch, block, model_kind)
    batches = [stream.next_batch() for _ in range(3)]
    _train_step(model, opt, batches[0])  # optimizer state exists, as in training
    _collect(model, opt, [batches[1]]) if what == "collect" else _train_step(model, opt, batches[1])
    opt.zero_grad(set_to_none=True)
    start = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    if what == "collect":
        _collect(model, opt, [batches[2]])
    else:
        _train_step(model, opt, batches[2])
    return _status_bytes("VmHWM") - start


def peak_bytes(what: str, micro_batch: int, block: int, model_kind: str = "default") -> int:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    out = subprocess.run([sys.executable, __file__, "--_memory", what, str(micro_batch), str(block), model_kind],
                         env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--block_size", type=int, default=256)
    p.add_argument("--quick", action="store_true", help="tiny batch, 1 repeat, results not written")
    p.add_argument("--no_default_run", action="store_true", help="skip the shipped-config run through deepspeed")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: time.perf_counter; cpu: the process's CPU time (time.process_time), for a "
                        "loaded machine (use with --threads 1)")
    p.add_argument("--model", choices=("default", "moe"), default="default",
                   help="default: the default dense model; moe: a small Mixtral (MOE_CONFIG), no default run")
    p.add_argument("--_memory", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._memory:
        print(_memory_child(args._memory[0], int(args._memory[1]), int(args._memory[2]), args._memory[3]))
        return 0
    moe = args.model == "moe"
    if args.threads is not None:
        if args.threads < 1:
            p.error(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    mb, block = (1, 64) if args.quick else (args.micro_batch, args.block_size)
    repeats = 1 if args.quick else args.repeats
    model, opt, stream = _setup(mb, block, args.model)
    _train_step(model, opt, stream.next_batch())  # warm-up, and Adam state for the preconditioner
    times = {"step": [], "collect_1": [], "collect_1_study": [], "collect_2": [], "solve": []}
    payload: list = []
    stats = None
    for r in range(repeats):
        batch = stream.next_batch()
        start = clock()
        _train_step(model, opt, batch)
        times["step"].append(clock() - start)
        for n in (1, 2):
            batches = [stream.next_batch() for _ in range(n)]
            counter = payload if (r == 0 and n == 1) else None
            start = clock()
            stats = _collect(model, opt, batches, counter)
            times[f"collect_{n}"].append(clock() - start)
            if n == 1:  # the same batch with every study field
                start = clock()
                _collect(model, opt, batches, study=tuple(STUDY_FIELDS))
                times["collect_1_study"].append(clock() - start)
        start = time.perf_counter()  # the solver runs in its own threads: wall time either way
        with preserve_torch_threads():  # CBC would leave torch single-threaded for the next repeat
            solve_baseline("best", stats, 0.75)
        times["solve"].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    n_layers = len(stats["layers"])
    bytes_default = payload[0]
    # The payload is (per-layer scalars) x layers + global scalars; both counts come from this run's keys.
    n_global = sum(1 for k in _GLOBAL_KEYS)
    per_layer = (bytes_default / 8 - n_global) / n_layers
    on_paper = {} if moe else {name: int(round(per_layer * n + n_global)) * 8 for name, n in LLAMA_LINEARS.items()}
    pairs = {f: r for f, r in stats["layers"].items() if "routed_tokens" in r}  # the experts' records
    params = sum(p.numel() for p in model.parameters())
    label = (f"small Mixtral ({params / 1e6:.1f}M params, {n_layers - len(pairs)} linears + {len(pairs)} "
             f"(expert, projection) pairs)" if moe else "default (9.6M params, 42 linears)")
    short = (f"this model ({n_layers - len(pairs)} linears + {len(pairs)} pairs)" if moe
             else "default model (42 linears)")
    mem = {} if args.quick else {w: peak_bytes(w, mb, block, args.model) for w in ("step", "collect")}
    ks = sorted({SHIPPED_REPLAN_EVERY, 100, 200, 500, 1000})

    def share(cost: float, step: float) -> dict:
        return {str(k): cost / (k * step + cost) for k in ks}

    overhead = share(med["collect_1"] + med["solve"], med["step"])
    run = None if (args.quick or args.no_default_run or args.clock == "cpu" or moe) else default_run()
    run_study = None if run is None else default_run(study_fields=tuple(STUDY_FIELDS))
    if run_study is not None:
        run_study["collect_step_equivalents"] = run_study["median_s"]["collect"] / run_study["median_s"]["step"]
    if run is not None:
        rm = run["median_s"]
        run["collect_step_equivalents"] = rm["collect"] / rm["step"]
        run["overhead_share_by_replan_every"] = share(rm["collect"] + rm["solve_and_broadcast"], rm["step"])
        n = run["measure_every"]
        run["bf16_measure_share"] = rm["bf16_measure_forward"] / (n * rm["step"]) if n else 0.0
        run["shipped_long_run"] = shipped_share(rm, LONG_RUN_STEPS)
        run["shipped_default_run"] = shipped_share(rm, None)
    result = {
        "model": label, "model_config": dict(MOE_CONFIG) if moe else None,
        "tokens_per_batch": mb * block, "repeats": repeats,
        "median_s": med,
        "collect_step_equivalents": {"collect_batches=1": med["collect_1"] / med["step"],
                                     "collect_batches=2": med["collect_2"] / med["step"],
                                     "collect_batches=1, every study field": med["collect_1_study"] / med["step"]},
        "peak_bytes": mem,
        "memory_ratio": (mem["collect"] / mem["step"]) if mem else None,
        "allreduce_bytes": {short: bytes_default, **on_paper},
        "expert_pairs": ({"pairs": len(pairs), "without_tokens": sum(bool(r["no_tokens"]) for r in pairs.values()),
                          "routed_tokens_min": min(r["routed_tokens"] for r in pairs.values()),
                          "routed_tokens_max": max(r["routed_tokens"] for r in pairs.values())}
                         if pairs else None),  # the last collection's (collect_batches=2) routing
        "scalars_per_layer": per_layer,
        "overhead_share_by_replan_every": overhead, "shipped_replan_every": SHIPPED_REPLAN_EVERY,
        "default_run": run,
        "default_run_every_study_field": run_study,
        "threads": torch.get_num_threads(),
        "clock": args.clock,
    }
    print(json.dumps(result, indent=2))
    if args.quick:
        return 0
    RESULTS.mkdir(exist_ok=True)
    name = "bench_collect_moe" if moe else "bench_collect"
    name = name if args.clock == "wall" else f"{name}_cpu{torch.get_num_threads()}"
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    ce = result["collect_step_equivalents"]
    lines = [f"# bench_collect: one SNIP statistics collection vs a training step "
             f"({'small Mixtral' if moe else 'default model'}, CPU, FP32)", ""]
    if moe:
        ep = result["expert_pairs"]
        lines += [f"Model: {label}: the default model's attention (6 blocks, hidden 384, 6 heads, 2 KV heads), in "
                  "each block 8 experts of SwiGLU width 512, top-2 routing (`MOE_CONFIG`), swapped with "
                  "`swap_model`, every (expert, projection) pair measured as a layer of its own "
                  f"(`model_layers`); in the last collection (collect_batches=2) the pairs saw "
                  f"{ep['routed_tokens_min']:.0f}-{ep['routed_tokens_max']:.0f} routed tokens per step, "
                  f"{ep['without_tokens']} of {ep['pairs']} none: the config has no auxiliary load-balancing "
                  "loss (`output_router_logits` off, transformers' default), so the few AdamW steps before it "
                  "concentrate the routing; the figures are for that routing. No default run (the shipped config "
                  "trains the dense default model).", ""]
    lines += [f"Micro-batch {mb}x{block} tokens, {torch.get_num_threads()} threads, "
             f"{'wall' if args.clock == 'wall' else 'process CPU'} time, median of {repeats} "
             "round-robin repeats; training step = fp8 plan forward+backward+AdamW (backend auto: on the CPU the "
             "torch backend with the fused CPU quantization kernels; the collection quantizes through them too).", "",
             "| measure | value | target |", "|---|---|---|",
             f"| collection, collect_batches=1 | {ce['collect_batches=1']:.2f} step equivalents | <= 3 |",
             f"| collection, collect_batches=2 | {ce['collect_batches=2']:.2f} step equivalents | |",
             f"| ... collect_batches=1 with every study field (as before they were optional) | "
             f"{ce['collect_batches=1, every study field']:.2f} step equivalents | |",
             f"| peak memory added, collection / training step | {result['memory_ratio']:.2f}x | <= 1.3x |",
             f"| all-reduced per collection, {short} | {bytes_default / 1024:.1f} KiB | |"]
    if on_paper:
        lines += [f"| ... Llama-2-7B (224 linears, on paper) | {on_paper['Llama-2-7B'] / 1024:.1f} KiB | |",
                  f"| ... Llama-2-70B (560 linears, on paper) | {on_paper['Llama-2-70B'] / 1024:.1f} KiB | < 1 MB |"]
    lines += [f"| solve time ({n_layers} layers) | {med['solve'] * 1000:.0f} ms | |", "",
             "Share of training time spent in collection + solve (collect_batches=1) by replan_every:", "",
             "| replan_every | overhead |", "|---|---|"]
    lines += [f"| {k}{' (shipped default)' if int(k) == SHIPPED_REPLAN_EVERY else ''} | {v * 100:.1f} % |"
              for k, v in overhead.items()]
    if run is not None:
        rm = run["median_s"]
        lines += ["", f"**The default run** (`ds_configs/zero3.json` through the deepspeed launcher, 1 rank, ZeRO-3, "
                  f"adaptive plan at rho {json.loads(SHIPPED_CONFIG.read_text())['snip']['efficiency_saving']}; "
                  f"{run['max_steps']} steps re-planning every {run['replan_every']} for "
                  f"{run['collections']} collections): median collection {rm['collect']:.2f} s, solve + "
                  f"broadcast {rm['solve_and_broadcast'] * 1000:.0f} ms, training step {rm['step']:.2f} s "
                  f"({run['collect_step_equivalents']:.2f} step equivalents per collection). The extra BF16 "
                  f"forward that measures the plan's divergence every {run['measure_every']} steps costs "
                  f"{rm['bf16_measure_forward']:.2f} s, {run['bf16_measure_share'] * 100:.1f} % of training "
                  "time, on top of the table below.", "",
                  "| replan_every | overhead in the default run |", "|---|---|"]
        lines += [f"| {k}{' (shipped default)' if int(k) == SHIPPED_REPLAN_EVERY else ''} | {v * 100:.1f} % |"
                  for k, v in run["overhead_share_by_replan_every"].items()]
        lines += ["", "**All of SNIP's own work at the shipped settings** (collections, solves + broadcasts and the "
                  "measuring forwards, counted from the shipped schedule, priced at this run's median times):", "",
                  "| run | collections | measurements | share of training time | target |", "|---|---|---|---|---|"]
        for label, r, target in (("a long run", run["shipped_long_run"], "<= 2 %"),
                                 ("the 120-step default run itself", run["shipped_default_run"], "")):
            lines.append(f"| {label}: {r['steps']} steps, re-plans every {r['replan_every']} and after "
                         f"{', '.join(map(str, r['early_replan_steps']))}; measured every {r['measure_every']} and "
                         f"after each re-plan | {r['collections']} | {r['measurements']} | "
                         f"{r['share'] * 100:.2f} % | {target} |")
        rs = run_study["median_s"]
        lines += ["", f"The same run with `snip.research.study_fields` listing every group (the collection as it was "
                  f"before the study fields became optional), right after: median collection {rs['collect']:.2f} s, "
                  f"training step {rs['step']:.2f} s ({run_study['collect_step_equivalents']:.2f} step "
                  "equivalents per collection)."]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
