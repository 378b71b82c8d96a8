"""The sweep: every causal-LM family of the installed transformers, each in a child process of its own.

The parent imports torch, transformers (the Trainer included) and snip_ds once, then forks one child per
family (``--jobs`` at a time), so that a child pays only for its own model's module. A child builds the
family's tiny model (:mod:`snip_ds.families.build`), runs the plain step, looks for experts by structure
(:mod:`snip_ds.families.structure`), runs every plan through the Trainer (:mod:`snip_ds.families.probe`) and
sends back its row (a JSON-able dict); its stdout and stderr go to a log file, whose tail the row of a child
that timed out or died keeps. A child that outlives the timeout is killed (the row says so); one that dies without a row
(a signal, an abort in native code) becomes a row too. Nothing a family does can stop the sweep.
"""
from __future__ import annotations

import multiprocessing
import os
import resource
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from snip_ds.families.probe import PLANS

DEFAULT_TIMEOUT = 120.0  # seconds per family (all its plans)
_LOG_TAIL = 2000


def causal_lm_families() -> Dict[str, str]:
    """``{model type: causal-LM class name}`` of the installed transformers, sorted by model type, each followed
    by its variants (:data:`snip_ds.families.overrides.VARIANTS`, ``<model type>:<variant>``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from snip_ds.families.overrides import VARIANTS, base_type

    names = dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    names.update({v: names[base_type(v)] for v in VARIANTS if base_type(v) in names})
    return dict(sorted(names.items(), key=lambda kv: (base_type(kv[0]), kv[0])))


def _warm_imports() -> None:
    """What every child would import: imported once in the parent (no torch operation runs here, so the
    forked children start with no thread pool of the parent's)."""
    import datasets  # noqa: F401  (the Trainer imports it)
    import transformers
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments  # noqa: F401
    import transformers.trainer  # noqa: F401

    import snip_ds.engine.adaptive  # noqa: F401
    import snip_ds.families.build  # noqa: F401
    import snip_ds.families.structure  # noqa: F401
    import snip_ds.hf  # noqa: F401
    import snip_ds.planner  # noqa: F401
    import snip_ds.stats  # noqa: F401
    import snip_ds.swap  # noqa: F401

    transformers.logging.set_verbosity_error()


def survey_family(model_type: str, plans: Sequence[str] = PLANS) -> dict:
    """The row of one family, computed in this process (the child's work; never raises)."""
    from snip_ds.families.build import build_tiny, plain_step
    from snip_ds.families.overrides import reasons
    from snip_ds.families.probe import first_line, frames_of, probe_family
    from snip_ds.families.structure import find_experts

    row: dict = {"model_type": model_type, "class": causal_lm_families().get(model_type, ""), "buildable": False}
    if reasons(model_type):
        row["override"] = reasons(model_type)
    start = time.perf_counter()
    try:
        tiny = build_tiny(model_type)
        row["class"] = tiny.class_name
        row["parameters"] = tiny.parameters()
        row["layers_kept"] = tiny.tiny.kept_layers
        row["plain_loss"] = plain_step(tiny)
        row["buildable"] = True
    except Exception as err:
        row["build_error"] = first_line(err)
        row["build_where"] = frames_of(err)[0]
        row["seconds"] = round(time.perf_counter() - start, 2)
        return row
    experts = find_experts(tiny.model)
    row["moe"] = bool(experts)
    row["experts_modules"] = [{"path": e.path, "layout": e.layout, "experts": e.experts} for e in experts]
    row["plans"] = {o.plan: o.to_dict() for o in probe_family(tiny, plans)}
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def _child(model_type: str, plans: Sequence[str], conn, log_path: str, threads: int) -> None:
    """A child process: one family, its output to ``log_path``, its row through ``conn``."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import torch

    torch.set_num_threads(threads)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    row = survey_family(model_type, plans)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    row["peak_rss_mb"] = round(peak / 1024, 1)
    row["rss_growth_mb"] = round((peak - base) / 1024, 1)
    conn.send(row)
    conn.close()
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown in a forked child


def _log_tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _LOG_TAIL))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


@dataclass
class _Running:
    model_type: str
    process: multiprocessing.Process
    conn: object
    log: str
    started: float


def sweep(model_types: Sequence[str], plans: Sequence[str] = PLANS, timeout: float = DEFAULT_TIMEOUT,
          jobs: int = 1, threads: int = 1, progress: Optional[Callable[[int, int, dict], None]] = None
          ) -> List[dict]:
    """The rows of ``model_types`` (in that order), ``jobs`` families at a time, each child with ``threads``
    torch threads and at most ``timeout`` seconds."""
    _warm_imports()
    context = multiprocessing.get_context("fork")
    pending = list(model_types)
    running: List[_Running] = []
    rows: Dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="snip_families_logs_") as logs:
        while pending or running:
            while pending and len(running) < jobs:
                model_type = pending.pop(0)
                receive, send = context.Pipe(duplex=False)
                log = os.path.join(logs, f"{len(rows) + len(running)}.log")
                proc = context.Process(target=_child, args=(model_type, plans, send, log, threads), daemon=True)
                proc.start()
                send.close()
                running.append(_Running(model_type, proc, receive, log, time.monotonic()))
            time.sleep(0.05)
            for job in list(running):
                row = _finished(job, timeout)
                if row is None:
                    continue
                running.remove(job)
                rows[job.model_type] = row
                if progress is not None:
                    progress(len(rows), len(model_types), row)
    return [rows[m] for m in model_types]


def _finished(job: _Running, timeout: float) -> Optional[dict]:
    """The job's row once it is done (sent, died or timed out), else None."""
    elapsed = time.monotonic() - job.started
    if job.conn.poll():
        try:
            row = job.conn.recv()
        except EOFError:  # closed without a row: it died
            row = None
        job.process.join(10)
        if job.process.is_alive():
            job.process.kill()
            job.process.join()
        if row is not None:
            return row
        return _died(job, elapsed)
    if not job.process.is_alive():
        job.process.join()
        return _died(job, elapsed)
    if elapsed > timeout:
        job.process.kill()
        job.process.join()
        return {"model_type": job.model_type, "class": causal_lm_families().get(job.model_type, ""),
                "timed_out": True, "seconds": round(elapsed, 1), "error": f"timed out after {timeout:g} s",
                "log_tail": _log_tail(job.log)}
    return None


def _died(job: _Running, elapsed: float) -> dict:
    code = job.process.exitcode
    how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    return {"model_type": job.model_type, "class": causal_lm_families().get(job.model_type, ""), "died": True,
            "seconds": round(elapsed, 1), "error": f"the child process died ({how}) without a row",
            "log_tail": _log_tail(job.log)}


__all__ = ["DEFAULT_TIMEOUT", "causal_lm_families", "survey_family", "sweep"]
