"""Adaptive SNIP re-planning inside training (the plan and the schedule of docs/method.md).

Before the first step, at the ``early_replan_steps`` and every ``replan_every`` steps (:mod:`snip_ds.engine.schedule`;
driven by :meth:`snip_ds.engine.state.SnipState.before_step`,
which both :class:`~snip_ds.engine.core.SnipEngine` and :class:`~snip_ds.hf.SnipCallback` call): collect
statistics on ``collect_batches`` micro-batches of a private data stream, or of the step about to be taken
when there is none (one BF16 forward+backward with hooks and Monte-Carlo Fisher probes; all-reduced over
the data-parallel ranks), solve the ILP on rank 0, broadcast the plan as JSON, check that every rank holds
the same plan, and switch to it before the next optimizer step. If rank 0 cannot solve (for example pinned
layers leave the FP4 target out of reach), every rank hears it: a re-plan keeps the plan in force and says
so in the log; the first adaptive plan stops the run with the reason. Right after each re-plan and every
``additional_bf16_fwd_every_n_steps`` steps two extra no-grad forwards of one batch (BF16, then the plan; the
batch from the private measurement stream, or the step's first micro-batch without one) measure the forward
divergence of the plan in force (their outputs' KL divergence) and the loss change its quantization causes,
logged beside the predicted divergence.
"""
from __future__ import annotations

import time
import warnings
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from snip_ds.runtime import distributed as sdist
from snip_ds import divergence as dv
from snip_ds.runtime import compile_stance, faults
from snip_ds.stats import CollectSettings, collect_statistics
from snip_ds.stats_file import carry_unrouted
from snip_ds.stats.precond import in_storage_order
from snip_ds.runtime.console import say
from snip_ds.engine.adam_state import layer_preconditioner
from snip_ds.engine.expert_state import expert_preconditioner
from snip_ds.engine.zero_leaf import leaf_backward_hooks_suspended
from snip_ds.experts.points import ExpertPoint
from snip_ds.runtime.omp import preserve_torch_threads
from snip_ds.plan import Plan, fp4_share
from snip_ds.report.run_report import plan_moves
from snip_ds.engine.schedule import measure_due, replan_due
from snip_ds.options import build
from snip_ds.planner import CostSettings, SolverSettings, solve_baseline
from snip_ds.planner.costs import predicted_divergence
from snip_ds.config.settings import ConfigError


class AdaptivePlanner:
    """Owns the statistics and the re-planning schedule of one :class:`~snip_ds.engine.state.SnipState`; reads the
    model, the optimizer's Adam state, the step and the learning rate through its
    :class:`~snip_ds.engine.state.TrainingLoop`.

    Attributes:
        last_stats: the latest statistics artifact (identical on every rank), or None.
        history: one record per re-plan (step, seconds spent, fp4 share, layers changed).
    """

    def __init__(self, state, collect_stream=None) -> None:
        self.state = state
        self.stream = collect_stream
        self.last_stats: Optional[Dict[str, Any]] = None
        self.history: List[Dict[str, Any]] = []
        self.planned_at: Optional[int] = None  # step of the last re-plan (so a resumed run does not repeat it)
        self.last_error = ""  # why rank 0 could not solve the last failed re-plan

    @property
    def settings(self):
        """The run's validated ``"snip"`` section: its state's (:attr:`snip_ds.engine.state.SnipState.settings`)."""
        return self.state.settings

    # ------------------------------------------------------------------ schedule
    def due(self, step: int) -> bool:
        """Whether statistics are collected before optimizer step ``step + 1`` (:func:`snip_ds.engine.schedule.replan_due`)."""
        return replan_due(step, self.settings.replan_every, self.settings.early_replan_steps)

    def measure_due(self, step: int) -> bool:
        """Whether the plan's forward divergence is measured before optimizer step ``step + 1``: right after a
        re-plan at this step, and every ``additional_bf16_fwd_every_n_steps`` (:func:`snip_ds.engine.schedule.measure_due`)."""
        return measure_due(step, self.settings.additional_bf16_fwd_every_n_steps, self.planned_at == step)

    # ------------------------------------------------------------------ collection and solve
    def collect(self, step_batches: Sequence[Mapping[str, torch.Tensor]] = ()) -> Dict[str, Any]:
        """One statistics collection on the next ``collect_batches`` batches of the private stream, or, with
        no stream, on the first ``collect_batches`` of ``step_batches`` (cycled if there are fewer)."""
        eng, s = self.state, self.settings
        faults.pause_point("collect", eng.step, sdist.rank())  # a test's fault injection; else a no-op
        points = {fqn: layer for fqn, layer in eng.layers.items() if isinstance(layer, ExpertPoint)}
        weights = {fqn: layer.parameter for fqn, layer in eng.layers.items() if fqn not in points}
        precond, source = layer_preconditioner(eng.loop.optimizer, weights, eng.step)
        if precond is not None:  # weights stored [in, out] (Conv1D): the state in that order
            precond = in_storage_order(precond, {f: eng.layers[f] for f in weights})
        if points and precond is not None:  # MoE pairs: their slice of their 3-D Parameter's Adam state
            precond = expert_preconditioner(eng.loop.optimizer, points, eng.step, dense=precond)[0]
        if self.stream is not None:
            batches = [self.stream.next_batch() for _ in range(s.collect_batches)]
        elif step_batches:
            batches = [step_batches[i % len(step_batches)] for i in range(s.collect_batches)]
        else:
            raise ValueError("statistics: no private stream and no micro-batches to collect on")
        dev = next(iter(eng.layers.values())).weight.device
        batches = [{k: v.to(dev) for k, v in b.items()} for b in batches]
        how = build(CollectSettings, s, seed=s.train.seed + eng.step, retain_graph=eng.zero_stage < 3,
                    bwd_propagated=s.dgrad_cost == "upstream", study_fields=s.collect_study_fields)
        # eagerly, also in a compiled model (snip_ds.runtime.compile_stance); ZeRO-3 MoE blocks: snip_ds.engine.zero_leaf
        with compile_stance.eager(), leaf_backward_hooks_suspended(eng.loop.module):
            stats = collect_statistics(eng.loop.module, batches, how, layers=list(eng.layers), lr=eng.lr(),
                                       precond=precond, reduce=sdist.dist_sum, step=eng.step,
                                       world_size=eng.dp_size)
        stats["precond_source"] = source
        return stats

    def solve(self, stats: Mapping[str, Any]) -> Optional[Plan]:
        """The plan for ``stats``: solved on rank 0, broadcast as JSON, the same object on every rank.

        If rank 0 cannot solve, every rank learns why: a re-plan returns None (the caller keeps the plan in
        force); the first adaptive plan raises :class:`~snip_ds.config.settings.ConfigError` with the reason.
        """
        s = self.settings
        payload = None
        if sdist.rank() == 0:
            caught: list = []
            try:
                # The solver's warnings (layers whose statistics are not finite, pinned to fp8) are said at every
                # re-plan, not once per process as Python's warnings would be.
                with preserve_torch_threads(), warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    plan = solve_baseline(s.method, stats, s.efficiency_saving, build(CostSettings, s),
                                          build(SolverSettings, s), seed=s.plan_seed, previous=self.state.plan)[0]
                payload = {"plan": plan.to_dict()}
            except (ValueError, RuntimeError) as err:  # no plan reaches the target: tell every rank
                payload = {"error": str(err)}
            for w in caught:
                say(f"snip_ds: warning: plan at step {self.state.step}: {w.message}")
                self.state.logger.text("plan/warnings", f"step {self.state.step}: {w.message}", self.state.step)
        payload = sdist.broadcast_json(payload)
        if "error" in payload:
            if self.planned_at is None:
                raise ConfigError(f"snip: the first adaptive plan cannot be solved at step {self.state.step}: "
                                  f"{payload['error']}")
            self.last_error = payload["error"]
            return None
        return Plan.from_dict(payload["plan"], source="broadcast plan")

    def replan(self, step_batches: Sequence[Mapping[str, torch.Tensor]] = ()) -> Optional[Plan]:
        """Collect, solve, broadcast and apply; logs timings, the share and the number of layers changed.

        Returns the new plan, or None when rank 0 could not solve a re-plan (the plan in force stays; the
        failure is logged on TensorBoard as ``snip/replan_failed`` and printed by rank 0).
        """
        eng = self.state
        start = time.perf_counter()
        stats = carry_unrouted(self.collect(step_batches), self.last_stats)  # MoE pairs without tokens
        collected = time.perf_counter()
        plan = self.solve(stats)
        solved = time.perf_counter()
        self.last_stats = stats
        self.planned_at = eng.step
        eng.flops_from(stats)
        if plan is None:
            self.history.append({"step": eng.step, "collect_s": collected - start, "solve_s": solved - collected,
                                 "fp4_share": eng.plan_fp4_share(), "changed": 0, "status": "failed",
                                 "precond": stats["precond_source"]})
            eng.logger.scalars({"snip/replan_failed": 1.0, "plan/fp4_share": eng.plan_fp4_share()}, eng.step)
            eng.logger.text("plan/changes", f"step {eng.step}: re-plan failed on rank 0 ({self.last_error}); "
                            "the plan in force stays", eng.step)
            if sdist.rank() == 0:
                say(f"snip_ds: warning: re-plan at step {eng.step} could not be solved ({self.last_error}); keeping "
                    f"the plan in force")
            return None
        previous = eng.plan
        changed = 0 if previous is None else sum(previous.assignment.get(f) != p for f, p in plan.assignment.items())
        record = {"step": eng.step, "collect_s": collected - start, "solve_s": solved - collected,
                  "fp4_share": fp4_share(plan.assignment, eng.flops), "changed": changed, "status": plan.status,
                  "precond": stats["precond_source"]}
        moves = plan_moves(previous, plan)
        what = (f"{'re-plan' if self.history else 'first plan'}: {moves['to_fp4']} {moves['unit']} FP8->FP4, "
                f"{moves['to_fp8']} FP4->FP8" + (f", {moves['other']} to or from BF16" if moves["other"] else ""))
        eng.set_plan(plan, f"{what}, fp4 share {record['fp4_share']:.3f}, plan {plan.status} (statistics "
                           f"{record['collect_s']:.2f} s, solve {record['solve_s']:.2f} s)")
        self.history.append(record)  # the console line follows the measurement (SnipState.before_step)
        # one value per tag and step: set_plan logs plan/fp4_share when the plan changes (here only the share of
        # an unchanged plan, whose FLOPs the statistics may have moved); the measurement that may follow leaves
        # snip/predicted_fld to this (SnipState.before_step)
        unchanged = previous is not None and previous.digest() == plan.digest()
        eng.logger.scalars({"snip/collect_time_s": record["collect_s"], "snip/solve_time_s": record["solve_s"],
                            "snip/layers_changed": changed, "snip/predicted_fld": self.predicted_fld(),
                            **({"plan/fp4_share": record["fp4_share"]} if unchanged else {})}, eng.step)
        eng.logger.text("snip/precond", f"step {eng.step}: preconditioner from {stats['precond_source']}",
                        eng.step)
        return plan

    def state_dict(self) -> Dict[str, Any]:
        """JSON-able state for checkpoints: the private stream's position (None without one: statistics on the
        steps' own batches) and the latest statistics."""
        return {"stream": None if self.stream is None else self.stream.state_dict(), "last_stats": self.last_stats,
                "planned_at": self.planned_at, "history": self.history}

    def load_state_dict(self, state: Optional[Mapping[str, Any]]) -> None:
        if not state:
            raise ValueError("checkpoint: no adaptive-planner state (it was saved by a run with a fixed plan)")
        if self.stream is not None and state["stream"] is not None:  # else a stream starts where it starts
            self.stream.load_state_dict(state["stream"], exact=False)  # new samples suffice
        self.last_stats, self.planned_at = state["last_stats"], state["planned_at"]
        self.history = list(state["history"])

    def predicted_fld(self) -> float:
        """Σ over layers of the predicted FLD at the precision the plan gives their fprop."""
        if self.last_stats is None or self.state.plan is None:
            return float("nan")
        layers, plan = self.last_stats["layers"], self.state.plan
        return predicted_divergence(layers, {fqn: plan.assignment[fqn] for fqn in layers})[0]

    # ------------------------------------------------------------------ measured divergence
    @torch.no_grad()
    def measure_forward(self, batch: Mapping[str, torch.Tensor]) -> Tuple[float, float, float]:
        """Two no-grad forwards of ``batch`` (eval mode, the weights of the step about to be taken): every layer
        unquantized, then the plan in force, both given the labels. Returns the unquantized loss, the plan's loss
        and the measured FLD: the mean over the loss's tokens of ``KL(p_unquantized ‖ p_plan)``
        (:func:`snip_ds.divergence.next_token_kl`), each averaged over every rank's tokens. The forward
        quantization draws no random numbers, so the measurement leaves training bit for bit as it was."""
        st = self.state
        module = st.loop.module
        saved = {fqn: layer.precision for fqn, layer in st.layers.items()}
        was_training = module.training
        dev = next(iter(st.layers.values())).weight.device
        ids = batch["input_ids"].to(dev)
        labels = batch["labels"].to(dev) if "labels" in batch else ids
        try:
            module.eval()
            for layer in st.layers.values():
                layer.precision = "bf16"
            with compile_stance.eager():  # also in a compiled model (snip_ds.runtime.compile_stance)
                unquantized = st.loop.forward(input_ids=ids, labels=labels)
                for fqn, layer in st.layers.items():
                    layer.precision = saved[fqn]
                planned = st.loop.forward(input_ids=ids, labels=labels)
        finally:
            for fqn, layer in st.layers.items():
                layer.precision = saved[fqn]
            module.train(was_training)
        kl_sum, n = dv.next_token_kl(unquantized.logits, planned.logits, labels)
        losses = torch.stack([unquantized.loss.detach().double().cpu(), planned.loss.detach().double().cpu()])
        totals = sdist.dist_sum(torch.cat([losses, kl_sum.detach().double().cpu().reshape(1),
                                           torch.tensor([float(n)], dtype=torch.float64)]))
        world = sdist.world_size()
        kl = float(totals[2] / totals[3]) if totals[3] > 0 else 0.0
        return float(totals[0]) / world, float(totals[1]) / world, kl
