"""``snip_ds.initialize`` and :class:`SnipEngine`: a DeepSpeed engine plus the current precision plan."""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import socket
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

from snip_ds import distributed as sdist
from snip_ds import faults
from snip_ds.backend import check_backend
from snip_ds.console import say
from snip_ds.deepspeed_config import resolve_ds_config
from snip_ds.engine import checkpoint as ckpt
from snip_ds.tensorboard import NullLogger, precision_map_image
from snip_ds.plan import Plan, fp4_share
from snip_ds.settings import SnipSettings, parse_snip_section
from snip_ds.swap import LayerInfo, check_still_swapped, snip_layers, swap_linears
from snip_ds.types import block_index


class NonFiniteError(RuntimeError):
    """A NaN or Inf loss or gradient stopped training (``snip.nonfinite: "stop"``), before the step's update.
    The message, the same on every rank, names the step, the micro-batch, the rank and the first module whose
    forward output went non-finite."""


def _floating_tensors(out) -> list:
    """The floating-point tensors of a module's output (a tensor, a tuple/list, or a dict / ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _floating_tensors(o)]
    if isinstance(out, Mapping):
        return [t for o in out.values() for t in _floating_tensors(o)]
    return []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DEFAULT_DIST_TIMEOUT_S = 600.0  # DeepSpeed's own default (deepspeed.constants.default_pg_timeout, 10 minutes)


def init_distributed(timeout_s: Optional[float] = None) -> None:
    """Initialises torch.distributed the way DeepSpeed does: gloo on CPU, nccl on GPU.

    Works under the ``deepspeed`` launcher, ``torchrun``, and a plain ``python`` process (one rank).

    Args:
        timeout_s: the process group's timeout in seconds (``launch/train.py --dist_timeout``): a collective
            (or barrier) that a peer does not join within it raises on the waiting rank, so a rank whose peer
            hangs stops instead of waiting for ever (a peer that dies is noticed at once: its connections
            close). It must exceed the longest time one rank legitimately waits for another (rank 0's solve,
            a checkpoint's hashing, a slow first step). None: :data:`DEFAULT_DIST_TIMEOUT_S`.

    Raises:
        ValueError: ``timeout_s`` is not a positive number.
    """
    if dist.is_initialized():
        return
    timeout_s = DEFAULT_DIST_TIMEOUT_S if timeout_s is None else timeout_s
    if not timeout_s > 0 or timeout_s == float("inf"):
        raise ValueError(f"init_distributed: timeout_s must be a positive number of seconds, got {timeout_s}")
    if "WORLD_SIZE" not in os.environ or os.environ.get("SNIP_DS_SINGLE_PROCESS") == "1":
        # A plain `python launch/train.py` (or a test calling it in-process): one rank on a fresh port.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()), SNIP_DS_SINGLE_PROCESS="1")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    release_shm_buffer()


def shm_buffer_path(rank: int) -> Path:
    """The file of ``rank``'s buffer of DeepSpeed's CPU shared-memory all-reduce (``deepspeed_shm_comm``),
    named as its shm.cpp names it from the uid, ``MASTER_ADDR`` and ``MASTER_PORT``."""
    return Path("/dev/shm") / (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
                               f"{os.environ.get('MASTER_PORT', '')}_{rank}")


def release_shm_buffer() -> None:
    """Unlinks this rank's shared-memory all-reduce buffer once every rank has mapped every buffer.

    When all ranks run on one machine, DeepSpeed creates one ~66 MB file per rank in /dev/shm and never
    removes it: every run leaks them, until /dev/shm (RAM) is full. The ranks open each other's buffers inside
    ``deepspeed.init_distributed``; after a barrier the names are no longer needed, and the mappings stay
    valid until the processes exit, so the memory is returned then, also when a run crashes.
    """
    if sdist.world_size() > 1:
        dist.barrier()
    try:
        shm_buffer_path(sdist.rank()).unlink()
    except FileNotFoundError:  # ranks on several machines, or torchrun: no shared-memory all-reduce
        pass


def device() -> torch.device:
    """This rank's compute device."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class SnipEngine:
    """A DeepSpeed engine whose decoder linears follow a :class:`~snip_ds.plan.Plan`.

    Attributes:
        ds: the ``DeepSpeedEngine``.
        infos: ``{fqn: LayerInfo}`` of the swapped layers, in model order.
        plan: the plan in force.
        settings: the validated ``"snip"`` section.
        planner: the :class:`~snip_ds.engine.adaptive.AdaptivePlanner` of an adaptive run (None otherwise):
            :meth:`train_step` lets it collect, solve and switch before the steps it is due.
        skipped_steps: steps skipped for a non-finite loss or gradient (``snip.nonfinite: "skip"``; saved in
            checkpoints).
    """

    def __init__(self, ds_engine, infos: Mapping[str, LayerInfo], settings: SnipSettings,
                 tokens_per_step: int, logger=None) -> None:
        self.ds = ds_engine
        self.infos = dict(infos)
        self.settings = settings
        self.tokens_per_step = tokens_per_step
        self.logger = logger or NullLogger()
        self.layers = snip_layers(ds_engine.module)
        self.flops = {fqn: info.flops(tokens_per_step) for fqn, info in self.infos.items()}
        self.plan: Optional[Plan] = None
        self.planner = None
        self.last_first_loss = float("nan")  # global mean loss of the last step's first micro-batch
        self.skipped_steps = 0  # steps skipped for a non-finite loss or gradient (snip.nonfinite "skip")
        # Every trainable parameter's gradient is checked for NaN/Inf as it is computed, during train_step's
        # backward passes only (not the statistics' own backward).
        self._grad_flags: Optional[list] = None
        self._param_order: Dict[str, int] = {}
        for i, (name, p) in enumerate(ds_engine.module.named_parameters()):
            if p.requires_grad:
                self._param_order[name] = i
                p.register_hook(self._grad_hook(name))

    # ------------------------------------------------------------------ plan
    @property
    def step(self) -> int:
        """Optimizer steps taken so far."""
        return int(self.ds.global_steps)

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
        self.plan = plan
        if changed:
            self.logger.scalar("plan/fp4_share", self.plan_fp4_share(), self.step)
            self.logger.image("plan/precision_map", precision_map_image(
                plan.assignment, block_index, kinds=[i.kind for i in self.infos.values()], step=self.step,
                fp4_share=self.plan_fp4_share(), method=plan.method),
                self.step)
            if reason:
                self.logger.text("plan/changes", f"step {self.step}: {reason}", self.step)

    @property
    def zero_stage(self) -> int:
        return int(self.ds.zero_optimization_stage())

    def plan_fp4_share(self) -> float:
        """FP4 share of the linear-GEMM FLOPs under the current plan."""
        from snip_ds.plan import fp4_share
        return fp4_share(self.plan.assignment, self.flops)

    # ------------------------------------------------------------------ steps
    def _forward_loss(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        dev = device()
        out = self.ds(input_ids=batch["input_ids"].to(dev), labels=batch["labels"].to(dev))
        return out.loss

    def train_step(self, micro_batches: Sequence[Mapping[str, torch.Tensor]]) -> float:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches; returns the global mean loss.

        In an adaptive run the planner first re-plans if it is due (before the first step and every
        ``replan_every`` steps: collect, solve on rank 0, broadcast, switch), and every
        ``additional_bf16_fwd_every_n_steps`` steps two extra no-grad forwards of the first micro-batch (BF16,
        then the plan) give the measured forward divergence (the KL divergence of their outputs, nats per
        token), logged after the step beside the predicted one, and the loss change the plan's quantization
        causes on that micro-batch (signed).

        Every micro-batch's loss and every parameter's gradient is checked for NaN/Inf; the ranks agree before
        the update (one flag all-reduced per step). A non-finite step raises :class:`NonFiniteError` before its
        update, or with ``snip.nonfinite: "skip"`` is skipped (:attr:`skipped_steps`; its loss is returned).
        """
        ga = self.ds.gradient_accumulation_steps()
        if len(micro_batches) != ga:
            raise ValueError(f"train_step needs {ga} micro-batches (gradient_accumulation_steps), "
                             f"got {len(micro_batches)}")
        planner = self.planner
        measured = None
        if planner is not None:
            if planner.due(self.step) and planner.planned_at != self.step:
                planner.replan(micro_batches)
            if planner.measure_due(self.step):
                measured = planner.measure_forward(micro_batches[0])  # (unquantized loss, KL)
        losses = []
        bad = None  # this rank's first non-finite micro-batch: {"micro_batch": i, "what": ...}
        for i, batch in enumerate(micro_batches):
            loss = self._forward_loss(batch)
            self._grad_flags = []
            try:
                self.ds.backward(loss)
            finally:
                flags, self._grad_flags = self._grad_flags, None
            if not losses:
                faults.pause_point("step", self.step, sdist.rank())  # a test's fault injection; else a no-op
            if bad is None:
                bad = self._nonfinite(i, loss, flags)
            # Before the update (the last micro-batch's ds.step()), the ranks agree whether any saw a non-finite
            # loss or gradient: one all-reduce of one flag per optimizer step.
            if i == ga - 1 and sdist.dist_max_flag(bad is not None):
                self._on_nonfinite(bad, micro_batches)  # raises NonFiniteError unless snip.nonfinite is "skip"
                self._skip_update()
            else:
                self.ds.step()
            losses.append(loss.detach().double().cpu())
        local = torch.stack(losses)
        # One collective for both: the step's mean loss and the first micro-batch's (for the measured FLD).
        mean_first = sdist.dist_mean(torch.stack([local.mean(), local[0]]))
        self.last_first_loss = float(mean_first[1])
        if measured is not None:
            self.logger.scalars({"snip/measured_fld": measured[1], "snip/predicted_fld": planner.predicted_fld(),
                                 "snip/measured_loss_change": self.last_first_loss - measured[0]}, self.step)
        return float(mean_first[0])

    # ------------------------------------------------------------------ non-finite numbers
    def _grad_hook(self, name: str):
        def hook(grad: torch.Tensor):
            if self._grad_flags is not None:
                self._grad_flags.append((name, torch.isfinite(grad).all()))
            return None
        return hook

    def _nonfinite(self, index: int, loss: torch.Tensor, flags: Sequence) -> Optional[Dict[str, Any]]:
        """What went non-finite in micro-batch ``index`` on this rank (its loss, or the gradient of the first
        parameter in model order whose gradient did), or None."""
        value = float(loss.detach().float().cpu())
        if not math.isfinite(value):
            return {"micro_batch": index, "what": f"loss ({value})"}
        if flags and not bool(torch.stack([f.to(flags[0][1].device) for _, f in flags]).all()):  # one sync
            name = min((n for n, f in flags if not bool(f)), key=lambda n: self._param_order.get(n, 0))
            return {"micro_batch": index, "what": f"gradient (of {name}, the first such parameter in model "
                                                  f"order; the loss was finite)"}
        return None

    def _on_nonfinite(self, bad: Optional[Dict[str, Any]], micro_batches) -> None:
        """Collective: the same report on every rank; raises :class:`NonFiniteError` (``stop``) or logs the skip.

        Every rank re-runs the forward of the first bad micro-batch's index (its own micro-batch there; under
        ZeRO-3 the forward is collective) with forward hooks, to find the first module whose output is
        non-finite. Only on failure, so it costs nothing otherwise.
        """
        reports = sdist.all_gather_json(bad)
        rank = min(r for r, rep in enumerate(reports) if rep)
        rep = reports[rank]
        located = sdist.all_gather_json(self._first_nonfinite_module(micro_batches[rep["micro_batch"]]))[rank]
        ga = len(micro_batches)
        where = (f"first module with a non-finite output: {located}" if located else
                 "every module's forward output was finite: the backward pass went non-finite")
        msg = (f"non-finite {rep['what']} at step {self.step + 1}, micro-batch {rep['micro_batch'] + 1} of {ga} "
               f"on rank {rank}; {where}")
        if self.settings.nonfinite != "skip":
            raise NonFiniteError(f"{msg}; the step's update was not applied and no checkpoint was saved after "
                                 f"step {self.step} (snip.nonfinite \"skip\" skips such steps instead)")
        self.skipped_steps += 1
        self.logger.scalar("train/skipped_steps", self.skipped_steps, self.step + 1)
        self.logger.text("train/nonfinite", f"step {self.step + 1}: {msg}; skipped", self.step + 1)
        if sdist.rank() == 0:
            say(f"snip_ds: warning: {msg}; step skipped ({self.skipped_steps} so far)")

    @torch.no_grad()
    def _first_nonfinite_module(self, batch: Mapping[str, torch.Tensor]) -> Optional[str]:
        """The name and class of the first module (in the order modules finish their forward) whose output
        holds a NaN or Inf on ``batch``, or None. Restores the RNG state, so training is not shifted."""
        found: List[str] = []

        def hook(name):
            def check(module, inputs, output):
                if not found and any(not bool(torch.isfinite(t).all()) for t in _floating_tensors(output)):
                    found.append(f"{name} ({type(module).__name__})")
            return check

        handles = [m.register_forward_hook(hook(n)) for n, m in self.ds.module.named_modules() if n]
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        try:
            self._forward_loss(batch)
        finally:
            for h in handles:
                h.remove()
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng)
        return found[0] if found else None

    def _skip_update(self) -> None:
        """The step's ``ds.step()`` with the wrapped optimizer's update suppressed (what DeepSpeed's own overflow
        skip does, for any ZeRO stage and precision): DeepSpeed still finishes the step -- drops the accumulated
        gradients, advances its step counter -- but no parameter or optimizer state changes. (Its scheduler
        advances unless DeepSpeed's own check saw the non-finite gradient norm too.)
        """
        base = getattr(self.ds.optimizer, "optimizer", self.ds.optimizer)  # ZeRO / bf16 wrappers hold it there
        own = vars(base).get("step")  # a scheduler may have wrapped step on the instance
        base.step = lambda *args, **kwargs: None
        try:
            self.ds.step()
        finally:
            if own is None:
                del base.step
            else:
                base.step = own

    @torch.no_grad()
    def evaluate(self, batches: Sequence[Mapping[str, torch.Tensor]]) -> float:
        """Mean validation loss over ``batches`` and all ranks, with the current plan's forward."""
        was_training = self.ds.module.training
        self.ds.eval()
        total = torch.zeros((), dtype=torch.float64)
        for batch in batches:
            total += self._forward_loss(batch).double().cpu()
        if was_training:
            self.ds.train()
        return float(sdist.dist_mean(total / max(len(batches), 1)))

    def lr(self) -> float:
        """The learning rate of the next optimizer step (read from the optimizer, which the scheduler sets)."""
        return float(self.ds.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir: str | Path, extra: Mapping[str, Any]) -> Path:
        """Saves DeepSpeed's state plus ours under ``save_dir/step_<N>``; ``latest`` moves only when complete."""
        state = {"generators": {fqn: layer.generator.get_state() for fqn, layer in self.layers.items()
                                if layer.generator is not None},
                 "torch_rng": torch.get_rng_state()}
        meta = {"step": self.step, "skipped_steps": self.skipped_steps,
                "plan": self.plan.to_dict() if self.plan else None,
                "settings": self.settings.to_dict(), "model_config": ckpt.model_config(self.ds.module), **extra}
        return ckpt.save(self.ds, Path(save_dir), f"step_{self.step}", meta, state,
                         ckpt.model_fingerprint(self.ds.module), sdist.world_size(),
                         ckpt.model_architecture(self.ds.module))

    def load_checkpoint(self, path: str | Path) -> Dict[str, Any]:
        """Restores a checkpoint written by :meth:`save_checkpoint`; returns its metadata.

        Raises:
            CheckpointError: missing/incomplete checkpoint, a different model or a different world size.
        """
        tag_dir = ckpt.resolve(Path(path))
        meta = ckpt.validate(tag_dir, ckpt.model_fingerprint(self.ds.module), sdist.world_size(),
                             ckpt.model_architecture(self.ds.module))
        state = ckpt.load(self.ds, tag_dir, sdist.rank())
        for fqn, gen_state in state["generators"].items():
            self.layers[fqn].generator.set_state(gen_state)
        torch.set_rng_state(state["torch_rng"])
        self.skipped_steps = int(meta.get("skipped_steps") or 0)
        if meta.get("plan"):
            self.set_plan(Plan.from_dict(meta["plan"], source=str(tag_dir / ckpt.META_FILE)), "restored")
        return meta


def initial_plan(fqns: Sequence[str], flops: Mapping[str, float], settings: SnipSettings) -> Plan:
    """The plan a run starts from: the plan file's, a uniform precision's, or (adaptive) uniform FP8 as a
    placeholder until the first statistics are in, before step 1.

    Raises:
        ValueError: the plan file is missing or invalid, or names other layers than ``fqns`` (the message
            names the file).
    """
    fqns = list(fqns)
    if settings.plan_file:
        path = Path(settings.plan_file)
        if not path.is_file():
            raise ValueError(f"{path}: plan file not found")
        plan = Plan.load(path)
        plan.check_layers(fqns, source=str(path))  # before the FLOPs, whose error would not name the file
        if plan.fp4_share is None:
            plan = dataclasses.replace(plan, fp4_share=fp4_share(plan.assignment, flops))
        return plan
    if settings.is_adaptive:
        return Plan.uniform(fqns, "fp8", flops)
    return Plan.uniform(fqns, settings.plan, flops)


def initialize(model: nn.Module, config: Mapping[str, Any], settings: Optional[SnipSettings] = None, *,
               tokens_per_step: int, logger=None, seed: int = 0, plan: Optional[Plan] = None,
               statistics_stream=None) -> SnipEngine:
    """Swaps the decoder linears, builds the DeepSpeed engine and returns a :class:`SnipEngine` with its plan.

    Args:
        model: a Llama-family causal LM (not yet wrapped by DeepSpeed).
        config: the DeepSpeed config. Its ``"snip"`` section never reaches DeepSpeed; it is read (and
            validated: unknown keys are errors) when ``settings`` is None.
        settings: the validated ``"snip"`` section; None reads ``config["snip"]`` (defaults if absent).
        tokens_per_step: tokens per optimizer step on one rank (scales FLOPs; shares do not depend on it).
        logger: a TensorBoard logger on the logging rank (see :mod:`snip_ds.tensorboard`), else None.
        seed: seeds the stochastic-rounding generators.
        plan: the starting plan; None: :func:`initial_plan` of the settings.
        statistics_stream: adaptive runs only: an object whose ``next_batch()`` returns a micro-batch (a
            mapping with ``input_ids``, optional ``labels``) to collect statistics on, ideally a private
            stream so that collecting never shifts the training data (``launch/train.py`` passes one);
            None collects on the first ``collect_batches`` micro-batches of the step about to be taken.

    With an adaptive plan, :meth:`SnipEngine.train_step` runs SNIP by itself: statistics before the first
    step and every ``replan_every`` steps, the ILP on rank 0, the plan broadcast and checked on every rank.

    torch.distributed is started if it is not yet (gloo on CPU, nccl on GPU; one rank in a plain ``python``
    process), and ``"auto"`` values are resolved as ``launch/train.py`` does (``snip.train.max_steps`` sizes
    the scheduler).

    Raises:
        ConfigError: an invalid ``"snip"`` section or DeepSpeed value (the message names the field).
        ValueError: an invalid plan file.
        snip_ds.backend.BackendError: ``snip.quant.backend`` cannot run here (names backend, recipe, device).
    """
    config = dict(config)
    section = config.pop("snip", None)
    if settings is None:
        settings = parse_snip_section(section, source="DeepSpeed config")
    init_distributed()  # a no-op under a launcher that already did it; one rank in a plain python process
    # "auto" values as launch/train.py resolves them (a no-op for a config it already resolved)
    config = resolve_ds_config(config, max_steps=settings.train.max_steps, on_gpu=torch.cuda.is_available(),
                               source="DeepSpeed config", world_size=sdist.world_size())
    if not any(getattr(p, "ds_id", None) is not None for p in model.parameters()):  # not zero.Init-partitioned
        model.to(device())  # so the stochastic-rounding generators live where the activations do
    check_backend(settings.quant, device())  # BackendError (a ValueError) before DeepSpeed starts
    infos = swap_linears(model, "bf16", settings.quant, seed=seed, rank=sdist.rank(), exclude=settings.exclude)
    if plan is None:
        plan = initial_plan(list(infos), {f: info.flops(tokens_per_step) for f, info in infos.items()}, settings)
    params = [p for p in model.parameters() if p.requires_grad]
    ds_engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    check_still_swapped(ds_engine.module, infos, "deepspeed.initialize")
    ckpt.install_safe_loader(ds_engine)
    engine = SnipEngine(ds_engine, infos, settings, tokens_per_step, logger)
    engine.set_plan(plan, "initial plan")
    if settings.is_adaptive:
        from snip_ds.engine.adaptive import AdaptivePlanner
        engine.planner = AdaptivePlanner(engine, statistics_stream)
    return engine
