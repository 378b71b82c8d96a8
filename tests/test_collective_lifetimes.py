"""snip_ds/runtime/distributed.py's collectives keep the tensors they hand to torch.distributed referenced until
the next one: gloo's worker thread lets go of a finished collective's tensors a moment after the caller's wait
returns, and a tensor it is the last to hold is freed on that thread, which at interpreter exit cannot take the
GIL (the process aborts). One gloo rank in a plain process."""
import json
import subprocess
import sys
import textwrap

from train_utils import REPO, env

SCRIPT = textwrap.dedent("""
    import gc, json, weakref
    import torch
    import torch.distributed as dist
    from snip_ds.engine import destroy_distributed, init_distributed
    from snip_ds.runtime import distributed as sdist

    init_distributed()
    out = sdist.dist_sum(torch.ones(3, dtype=torch.float64))  # (float64 on the CPU: the buffer itself)
    total = out.tolist()
    handed = weakref.ref(out)
    del out
    gc.collect()
    kept = handed() is not None
    same = sdist.agree("text")
    gc.collect()
    freed_by_next = handed() is None
    plan = sdist.broadcast_json({"plan": [1, 2]})
    gathered = sdist.all_gather_json("mine")
    destroy_distributed()
    print(json.dumps({"total": total, "kept": kept, "freed_by_next": freed_by_next, "same": same, "plan": plan,
                      "gathered": gathered}))
""")


def test_a_collective_s_tensors_outlive_it_until_the_next_one():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"total": [1.0, 1.0, 1.0], "kept": True, "freed_by_next": True, "same": True,
                   "plan": {"plan": [1, 2]}, "gathered": ["mine"]}
