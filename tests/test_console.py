"""The console of launch/train.py, piece by piece: each re-plan's line (moves FP8->FP4 and FP4->FP8, share against
target, predicted and measured divergence, where to look), the final plan in one line, the end summary, plain
progress lines without bar fragments in a log that is not a terminal, a one-time build said before it starts."""
import io
import json
import math
import re

import pytest

from snip_ds.engine import builds
from snip_ds.runtime import console
from snip_ds.plan import Plan
from snip_ds.report.progress import Progress, console_interval
from snip_ds.report.run_report import block_map, plan_line, plan_moves, replan_line
from snip_ds.report.run_summary import emulation_note, summary_lines

KINDS = ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj")
FQNS = [f"model.layers.{b}.{k}" for b in range(3) for k in KINDS]
FLOPS = {f: 1.0 for f in FQNS}


def _plan(fp4, fp8_rest=True, **kw):
    return Plan.fixed({f: ("fp4" if f in fp4 else "fp8") for f in FQNS}, FLOPS, **kw)


def test_moves_count_each_direction_from_the_previous_plan_or_the_fp8_start():
    first = _plan(FQNS[:5])
    assert plan_moves(None, first) == {"unit": "layers", "to_fp4": 5, "to_fp8": 0, "other": 0, "total": 9}
    second = _plan(FQNS[2:8])  # 0, 1 back to FP8; 5, 6, 7 newly FP4
    assert plan_moves(first, second) == {"unit": "layers", "to_fp4": 3, "to_fp8": 2, "other": 0, "total": 9}
    bf16 = Plan.fixed({**second.assignment, FQNS[8]: "bf16"}, FLOPS)
    assert plan_moves(second, bf16)["other"] == 1
    per_gemm = Plan.fixed({f: {"fprop": "fp4", "dgrad": "fp8", "wgrad": "fp8"} for f in FQNS}, FLOPS)
    assert plan_moves(None, per_gemm) == {"unit": "GEMMs", "to_fp4": 9, "to_fp8": 0, "other": 0, "total": 27}


def _numbers(text):
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", text)]


def test_replan_line_says_moves_share_target_divergences_time_and_where_to_look():
    first, second = _plan(FQNS[:5]), _plan(FQNS[2:8])
    record = {"step": 16, "collect_s": 2.25, "solve_s": 0.5, "measure_s": 0.25, "fp4_share": 6 / 9,
              "status": "optimal"}
    line = replan_line(record, first, second, 0.75, 0.00123, 0.00456, "/runs/a")
    assert line.startswith("snip_ds: ") and "\n" not in line
    nums = _numbers(line)
    for value in (16, 3, 2, round(6 / 9, 3), 0.75, 0.00123, 0.00456, 3.0, 2.2, 0.5):
        assert any(math.isclose(value, n, rel_tol=1e-3) for n in nums), (value, line)
    assert "snip-ds show /runs/a" in line and "first" not in line
    assert re.search(r"\b3 layers FP8->FP4, 2 FP4->FP8", line)
    # the first plan counts from the uniform FP8 start; no show_dir, no pointer; a measurement missing says so
    line = replan_line({**record, "step": 0}, _plan([]), first, 0.75, 0.001, None, first=True)
    assert "first plan" in line and re.search(r"\b5 layers FP8->FP4, 0 FP4->FP8", line) and "of 9" in line
    assert "snip-ds show" not in line and "measured n/a" in line
    assert "plan unchanged" in replan_line(record, second, second, 0.75, 0.1, 0.1)
    assert "infeasible" in replan_line({**record, "status": "infeasible"}, first, second, 0.75, 0.1, 0.1)


def test_plan_line_counts_the_precisions_and_draws_each_block():
    plan = _plan([FQNS[0], FQNS[4], FQNS[5]])
    line = plan_line(plan, FLOPS)
    assert "FP4 3, FP8 6 of 9 layers" in line and "FP4 share 0.333" in line
    assert block_map(plan) == "(q k down) 0 488 | 1 844 | 2 888"
    many = {f"model.layers.{b}.{k}": "fp8" for b in range(200) for k in KINDS}
    assert block_map(Plan.fixed(many, {f: 1.0 for f in many})) is None  # too long for a line: counts only
    assert "by block" not in plan_line(Plan.fixed(many, {f: 1.0 for f in many}), {f: 1.0 for f in many})
    experts = {f"model.layers.0.mlp.experts.{e}.{k}": p for e, p in enumerate(("fp4", "fp8")) for k in ("w1", "w2")}
    moe_flops = {f: 1.0 for f in [*FQNS, *experts]}
    moe = Plan.fixed({**plan.assignment, **experts}, moe_flops)
    assert block_map(moe) is None  # (expert, projection) pairs: counts only, `snip-ds show` draws them
    line = plan_line(moe, moe_flops)
    assert line.startswith("FP4 5, FP8 8 of 13 layers") and "by block" not in line


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_log_gets_plain_progress_lines_with_the_mean_loss_and_no_bar(capsys):
    log = io.StringIO()
    p = Progress(total=25, start=0, interval=10, tokens_per_step=100, stream=log)
    assert p.bar is None
    for step in range(1, 26):
        p.step(step, loss=float(step), seconds=0.5, snip_seconds=2.5 * (step >= 10))
    p.close()
    out = capsys.readouterr().out
    assert "\r" not in out and log.getvalue() == ""  # said through console.say, on lines of their own
    lines = [line for line in out.splitlines() if line]
    assert len(lines) == 3  # steps 10, 20 and the last, 25
    assert [_numbers(line)[:3] for line in lines] == [[10, 25, 5.5], [20, 25, 15.5], [25, 25, 20.5]]
    assert "200 tokens/s" in lines[0]  # 100 tokens per step, 0.5 s a step
    assert "SNIP 50%" in lines[0] and "SNIP 20%" in lines[2]  # 2.5 s of 5 s, then of 12.5 s
    assert p.train_s == 12.5 and p.tokens == 2500 and p.mean_loss() == pytest.approx(20.5)


def test_a_terminal_gets_the_bar_and_messages_above_it(capsys):
    term = _Terminal()
    p = Progress(total=4, start=0, interval=2, tokens_per_step=10, stream=term)
    try:
        assert p.bar is not None
        p.step(1, 3.0, 1.0, 0.0)
        console.say("snip_ds: a message")
    finally:
        p.close()
    assert "train:" in term.getvalue() and "snip_ds: progress" not in capsys.readouterr().out
    quiet = Progress(total=4, start=0, interval=2, tokens_per_step=10, stream=term, show=False)
    quiet.step(2, 1.0, 1.0, 0.0)
    assert quiet.bar is None and capsys.readouterr().out == ""
    assert console_interval(1) == 10 and console_interval(25) == 25


def test_end_summary_lines_hold_the_runs_figures():
    s = {"steps": 120, "first_step": 1, "last_step": 120, "train_seconds": 150.0, "tokens_per_s": 3930.4,
         "peak_memory_bytes": [2**30, 3 * 2**29], "peak_memory_kind": "resident memory (RSS)",
         "snip_seconds": 15.0, "snip_share": 0.1, "replans": 4, "statistics_seconds": 12.5, "solve_seconds": 0.25,
         "plan_line": "FP4 30, FP8 12 of 42 layers", "checkpoint": "/o/checkpoints/step_120",
         "tensorboard": "/o/tensorboard", "output_dir": "/o", "emulation": emulation_note("cpu", {})}
    text = "\n".join(summary_lines(s))
    assert all(line.startswith("snip_ds: ") for line in text.splitlines())
    for part in ("120 steps", "3,930 tokens/s", "rank 0 1.00 GiB", "rank 1 1.50 GiB", "15.0 s", "10%",
                 "4 re-plan", "FP4 30, FP8 12 of 42 layers", "/o/checkpoints/step_120", "--logdir /o/tensorboard",
                 "snip-ds show /o", "emulated on a CPU"):
        assert part in text, part


def test_emulation_note_names_what_runs_without_fp8_fp4_hardware():
    assert "FP8 and FP4" in emulation_note("cpu", {"fp8": "torch", "fp4": "torch"})
    gpu = emulation_note("cuda", {"fp8": "torch", "fp4": "torch"}, fp8_hardware=True)
    assert "FP4 is emulated" in gpu and "FP8" not in gpu
    assert emulation_note("cuda", {"fp8": "te", "fp4": "te"}, fp8_hardware=True) is None
    assert "FP8 and FP4" in emulation_note("cuda", {"fp8": "torch", "fp4": "torch"}, fp8_hardware=False)


def test_a_build_is_said_before_it_starts_and_not_when_it_is_cached(monkeypatch, capsys):
    from snip_ds.backend import cpu as cpu_kernels

    loads = []
    monkeypatch.setattr(cpu_kernels, "load", lambda: loads.append(1) or True)
    monkeypatch.setattr(cpu_kernels, "load_seconds", lambda: None)
    monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda: None)
    monkeypatch.setattr(builds, "cpu_quantizer_built", lambda: False)
    builds.load_cpu_quantizer("cpu")
    out = capsys.readouterr().out
    assert loads == [1] and out.count("\n") == 1 and "snip_ds's CPU quantization kernels" in out
    assert builds.TYPICAL["snip_ds_cpu_quant"] in out and "launch/warm_ops.py" in out
    monkeypatch.setattr(builds, "cpu_quantizer_built", lambda: True)
    builds.load_cpu_quantizer("cpu")
    builds.load_cpu_quantizer("cuda")  # no CPU kernels on a GPU run
    assert capsys.readouterr().out == "" and loads == [1, 1]


def test_summary_json_is_plain_json():
    from snip_ds.report.run_summary import _plain

    assert json.loads(json.dumps(_plain({"train_loss": math.nan, "steps": 3}))) == {"train_loss": None, "steps": 3}
