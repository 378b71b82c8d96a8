"""The Hugging Face ``Trainer`` as the loop :class:`snip_ds.engine.state.SnipState` drives under
:class:`snip_ds.hf.SnipCallback`: :class:`TrainerLoop` (its model, optimizer, step count, ZeRO stage and
data-parallel layout), :class:`TrainerLogger` (scalars through ``Trainer.log``, images and text to TensorBoard)
and :class:`BatchView` (the training set as SNIP's private streams read it).
"""
from __future__ import annotations

from typing import Mapping

import torch

from snip_ds.runtime import distributed as sdist


class BatchView:
    """The training set as :class:`~snip_ds.run.data.DataStream` reads it: ``get_batch(indices)`` through the
    Trainer's data collator (datasets of dicts of lists), or the dataset's own ``get_batch``."""

    def __init__(self, dataset, collator) -> None:
        self.dataset, self.collator = dataset, collator

    def __len__(self) -> int:
        return len(self.dataset)

    def get_batch(self, indices):
        if hasattr(self.dataset, "get_batch"):
            batch = self.dataset.get_batch(indices)
        else:
            batch = self.collator([self.dataset[i] for i in indices])
        return {k: v for k, v in batch.items() if k in ("input_ids", "labels", "attention_mask")}


class TrainerLoop:
    """The :class:`~snip_ds.engine.state.TrainingLoop` of a ``Trainer`` whose optimizer is built (``on_train_begin``):
    its model, the optimizer holding Adam's state (the DeepSpeed engine's ZeRO optimizer, or the torch
    optimizer inside accelerate's wrapper), its step count and ZeRO stage (0 without DeepSpeed)."""

    def __init__(self, trainer, tp: int = 1) -> None:
        self.trainer, self.tp = trainer, tp
        wrapped = trainer.model_wrapped if getattr(trainer, "is_deepspeed_enabled", False) else None
        self.ds_engine = wrapped if hasattr(wrapped, "zero_optimization_stage") else None

    @property
    def module(self):
        return self.trainer.model

    @property
    def optimizer(self):
        if self.ds_engine is not None:
            return self.ds_engine.optimizer
        opt = self.trainer.optimizer
        while hasattr(opt, "optimizer") and not isinstance(opt, _TORCH_OPTIMIZERS):  # accelerate's wrapper
            opt = opt.optimizer
        return opt

    @property
    def step(self) -> int:
        return int(self.trainer.state.global_step)

    @property
    def zero_stage(self) -> int:
        return int(self.ds_engine.zero_optimization_stage()) if self.ds_engine is not None else 0

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: the world size over the tensor-parallel degree."""
        return sdist.world_size() // self.tp

    @property
    def dp_rank(self) -> int:
        return sdist.rank() // self.tp

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def forward(self, **inputs):
        # The model itself (under ZeRO-3 its partitioned parameters are gathered by DeepSpeed's module hooks).
        return self.trainer.model(**inputs)


_TORCH_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW)


class TrainerLogger:
    """The engine's logger interface over the Trainer: scalars through ``Trainer.log`` (every reporter),
    images and text to the TensorBoard writer of a ``TensorBoardCallback`` when there is one (rank 0)."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def _tb(self):
        from transformers.integrations import TensorBoardCallback

        for cb in self.trainer.callback_handler.callbacks:
            if isinstance(cb, TensorBoardCallback) and getattr(cb, "tb_writer", None) is not None:
                return cb.tb_writer
        return None

    def scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars({tag: value}, step)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        # Trainer.log clears control.should_log (its on_log event): logged from a callback's on_step_end, after
        # the Trainer's flow callback asked for the step's log, it would swallow the step's loss and learning
        # rate. The request stands as it was.
        control = self.trainer.control
        should_log = control.should_log
        self.trainer.log({k: float(v) for k, v in values.items()})
        self.trainer.control.should_log = should_log

    @property
    def writes_images(self) -> bool:
        return self.trainer.is_world_process_zero() and self._tb() is not None

    def image(self, tag: str, chw, step: int) -> None:
        tb = self._tb() if self.trainer.is_world_process_zero() else None
        if tb is not None:
            tb.add_image(tag, chw, step)

    def text(self, tag: str, text: str, step: int) -> None:
        tb = self._tb() if self.trainer.is_world_process_zero() else None
        if tb is not None:
            tb.add_text(tag, text, step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def sequence_length(dataset) -> int:
    """Tokens per sample, for the FLOP counts (plans depend only on their ratios); 1 if unknown."""
    try:
        ids = dataset[0]["input_ids"]
        return max(1, len(ids))
    except Exception:  # an iterable dataset or items without input_ids: the shares do not need it
        return 1
