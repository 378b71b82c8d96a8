"""One family through snip_ds's public path, as a user runs it, with every claim checked.

For each plan (``bf16``, ``fp8``, ``fp4``: a fixed plan, one optimizer step; ``adaptive``: a statistics
collection, an ILP solve and one step), a copy of the family's tiny model is trained by a Hugging Face
``Trainer`` (no DeepSpeed, CPU, FP32 weights, AdamW) to which :func:`snip_ds.hf.add_snip` was added with the
plan's settings, on random token ids made in memory. A :class:`_StepWatch` callback, added after snip_ds's, sees
the training step itself (after snip_ds's ``on_step_begin`` has collected and solved) and checks:

* every planned layer (:func:`snip_ds.swap.model_layers` after the swap) ran, and at a quantized precision
  under a quantized plan: a :class:`~snip_ds.linear.SnipLinear` by its forward calls during the step (a forward
  hook reading its precision at the call); an MoE (expert, projection) pair by its expert's routed tokens
  (:func:`snip_ds.experts.model.take_routed_tokens`, taken at the step's start and end) and its precision;
* the step's loss is finite (the Trainer's ``training_loss``);
* for the adaptive plan, that a plan was solved before the step: the ``plan/fp4_share`` and
  ``snip/solve_time_s`` that snip_ds logs through ``Trainer.log`` (``trainer.state.log_history``), and the
  planner's history (its status).

An exception becomes an :class:`Outcome`: a **refusal** when snip_ds raised it itself (the innermost frame in
snip_ds, a ``ValueError``/``RuntimeError``/``NotImplementedError`` with a one-line message) before the training
step began; anything else is a **crash**, recorded with its last frame.
"""
from __future__ import annotations

import copy
import math
import os
import tempfile
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence


PLANS = ("bf16", "fp8", "fp4", "adaptive")

# the adaptive run: one collection and one solve before step 1, nothing else (no measurement passes)
ADAPTIVE = {"plan": "adaptive", "replan_every": 1000, "early_replan_steps": [],
            "additional_bf16_fwd_every_n_steps": 0, "collect_batches": 1, "num_probes": 1, "solver_time_limit": 5}

_SNIP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the snip_ds package
_REFUSALS = (ValueError, RuntimeError, NotImplementedError)


def settings_for(plan: str) -> Dict[str, Any]:
    """The ``"snip"`` settings of one plan of the survey."""
    return dict(ADAPTIVE) if plan == "adaptive" else {"plan": plan}


@dataclass
class Outcome:
    """What one plan's run did."""

    plan: str
    result: str = "ok"  # ok, refused, crash, nonfinite
    error: str = ""  # the exception's type and first line
    where: str = ""  # its innermost frame (file:line function)
    snip_frame: str = ""  # the innermost frame inside snip_ds
    stage: str = ""  # setup (Trainer + add_snip), train (before the step), step (in the step)
    loss: Optional[float] = None
    quantized_linears: int = 0  # planned SnipLinear layers
    expert_pairs: int = 0  # planned (expert, projection) pairs
    unrun: List[str] = field(default_factory=list)  # planned layers that did not run (quantized, where planned so)
    left_out: List[str] = field(default_factory=list)  # layers snip_ds found never run and left out of the share
    fp4_share: Optional[float] = None  # adaptive: the solved plan's share
    plan_status: str = ""  # adaptive: the solve's status
    seconds: float = 0.0

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _quantized(precision) -> bool:
    if isinstance(precision, str):
        return precision != "bf16"
    return any(v != "bf16" for v in dict(precision).values())


def _short(path: str) -> str:
    path = os.path.abspath(path)
    if path.startswith(_SNIP_DIR + os.sep):
        return os.path.relpath(path, os.path.dirname(_SNIP_DIR))
    return path.split("site-packages/")[-1] if "site-packages/" in path else os.path.basename(path)


def _in_snip(path: str) -> bool:
    path = os.path.abspath(path)
    return path.startswith(_SNIP_DIR + os.sep) and not path.startswith(os.path.join(_SNIP_DIR, "families") + os.sep)


def frames_of(err: BaseException) -> tuple:
    """``(innermost frame, innermost frame inside snip_ds)`` of ``err``'s traceback as ``file:line function``
    (empty where there is none)."""
    frames = traceback.extract_tb(err.__traceback__)
    last = f"{_short(frames[-1].filename)}:{frames[-1].lineno} {frames[-1].name}" if frames else ""
    ours = [f for f in frames if _in_snip(f.filename)]
    snip = f"{_short(ours[-1].filename)}:{ours[-1].lineno} {ours[-1].name}" if ours else ""
    return last, snip


def _raised_by_snip(err: BaseException) -> bool:
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and _in_snip(frames[-1].filename)


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


class _StepWatch:
    """Counts, during the training step only, each planned layer's quantized calls (forward hooks) and each
    expert's routed tokens; a ``TrainerCallback`` added after snip_ds's, so its ``on_step_begin`` runs after
    snip_ds's collection and solve."""

    def __init__(self, model) -> None:
        from snip_ds.experts.points import ExpertPoint
        from snip_ds.swap import model_layers

        self.model = model
        self.layers = model_layers(model)
        self.points = {n: l for n, l in self.layers.items() if isinstance(l, ExpertPoint)}
        self.modules = {n: l for n, l in self.layers.items() if n not in self.points}
        self.in_step = False
        self.began = False
        self.calls: Dict[str, int] = {}
        self.quantized_calls: Dict[str, int] = {}
        self.routed: Dict[str, int] = {}
        self.precisions: Dict[str, Any] = {}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in self.modules.items()]

    def _hook(self, name: str):
        def hook(module, args, output):
            if self.in_step:
                self.calls[name] = self.calls.get(name, 0) + 1
                if _quantized(module.precision):
                    self.quantized_calls[name] = self.quantized_calls.get(name, 0) + 1
        return hook

    def callback(self):
        from transformers import TrainerCallback

        watch = self

        class StepWatch(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                watch.began = True
                watch.in_step = True
                watch._take_routed()  # whatever was counted before the step is not the step's
                return control

            def on_step_end(self, args, state, control, **kwargs):
                watch.in_step = False
                for name, count in watch._take_routed().items():
                    watch.routed[name] = watch.routed.get(name, 0) + count
                watch.precisions.update({n: p.precision for n, p in watch.points.items()})
                return control

        return StepWatch()

    def _take_routed(self) -> Dict[str, int]:
        if not self.points:
            return {}
        from snip_ds.experts.model import take_routed_tokens

        return take_routed_tokens(self.model)

    def unrun(self, quantized_plan: bool) -> List[str]:
        """Planned layers that did not run in the step (under a quantized plan: did not run quantized). An
        expert pair without tokens in this step is no such layer (routing chose other experts: its FLOPs follow
        its routed tokens); an experts module none of whose pairs saw a token is."""
        modules = {}
        for name in self.points:
            modules.setdefault(name.rsplit(".", 2)[0], []).append(name)
        idle = {n for names in modules.values() if not any(self.routed.get(m, 0) for m in names) for n in names}
        out = []
        for name in self.layers:
            if name in self.points:
                ran = name not in idle and (not quantized_plan or _quantized(self.precisions.get(name, "bf16")))
            else:
                ran = (self.quantized_calls if quantized_plan else self.calls).get(name, 0) > 0
            if not ran:
                out.append(name)
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def run_plan(model, samples: Sequence[dict], plan: str, workdir: str) -> Outcome:
    """Trains ``model`` (changed in place: pass a copy) one step under ``plan`` through the Trainer and
    :func:`snip_ds.hf.add_snip`; never raises."""
    import time

    from transformers import Trainer, TrainingArguments, default_data_collator

    from snip_ds.hf import add_snip

    out = Outcome(plan)
    start = time.perf_counter()
    watch = None
    try:
        out.stage = "setup"
        args = TrainingArguments(output_dir=workdir, per_device_train_batch_size=2, max_steps=1,
                                 learning_rate=1e-3, report_to="none", save_strategy="no", logging_strategy="no",
                                 eval_strategy="no", disable_tqdm=True, use_cpu=True, seed=0,
                                 dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=list(samples),
                          data_collator=default_data_collator)
        snip = add_snip(trainer, settings=settings_for(plan))
        watch = _StepWatch(model)
        trainer.add_callback(watch.callback())
        out.quantized_linears = len(watch.modules)
        out.expert_pairs = len(watch.points)
        out.stage = "train"
        result = trainer.train()
        out.stage = "step"
        out.loss = float(result.training_loss)
        left_out = set(getattr(snip.state, "unrun", ()) or ())  # named by snip_ds, out of the plan's share
        out.left_out = sorted(left_out)
        out.unrun = [n for n in watch.unrun(quantized_plan=plan != "bf16") if n not in left_out]
        if plan == "adaptive":
            logs = trainer.state.log_history  # the solve and the plan it applied are logged apart
            shares = [e["plan/fp4_share"] for e in logs if "plan/fp4_share" in e]
            if shares and any("snip/solve_time_s" in e for e in logs):
                out.fp4_share = float(shares[-1])
            history = getattr(snip.planner, "history", None) or []
            out.plan_status = str(history[-1].get("status", "")) if history else ""
        if not math.isfinite(out.loss):
            out.result = "nonfinite"
    except Exception as err:  # every failure is a row
        if watch is not None and watch.began:
            out.stage = "step"
        out.error = first_line(err)
        out.where, out.snip_frame = frames_of(err)
        nonfinite = type(err).__name__ == "NonFiniteError"
        refused = (not nonfinite and out.stage in ("setup", "train") and isinstance(err, _REFUSALS)
                   and _raised_by_snip(err) and "\n" not in str(err).strip())
        out.result = "nonfinite" if nonfinite else "refused" if refused else "crash"
    finally:
        if watch is not None:
            watch.close()
    out.seconds = round(time.perf_counter() - start, 2)
    return out


def probe_family(tiny, plans: Sequence[str] = PLANS, workdir: Optional[str] = None) -> List[Outcome]:
    """Every plan of ``plans`` on a copy of the built family ``tiny`` (:class:`~snip_ds.families.build.
    TinyModel`); the model itself stays as it is."""
    samples = tiny.samples(8)
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="snip_families_", dir=workdir) as tmp:
        for plan in plans:
            try:
                model = copy.deepcopy(tiny.model)
            except Exception:  # a model that does not deep-copy: build it again (same seed, same weights)
                from snip_ds.families.build import build_tiny
                model = build_tiny(tiny.model_type).model
            outcomes.append(run_plan(model, samples, plan, os.path.join(tmp, plan)))
    return outcomes


__all__ = ["ADAPTIVE", "PLANS", "Outcome", "first_line", "probe_family", "run_plan", "settings_for"]
