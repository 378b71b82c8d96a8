"""SNIP in the Hugging Face ``Trainer``: one line after building it, ``add_snip(trainer)``.

    trainer = Trainer(model=model, args=args, train_dataset=train, ...)
    add_snip(trainer)            # or: cb = SnipCallback(); Trainer(..., callbacks=[cb]); cb.attach(trainer)

The callback needs its Trainer (for ``Trainer.log``, the DeepSpeed engine and the optimizer), and
transformers hands callbacks neither: its ``CallbackHandler`` passes ``model``, ``processing_class``,
``optimizer`` and ``lr_scheduler`` as given to ``Trainer(...)`` (so no DeepSpeed optimizer) and the data
loaders. Hence the explicit :func:`add_snip` / :meth:`SnipCallback.attach`; a ``SnipCallback`` that was
never attached stops ``trainer.train()`` before the first step, saying what to call.

:class:`SnipCallback` is the Trainer's thin driver of :class:`snip_ds.engine.state.SnipState`, the object
:func:`snip_ds.initialize`'s engine drives in its own loop:

* ``on_init_end`` or :meth:`~SnipCallback.attach`, whichever comes first (both before the Trainer builds
  the optimizer): reads the ``"snip"`` section of the Trainer's DeepSpeed config (``TrainingArguments.
  deepspeed``, or the config file of accelerate's DeepSpeed plugin under ``accelerate launch``) or the
  settings given to the callback, checks it against the ``TrainingArguments`` once (:func:`snip_ds.hf.checks.
  check_trainer`, whose frozen result the later hooks read instead of the arguments), and
  swaps the decoder linears for :class:`~snip_ds.linear.SnipLinear` keeping the very same Parameters
  (:func:`snip_ds.swap.swap_linears`), so the optimizer and ZeRO see the parameters they would have seen; with
  DeepSpeed it builds the fused Adam and, until ``on_train_begin``, holds ``TORCH_CUDA_ARCH_LIST`` in the form
  DeepSpeed's JIT builder reads (:func:`snip_ds.runtime.jit_builds.deepspeed_arch_list_set`), for the ops DeepSpeed
  builds while the Trainer starts it;
* ``on_train_begin`` (the DeepSpeed engine or the torch optimizer is built): under tensor parallelism
  (``tensor_parallel.autotp_size`` N above 1) turns the shards DeepSpeed's AutoTP put in place of the swapped
  layers into quantized ones (:mod:`snip_ds.hf.tp`); builds the state over a
  :class:`~snip_ds.hf.loop.TrainerLoop`, puts the non-finite check in front of the update (the DeepSpeed
  engine's ``step``, or without DeepSpeed the ``step`` of the torch optimizer inside accelerate's wrapper), and
  applies the starting plan, or on a resumed run the plan, planner state, streams and rounding generators saved
  in ``checkpoint-N`` (the only plan logged then is the restored one; :mod:`snip_ds.hf.checkpoint`);
* ``on_step_begin`` (the optimizer-step boundary, before the step's first micro-batch):
  :meth:`~snip_ds.engine.state.SnipState.before_step`: in an adaptive run, before step 1, at the ``early_replan_steps``
  and every ``replan_every`` steps (:mod:`snip_ds.engine.schedule`), the
  :class:`~snip_ds.engine.adaptive.AdaptivePlanner` collects statistics on a private seeded stream
  over the training set (the Trainer's data order is never touched), reads Adam's second moments from the
  Trainer's optimizer (DeepSpeed ZeRO 0-3 or torch AdamW, :mod:`snip_ds.engine.adam_state`), solves on rank 0,
  broadcasts and applies the plan (rank 0 prints one line); right after each re-plan and every
  ``additional_bf16_fwd_every_n_steps`` steps it measures the forward divergence and the loss change of the
  plan in force on a second private stream;
* the update: every gradient of the step is checked for NaN/Inf; the ranks agree, then ``snip.nonfinite``
  "stop" raises :class:`~snip_ds.engine.state.NonFiniteError` before the update (the message names the step, the rank
  and the first such parameter; the Trainer does not hand SNIP its batches, so the module is not located) and
  "skip" leaves parameters, optimizer state and the learning rate as they were (``train/skipped_steps``);
* ``on_save``: writes ``snip_state.json`` (:meth:`~snip_ds.engine.state.SnipState.state_dict`,
  :data:`snip_ds.report.artifacts.STATE_FORMAT`) and one ``snip_rng_rank<r>.safetensors`` (stochastic-rounding
  generators) per rank into the Trainer's ``checkpoint-N`` folder: the files ``launch/train.py``'s checkpoints
  hold too, which ``snip-ds show/diff/plan/export`` read. Checkpoints of older versions
  (:data:`snip_ds.report.artifacts.TRAINER_STATE_FORMAT`) still resume.

Scalars go through ``Trainer.log`` (so every ``report_to`` integration receives them); the precision map and
the plan-change notes go to TensorBoard when a ``TensorBoardCallback`` is reporting.

This module holds the callback's lifecycle; the Trainer-specific checks are :mod:`snip_ds.hf.checks`', the
Trainer as SNIP's loop :mod:`snip_ds.hf.loop`'s, the checkpoint files :mod:`snip_ds.hf.checkpoint`'s and
tensor parallelism :mod:`snip_ds.hf.tp`'s.

May import: run/ (its data stream), engine/ and everything below it; never export/, families/ or experiments/. Its
modules: :mod:`.checks`, :mod:`.checkpoint`, :mod:`.loop`, :mod:`.tp`.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import os
from typing import Any, Mapping, Optional

import torch
from transformers import TrainerCallback

from snip_ds.runtime import distributed as sdist
from snip_ds.hf import checkpoint as hf_checkpoint, tp as hf_tp
from snip_ds.runtime import jit_builds
from snip_ds.report.artifacts import STATE_FILE
from snip_ds.engine.builds import load_cpu_quantizer
from snip_ds.runtime.deprecations import show_deprecations_once
from snip_ds.hf.checks import TrainerChecks, check_trainer, uses_deepspeed
from snip_ds.hf.loop import BatchView, TrainerLogger, TrainerLoop, sequence_length
from snip_ds.config.settings import ConfigError, SnipSettings
from snip_ds.engine.state import MEASURE_SEED_OFFSET, STATS_SEED_OFFSET, SnipState, run_without_update

jit_builds.prepare()  # where DeepSpeed builds its ops when the Trainer starts it (snip_ds.runtime.jit_builds)
show_deprecations_once()  # torch's FutureWarnings for the collectives DeepSpeed calls: once, not every step


def share_cpu_ranks_with_accelerate(args) -> None:
    """Several CPU ranks under DeepSpeed: tell accelerate about them (call right after ``TrainingArguments``,
    before the ``Trainer``; a no-op on GPUs, for one rank, and without DeepSpeed).

    accelerate (1.1 to 1.15 at least) picks a distributed backend only for accelerators (CUDA, XPU, ...): on a
    CPU with DeepSpeed, from ``TrainingArguments(deepspeed=...)`` or ``accelerate launch`` with a DeepSpeed
    plugin, its state says one process while the launcher started several and DeepSpeed trains them together:
    every rank would read the same batches, and gathering evaluation losses fails. Starting DeepSpeed's process
    group (gloo) first and recording it in accelerate's shared state gives each rank its own shard of the data,
    as on GPUs. :class:`SnipCallback` refuses to train when it was needed and not called. The process group's
    timeout is ``args.ddp_timeout`` (seconds), as accelerate gives it on GPUs: a collective (SNIP's statistics
    collection, a plan broadcast, the non-finite flag) that a peer does not join within it raises on the
    waiting rank, and a peer that dies is noticed at once (its connections close).
    """
    if not uses_deepspeed(args) or torch.cuda.is_available() or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return
    import deepspeed
    import torch.distributed as dist
    from accelerate.utils import DistributedType

    from snip_ds.engine.core import release_shm_buffer

    # TrainingArguments.ddp_timeout bounds every collective, SNIP's included (accelerate passes it on GPUs too)
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=args.ddp_timeout))
    release_shm_buffer()
    state = args.distributed_state
    state.backend, state.distributed_type = "gloo", DistributedType.DEEPSPEED
    state.num_processes, state.process_index = dist.get_world_size(), dist.get_rank()
    state.local_process_index = int(os.environ.get("LOCAL_RANK", "0"))


def _prepare_fused_adam(args) -> None:
    """DeepSpeed's fused Adam, built before the Trainer starts DeepSpeed (so a ``TORCH_CUDA_ARCH_LIST`` such as
    ``9.0a`` does not stop its build), or torch's AdamW in the configs the Trainer will hand DeepSpeed, with a
    warning, where it cannot be built (:mod:`snip_ds.engine.optimizer`)."""
    from snip_ds.engine.optimizer import prepare_adam_in_place

    plugin = getattr(args, "deepspeed_plugin", None)
    prepare_adam_in_place([getattr(getattr(args, "hf_deepspeed_config", None), "config", None),
                           getattr(getattr(plugin, "hf_ds_config", None), "config", None),
                           getattr(plugin, "deepspeed_config", None)])


def add_snip(trainer, settings: Optional[Mapping[str, Any] | SnipSettings] = None) -> "SnipCallback":
    """SNIP for ``trainer``: call right after ``trainer = Trainer(...)``, before ``trainer.train()``.

    Attaches the ``SnipCallback`` already among the Trainer's callbacks, or adds a new one (with ``settings``:
    see :class:`SnipCallback`); returns it.
    """
    from transformers import Trainer

    if not isinstance(trainer, Trainer):
        raise TypeError(f"add_snip: expected a transformers.Trainer, got {type(trainer).__name__}")
    present = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, SnipCallback)]
    if len(present) > 1:
        raise ConfigError("add_snip: the Trainer has several SnipCallbacks; give it one")
    if present:
        if settings is not None:
            raise ConfigError("add_snip(trainer, settings=...): the Trainer already has a SnipCallback; give the "
                              "settings to it (SnipCallback(settings=...)) or leave it out of callbacks=[...]")
        return present[0].attach(trainer)
    return SnipCallback(settings).attach(trainer)


class SnipCallback(TrainerCallback):
    """SNIP FP8/FP4 mixed precision for a ``transformers.Trainer``: ``add_snip(trainer)`` creates and attaches
    one; or ``Trainer(..., callbacks=[cb])`` followed by ``cb.attach(trainer)``.

    Args:
        settings: the ``"snip"`` section as a mapping (or :class:`~snip_ds.config.settings.SnipSettings`), for a
            Trainer without a DeepSpeed config; None reads the section from the Trainer's DeepSpeed config
            (``TrainingArguments.deepspeed``, or accelerate's DeepSpeed plugin under ``accelerate launch``).
            Its ``train`` part belongs to ``launch/train.py`` and is not used here (the Trainer's arguments
            decide), except that ``TrainingArguments.seed`` replaces ``train.seed``.

    Errors found before training (an unknown or invalid key, a DeepSpeed batch size or accumulation that
    disagrees with the ``TrainingArguments``, a malformed ``SNIP_DS_TRITON_DIRECT``, a plan file naming layers the
    model lacks, a model without decoder linears or with MoE experts (:mod:`snip_ds.decoder`), an ``exclude`` glob
    matching no layer, CPU
    ranks accelerate does not know of, a tensor-parallel degree that does not divide the ranks, heads or widths
    or comes with a ``train_batch_size`` other than "auto") are raised from ``Trainer(...)`` (a
    callback given there) or from :func:`add_snip` as :class:`~snip_ds.config.settings.ConfigError` or ``ValueError``
    with one line naming the field or file.

    Attributes:
        state: SNIP's :class:`~snip_ds.engine.state.SnipState` over the Trainer (after ``on_train_begin``): the plan in
            force, the planner, the streams, the skipped steps; the same object ``snip_ds.initialize``'s engine
            drives.
        planner: its :class:`~snip_ds.engine.adaptive.AdaptivePlanner` in an adaptive run, else None.
        settings: the validated ``"snip"`` section, held by the state once it exists (one owner).
        checks: what :func:`~snip_ds.hf.checks.check_trainer` checked and resolved from the ``TrainingArguments``
            (settings, DeepSpeed config, ranks, tensor-parallel degree), once, at the setup; None before it.
    """

    def __init__(self, settings: Optional[Mapping[str, Any] | SnipSettings] = None) -> None:
        from snip_ds.backend.kernels.switches import direct_switched_on

        direct_switched_on()  # a malformed SNIP_DS_TRITON_DIRECT: an error now, not where the Triton kernels load
        self._given = settings
        self.checks: Optional[TrainerChecks] = None  # what hf_checks.check_trainer checked and resolved, once
        self._settings: Optional[SnipSettings] = None  # the resolved settings until the state takes them
        self.trainer = None
        self.infos = None
        self.plan = None
        self.state: Optional[SnipState] = None
        self._held = None  # the stand-in for the scheduler's step after a skipped update (see _hold_schedule)
        self._builds = contextlib.ExitStack()  # settings held while the Trainer starts DeepSpeed
        self._resumed_from = None  # trainer.train(resume_from_checkpoint=...)
        self._originals = {}  # under tensor parallelism: {fqn: the SnipLinear AutoTP replaces}
        self._zero_init = False  # whether deepspeed.zero.Init partitioned the model as it was built

    # ------------------------------------------------------------------ before the optimizer exists
    def attach(self, trainer) -> "SnipCallback":
        """Connects the callback to ``trainer`` (call before ``trainer.train()``); adds it to the Trainer's
        callbacks if it is not there, and then reads the settings and swaps the linears as ``on_init_end``
        does. ``trainer.train`` is wrapped (on this instance) to learn its ``resume_from_checkpoint``, which
        transformers tells no callback: SNIP's state is restored from there, and a DeepSpeed checkpoint of another
        number of ranks or tensor-parallel degree is refused before the Trainer reads it. Returns the callback."""
        from transformers import Trainer

        if not isinstance(trainer, Trainer):
            raise TypeError(f"SnipCallback.attach: expected a transformers.Trainer, got {type(trainer).__name__}")
        if self.trainer is not None and self.trainer is not trainer:
            raise ConfigError("SnipCallback.attach: already attached to another Trainer; use one SnipCallback "
                              "per Trainer")
        if getattr(trainer, "is_in_train", False):
            raise ConfigError("SnipCallback.attach: the Trainer is training; attach before trainer.train()")
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        if self.trainer is None:
            self._note_resume_argument(trainer)
        self.trainer = trainer
        self._setup(trainer.args, trainer.model)
        return self

    def _note_resume_argument(self, trainer) -> None:
        """Keeps ``trainer.train(resume_from_checkpoint=...)``'s folder, which transformers tells no callback, for
        :meth:`_restore` (the Trainer's method is wrapped on this instance only)."""
        original = trainer.train

        @functools.wraps(original)
        def train(*args, **kwargs):
            self._resumed_from = kwargs.get("resume_from_checkpoint", args[0] if args else None)
            if self.checks is not None:
                hf_checkpoint.check_resume_shape(self.checks, trainer.args.output_dir, self._resumed_from)
            return original(*args, **kwargs)
        trainer.train = train

    def on_init_end(self, args, state, control, model=None, **kwargs):
        self._setup(args, model)
        return control

    def _setup(self, args, model) -> None:
        """Checks (:func:`~snip_ds.hf.checks.check_trainer`, whose result the hooks read from then on) and the
        swap; once (``on_init_end`` and :meth:`attach` both call it)."""
        from snip_ds.config.model_settings import check_layer_settings, initial_plan
        from snip_ds.swap import model_layers, swap_model

        if self.infos is not None:
            return
        checks = check_trainer(args, self._given)
        tp = checks.tp
        if checks.ds_config is not None:
            _prepare_fused_adam(args)
            # The Trainer starts DeepSpeed inside train(), where it may build more ops (the CPU Adam of an
            # optimizer offload): until on_train_begin the architecture list reads as DeepSpeed can parse it.
            self._builds.enter_context(jit_builds.deepspeed_arch_list_set())
        self._settings = checks.settings
        # partitioned by deepspeed.zero.Init as transformers built it under ZeRO-3 (DeepSpeed has not started yet)
        self._zero_init = any(getattr(p, "ds_id", None) is not None for p in model.parameters())
        rank = int(os.environ.get("RANK", "0")) if not sdist.is_initialized() else sdist.rank()
        infos = swap_model(model, "bf16", self.settings.quant, seed=args.seed, rank=rank,
                           exclude=self.settings.exclude)
        check_layer_settings(infos, self.settings)
        if tp > 1:  # AutoTP rebuilds these layers as its own shards in deepspeed.initialize: on_train_begin
            self._originals = hf_tp.check_swapped_model(model, infos, self.settings, tp)  # quantizes them again
        # FLOPs per step, for the shares (which do not depend on the token count)
        flops = {fqn: info.flops(1) for fqn, info in infos.items()}
        try:
            self.plan = initial_plan(list(infos), flops, self.settings)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        for fqn, layer in model_layers(model).items():
            layer.precision = self.plan.assignment[fqn]
        self.infos, self.checks = infos, checks

    @property
    def tp(self) -> int:
        """The tensor-parallel degree (``tensor_parallel.autotp_size``; 1 without, and before the checks)."""
        return self.checks.tp if self.checks is not None else 1

    # ------------------------------------------------------------------ optimizer built
    def on_train_begin(self, args, state, control, **kwargs):
        from snip_ds.run.data import DataStream
        from snip_ds.swap import check_still_swapped

        self._builds.close()  # DeepSpeed is started: the user's architecture list again

        trainer, s = self.trainer, self.settings  # the state's, where an earlier train() built one
        if trainer is None:
            raise RuntimeError("SnipCallback is not attached to its Trainer (transformers does not hand it to "
                               "callbacks): after trainer = Trainer(...), call snip_ds.hf.add_snip(trainer), or "
                               "callback.attach(trainer) for the SnipCallback in callbacks=[...]")
        if sdist.is_initialized():  # DeepSpeed's CPU all-reduce buffers are mapped by now: unlink their names
            from snip_ds.engine.core import release_shm_buffer
            release_shm_buffer()
        if self.tp > 1:  # AutoTP's shards of the swapped layers, at the plan's precision from here on
            hf_tp.quantize_shards(trainer.model, self._originals, s, self.tp)
        check_still_swapped(trainer.model, self.infos, "the Trainer's model preparation (deepspeed.initialize)")
        loop = TrainerLoop(trainer, self.tp)
        load_cpu_quantizer(next(trainer.model.parameters()).device)  # built now, not inside SNIP's first timing
        block = sequence_length(trainer.train_dataset)
        tokens_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * block
        self.state = SnipState(loop, self.infos, s, tokens_per_step, TrainerLogger(trainer), driver="trainer",
                               zero_init=self._zero_init)
        self._settings = None  # the state's from here on: one owner
        if s.is_adaptive:
            from snip_ds.engine.adaptive import AdaptivePlanner

            data = BatchView(trainer.train_dataset, trainer.data_collator)
            rank, world = loop.dp_rank, loop.dp_size  # a tensor-parallel group reads the same batches
            try:
                stream = DataStream(data, args.per_device_train_batch_size, seed=args.seed + STATS_SEED_OFFSET,
                                    rank=rank, world_size=world)
            except ValueError as err:
                raise ValueError(f"training set: statistics stream: {err}") from None
            self.state.measure_stream = DataStream(data, args.per_device_train_batch_size,
                                                   seed=args.seed + MEASURE_SEED_OFFSET, rank=rank, world_size=world)
            self.state.planner = AdaptivePlanner(self.state, stream)
        self._guard_updates(loop)
        if state.global_step > 0:  # a resumed run: the saved plan is the first one applied and logged
            self._restore(args, state)
        else:
            self.state.set_plan(self.plan, "initial plan")
        return control

    @property
    def settings(self) -> Optional[SnipSettings]:
        """The validated ``"snip"`` section (``TrainingArguments.seed`` as ``train.seed``), once read: the
        state's (:attr:`snip_ds.engine.state.SnipState.settings`) from ``on_train_begin`` on, the callback's until then;
        None before the callback has read them."""
        return self.state.settings if self.state is not None else self._settings

    @property
    def planner(self):
        """The :class:`~snip_ds.engine.adaptive.AdaptivePlanner` of an adaptive run (after ``on_train_begin``),
        else None."""
        return self.state.planner if self.state is not None else None

    def on_step_begin(self, args, state, control, **kwargs):
        self.state.before_step()  # re-plan / measure if due, on the private streams
        self.state.guard.arm()  # the step's training backward passes are checked from here to the update
        return control

    # ------------------------------------------------------------------ non-finite numbers
    def _guard_updates(self, loop: TrainerLoop) -> None:
        """Puts the non-finite check in front of the step's update: the DeepSpeed engine's ``step`` (accelerate
        calls it inside ``accelerator.backward`` at the accumulation boundary; the Trainer's own
        ``optimizer.step()`` is a no-op there), or the step of the torch optimizer inside accelerate's wrapper
        without DeepSpeed (called once per optimizer step, at the accumulation boundary). The
        ranks agree (one all-reduced flag); then ``snip.nonfinite`` "stop" raises NonFiniteError before the
        update and "skip" leaves parameters, optimizer state and the learning rate as they were."""
        ds = loop.ds_engine
        if ds is not None:
            original = ds.step

            def ds_step(*a, **k):
                if ds.is_gradient_accumulation_boundary() and self._nonfinite_step():
                    return run_without_update(ds.optimizer, lambda: original(*a, **k), ds.lr_scheduler)
                return original(*a, **k)
            ds.step = ds_step
        else:  # the torch optimizer inside accelerate's wrapper (whose step the lr scheduler tracks)
            opt = loop.optimizer
            original = opt.step

            @functools.wraps(original)
            def opt_step(*a, **k):
                if self._nonfinite_step():
                    self._hold_schedule()
                    return None
                return original(*a, **k)
            opt.step = opt_step

    def _hold_schedule(self) -> None:
        """The Trainer steps its learning-rate scheduler right after the (skipped) update: that one call does
        nothing, so the learning rate stays where it was, as DeepSpeed's own overflow skip leaves it. The stand-in
        removes itself when called, and :meth:`on_step_end` removes one the Trainer did not call, so the
        scheduler's ``state_dict`` never holds it."""
        scheduler = self.trainer.lr_scheduler
        if scheduler is None or "step" in vars(scheduler):
            return

        def held(*args, **kwargs):
            del scheduler.step
        scheduler.step = self._held = held

    def on_step_end(self, args, state, control, **kwargs):
        scheduler = self.trainer.lr_scheduler if self.trainer is not None else None
        if scheduler is not None and self._held is not None and vars(scheduler).get("step") is self._held:
            del scheduler.step
        self._held = None
        self.state.after_step()
        return control

    def _nonfinite_step(self) -> bool:
        """Collective, before the update: whether the step went non-finite on any rank (then "skip" counts it and
        the caller skips the update; "stop" raises :class:`~snip_ds.engine.state.NonFiniteError`)."""
        guard = self.state.guard
        guard.note(None, None, guard.disarm())
        if not guard.agree():
            return False
        guard.act(int(self.trainer.args.gradient_accumulation_steps))
        return True

    # ------------------------------------------------------------------ checkpoints
    def on_save(self, args, state, control, **kwargs):
        if self.state is not None:
            hf_checkpoint.save_state(self.state, args.output_dir, state.global_step)
        return control

    def _restore(self, args, state) -> None:
        hf_checkpoint.restore_state(self.state, args, state.global_step, self._resumed_from)


__all__ = ["SnipCallback", "STATE_FILE", "add_snip", "share_cpu_ranks_with_accelerate"]
