"""Soak run: a long 2-rank adaptive training run that watches for leaks and plan disagreement.

    python benchmarks/soak.py [--steps 2000] [--replan_every 50] [--save_every 500] [--results_dir DIR]

The deepspeed launcher starts 2 ranks (gloo on CPU, ZeRO-3 as ds_configs/zero3.json, DeepSpeed's
shared-memory all-reduce buffers in /dev/shm) of this script's worker: the tiny test Llama (2 layers, hidden
64, 0.1M parameters) on the stdlib corpus, micro-batch 2 x 64 tokens, adaptive SNIP re-planned every
``--replan_every`` steps (statistics, solve on rank 0, broadcast), the measured-FLD forwards every 10 steps,
TensorBoard logging every step on rank 0, a validation pass every 100 steps and a checkpoint every
``--save_every`` steps (only the newest kept). After every re-plan each rank reports its resident memory
(RSS), open file descriptors, threads and plan digest; rank 0 adds /dev/shm (this run's DeepSpeed buffers by
name, and the filesystem's use) and prints one line. After the launcher exits, the driver checks that none
of this run's files is left in /dev/shm and writes ``soak.json`` and ``soak.md`` to ``--results_dir``.

Targets: after the warm-up (the first ``--warmup`` steps, default 10%), each rank's RSS and descriptor count
stay within 5% of their first value after the warm-up; /dev/shm holds none of the run's files at exit; every
re-plan's digests agree. The exit code is 0 only if all hold (and the run finished).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TINY_MODEL = {"model_type": "llama", "vocab_size": 264, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "tie_word_embeddings": False}
BLOCK, MICRO_BS, TOLERANCE = 64, 2, 0.05


def shm_buffers(uid: int, addr: str, port: str) -> list:
    """This run's DeepSpeed shared-memory all-reduce buffers in /dev/shm (named by uid, address and port)."""
    return sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{uid}_{addr}_{port}_*"))


def shm_used_bytes() -> int:
    """Bytes in use on /dev/shm (every process's files, not only this run's)."""
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


# ------------------------------------------------------------------------------------------------ worker
def worker(args: argparse.Namespace) -> int:
    import psutil
    import torch

    from snip_ds.runtime import distributed as sdist
    from snip_ds.run.data import DataStream, load_dataset_blocks
    from snip_ds.engine import init_distributed, initialize
    from snip_ds.report.tensorboard import make_logger
    from snip_ds.run.model import build_model

    torch.set_flush_denormal(True)
    init_distributed()
    rank, world = sdist.rank(), sdist.world_size()
    work = Path(args.work)
    cfg = json.loads((work / "ds_config.json").read_text())
    train_ds, val_ds, vocab, _ = load_dataset_blocks(None, BLOCK, None, seed=0, max_bytes=200_000,
                                                     max_validation_bytes=BLOCK * 64)
    model = build_model(None, TINY_MODEL, vocab_size=vocab, seed=0, dtype=torch.float32, block_size=BLOCK)
    stream = DataStream(train_ds, MICRO_BS, seed=0, rank=rank, world_size=world)
    collect = DataStream(train_ds, MICRO_BS, seed=7919, rank=rank, world_size=world)
    val = DataStream(val_ds, MICRO_BS, seed=0, rank=rank, world_size=world, shuffle=False)
    eval_batches = [val.next_batch() for _ in range(2)]
    logger = make_logger(work / "tensorboard", rank)
    engine = initialize(model, cfg, tokens_per_step=MICRO_BS * BLOCK, logger=logger, seed=0,
                        statistics_stream=collect)
    me = psutil.Process()
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    records = open(work / "records.jsonl", "w") if rank == 0 else None
    start = last_t = time.perf_counter()
    last_step = 0
    while engine.step < args.steps:
        replans = len(engine.planner.history)
        loss = engine.train_step([stream.next_batch()])
        step = engine.step
        logger.scalars({"train/loss": loss, "train/lr": engine.lr()}, step)
        if step % 100 == 0:
            logger.scalars({"eval/loss": engine.evaluate(eval_batches)}, step)
        if args.save_every and step % args.save_every == 0:
            tag_dir = engine.save_checkpoint(work / "checkpoints", {"data": stream.state_dict()})
            if rank == 0:  # keep only the newest checkpoint: the soak is about the process, not the disk
                for old in (work / "checkpoints").glob("step_*"):
                    if old != tag_dir:
                        shutil.rmtree(old)
        replanned = len(engine.planner.history) > replans
        if not replanned and step != args.steps:
            continue
        mem = me.memory_info()
        mine = {"rss": mem.rss, "fds": me.num_fds(), "threads": me.num_threads(), "digest": engine.plan.digest()}
        every = sdist.all_gather_json(mine)
        if rank != 0:
            continue
        now = time.perf_counter()
        h = engine.planner.history[-1]
        rec = {"step": step, "replanned": replanned, "replan_at": h["step"], "loss": loss, "fp4_share": h["fp4_share"],
               "changed": h["changed"], "collect_s": h["collect_s"], "solve_s": h["solve_s"],
               "rss": [e["rss"] for e in every], "fds": [e["fds"] for e in every],
               "threads": [e["threads"] for e in every], "digests": [e["digest"] for e in every],
               "agree": len({e["digest"] for e in every}) == 1,
               "shm_files": [p.name for p in shm_buffers(os.getuid(), addr, port)], "shm_used": shm_used_bytes(),
               "elapsed_s": now - start, "steps_per_s": (step - last_step) / max(now - last_t, 1e-9)}
        last_t, last_step = now, step
        records.write(json.dumps(rec) + "\n")
        records.flush()
        print(f"soak: step {step:5d} {'re-plan' if replanned else 'end of'} {len(engine.planner.history):3d} | RSS MiB "
              + " ".join(f"{r / 2**20:7.1f}" for r in rec["rss"]) + " | fds " + " ".join(map(str, rec["fds"]))
              + f" | /dev/shm run files {len(rec['shm_files'])}, used {rec['shm_used'] / 2**20:.1f} MiB"
              + f" | digests {'agree' if rec['agree'] else 'DIFFER'} {rec['digests'][0][:8]}"
              + f" | loss {loss:.3f} fp4 {rec['fp4_share']:.2f} changed {rec['changed']}"
              + f" | {rec['steps_per_s']:.1f} steps/s", flush=True)
    logger.close()
    if records is not None:
        records.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------------------ driver
def _flat(series: list, warm_index: int) -> dict:
    """Growth of one rank's series after the warm-up, relative to its first value after the warm-up."""
    after = series[warm_index:]
    ref = after[0]
    return {"first_after_warmup": ref, "max_after_warmup": max(after), "min_after_warmup": min(after),
            "last": after[-1], "max_growth": (max(after) - ref) / ref, "last_growth": (after[-1] - ref) / ref,
            "ok": max(after) <= ref * (1 + TOLERANCE)}


def summarize(records: list, args: argparse.Namespace, leftover: list, returncode: int, wall_s: float) -> dict:
    warm = next((i for i, r in enumerate(records) if r["step"] >= args.warmup), len(records) - 1)
    world = len(records[0]["rss"]) if records else 0
    rss = [_flat([r["rss"][k] for r in records], warm) for k in range(world)]
    fds = [_flat([r["fds"][k] for r in records], warm) for k in range(world)]
    agreed = sum(r["agree"] for r in records if r["replanned"])
    replans = sum(r["replanned"] for r in records)
    finished = returncode == 0 and bool(records) and records[-1]["step"] == args.steps
    ok = {"finished": finished, "rss_flat": all(x["ok"] for x in rss), "fds_flat": all(x["ok"] for x in fds),
          "shm_empty_at_exit": not leftover, "shm_run_files_during": all(not r["shm_files"] for r in records),
          "replans_agreed": bool(records) and agreed == replans}
    return {"steps": args.steps, "replan_every": args.replan_every, "save_every": args.save_every,
            "warmup_steps": args.warmup, "ranks": world, "replans": replans, "replans_agreed": agreed,
            "rss": rss, "fds": fds, "shm_left_at_exit": leftover, "launcher_returncode": returncode,
            "wall_s": wall_s, "targets": ok, "passed": all(ok.values()),
            "machine": {"python": platform.python_version(), "cores": os.cpu_count(),
                        "load_average_end": os.getloadavg()[0]},
            "records": records}


def markdown(s: dict) -> str:
    mib = 2 ** 20
    lines = [f"# soak: {s['ranks']} ranks, {s['steps']} steps, re-plan every {s['replan_every']} steps",
             "",
             f"The tiny test Llama (0.1M parameters), ZeRO-3, gloo, CPU, deepspeed launcher; a checkpoint every "
             f"{s['save_every']} steps, validation every 100, the measured-FLD forwards every 10. Wall time "
             f"{s['wall_s'] / 60:.1f} min on {s['machine']['cores']} cores shared with other jobs (load average "
             f"{s['machine']['load_average_end']:.1f} at the end). Warm-up: the first {s['warmup_steps']} steps.",
             "",
             "| target | result |", "|---|---|",
             f"| run finished (launcher exit 0) | {'yes' if s['targets']['finished'] else 'no'} "
             f"(exit {s['launcher_returncode']}) |",
             f"| every re-plan's digests agree | {s['replans_agreed']} of {s['replans']} |",
             f"| RSS within 5% after warm-up | {'yes' if s['targets']['rss_flat'] else 'no'} |",
             f"| descriptors within 5% after warm-up | {'yes' if s['targets']['fds_flat'] else 'no'} |",
             f"| run's /dev/shm files during the run | "
             f"{'none' if s['targets']['shm_run_files_during'] else 'some'} |",
             f"| run's /dev/shm files at exit | {len(s['shm_left_at_exit'])} |",
             "", "Each rank is sampled after every re-plan and after the last step.", "",
             "| rank | RSS after warm-up | max | last | max growth | fds after warm-up | max | last |",
             "|---|---|---|---|---|---|---|---|"]
    for k, (r, f) in enumerate(zip(s["rss"], s["fds"])):
        lines.append(f"| {k} | {r['first_after_warmup'] / mib:.1f} MiB | {r['max_after_warmup'] / mib:.1f} MiB | "
                     f"{r['last'] / mib:.1f} MiB | {100 * r['max_growth']:+.2f}% | {f['first_after_warmup']} | "
                     f"{f['max_after_warmup']} | {f['last']} |")
    lines += ["", "After every 5th re-plan, and at the end:", "",
              "| step | RSS rank 0 | RSS rank 1 | fds | threads | /dev/shm used | digests | fp4 share | loss |",
              "|---|---|---|---|---|---|---|---|---|"]
    recs = s["records"]
    for i, r in enumerate(recs):
        if i % 5 == 0 or i == len(recs) - 1:
            lines.append(f"| {r['step']} | {r['rss'][0] / mib:.1f} MiB | {r['rss'][-1] / mib:.1f} MiB | "
                         f"{'/'.join(map(str, r['fds']))} | {'/'.join(map(str, r['threads']))} | "
                         f"{r['shm_used'] / mib:.1f} MiB | {'agree' if r['agree'] else 'DIFFER'} | "
                         f"{r['fp4_share']:.2f} | {r['loss']:.3f} |")
    lines += ["", "/dev/shm used is the whole filesystem's use (other jobs on the machine included); this run's "
              "own files are found by name (DeepSpeed's buffers carry the uid, master address and port)."]
    return "\n".join(lines) + "\n"


def driver(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(REPO / "tests"))
    from snip_ds.engine.core import _free_port

    work = Path(tempfile.mkdtemp(prefix="snip_soak_"))
    cfg = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = MICRO_BS
    cfg["gradient_accumulation_steps"] = 1
    # A steady cadence (no early re-plans) and the divergence measured every 10 steps: many collectives per step.
    cfg["snip"].update(replan_every=args.replan_every, early_replan_steps=[], additional_bf16_fwd_every_n_steps=10)
    cfg["snip"]["train"] = {"max_steps": args.steps, "seed": 0, "block_size": BLOCK}
    (work / "ds_config.json").write_text(json.dumps(cfg, indent=1))
    port = str(_free_port())
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", port,
           str(Path(__file__).resolve()), "--worker", "--work", str(work), "--steps", str(args.steps),
           "--save_every", str(args.save_every)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SNIP_DS_SINGLE_PROCESS"):
        env.pop(key, None)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail = []
    for line in proc.stdout:
        if line.startswith("soak:"):
            print(line, end="", flush=True)
        tail = (tail + [line])[-40:]
    code = proc.wait()
    wall = time.perf_counter() - start
    leftover = [p.name for p in shm_buffers(os.getuid(), "127.0.0.1", port)]
    path = work / "records.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    if code != 0 or not records:
        sys.stderr.write("".join(tail))
    summary = summarize(records, args, leftover, code, wall)
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "soak.md").write_text(markdown(summary))
    print(f"soak: {'PASSED' if summary['passed'] else 'FAILED'} {json.dumps(summary['targets'])}; "
          f"results in {out / 'soak.json'} and {out / 'soak.md'}", flush=True)
    for p in shm_buffers(os.getuid(), "127.0.0.1", port):  # a failed run must not leave RAM behind
        p.unlink(missing_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    return 0 if summary["passed"] else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    p.add_argument("--replan_every", type=int, default=50, help="steps between adaptive re-plans")
    p.add_argument("--save_every", type=int, default=500, help="steps between checkpoints (0: none)")
    p.add_argument("--warmup", type=int, default=None, help="steps before memory must be flat (default 10%%)")
    p.add_argument("--results_dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = p.parse_args()
    for name in ("steps", "replan_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: must be at least 1, got {getattr(args, name)}")
    if args.save_every < 0:
        p.error(f"--save_every: must not be negative, got {args.save_every}")
    if args.warmup is None:
        args.warmup = args.steps // 10
    if args.worker:
        code = worker(args)
        # As launch/train.py's finish(): skip the interpreter teardown, where a 2-rank CPU rank aborts now
        # and then (gloo's threads, pytorch/pytorch#179291), whether it finished or failed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
