"""The training loop of the plan comparison, in plain torch (one process, FP32 master weights, torch AdamW;
on the CPU, or on the model's GPU for the GPU study).

* :class:`TrainSettings`, :func:`make_optimizer`, :func:`train_steps`, :func:`evaluate`, :func:`lm_loss` —
  train a causal LM for some steps on a learning-rate schedule, and score it by validation loss;
* :func:`save_checkpoint`, :func:`load_checkpoint` — model as safetensors, optimizer with ``torch.save``,
  read back with ``weights_only=True``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

CKPT_MODEL, CKPT_OPTIMIZER, CKPT_META = "model.safetensors", "optimizer.pt", "meta.json"


# --------------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainSettings:
    """AdamW hyper-parameters and batch shape of a comparison.

    Attributes:
        lr: Peak learning rate (constant after ``lr_warmup_steps`` until ``decay_start``).
        betas: AdamW (β₁, β₂).
        eps: AdamW ε.
        weight_decay: Decoupled weight decay.
        grad_clip: Global gradient-norm clip (0 disables it).
        batch_size: Sequences per step.
        lr_warmup_steps: Linear learning-rate warm-up from the first step of training (counted over the
            whole run, so a comparison resumed after it runs at the constant rate).
        decay_start: Global step from which the rate decays linearly (``None``: no decay).
        decay_steps: Length of that decay: step ``decay_start + i`` runs at ``lr * (1 - i / decay_steps)``,
            so the last of ``decay_steps`` steps runs at ``lr / decay_steps`` and any later step at 0.
    """

    lr: float = 2e-3
    betas: Tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    batch_size: int = 8
    lr_warmup_steps: int = 20
    decay_start: Optional[int] = None
    decay_steps: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip must be >= 0 (0 disables clipping), got {self.grad_clip!r}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size!r}")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"lr_warmup_steps must be >= 0, got {self.lr_warmup_steps!r}")
        if self.decay_start is not None and (self.decay_start < 0 or self.decay_steps < 1):
            raise ValueError(f"a decay needs decay_start >= 0 and decay_steps >= 1, got decay_start="
                             f"{self.decay_start!r}, decay_steps={self.decay_steps!r}")

    def lr_at(self, step: int) -> float:
        """Learning rate of global optimizer step ``step`` (0-based)."""
        lr = self.lr * (step + 1) / self.lr_warmup_steps if step < self.lr_warmup_steps else self.lr
        if self.decay_start is not None and step >= self.decay_start:
            lr *= max(0.0, 1.0 - (step - self.decay_start) / self.decay_steps)
        return lr


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of a causal LM on token ids ``[B, L]`` (FP32 logits), on the model's device
    (the batches come from the CPU)."""
    ids = ids.to(next(model.parameters()).device)
    logits = model(input_ids=ids).logits.float()  # [B, L, V]
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def make_optimizer(model: nn.Module, settings: TrainSettings) -> torch.optim.AdamW:
    """Plain torch AdamW over every parameter, one param group."""
    return torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=settings.betas, eps=settings.eps,
                             weight_decay=settings.weight_decay)


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, next_batch: Callable[[], Mapping],
                steps: int, settings: TrainSettings, start_step: int = 0) -> List[float]:
    """Runs ``steps`` optimizer steps; returns the training loss of each.

    Args:
        model: The causal LM (its SnipLinear precisions decide the GEMMs).
        optimizer: Its optimizer; the learning rate is set from ``settings.lr_at`` before every step.
        next_batch: Returns the next batch, a mapping with ``input_ids``.
        steps: Number of steps.
        settings: Hyper-parameters.
        start_step: Global index of the first step (for the learning-rate schedule).

    Raises:
        FloatingPointError: A loss is not finite (names the step).
    """
    model.train()
    losses = []
    for i in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = settings.lr_at(start_step + i)
        loss = lm_loss(model, next_batch()["input_ids"])
        if not torch.isfinite(loss):
            raise FloatingPointError(f"training loss is {loss.item()} at step {start_step + i}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if settings.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        losses.append(float(loss.detach()))
    optimizer.zero_grad(set_to_none=True)
    return losses


@torch.no_grad()
def evaluate(model: nn.Module, batches: Sequence[torch.Tensor]) -> float:
    """Token-weighted mean validation loss over ``batches`` (each ``[B, L]`` ids; equal shapes weigh equally)."""
    if not batches:
        raise ValueError("evaluate: batches is empty")
    was_training = model.training
    model.eval()
    try:
        total = sum(lm_loss(model, ids).item() * ids[:, 1:].numel() for ids in batches)
        return total / sum(ids[:, 1:].numel() for ids in batches)
    finally:
        model.train(was_training)


# --------------------------------------------------------------------------------------------------------
# Checkpoints (no pickles: safetensors for the model, weights_only for the optimizer's tensors)
# --------------------------------------------------------------------------------------------------------
def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | Path,
                    meta: Optional[Mapping[str, Any]] = None) -> Path:
    """Writes ``model.safetensors``, ``optimizer.pt`` and ``meta.json`` (JSON scalars) under ``path``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(path / CKPT_MODEL))
    torch.save(optimizer.state_dict(), path / CKPT_OPTIMIZER)
    (path / CKPT_META).write_text(json.dumps(dict(meta or {}), sort_keys=True), encoding="utf-8")
    return path


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | Path) -> Dict[str, Any]:
    """Loads what :func:`save_checkpoint` wrote (optimizer with ``weights_only=True``); returns the meta.

    Raises:
        FileNotFoundError: A checkpoint file is missing (named).
    """
    from safetensors.torch import load_file

    path = Path(path)
    for name in (CKPT_MODEL, CKPT_OPTIMIZER, CKPT_META):
        if not (path / name).is_file():
            raise FileNotFoundError(f"checkpoint {str(path)!r} has no {name}")
    model.load_state_dict(load_file(str(path / CKPT_MODEL)))
    optimizer.load_state_dict(torch.load(path / CKPT_OPTIMIZER, weights_only=True))
    return json.loads((path / CKPT_META).read_text(encoding="utf-8"))

