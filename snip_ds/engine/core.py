"""``snip_ds.initialize`` and :class:`SnipEngine`: a DeepSpeed engine plus the current precision plan."""
from __future__ import annotations

import datetime
import os
import socket
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

from snip_ds.runtime import distributed as sdist
from snip_ds.runtime import faults
from snip_ds.runtime import jit_builds
from snip_ds.backend import check_backend
from snip_ds.engine.builds import load_cpu_quantizer
from snip_ds.runtime.deprecations import LR_BEFORE_START, dropped_logs
from snip_ds.config.deepspeed_config import resolve_ds_config, tensor_parallel_degree
from snip_ds.engine import checkpoint as ckpt
from snip_ds.engine.checkpoint_io import install_safe_loader
from snip_ds.engine.checkpoint_layout import (is_universal, model_architecture, model_config, model_fingerprint,
                                              read_meta, read_snip_state, resolve)
from snip_ds.engine.checkpoint_verify import validate
from snip_ds.engine.universal import check_universal_batch, with_load_universal
from snip_ds.engine import tensor_parallel as tpar
from snip_ds.engine.op_builds import announce_optimizer_build, quiet_shm_comm
from snip_ds.engine.optimizer import working_adam_config
from snip_ds.plan import Plan
from snip_ds.config.settings import SnipSettings, parse_snip_section
from snip_ds.engine.state import NonFiniteError, SnipState, located_forward_hooks, run_without_update
from snip_ds.config.model_settings import check_layer_settings, initial_plan
from snip_ds.swap import LayerInfo, check_still_swapped, snip_layers, swap_model

__all__ = ["DeepSpeedLoop", "NonFiniteError", "SnipEngine", "destroy_distributed", "init_distributed", "initialize"]


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
    with quiet_shm_comm():  # a line when its CPU collectives build; none when they only load
        deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    release_shm_buffer()


def destroy_distributed() -> None:
    """Destroys the process group that :func:`init_distributed` made, and DeepSpeed's references to it.

    DeepSpeed keeps groups it derives from the world group (its clone of it, the data-parallel group) in
    module globals; ``torch.distributed.destroy_process_group`` alone leaves them pointing at the destroyed
    group, and the next ``deepspeed.initialize`` in the same process (a second in-process training run)
    fails with "Group ... is not registered". ``deepspeed.comm.destroy_process_group`` releases them.
    A no-op when no process group is up.
    """
    if not dist.is_initialized():
        return
    from deepspeed.comm import comm as ds_comm  # the module: the package re-exports its `cdb` at import (None)

    if getattr(ds_comm, "cdb", None) is not None:
        ds_comm.destroy_process_group()
    else:  # set up by someone else than deepspeed.init_distributed: DeepSpeed holds nothing of it
        dist.destroy_process_group()


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


class DeepSpeedLoop:
    """The :class:`~snip_ds.engine.state.TrainingLoop` of a ``DeepSpeedEngine``."""

    def __init__(self, ds_engine) -> None:
        self.ds = ds_engine

    @property
    def module(self) -> nn.Module:
        return self.ds.module

    @property
    def optimizer(self):
        return self.ds.optimizer

    @property
    def step(self) -> int:
        return int(self.ds.global_steps)

    @property
    def zero_stage(self) -> int:
        return int(self.ds.zero_optimization_stage())

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (the ranks of a tensor-parallel group share their batches)."""
        return int(self.ds.dp_world_size)

    def lr(self) -> float:
        """The learning rate of the next optimizer step (read from the optimizer, which the scheduler sets)."""
        return float(self.ds.optimizer.param_groups[0]["lr"])

    def forward(self, **inputs):
        return self.ds(**inputs)


class SnipEngine:
    """A DeepSpeed engine whose decoder linears follow a :class:`~snip_ds.plan.Plan`: the thin driver of a
    :class:`~snip_ds.engine.state.SnipState` in a loop that hands it each step's micro-batches.

    Attributes:
        ds: the ``DeepSpeedEngine``.
        state: SNIP's :class:`~snip_ds.engine.state.SnipState` (plan, planner, streams, generators, skipped steps);
            ``infos``, ``layers``, ``flops``, ``settings``, ``logger``, ``plan``, ``planner`` and
            ``skipped_steps`` read through to it.
    """

    def __init__(self, ds_engine, infos: Mapping[str, LayerInfo], settings: SnipSettings,
                 tokens_per_step: int, logger=None, zero_init: bool = False) -> None:
        self.ds = ds_engine
        self.state = SnipState(DeepSpeedLoop(ds_engine), infos, settings, tokens_per_step, logger, driver="engine",
                               zero_init=zero_init)

    # ------------------------------------------------------------------ the state's parts
    infos = property(lambda self: self.state.infos)
    layers = property(lambda self: self.state.layers)
    flops = property(lambda self: self.state.flops)
    settings = property(lambda self: self.state.settings)
    logger = property(lambda self: self.state.logger)
    tokens_per_step = property(lambda self: self.state.tokens_per_step)
    plan = property(lambda self: self.state.plan, doc="The plan in force.")
    skipped_steps = property(lambda self: self.state.skipped_steps,
                             doc="Steps skipped for a non-finite loss or gradient (snip.nonfinite \"skip\").")

    @property
    def planner(self):
        """The :class:`~snip_ds.engine.adaptive.AdaptivePlanner` of an adaptive run (None otherwise)."""
        return self.state.planner

    @property
    def step(self) -> int:
        """Optimizer steps taken so far."""
        return self.state.step

    @property
    def zero_stage(self) -> int:
        return self.state.zero_stage

    @property
    def tensor_parallel(self) -> int:
        """The tensor-parallel degree (``tensor_parallel.autotp_size``; 1 without tensor parallelism)."""
        return max(int(self.ds.autotp_size()), 1)

    def lr(self) -> float:
        """The learning rate of the next optimizer step (read from the optimizer, which the scheduler sets)."""
        return self.state.lr()

    def set_plan(self, plan: Plan, reason: str = "") -> None:
        """Applies ``plan`` to every layer (:meth:`snip_ds.engine.state.SnipState.set_plan`)."""
        self.state.set_plan(plan, reason)

    def plan_fp4_share(self) -> float:
        """FP4 share of the linear-GEMM FLOPs under the current plan."""
        return self.state.plan_fp4_share()

    # ------------------------------------------------------------------ steps
    def _forward_loss(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        dev = device()
        out = self.ds(input_ids=batch["input_ids"].to(dev), labels=batch["labels"].to(dev))
        return out.loss

    def train_step(self, micro_batches: Sequence[Mapping[str, torch.Tensor]]) -> float:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches; returns the global mean loss.

        First :meth:`snip_ds.engine.state.SnipState.before_step`: in an adaptive run the planner re-plans if it is due
        (:mod:`snip_ds.engine.schedule`: before the first step, at the ``early_replan_steps`` and every ``replan_every``
        steps: collect, solve on rank 0, broadcast, switch), and right after a re-plan and every
        ``additional_bf16_fwd_every_n_steps`` steps two extra no-grad forwards of one batch (the
        private measurement stream's, else the first micro-batch; BF16, then the plan) give the measured forward
        divergence and the loss change the plan's quantization causes on that batch.

        Every micro-batch's loss and every parameter's gradient is checked for NaN/Inf; the ranks agree before
        the update (one flag all-reduced per step). The host reads the guard's agreed flag once, the
        micro-batches' losses once after the last, and their mean over the ranks. A non-finite step raises
        :class:`~snip_ds.engine.state.NonFiniteError` before its update, or with ``snip.nonfinite: "skip"`` is skipped
        (:attr:`skipped_steps`; its loss is returned).
        """
        ga = self.ds.gradient_accumulation_steps()
        if len(micro_batches) != ga:
            raise ValueError(f"train_step needs {ga} micro-batches (gradient_accumulation_steps), "
                             f"got {len(micro_batches)}")
        st = self.state
        st.before_step(micro_batches)
        guard = st.guard
        losses = []
        for i, batch in enumerate(micro_batches):
            loss = self._forward_loss(batch)
            guard.arm()
            try:
                self.ds.backward(loss)
            finally:
                flags = guard.disarm()
            if not losses:
                faults.pause_point("step", self.step, sdist.rank())  # a test's fault injection; else a no-op
            guard.note(i, loss, flags)
            # Before the update (the last micro-batch's ds.step()), the ranks agree whether any saw a non-finite
            # loss or gradient: one all-reduce of one flag per optimizer step.
            if i == ga - 1 and guard.agree():
                # raises NonFiniteError unless snip.nonfinite is "skip"
                guard.act(ga, lambda j: self._first_nonfinite_module(micro_batches[j]))
                run_without_update(self.ds.optimizer, self.ds.step, self.ds.lr_scheduler)
            else:
                self.ds.step()
            losses.append(loss.detach())  # read once, after the step (the same float64 mean as each read apart)
        st.after_step()
        return float(sdist.dist_mean(torch.stack(losses).double().cpu().mean()))

    @torch.no_grad()
    def _first_nonfinite_module(self, batch: Mapping[str, torch.Tensor]) -> Optional[str]:
        """The name and class of the first module (in the order modules finish their forward) whose output
        holds a NaN or Inf on ``batch``, or None. Restores the RNG state, so training is not shifted."""
        found: List[str] = []
        handles = located_forward_hooks(self.ds.module, found)
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

    @torch.no_grad()
    def evaluate(self, batches: Sequence[Mapping[str, torch.Tensor]]) -> float:
        """Mean validation loss over ``batches`` and all ranks, with the current plan's forward."""
        was_training = self.ds.module.training
        self.ds.eval()
        total = torch.zeros((), dtype=torch.float64, device=device())
        for batch in batches:
            total += self._forward_loss(batch).double()  # on the device, read once: the same float64 sum
        total = total.cpu()
        if was_training:
            self.ds.train()
        return float(sdist.dist_mean(total / max(len(batches), 1)))

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir: str | Path, extra: Mapping[str, Any]) -> Path:
        """Saves DeepSpeed's state plus ours under ``save_dir/step_<N>``; ``latest`` moves only when complete.

        SNIP's state goes into ``snip_state.json`` and ``snip_rng_rank<r>.safetensors``
        (:meth:`snip_ds.engine.state.SnipState.state_dict`, the Trainer's format too); ``snip_meta.json`` holds
        ``extra`` (the data stream, lr schedule, tokenizer), the model's config and every file's checksum."""
        meta = {"step": self.step, "model_config": model_config(self.ds.module), **extra}
        if self.tensor_parallel > 1:
            meta["tensor_parallel"] = self.tensor_parallel
        return ckpt.save(self.ds, Path(save_dir), f"step_{self.step}", meta, self.state.rank_tensors(),
                         self.state.state_dict(), model_fingerprint(self.ds.module), sdist.world_size(),
                         model_architecture(self.ds.module))

    def load_checkpoint(self, path: str | Path) -> Dict[str, Any]:
        """Restores a checkpoint written by :meth:`save_checkpoint` (or by an older snip_ds, whose plan and
        planner state are in ``snip_meta.json``); returns its metadata.

        Raises:
            CheckpointError: missing/incomplete checkpoint, a different model or a different world size (a
                universal checkpoint, ``snip-ds universal``'s, resumes at any world size, when the DeepSpeed
                engine was initialized with :func:`~snip_ds.engine.universal.with_load_universal`'s config, as
                :func:`initialize` with ``resume_from`` does).
            ValueError: SNIP's state does not fit this run (an adaptive run from a fixed-plan checkpoint).
        """
        tag_dir = resolve(Path(path))
        meta = validate(tag_dir, model_fingerprint(self.ds.module), sdist.world_size(),
                        model_architecture(self.ds.module), self.tensor_parallel)
        tensors = ckpt.load(self.ds, tag_dir, sdist.rank())
        self.state.load_rank_tensors(tensors, global_rngs=True)  # {} on a rank the saving run did not have
        snip, source = read_snip_state(tag_dir, meta)
        self.state.load_state_dict(snip, source, any_world_size=is_universal(meta))
        return meta


def initialize(model: nn.Module, config: Mapping[str, Any], settings: Optional[SnipSettings] = None, *,
               tokens_per_step: int, logger=None, seed: int = 0, plan: Optional[Plan] = None,
               statistics_stream=None, measurement_stream=None,
               resume_from: Optional[str | Path] = None) -> SnipEngine:
    """Swaps the decoder linears and MoE experts (:func:`snip_ds.swap.swap_model`), builds the DeepSpeed engine
    and returns a :class:`SnipEngine` with its plan.

    Args:
        model: a decoder-only causal LM (not yet wrapped by DeepSpeed): Llama-like, fused projections, or MoE.
        config: the DeepSpeed config. Its ``"snip"`` section never reaches DeepSpeed; it is read (and
            validated: unknown keys are errors) when ``settings`` is None.
        settings: the validated ``"snip"`` section; None reads ``config["snip"]`` (defaults if absent).
        tokens_per_step: tokens per optimizer step on one rank (scales FLOPs; shares do not depend on it).
        logger: a TensorBoard logger on the logging rank (see :mod:`snip_ds.report.tensorboard`), else None.
        seed: seeds the stochastic-rounding generators.
        plan: the starting plan; None: :func:`initial_plan` of the settings.
        statistics_stream: adaptive runs only: an object whose ``next_batch()`` returns a micro-batch (a
            mapping with ``input_ids``, optional ``labels``) to collect statistics on, ideally a private
            stream so that collecting never shifts the training data (``launch/train.py`` passes one);
            None collects on the first ``collect_batches`` micro-batches of the step about to be taken.
        measurement_stream: adaptive runs only: like ``statistics_stream`` (another private stream), the batches
            the measured divergence and ``snip/measured_loss_change`` are computed on every
            ``additional_bf16_fwd_every_n_steps`` steps; None measures on the step's first micro-batch.
        resume_from: a checkpoint :meth:`SnipEngine.save_checkpoint` wrote (its tag directory, the save
            directory with ``latest``, or a run's output directory), or a universal one (``snip-ds
            universal``'s, resumed at any number of ranks with the global batch and ZeRO stage it was saved
            with): restored before this returns, DeepSpeed initialized as it needs (for a universal one with
            ``"checkpoint": {"load_universal": true}``). The data position is the caller's (the checkpoint's
            ``snip_meta.json`` holds what ``save_checkpoint``'s ``extra`` gave).

    With ``"tensor_parallel": {"autotp_size": N}`` DeepSpeed's AutoTP shards the decoder linears over N ranks and
    every shard runs at the plan's precision (:mod:`snip_ds.engine.tensor_parallel`); the ranks of a tensor-parallel
    group must be handed the same batches (data-parallel rank ``rank // N`` of ``world // N``), and
    ``tokens_per_step`` stays one rank's.

    With an adaptive plan, :meth:`SnipEngine.train_step` runs SNIP by itself: statistics before the first
    step, at the ``early_replan_steps`` and every ``replan_every`` steps (:mod:`snip_ds.engine.schedule`), the ILP on
    rank 0, the plan broadcast and checked on every rank.

    torch.distributed is started if it is not yet (gloo on CPU, nccl on GPU; one rank in a plain ``python``
    process), and ``"auto"`` values are resolved as ``launch/train.py`` does (``snip.train.max_steps`` sizes
    the scheduler).

    Raises:
        ConfigError: an invalid ``"snip"`` section or DeepSpeed value (the message names the field).
        ValueError: an invalid plan file.
        snip_ds.backend.BackendError: ``snip.quant.backend`` cannot run here (names backend, recipe, device).
        CheckpointError: ``resume_from`` is missing, incomplete, of another model, or of another number of
            ranks or tensor-parallel degree and not universal (the message names the file or field).
    """
    config = dict(config)
    section = config.pop("snip", None)
    if settings is None:
        settings = parse_snip_section(section, source="DeepSpeed config")
    init_distributed()  # a no-op under a launcher that already did it; one rank in a plain python process
    # "auto" values as launch/train.py resolves them (a no-op for a config it already resolved)
    config = resolve_ds_config(config, max_steps=settings.train.max_steps, on_gpu=torch.cuda.is_available(),
                               source="DeepSpeed config", world_size=sdist.world_size())
    tag_dir = None
    if resume_from is not None:
        tag_dir = resolve(Path(resume_from))
        meta = read_meta(tag_dir)
        config = with_load_universal(config, meta)
    zero_init = any(getattr(p, "ds_id", None) is not None for p in model.parameters())  # built under zero.Init
    if not zero_init:
        model.to(device())  # so the stochastic-rounding generators live where the activations do
    check_backend(settings.quant, device())  # BackendError (a ValueError) before DeepSpeed starts
    infos = swap_model(model, "bf16", settings.quant, seed=seed, rank=sdist.rank(), exclude=settings.exclude)
    check_layer_settings(infos, settings)
    tp = tensor_parallel_degree(config, "DeepSpeed config", sdist.world_size())
    originals = snip_layers(model) if tp > 1 else {}
    if tp > 1:
        tpar.check_deepspeed_version(deepspeed.__version__)
        tpar.check_model(infos, settings, getattr(model, "config", None), tp, model)
    if plan is None:
        plan = initial_plan(list(infos), {f: info.flops(tokens_per_step) for f, info in infos.items()}, settings)
    params = [p for p in model.parameters() if p.requires_grad]
    config = working_adam_config(config)  # torch's Adam, with a warning, where DeepSpeed's fused one cannot build
    load_cpu_quantizer(device())  # built now if due, never inside the first statistics' time
    announce_optimizer_build(config)
    # the other ops DeepSpeed builds while it starts; its scheduler asked for its rate before the first step
    with jit_builds.deepspeed_arch_list_set(), dropped_logs("DeepSpeed", LR_BEFORE_START):
        ds_engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    if tp > 1:
        tpar.check_groups(tp, sdist.rank(), sdist.world_size())
        tpar.quantize_tp_layers(ds_engine.module, originals, settings.quant)
    check_still_swapped(ds_engine.module, infos, "deepspeed.initialize")
    install_safe_loader(ds_engine)
    engine = SnipEngine(ds_engine, infos, settings, tokens_per_step, logger, zero_init=zero_init)
    engine.set_plan(plan, "initial plan")
    if settings.is_adaptive:
        from snip_ds.engine.adaptive import AdaptivePlanner
        engine.state.planner = AdaptivePlanner(engine.state, statistics_stream)
        engine.state.measure_stream = measurement_stream
    if tag_dir is not None:
        ds = engine.ds
        dp = engine.state.dp_size  # DeepSpeed's train_batch_size() counts tensor-parallel ranks too
        micro, ga = ds.train_micro_batch_size_per_gpu(), ds.gradient_accumulation_steps()
        check_universal_batch(tag_dir, meta, micro * ga * dp, micro, ga, dp, ds.zero_optimization_stage())
        engine.load_checkpoint(tag_dir)
    return engine
