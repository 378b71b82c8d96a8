"""The end of a ``launch/train.py`` run: a few console lines and ``<output_dir>/summary.json``.

:func:`finish` (collective: every rank's peak memory is gathered) builds the summary -- steps, tokens/s, peak
memory per rank, SNIP's own time and its share of the training time, the final plan in one line, the last
checkpoint, the TensorBoard folder -- writes it on rank 0 as ``summary.json`` (what ``launch/ab.py`` compares) and
prints it::

    snip_ds: done: 120 steps in 2m 05s (steps 1-120), 3,930 tokens/s; peak resident memory (RSS) per rank: 1.21 GiB
    snip_ds: SNIP's own time: 11.2 s, 9% of the training time (4 re-plans: statistics 9.8 s, solves 0.1 s, ...)
    snip_ds: final plan: FP4 30, FP8 12 of 42 layers, FP4 share 0.750 of the linear FLOPs; by block (q k v ...) ...
    snip_ds: checkpoint /out/checkpoints/step_120; TensorBoard: tensorboard --logdir /out/tensorboard; ...

:func:`emulation_note` says where FP8/FP4 are emulated rather than run on FP8/FP4 hardware (a CPU always).
"""
from __future__ import annotations

import json
import math
import os
import resource
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import torch

from snip_ds.runtime import distributed as sdist
from snip_ds.runtime.console import say
from snip_ds.runtime.fileio import atomic_write_text
from snip_ds.report.progress import duration
from snip_ds.report.run_report import plan_line

SUMMARY_FILE = "summary.json"


def peak_memory() -> Dict[str, Any]:
    """This rank's peak memory: on a GPU the most torch allocated on it, else the process's peak resident set."""
    if torch.cuda.is_available():
        return {"bytes": int(torch.cuda.max_memory_allocated()), "kind": "GPU memory allocated by torch"}
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"bytes": int(kib) * 1024, "kind": "resident memory (RSS)"}


def emulation_note(device_type: str, backends: Mapping[str, str], fp8_hardware: bool = False) -> Optional[str]:
    """Which of FP8 and FP4 are emulated here (quantized values multiplied by higher-precision GEMMs, so their
    speed and memory are not FP8/FP4 hardware's), or None. ``backends``: ``{"fp8": name, "fp4": name}``;
    ``fp8_hardware``: the GPU has FP8 tensor cores (compute capability >= 8.9)."""
    if device_type == "cpu":
        return ("FP8 and FP4 are emulated on a CPU (their grid values in FP32 GEMMs): losses are the formats', "
                "but tokens/s and memory are not what FP8/FP4 hardware gives")
    emulated = [p.upper() for p in ("fp8", "fp4") if backends.get(p) == "emulated"
                or (backends.get(p) == "torch" and (p == "fp4" or not fp8_hardware))]
    if not emulated:
        return None
    return (f"{' and '.join(emulated)} {'is' if len(emulated) == 1 else 'are'} emulated on this GPU (grid values in "
            f"BF16 GEMMs): tokens/s and memory are not what {'/'.join(emulated)} hardware gives")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def finish(state, *, start_step: int, progress, out_dir: Path, checkpoint: Optional[str],
           final_loss: Optional[float], emulation: Optional[str]) -> Dict[str, Any]:
    """Collective, after the last step: the run's summary (see the module's docstring); rank 0 writes
    ``summary.json`` under ``out_dir`` (a failure to write is said, not fatal) and prints it. ``state``: the
    :class:`~snip_ds.engine.state.SnipState`; ``progress``: the run's :class:`~snip_ds.report.progress.Progress`;
    ``final_loss``: the last validation loss."""
    memory = sdist.all_gather_json(peak_memory())
    planner = state.planner
    replans = [h for h in (planner.history if planner is not None else []) if h["step"] >= start_step]
    steps = state.step - start_step
    train_s = progress.train_s
    summary = {
        "steps": steps, "first_step": start_step + 1, "last_step": state.step, "train_seconds": train_s,
        "tokens_per_s": progress.tokens / train_s if train_s > 0 else None,
        "train_loss": progress.mean_loss(), "train_loss_steps": len(progress.losses),
        "validation_loss": final_loss,
        "peak_memory_bytes": [m["bytes"] for m in memory], "peak_memory_kind": memory[0]["kind"],
        "snip_seconds": state.snip_seconds, "snip_share": state.snip_seconds / train_s if train_s > 0 else None,
        "replans": len(replans), "statistics_seconds": sum(h["collect_s"] for h in replans),
        "solve_seconds": sum(h["solve_s"] for h in replans),
        "plan": state.plan.to_dict() if state.plan is not None else None,
        "plan_line": plan_line(state.plan, state.flops) if state.plan is not None else None,
        "fp4_share": state.plan_fp4_share() if state.plan is not None else None,
        "checkpoint": checkpoint, "tensorboard": str(out_dir / "tensorboard"), "output_dir": str(out_dir),
        "emulation": emulation, "world_size": sdist.world_size(),
    }
    if sdist.rank() == 0:
        for line in summary_lines(summary):
            say(line)
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(out_dir / SUMMARY_FILE, json.dumps(_plain(summary), indent=1) + "\n")
        except OSError as err:
            say(f"snip_ds: warning: {out_dir / SUMMARY_FILE} cannot be written ({err.strerror or err})")
    return summary


def _plain(summary: Mapping[str, Any]) -> Dict[str, Any]:
    """``summary`` with NaN and infinite numbers as null (JSON has none)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in summary.items()}


def summary_lines(s: Mapping[str, Any]) -> List[str]:
    """The console lines of a :func:`finish` summary."""
    mem = s["peak_memory_bytes"]
    per_rank = _gib(mem[0]) if len(mem) == 1 else ", ".join(f"rank {r} {_gib(b)}" for r, b in enumerate(mem))
    rate = "n/a" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:,.0f}"
    lines = [f"snip_ds: done: {s['steps']} steps in {duration(s['train_seconds'])} (steps {s['first_step']}-"
             f"{s['last_step']}), {rate} tokens/s; peak {s['peak_memory_kind']} per rank: {per_rank}"]
    if s["replans"] or s["snip_seconds"]:
        share = "" if s["snip_share"] is None else f", {s['snip_share']:.0%} of the training time"
        lines.append(f"snip_ds: SNIP's own time: {s['snip_seconds']:.1f} s{share} ({s['replans']} re-plan(s): "
                     f"statistics {s['statistics_seconds']:.1f} s, solves {s['solve_seconds']:.2f} s; the rest "
                     f"measures the plan's forward divergence)")
    if s["plan_line"]:
        lines.append(f"snip_ds: final plan: {s['plan_line']}")
    out = s["output_dir"]
    lines.append(f"snip_ds: checkpoint {s['checkpoint'] or 'none saved'}; TensorBoard: tensorboard --logdir "
                 f"{s['tensorboard']}; plan map: snip-ds show {out}; this summary: {os.path.join(out, SUMMARY_FILE)}")
    if s["emulation"]:
        lines.append(f"snip_ds: note: {s['emulation']}")
    return lines
