"""One rank of a 2-process gloo job exercising snip_ds.runtime.distributed.agree and broadcast_json.

Started twice by tests/test_user_inputs.py as a plain ``python`` process with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set (no launcher). Every collective is called on both ranks in the same order; the results, as each
rank saw them, go to ``<out>/rank<R>.json``.
"""
import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from snip_ds.runtime import distributed as sdist  # noqa: E402
from snip_ds.plan import Plan  # noqa: E402

FQNS = [f"model.layers.{i}.{m}" for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]

# What rank 0 broadcasts: nested, non-ASCII, floats that must survive exactly, and a payload far larger than
# any fixed-size buffer (so the size is really sent first).
RANK0_OBJECT = {"plan": {f: ("fp4" if i % 3 else "fp8") for i, f in enumerate(FQNS)},
                "note": "Präzision – 精度 ✓", "values": [0.1, 1e-300, -2.5, 12345678901234567],
                "nested": {"a": [None, True, False, {"b": []}]}, "blob": "x" * 200_000}
RANK1_OBJECT = {"from": "rank 1"}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    # env:// from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; a rank that fails must not leave the other waiting
    # for gloo's default 30 minutes.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = sdist.rank(), sdist.world_size()

    base = Plan.fixed({f: "fp8" for f in FQNS})
    flipped = Plan.fixed({**{f: "fp8" for f in FQNS}, FQNS[5]: "fp4"})  # one layer differs
    # The same plan built independently on each rank, in a different key order: same digest.
    order = FQNS if rank == 0 else list(reversed(FQNS))
    rebuilt = Plan.fixed({f: "fp8" for f in order})
    results = {
        "rank": rank, "world": world,
        "same_text": sdist.agree("the same digest"),
        "different_text": sdist.agree(f"digest of rank {rank}"),
        "same_plan": sdist.agree(base.digest()),
        "same_plan_rebuilt": sdist.agree(rebuilt.digest()),
        "one_layer_differs": sdist.agree(base.digest() if rank == 0 else flipped.digest()),
        "differs_on_rank0_only": sdist.agree(flipped.digest() if rank == 0 else base.digest()),
        "bcast_from_0": sdist.broadcast_json(RANK0_OBJECT if rank == 0 else RANK1_OBJECT, src=0),
        "bcast_from_1": sdist.broadcast_json({"sender": rank, "ok": [1, 2, 3]}, src=1),
        "bcast_empty": sdist.broadcast_json({} if rank == 0 else {"not": "empty"}, src=0),
        "bcast_plan": sdist.broadcast_json(flipped.to_dict() if rank == 0 else None, src=0),
    }
    # A group whose rank 0 is global rank 1: ``src`` counts within the group.
    solo = dist.new_group([1])  # collective: every rank creates it, only rank 1 is in it
    if rank == 1:
        results["bcast_subgroup"] = sdist.broadcast_json({"within": "group"}, src=0, group=solo)
        results["agree_subgroup"] = sdist.agree("alone", group=solo)
    # The plan a rank receives is the sender's plan: the digests now agree.
    received = Plan.from_dict(results["bcast_plan"])
    results["received_plan_digest"] = received.digest()
    results["agree_after_broadcast"] = sdist.agree(received.digest())
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as launch/train.py's finish(): skip the interpreter teardown (gloo's threads may abort it)
