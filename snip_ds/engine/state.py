"""SNIP's state in a training run, one object under both loops.

:class:`SnipState` holds what SNIP keeps while a model trains: the swapped layers and their
:class:`~snip_ds.swap.LayerInfo`, their FLOPs, the plan in force, the adaptive planner (with its statistics
stream), the measurement stream, the stochastic-rounding generators (inside the layers), the skipped steps,
the non-finite guard and the logger. Two thin drivers own one each:

* :class:`snip_ds.engine.core.SnipEngine` (``snip_ds.initialize``, ``launch/train.py``) over a DeepSpeed
  engine, and
* :class:`snip_ds.hf.SnipCallback` over a Hugging Face ``Trainer`` (with or without DeepSpeed).

Each driver hands the state a :class:`TrainingLoop` (a small adapter over its loop), calls
:meth:`SnipState.before_step` at every optimizer-step boundary (re-plan and measure if due), and saves
:meth:`SnipState.state_dict` (``snip_state.json``, rank 0) and :meth:`SnipState.rank_tensors`
(``snip_rng_rank<r>.safetensors``, every rank) into its checkpoint folder: one format for both loops.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Mapping, Optional, Protocol, Sequence

import torch
from torch import nn

from snip_ds.runtime import distributed as sdist
from snip_ds.report.artifacts import STATE_FORMAT, TRAINER_STATE_FORMAT
from snip_ds.runtime.console import say
from snip_ds.experts.points import ExpertPoint, recomputing
from snip_ds.runtime.global_rng import global_rng_tensors, restore_global_rngs
# the non-finite guard's parts, imported from here by the loops
from snip_ds.engine.nonfinite import NonFiniteError, NonFiniteGuard, located_forward_hooks, run_without_update  # noqa: F401
from snip_ds.plan import Plan, fp4_share
from snip_ds.report.run_report import replan_line
from snip_ds.engine.schedule import measure_due, replan_due
from snip_ds.config.settings import SnipSettings
from snip_ds.swap import LayerInfo, model_layers
from snip_ds.report.tensorboard import NullLogger, precision_map_image
from snip_ds.types import block_index, layer_kind


STATS_SEED_OFFSET = 7919  # the private statistics stream's seed is the run's seed + this (both loops)
MEASURE_SEED_OFFSET = 2 * 7919  # the private measurement stream's


class TrainingLoop(Protocol):
    """What SNIP's state needs from a training loop; a DeepSpeed engine and a ``Trainer`` both give it through
    small adapters (:class:`snip_ds.engine.core.DeepSpeedLoop`, :class:`snip_ds.hf.loop.TrainerLoop`)."""

    @property
    def module(self) -> nn.Module:
        """The model (unwrapped), whose decoder linears are swapped."""

    @property
    def optimizer(self) -> Any:
        """The optimizer holding Adam's state: a DeepSpeed ZeRO/bf16 optimizer or a torch Adam/AdamW."""

    @property
    def step(self) -> int:
        """Optimizer steps taken so far."""

    @property
    def zero_stage(self) -> int:
        """ZeRO stage (0 without DeepSpeed)."""

    def lr(self) -> float:
        """The learning rate of the next optimizer step."""

    def forward(self, **inputs) -> Any:
        """One forward of the model as the loop runs it (through the DeepSpeed engine: collective under ZeRO-3)."""


class SnipState:
    """Everything SNIP keeps during one training run, whichever loop drives it.

    Attributes:
        loop: the :class:`TrainingLoop` adapter.
        infos: ``{fqn: LayerInfo}`` of the planned layers (MoE pairs' ``ExpertLayerInfo`` included), in model
            order.
        layers: ``{fqn: SnipLinear or ExpertPoint}`` (:func:`snip_ds.swap.model_layers`).
        flops: ``{fqn: FLOPs per optimizer step}`` (the shares depend only on their ratios): from the calls each
            layer really receives once they are counted (a statistics collection's, :meth:`flops_from`; in a
            fixed-plan run the first step's, :meth:`before_step`), MoE pairs' from their routed tokens; a
            layer no call reaches has none, and is named once.
        settings: the validated ``"snip"`` section.
        plan: the plan in force.
        planner: the :class:`~snip_ds.engine.adaptive.AdaptivePlanner` of an adaptive run, else None.
        measure_stream: the private stream the measured divergence is computed on (None: the step's first
            micro-batch).
        skipped_steps: steps skipped for a non-finite loss or gradient (``snip.nonfinite: "skip"``).
        guard: the :class:`NonFiniteGuard`.
        logger: scalars, images and text (a TensorBoard logger on the logging rank, or the Trainer's reporters).
        driver: ``"engine"`` or ``"trainer"``: which loop wrote a checkpoint (recorded in ``snip_state.json``).
        zero_init: whether ``deepspeed.zero.Init`` partitioned the model's parameters when it was built, before
            DeepSpeed started (recorded in ``snip_state.json``: DeepSpeed's ``ds_to_universal`` cannot merge such a
            model's tensor-parallel shards, :mod:`snip_ds.engine.universal`).
    """

    def __init__(self, loop: TrainingLoop, infos: Mapping[str, LayerInfo], settings: SnipSettings,
                 tokens_per_step: int, logger=None, *, driver: str, zero_init: bool = False) -> None:
        self.loop = loop
        self.infos = dict(infos)
        self.settings = settings
        self.tokens_per_step = tokens_per_step
        self.logger = logger or NullLogger()
        self.driver = driver
        self.zero_init = bool(zero_init)
        self.layers = model_layers(loop.module)
        self.flops = {fqn: info.flops(tokens_per_step) for fqn, info in self.infos.items()}
        self.has_experts = any(isinstance(m, ExpertPoint) for m in self.layers.values())
        self.unrun: List[str] = []  # planned layers no call reached (named once, no FLOPs)
        self._calls: Optional[CallCounter] = None  # a fixed-plan run's first step: each layer's rows
        self._calls_settled = False
        self.plan: Optional[Plan] = None
        self.planner = None
        self.measure_stream = None
        self.skipped_steps = 0
        self.guard = NonFiniteGuard(self, loop.module)
        self.snip_seconds = 0.0  # SNIP's own work in this process: statistics, solves, measured divergence
        self.show_dir: Optional[str] = None  # what `snip-ds show` reads for this run (named in re-plan lines)

    # ------------------------------------------------------------------ the loop's facts
    @property
    def step(self) -> int:
        """Optimizer steps taken so far."""
        return int(self.loop.step)

    @property
    def zero_stage(self) -> int:
        return int(self.loop.zero_stage)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: the world size over the tensor-parallel degree (the loop's ``dp_size``, where
        it has one; else every rank is one)."""
        return int(getattr(self.loop, "dp_size", sdist.world_size()))

    @property
    def tensor_parallel(self) -> int:
        """The tensor-parallel degree: the world size over :attr:`dp_size`."""
        return sdist.world_size() // self.dp_size

    def lr(self) -> float:
        return float(self.loop.lr())

    # ------------------------------------------------------------------ plan
    def set_plan(self, plan: Plan, reason: str = "") -> None:
        """Applies ``plan`` to every layer; call between optimizer steps. Ranks must hold the same plan.

        Raises:
            ValueError: the plan names layers the model lacks or misses some it has.
            RuntimeError: ranks disagree on the plan (their digests differ).
        """
        plan.check_layers(self.infos, source=f"plan ({plan.method})")
        if not sdist.agree(plan.digest()):
            raise RuntimeError("ranks hold different plans (digest mismatch); refusing to train on")
        for fqn, layer in self.layers.items():
            layer.precision = plan.assignment[fqn]
        changed = self.plan is None or plan.digest() != self.plan.digest()
        # an adaptive run's starting plan that a re-plan at this step replaces (or, the planner not yet made, a
        # restored plan) before it trains: its share and map are not logged, so that the step holds one of each
        planner = self.planner
        starting = self.plan is None and self.settings.is_adaptive and (
            planner is None or (planner.due(self.step) and planner.planned_at != self.step))
        self.plan = plan
        if changed and not starting:
            self.logger.scalar("plan/fp4_share", self.plan_fp4_share(), self.step)
            if getattr(self.logger, "writes_images", True):  # rendered only where it is written (rank 0)
                self.logger.image("plan/precision_map", precision_map_image(
                    plan.assignment, block_index, kinds=[layer_kind(f) for f in self.infos], step=self.step,
                    fp4_share=self.plan_fp4_share(), method=plan.method),
                    self.step)
            if reason:
                self.logger.text("plan/changes", f"step {self.step}: {reason}", self.step)

    def flops_from(self, stats: Optional[Mapping[str, Any]]) -> None:
        """Takes every layer's FLOPs from a statistics collection's (a linear's follow the rows of all its calls,
        an expert pair's the tokens routed to it, :mod:`snip_ds.stats.experts`), so that the FP4 shares logged
        are the planner's; names, once, the planned layers that no call reached (``no_calls``: the plan keeps
        them at bf16, out of its share). Before the first collection a linear counts ``6·T·k·n`` and an expert
        pair the even share of the tokens (its ``LayerInfo.flops``)."""
        if not stats:
            return
        layers = stats.get("layers", {})
        if set(self.flops) <= set(layers):
            self.flops = {fqn: float(layers[fqn]["flops"]) for fqn in self.flops}
            self._name_unrun([f for f in self.flops if layers[f].get("no_calls") is True], "the statistics pass")

    def _name_unrun(self, names: Sequence[str], where: str) -> None:
        """Says once (rank 0) which planned layers received no call: they run nowhere, so their FLOPs are 0."""
        new = [n for n in names if n not in self.unrun]
        if not new:
            return
        self.unrun.extend(new)
        shown = ", ".join(new[:4]) + (f" and {len(new) - 4} more" if len(new) > 4 else "")
        msg = (f"{len(new)} planned layer(s) received no call in {where} (the model never runs them: {shown}); "
               f"they are left out of the plan's FP4 share")
        self.logger.text("plan/unrun_layers", msg, self.step)
        if sdist.rank() == 0:
            say(f"snip_ds: note: {msg}")

    def after_step(self) -> None:
        """At the end of an optimizer step (every rank: collective the first time in a fixed-plan run): the
        first step's calls settle each layer's FLOPs (:meth:`_settle_calls`)."""
        if self._calls is not None:
            self._settle_calls()

    def _settle_calls(self) -> None:
        """A fixed-plan run after its first step: each linear's FLOPs follow the rows its calls saw (summed over
        ranks), relative to the most common count (a layer run twice per forward costs twice); layers no call
        reached get none and are named."""
        counter, self._calls = self._calls, None
        rows = counter.finish()
        totals = sdist.dist_sum(torch.tensor([float(rows[f]) for f in rows], dtype=torch.float64)).tolist()
        counted = dict(zip(rows, totals))
        nonzero = [t for t in counted.values() if t > 0]
        if not nonzero:
            return
        usual = max(set(nonzero), key=nonzero.count)
        for fqn, t in counted.items():
            if t != usual:
                self.flops[fqn] = self.flops[fqn] * (t / usual)
        self._name_unrun([f for f, t in counted.items() if t == 0], f"step {self.step}")
        if self.plan is not None:
            self.logger.scalar("plan/fp4_share", self.plan_fp4_share(), self.step)

    def plan_fp4_share(self) -> float:
        """FP4 share of the linear-GEMM FLOPs under the current plan."""
        return fp4_share(self.plan.assignment, self.flops)

    # ------------------------------------------------------------------ before each optimizer step
    def before_step(self, step_batches: Sequence[Mapping[str, torch.Tensor]] = ()) -> None:
        """At an optimizer-step boundary, before the step's first micro-batch: in an adaptive run, re-plan if
        due (collect, solve on rank 0, broadcast, switch) and measure the plan's forward divergence if due
        (logged as ``snip/measured_fld``, ``snip/predicted_fld`` and ``snip/measured_loss_change`` at the global
        step, the optimizer steps done, as a re-plan is and as the Trainer's log counts). ``step_batches``: the
        step's micro-batches where the loop has them (collections and measurements without a private stream use
        them). Also resets the non-finite guard for the step."""
        self.guard.begin_step()
        planner = self.planner
        if planner is None:  # a fixed plan: the first step's calls tell each layer's FLOPs (and who never runs)
            if self._calls is None and not self._calls_settled:
                self._calls = CallCounter({f: m for f, m in self.layers.items() if not isinstance(m, ExpertPoint)})
                self._calls_settled = True
            return
        step, start, previous, kl = self.step, time.perf_counter(), self.plan, None
        new = planner.replan(step_batches) if planner.due(step) and planner.planned_at != step else None
        if planner.measure_due(step):
            if self.measure_stream is not None:
                batch = self.measure_stream.next_batch()
            elif step_batches:
                batch = step_batches[0]
            else:
                raise ValueError("measured divergence: no measurement stream and no micro-batch to measure on")
            measuring = time.perf_counter()
            unquantized, planned, kl = planner.measure_forward(batch)
            if new is not None:
                planner.history[-1]["measure_s"] = time.perf_counter() - measuring
            self.logger.scalars({"snip/measured_fld": kl, "snip/measured_loss_change": planned - unquantized,
                                 # a re-plan at this step logged it already (one value per tag and step)
                                 **({"snip/predicted_fld": planner.predicted_fld()} if new is None else {})}, step)
        self.snip_seconds += time.perf_counter() - start
        if new is not None and sdist.rank() == 0:  # what the re-plan did, its measured divergence included
            say(replan_line(planner.history[-1], previous, new, self.settings.efficiency_saving,
                            planner.predicted_fld(), kl, self.show_dir, first=len(planner.history) == 1))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """SNIP's state as JSON (``snip_state.json``, :data:`~snip_ds.report.artifacts.STATE_FORMAT`; the same on every
        rank): the plan, the planner's state (its stream's position, last statistics, history), the measurement
        stream's position, the skipped steps, the settings, and whether the model was built under
        ``deepspeed.zero.Init`` (``zero_init``)."""
        return {"format": STATE_FORMAT, "driver": self.driver, "step": self.step,
                "world_size": sdist.world_size(), "plan": self.plan.to_dict() if self.plan else None,
                "settings": self.settings.to_dict(),
                "planner": self.planner.state_dict() if self.planner is not None else None,
                "measure_stream": self.measure_stream.state_dict() if self.measure_stream is not None else None,
                "skipped_steps": self.skipped_steps, "zero_init": self.zero_init,
                **({"tensor_parallel": self.tensor_parallel} if self.tensor_parallel > 1 else {})}

    def load_state_dict(self, state: Mapping[str, Any], source: str, any_world_size: bool = False) -> None:
        """Restores :meth:`state_dict`'s output, or an older file: a Trainer's ``snip_ds.hf_checkpoint/1``, or
        the engine's plan, planner and skipped steps from its ``snip_meta.json`` (no ``format`` given then).
        Applies the plan (logged as "restored"). ``any_world_size``: a universal checkpoint, which another number of
        ranks may resume (the streams' positions are converted to this run's batch by their ``load_state_dict``).

        Raises:
            ValueError: a field is missing or does not fit this run (the message names ``source``).
        """
        fmt = state.get("format")
        if fmt not in (None, STATE_FORMAT, TRAINER_STATE_FORMAT):
            raise ValueError(f"{source}: format {fmt!r} is not {STATE_FORMAT}")
        if not any_world_size and "world_size" in state and state["world_size"] != sdist.world_size():
            raise ValueError(f"{source}: saved by {state['world_size']} rank(s), this run has {sdist.world_size()}")
        if self.planner is not None:
            if not state.get("planner"):
                raise ValueError(f"{source}: no adaptive-planner state (it was saved by a run with a fixed plan)")
            self.planner.load_state_dict(state["planner"])
            self.flops_from(self.planner.last_stats)
        if self.measure_stream is not None:
            saved = state.get("measure_stream")
            if saved is not None:
                self.measure_stream.load_state_dict(saved, exact=False)
            else:  # an engine checkpoint from before the measurement stream: as many measurements as were due
                s = self.settings
                self.measure_stream.step = sum(
                    measure_due(k, s.additional_bf16_fwd_every_n_steps,
                                replan_due(k, s.replan_every, s.early_replan_steps)) for k in range(self.step))
        self.skipped_steps = int(state.get("skipped_steps") or 0)
        if state.get("plan"):
            self.set_plan(Plan.from_dict(state["plan"], source=source), "restored")

    def rank_tensors(self) -> Dict[str, torch.Tensor]:
        """This rank's tensors for ``snip_rng_rank<r>.safetensors``: every stochastic-rounding generator's state
        (``generator/<fqn>``) and the process-wide generators' (torch's CPU RNG as ``torch_rng``, Python's
        ``random`` as ``python_rng/*``, NumPy's as ``numpy_rng/*``: :func:`snip_ds.runtime.global_rng.global_rng_tensors`)."""
        tensors = {f"generator/{fqn}": layer.generator.get_state().clone() for fqn, layer in self.layers.items()
                   if layer.generator is not None}
        tensors.update(global_rng_tensors())
        return tensors

    def load_rank_tensors(self, tensors: Mapping[str, torch.Tensor], global_rngs: bool) -> None:
        """Restores :meth:`rank_tensors`' output, or an older file (a Trainer's: generator states keyed by the bare
        fqn, no torch RNG; an engine's: torch's RNG without Python's and NumPy's). ``global_rngs``: restore the
        process-wide generators too (the engine; the Trainer restores its own from its ``rng_state.pth``)."""
        for key, value in tensors.items():
            fqn = key.split("/", 1)[1] if key.startswith("generator/") else key
            layer = self.layers.get(fqn)
            if layer is not None and layer.generator is not None:
                layer.generator.set_state(value)
        if global_rngs:
            restore_global_rngs(tensors)


class CallCounter:
    """Forward hooks that count the rows (tokens) each layer's calls receive until :meth:`finish` (activation
    checkpointing's recomputation not counted again)."""

    def __init__(self, layers: Mapping[str, nn.Module]) -> None:
        self.rows = {fqn: 0 for fqn in layers}
        self._handles = [m.register_forward_hook(self._hook(fqn)) for fqn, m in layers.items()]

    def _hook(self, fqn: str):
        def count(module, inputs, output):
            x = inputs[0] if inputs else None
            if isinstance(x, torch.Tensor) and x.dim() and not recomputing():
                self.rows[fqn] += x.numel() // max(x.shape[-1], 1)
        return count

    def finish(self) -> Dict[str, int]:
        for h in self._handles:
            h.remove()
        self._handles = []
        return self.rows
