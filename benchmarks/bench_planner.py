"""Planner solve time on Llama layer shapes (target: a 70B model solves in well under 1 s) and on a
DeepSeek-V3-shaped Mixture-of-Experts layer list (~30k layers; target: within 0.1 % of the optimum in <= 10 s).

Run from the repository root:

    python benchmarks/bench_planner.py                 # writes benchmarks/results/bench_planner.{json,md}
    python benchmarks/bench_planner.py --repeats 3 --no-write

Costs are seeded uniform random positive numbers (solve time depends on the instance's size and structure,
not on where the costs came from); FLOPs are the real per-layer shares F = 6·T·k·n of each model. The
target FP4 share is ρ = 0.75. Each configuration is solved once to warm up, then ``--repeats`` times with
different cost seeds; the table reports the median and the maximum wall time of ``solve_plan``.

The MoE list follows DeepSeek-V3's shapes: 61 blocks of MLA attention (q_a, q_b, kv_a, kv_b, o), the first 3
with a dense MLP, the other 58 with one shared expert and 256 routed experts (fused gate_up and down each),
every expert's FLOPs from the tokens routed to it (T tokens, top-8, a seeded skewed routing in which some
experts get none). Its rows also report the plan's distance above the LP relaxation's optimum (computed
here, independently of CBC, as a fractional knapsack), an upper bound on its distance from the optimum.

For the MoE plan it also reports what a re-plan ships: the size of its ``plan.json`` (``Plan.save``, as the
engine writes it) and of the payload the engine broadcasts (``{"plan": Plan.to_dict()}`` as
``snip_ds.runtime.distributed.broadcast_json`` encodes it), and the time of that broadcast from rank 0 to rank 1 of 2
gloo processes on this machine, with ``Plan.from_dict`` on the receiving side, as the engine's re-plan does
(``--transfer-repeats`` broadcasts after one warm-up, each after a barrier; rank 1's wall time).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from snip_ds.plan import GEMMS, Plan  # noqa: E402
from snip_ds.planner import SolverSettings, solve_plan  # noqa: E402

TOKENS_PER_STEP = 4096  # T; the FP4 share does not depend on it
RHO = 0.75
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


@dataclass(frozen=True)
class LlamaShape:
    """Decoder-block linear shapes of a Llama model."""

    name: str
    blocks: int
    hidden: int
    intermediate: int
    kv_dim: int  # output width of k_proj / v_proj (kv heads × head dim)

    def layer_flops(self) -> dict[str, float]:
        """fqn -> 6·T·k·n FLOPs per step (fprop + dgrad + wgrad)."""
        h, i, kv = self.hidden, self.intermediate, self.kv_dim
        dims = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
                "self_attn.o_proj": (h, h), "mlp.gate_proj": (h, i), "mlp.up_proj": (h, i),
                "mlp.down_proj": (i, h)}
        return {f"model.layers.{b}.{name}": 6.0 * TOKENS_PER_STEP * k * n
                for b in range(self.blocks) for name, (k, n) in dims.items()}


SHAPES = (
    LlamaShape("TinyLlama-1.1B", 22, 2048, 5632, 256),
    LlamaShape("Llama-2-7B", 32, 4096, 11008, 4096),
    LlamaShape("Llama-2-70B", 80, 8192, 28672, 1024),
)
@dataclass(frozen=True)
class MoEShape:
    """DeepSeek-V3-shaped decoder: MLA attention, dense first blocks, shared + routed experts."""

    name: str = "DeepSeek-V3-shaped MoE"
    blocks: int = 61
    dense_blocks: int = 3
    hidden: int = 7168
    dense_intermediate: int = 18432
    expert_intermediate: int = 2048
    experts: int = 256
    top_k: int = 8

    def layer_flops(self, seed: int = 0) -> dict[str, float]:
        """fqn -> 6·T·k·n FLOPs per step, an expert's T being the tokens routed to it."""
        rng = random.Random(seed)
        h, t = self.hidden, TOKENS_PER_STEP
        attention = {"q_a_proj": (h, 1536), "q_b_proj": (1536, 128 * 192), "kv_a_proj_with_mqa": (h, 576),
                     "kv_b_proj": (512, 128 * 256), "o_proj": (128 * 128, h)}
        flops = {}
        for b in range(self.blocks):
            for name, (k, n) in attention.items():
                flops[f"model.layers.{b}.self_attn.{name}"] = 6.0 * t * k * n
            if b < self.dense_blocks:
                i = self.dense_intermediate
                for name, (k, n) in {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}.items():
                    flops[f"model.layers.{b}.mlp.{name}"] = 6.0 * t * k * n
                continue
            i = self.expert_intermediate
            flops[f"model.layers.{b}.mlp.shared_experts.gate_up_proj"] = 6.0 * t * h * 2 * i
            flops[f"model.layers.{b}.mlp.shared_experts.down_proj"] = 6.0 * t * i * h
            popularity = [rng.paretovariate(1.5) for _ in range(self.experts)]
            for e in rng.sample(range(self.experts), self.experts // 16):
                popularity[e] = 0.0  # experts this step routed nothing to
            total = sum(popularity)
            routed = [round(t * self.top_k * p / total) for p in popularity]
            for e in range(self.experts):
                flops[f"model.layers.{b}.mlp.experts.{e}.gate_up_proj"] = 6.0 * routed[e] * h * 2 * i
                flops[f"model.layers.{b}.mlp.experts.{e}.down_proj"] = 6.0 * routed[e] * i * h
        return flops


def lp_bound_regret(costs, flops, target) -> float:
    """The LP relaxation's optimum of a per-layer fp8/fp4 instance, as regret above each layer's cheaper
    precision: a fractional knapsack filled by cost per FLOP (a lower bound on the integer optimum)."""
    total = sum(flops.values())
    share, bound, rest = 0.0, 0.0, []
    for f, c in costs.items():
        delta, w = c["fp4"] - c["fp8"], flops[f] / total
        if delta <= 0:
            share += w
        elif w > 0:
            rest.append((delta / w, delta, w))
    for _, delta, w in sorted(rest):
        if share >= target:
            break
        take = min(1.0, (target - share) / w)
        bound, share = bound + take * delta, share + take * w
    return bound


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _broadcast_worker(rank: int, world: int, port: int, plan_dict: dict, repeats: int, out: str) -> None:
    """One of ``world`` gloo ranks: rank 0 broadcasts ``plan_dict`` as the engine does (``to_dict`` of its plan,
    ``broadcast_json``), every other rank receives it and rebuilds the plan (``Plan.from_dict``); ranks 0 and 1
    write their times to ``out.<rank>``."""
    import torch
    import torch.distributed as dist

    from snip_ds.runtime import distributed as sdist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        plan = Plan.from_dict(plan_dict) if rank == 0 else None
        times = {"to_dict": [], "broadcast_json": [], "from_dict": [], "total": []}
        for i in range(repeats + 1):  # the first: warm-up
            dist.barrier()
            start = time.perf_counter()
            payload = {"plan": plan.to_dict()} if rank == 0 else None
            encoded = time.perf_counter()
            payload = sdist.broadcast_json(payload)
            received = time.perf_counter()
            got = Plan.from_dict(payload["plan"], source="broadcast plan")
            done = time.perf_counter()
            if rank != 0 and got.digest() != Plan.from_dict(plan_dict).digest():
                raise AssertionError(f"rank {rank} received another plan")
            if i:
                times["to_dict"].append(encoded - start)
                times["broadcast_json"].append(received - encoded)
                times["from_dict"].append(done - received)
                times["total"].append(done - start)
        dist.barrier()
        if rank <= 1:
            with open(f"{out}.{rank}", "w", encoding="utf-8") as f:
                json.dump(times, f)
    finally:
        dist.destroy_process_group()


def plan_transfer(plan: Plan, repeats: int, world: int = 2) -> dict:
    """``plan``'s plan.json size, the broadcast payload's size, and the median/max time of broadcasting it from
    rank 0 (to_dict + broadcast_json) and rebuilding it on rank 1 (from_dict), over ``world`` gloo processes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plan.json")
        plan.save(path)
        file_bytes = os.path.getsize(path)
        out = os.path.join(tmp, "times.json")
        mp.spawn(_broadcast_worker, args=(world, _free_port(), plan.to_dict(), repeats, out), nprocs=world)
        with open(f"{out}.0", encoding="utf-8") as f:
            sender = json.load(f)
        with open(f"{out}.1", encoding="utf-8") as f:
            times = json.load(f)  # the receiver's: its total runs from the barrier to its rebuilt plan
        times["to_dict"] = sender["to_dict"]  # the sender's encoding (the receiver has none)
    payload_bytes = len(json.dumps({"plan": plan.to_dict()}, sort_keys=True).encode())  # as broadcast_json
    return {"plan_json_bytes": file_bytes, "broadcast_bytes": payload_bytes, "ranks": world, "backend": "gloo",
            "repeats": repeats, "median_s": {k: statistics.median(v) for k, v in times.items()},
            "max_s": {k: max(v) for k, v in times.items()}}


def bench_moe(shape: MoEShape, repeats: int, transfer_repeats: int = 0) -> dict:
    flops = shape.layer_flops()
    fqns = sorted(flops)
    allowed = ("fp8", "fp4")
    solve_plan(random_costs(fqns, allowed, False, -1), flops, RHO, SolverSettings(allowed=allowed))
    times, statuses, shares, gaps = [], set(), [], []
    for seed in range(repeats):
        costs = random_costs(fqns, allowed, False, seed)
        start = time.perf_counter()
        plan = solve_plan(costs, flops, RHO, SolverSettings(allowed=allowed))
        times.append(time.perf_counter() - start)
        statuses.add(plan.status)
        shares.append(plan.fp4_share)
        regret = sum(costs[f][p] - min(costs[f].values()) for f, p in plan.assignment.items())
        gaps.append((regret - lp_bound_regret(costs, flops, RHO)) / regret)
    transfer = plan_transfer(plan, transfer_repeats) if transfer_repeats else None
    return {"transfer": transfer, "model": shape.name, "layers": len(fqns), "decision_units": len(fqns), "naive_binaries": len(fqns),
            "zero_flop_layers": sum(1 for f in flops.values() if f == 0), "median_s": statistics.median(times),
            "max_s": max(times), "repeats": repeats, "statuses": sorted(statuses), "min_fp4_share": min(shares),
            "mip_gap": plan.meta.get("mip_gap"), "max_gap_above_lp_bound": max(gaps)}


CONFIGS = (
    ("per-layer fp8/fp4", ("fp8", "fp4"), False),
    ("per-layer bf16/fp8/fp4", ("bf16", "fp8", "fp4"), False),
    ("per-GEMM fp8/fp4", ("fp8", "fp4"), True),
    ("per-GEMM bf16/fp8/fp4", ("bf16", "fp8", "fp4"), True),
)


def random_costs(fqns, allowed, per_gemm, seed):
    """Seeded uniform random positive costs in the planner's key scheme."""
    rng = random.Random(seed)
    if per_gemm:
        return {f: {p: {g: rng.uniform(1e-6, 1.0) for g in GEMMS} for p in allowed} for f in fqns}
    return {f: {p: rng.uniform(1e-6, 1.0) for p in allowed} for f in fqns}


def bench(shape: LlamaShape, allowed, per_gemm, repeats: int) -> dict:
    flops = shape.layer_flops()
    fqns = sorted(flops)
    solve_plan(random_costs(fqns, allowed, per_gemm, -1), flops, RHO, SolverSettings(allowed=allowed),
               per_gemm=per_gemm)
    times, statuses, shares = [], set(), []
    for seed in range(repeats):
        costs = random_costs(fqns, allowed, per_gemm, seed)
        start = time.perf_counter()
        plan = solve_plan(costs, flops, RHO, SolverSettings(allowed=allowed), per_gemm=per_gemm)
        times.append(time.perf_counter() - start)
        statuses.add(plan.status)
        shares.append(plan.fp4_share)
    units = len(fqns) * (len(GEMMS) if per_gemm else 1)
    return {"model": shape.name, "layers": len(fqns), "decision_units": units,
            "naive_binaries": units * (1 if len(allowed) == 2 else len(allowed)),
            "median_s": statistics.median(times), "max_s": max(times), "repeats": repeats,
            "statuses": sorted(statuses), "min_fp4_share": min(shares)}


def to_markdown(rows, env) -> str:
    lines = [
        "# Planner solve time (benchmarks/bench_planner.py)",
        "",
        f"Machine: {env['machine']}, {env['cpus']} CPUs, Python {env['python']}, mip {env['mip']} (CBC, 1 thread); "
        f"run started {env['started_utc']} UTC.",
        f"Target FP4 share ρ = {RHO}; random positive costs; {rows[0]['repeats']} cost seeds per row after one "
        "warm-up solve. Times are wall time of `solve_plan` (model build + CBC + plan object). The planner",
        "groups units of equal FLOPs into integer counts (exact), so the model CBC sees is far smaller than",
        "the naive 0/1 count in the table; without a compute budget 3 precisions reduce exactly to 2.",
        f"The machine was shared with other jobs (2 cores, 1-minute load average {env['load_start']:.1f} at the "
        f"start, {env['load_end']:.1f} at the end), so times are upper bounds.",
        "",
        "| model | decisions | layers | units | 0/1 vars if naive | median (s) | max (s) | status | min share |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['model']} | {r['config']} | {r['layers']} | {r['decision_units']} | {r['naive_binaries']} | "
                     f"{r['median_s']:.3f} | {r['max_s']:.3f} | {', '.join(r['statuses'])} | "
                     f"{r['min_fp4_share']:.4f} |")
    moe = [r for r in rows if "max_gap_above_lp_bound" in r]
    if moe:
        lines += ["", "Mixture-of-Experts rows: CBC's relative gap for instances of this size, and the plan's largest "
                  "distance above the LP relaxation's optimum (so at most that far above the optimum):", "",
                  "| model | layers | of them with 0 FLOPs | CBC gap | max distance above the LP bound |",
                  "|---|---:|---:|---:|---:|"]
        for r in moe:
            lines.append(f"| {r['model']} | {r['layers']} | {r['zero_flop_layers']} | {r['mip_gap']} | "
                         f"{100 * r['max_gap_above_lp_bound']:.4f} % |")
        moved = [r for r in moe if r.get("transfer")]
        if moved:
            lines += ["", "What a re-plan of that size ships: its `plan.json` (`Plan.save`, as the engine writes it), "
                      "the payload the engine broadcasts (`{\"plan\": Plan.to_dict()}` as "
                      "`snip_ds.runtime.distributed.broadcast_json` encodes it), and the time from rank 0's `to_dict` to "
                      "rank 1's `Plan.from_dict` of the received plan, over 2 gloo processes on this machine "
                      "(rank 1's wall time after a barrier; median and max over the repeats after one warm-up):",
                      "",
                      "| model | plan.json | broadcast payload | to_dict (rank 0) | broadcast_json | from_dict (rank 1) "
                      "| total, median | total, max |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|"]
            for r in moved:
                t = r["transfer"]
                m = t["median_s"]
                lines.append(f"| {r['model']} | {t['plan_json_bytes'] / 2**20:.2f} MiB | "
                             f"{t['broadcast_bytes'] / 2**20:.2f} MiB | {1000 * m['to_dict']:.0f} ms | "
                             f"{1000 * m['broadcast_json']:.0f} ms | {1000 * m['from_dict']:.0f} ms | "
                             f"{1000 * m['total']:.0f} ms | {1000 * t['max_s']['total']:.0f} ms |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--transfer-repeats", type=int, default=5,
                        help="broadcasts of the MoE plan over 2 gloo processes (0: not measured)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    env = {"machine": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
           "mip": metadata.version("mip"), "load_start": os.getloadavg()[0],
           "started_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    rows = []
    row = {"config": "per-layer fp8/fp4", **bench_moe(MoEShape(), args.repeats, args.transfer_repeats)}
    print(f"{row['model']:<15} per-layer fp8/fp4  layers {row['layers']:>5}  median {row['median_s']:.3f}s  "
          f"max {row['max_s']:.3f}s  {','.join(row['statuses'])}  {100 * row['max_gap_above_lp_bound']:.4f} % "
          f"above the LP bound", flush=True)
    if row["transfer"]:
        t = row["transfer"]
        print(f"  plan.json {t['plan_json_bytes']} B, broadcast {t['broadcast_bytes']} B, to_dict + broadcast_json "
              f"+ from_dict median {t['median_s']['total']:.3f}s max {t['max_s']['total']:.3f}s", flush=True)
    moe_row = row
    for shape in SHAPES:
        for config, allowed, per_gemm in CONFIGS:
            row = {"config": config, **bench(shape, allowed, per_gemm, args.repeats)}
            rows.append(row)
            print(f"{row['model']:<15} {config:<24} units {row['decision_units']:>5}  "
                  f"median {row['median_s']:.3f}s  max {row['max_s']:.3f}s  {','.join(row['statuses'])}",
                  flush=True)
    rows.append(moe_row)
    env["load_end"] = os.getloadavg()[0]
    md = to_markdown(rows, env)
    print()
    print(md)
    if not args.no_write:
        os.makedirs(RESULTS, exist_ok=True)
        with open(os.path.join(RESULTS, "bench_planner.json"), "w", encoding="utf-8") as f:
            json.dump({"rho": RHO, "tokens_per_step": TOKENS_PER_STEP, "env": env, "rows": rows}, f, indent=1)
            f.write("\n")
        with open(os.path.join(RESULTS, "bench_planner.md"), "w", encoding="utf-8") as f:
            f.write(md)


if __name__ == "__main__":
    main()
