"""What a training step costs the host outside the linears: the non-finite guard checks each gradient with one
launch and reads nothing until the update, where the whole step's check is one read; it still names the first
non-finite loss or gradient as before. And benchmarks/bench_step_host.py's short run: the engine's own reads are
per step, not per micro-batch nor per parameter (counts, not times)."""
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from snip_ds.backend.dispatch_audit import HostReads, OpCounter
from snip_ds.engine.nonfinite import NonFiniteGuard, max_abs
from train_utils import REPO

NAN = float("nan")


class _Poison(torch.autograd.Function):
    """The identity forward; its backward multiplies the gradient by ``factor`` (NaN: the layers before it get
    non-finite gradients while the loss stays finite)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 1)

    def forward(self, x, grad_factor=1.0):
        return self.second(_Poison.apply(self.first(x), grad_factor)).sum()


def _micro_batch(guard, net, index, x, grad_factor=1.0, loss_show=True):
    guard.arm()
    loss = net(x, grad_factor)
    loss.backward()
    guard.note(index if loss_show else None, loss if loss_show else None, guard.disarm())
    return loss


def _scalar_reads(reads) -> int:
    """Reads of a value (each once: the operator level's; the Python level names the same read again)."""
    return sum(1 for r in reads.reads if not r.what.startswith("Tensor."))


def test_max_abs_is_finite_exactly_when_every_element_is():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for value in (NAN, float("inf"), -float("inf"), 3.0e4):
            for pos in (0, 17, 4095):
                x = torch.randn(64, 64).to(dtype)
                x.view(-1)[pos] = value
                assert bool(torch.isfinite(max_abs(x))) == bool(torch.isfinite(x).all()), (dtype, value, pos)
    g = torch.randn(8, 8)
    with OpCounter() as counter:
        max_abs(g)
    assert counter.counts.launches == 1


def test_the_guard_launches_once_per_gradient_and_reads_once_per_step():
    net = _Net()
    x = torch.randn(3, 4)
    with OpCounter() as bare:
        net(x).backward()
    net.zero_grad(set_to_none=True)
    guard = NonFiniteGuard(None, net)
    guard.begin_step()
    with OpCounter() as guarded:
        guard.arm()
        net(x).backward()
        flags = guard.disarm()
    assert guarded.counts.launches - bare.counts.launches == 4  # one per parameter
    guard.note(0, net(x), flags)
    with HostReads() as reads:
        for i in (1, 2):
            _micro_batch(guard, net, i, x)
    assert _scalar_reads(reads) == 0  # nothing is read per micro-batch
    with HostReads() as reads:
        assert guard.agree() is False
    assert _scalar_reads(reads) == 1 and guard.bad is None


def test_the_guard_names_the_first_micro_batch_and_in_it_the_loss_or_else_the_first_parameter():
    net = _Net()
    x = torch.randn(3, 4)
    guard = NonFiniteGuard(None, net)
    first = ("gradient (of first.weight, the first such parameter in model order; the loss was finite)")

    guard.begin_step()
    _micro_batch(guard, net, 0, x)
    _micro_batch(guard, net, 1, x, grad_factor=NAN)  # first.* non-finite, second.* finite, the loss finite
    _micro_batch(guard, net, 2, x * NAN)
    assert guard.agree() is True
    assert guard.bad == {"micro_batch": 1, "what": first}

    guard.begin_step()
    _micro_batch(guard, net, 0, x * NAN, grad_factor=NAN)  # the loss before the gradients
    assert guard.agree() is True and guard.bad == {"micro_batch": 0, "what": "loss (nan)"}

    guard.begin_step()  # a loop that does not show the loss (the Trainer's): the step's gradients together
    guard.arm()
    net(x).backward()
    net(x, float("inf")).backward()
    guard.note(None, None, guard.disarm())
    assert guard.agree() is True
    assert guard.bad == {"micro_batch": None, "what": "gradient (of first.weight, the first such parameter in "
                                                      "model order; the loop does not show SNIP the loss)"}

    guard.begin_step()
    _micro_batch(guard, net, 0, x)
    assert guard.agree() is False and guard.bad is None


def _ours(where: str) -> bool:
    return any(f in where for f in ("engine/core.py", "engine/nonfinite.py", "engine/state.py"))


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("step_host")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_step_host.py"), "--stages", "0",
                           "--plans", "bf16", "fp8", "--steps", "1", "--warmup", "1", "--output_dir", str(out)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((out / "bench_step_host.json").read_text()), (out / "bench_step_host.md").read_text()


def test_a_step_reads_the_host_per_step_only_where_the_benchmark_says(bench):
    """The engine's own reads and moves to the CPU (train_step, the guard): as many at 2 micro-batches as at 1,
    two reads (the agreed flag, the mean loss) and five moves: the losses once, and two ``.to`` in each of the two
    all-reduces (the agreed flag's, the mean loss's; on a GPU the flag's stay on the device, the mean's goes there
    and back); the guard launches one kernel per parameter per micro-batch, and a few per step."""
    res, text = bench
    assert res["ga"] == 2 and {r["plan"] for r in res["rows"]} == {"bf16", "fp8"}
    for r in res["rows"]:
        ours = {s: n for s, n in r["read_sites"].items() if s.startswith("Tensor.") and _ours(s)}
        ours1 = {s: n for s, n in r["reads_ga1"]["read_sites"].items() if s.startswith("Tensor.") and _ours(s)}
        assert sum(ours.values()) == sum(ours1.values()) == 2, ours
        moves = {s: n for s, n in r["move_sites"].items() if _ours(s)}
        moves1 = {s: n for s, n in r["reads_ga1"]["move_sites"].items() if _ours(s)}
        assert sum(moves.values()) == sum(moves1.values()) == 5, moves
        guard, guard1 = r["by_source"]["guard"], r["by_source_ga1"]["guard"]
        assert guard - guard1 == r["parameters"], (guard, guard1)  # one launch per parameter per micro-batch
        assert guard1 - r["parameters"] <= 12  # and a few per step
        assert r["by_source"]["linear"] > 0 and r["step_us"] > 0
    fp8 = next(r for r in res["rows"] if r["plan"] == "fp8")
    assert fp8["triton"] > 0 and fp8["top_ops"]["linear"].get("aten::_scaled_mm") == 3 * fp8["linears"] * 2
    assert res["commit"] in text and "| 0 | fp8 |" in text
