"""Plan-quality comparison (SNIP.md section 7): paired training runs from one checkpoint, and their statistics.

Every plan of one comparison *cell* (a warm-up checkpoint × a data-order seed) starts from the same saved model
and optimizer state, sees the same batches and draws its stochastic rounding from generators seeded the same
way, so the difference of two plans' validation losses is a *paired* difference: the noise the runs share
cancels. This module holds the pieces, in plain torch (one process, FP32 on CPU, torch AdamW):

* :class:`TrainSettings`, :func:`make_optimizer`, :func:`train_steps`, :func:`evaluate` — the training loop;
* :func:`apply_plan`, :func:`bf16_forward` — put a :class:`~snip_ds.plan.Plan` on the model, or run a
  BF16 (unquantized) forward whatever the plan; :func:`predicted_divergence`, :func:`attainable_share` —
  what the statistics predict for a plan, and the FP4 share every method is solved at;
* :func:`save_checkpoint`, :func:`load_checkpoint` — model as safetensors, optimizer with ``torch.save``,
  read back with ``weights_only=True``;
* :func:`mean_se`, :func:`cell_means`, :func:`paired_differences` — means with standard errors of paired differences;
  :func:`spearman` — rank correlation (average ranks for ties).

Orchestration (the grid, the report, the plots) lives in ``launch/compare_plans.py``.
"""
from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from snip_ds.plan import Plan
from snip_ds.planner.costs import predicted_divergence  # noqa: F401  (the cost model's; imported from here too)
from snip_ds.swap import snip_layers

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
    """Mean next-token cross entropy of a causal LM on token ids ``[B, L]`` (FP32 logits)."""
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
# Plans on a model
# --------------------------------------------------------------------------------------------------------
def apply_plan(model: nn.Module, plan: Plan) -> None:
    """Sets every SnipLinear's precision from ``plan`` (per-layer or per-GEMM).

    Raises:
        ValueError: The plan and the model's SnipLinear layers are not the same set of fqns.
    """
    layers = snip_layers(model)
    plan.check_layers(layers, source=f"plan ({plan.method})")
    for fqn, layer in layers.items():
        value = plan.assignment[fqn]
        layer.precision = value if isinstance(value, str) else dict(value)


@contextmanager
def bf16_forward(model: nn.Module) -> Iterator[None]:
    """Every SnipLinear at ``bf16`` (unquantized) inside the block; the previous precisions after it."""
    layers = snip_layers(model)
    saved = {fqn: m.precision for fqn, m in layers.items()}
    try:
        for m in layers.values():
            m.precision = "bf16"
        yield
    finally:
        for fqn, m in layers.items():
            m.precision = saved[fqn]


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


def attainable_share(flops: Mapping[str, float], target: float, tol: float = 1e-9) -> float:
    """The smallest FP4 share ``>= target`` that some set of whole layers reaches exactly.

    Layer FLOPs are discrete, so a share such as 0.9 is usually not reachable exactly; solving every method
    at this share, as both the lower and the upper bound, lands all of them on the same FP4 share.

    Args:
        flops: ``{fqn: F}`` per-step FLOPs of each layer.
        target: The nominal share ρ in [0, 1].
        tol: Absolute tolerance of the comparison with ``target``.
    """
    if not 0.0 <= target <= 1.0:
        raise ValueError(f"target must lie in [0, 1], got {target!r}")
    values = [float(f) for f in flops.values()]
    if not values or any(not (math.isfinite(f) and f >= 0) for f in values):
        raise ValueError("flops must be a non-empty mapping of finite numbers >= 0")
    total = sum(values)
    if total == 0:
        return 0.0 if target <= tol else 1.0
    sums = {0.0}
    for f in values:  # distinct subset sums; few, since a model has few distinct layer shapes
        sums |= {s + f for s in sums}
    return min(s / total for s in sums if s / total >= target - tol)


# --------------------------------------------------------------------------------------------------------
# Paired statistics
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MeanSE:
    """Mean, standard error of the mean (sample SD / √n; NaN for n < 2) and count."""

    mean: float
    se: float
    n: int

    def to_dict(self) -> Dict[str, Any]:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


def mean_se(values: Iterable[float]) -> MeanSE:
    """:class:`MeanSE` of ``values`` (NaN mean for none)."""
    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        return MeanSE(float("nan"), float("nan"), 0)
    mean = sum(xs) / n
    if n < 2:
        return MeanSE(mean, float("nan"), 1)
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return MeanSE(mean, math.sqrt(var / n), n)


def cell_means(records: Sequence[Mapping[str, Any]], key: str, cell_keys: Sequence[str],
               select: Callable[[Mapping[str, Any]], bool]) -> Dict[tuple, float]:
    """Per cell (the values of ``cell_keys``), the mean of ``key`` over the selected records that have it."""
    cells: Dict[tuple, List[float]] = {}
    for r in records:
        if r.get(key) is not None and select(r):
            cells.setdefault(tuple(r.get(k) for k in cell_keys), []).append(float(r[key]))
    return {c: sum(v) / len(v) for c, v in cells.items()}


def paired_differences(records: Sequence[Mapping[str, Any]], key: str, cell_keys: Sequence[str],
                       select: Callable[[Mapping[str, Any]], bool],
                       reference: Callable[[Mapping[str, Any]], bool]) -> List[float]:
    """Per cell, ``mean(key over selected records) - mean(key over reference records)``.

    Records are grouped by the values of ``cell_keys`` (e.g. phase, seed, rho); a cell without both a
    selected and a reference record contributes nothing. Averaging within a cell first (e.g. over several
    random plans) keeps one difference per cell, so the standard error counts cells, the independent units.
    """
    sel, ref = (cell_means(records, key, cell_keys, f) for f in (select, reference))
    return [m - ref[c] for c, m in sel.items() if c in ref]


def paired_verdict(diff: MeanSE, room: MeanSE, z: float = 2.0) -> Dict[str, Any]:
    """How a paired difference ``method − baseline`` stands (negative: the method is better).

    Args:
        diff: Mean ± SE over cells of the method's loss minus the baseline's.
        room: Mean ± SE over the same cells of the baseline's loss minus the reference's (uniform FP8): how
            far the baseline is from the reference's quality.
        z: Standard errors that resolve a difference.

    Returns:
        ``below`` (mean < 0), ``resolved`` (|mean| > z·SE; ``None`` without an SE), ``floor`` (the room is
        under z·SE of the difference: a plan exactly at the reference's quality could not be shown below the
        baseline with these cells; ``None`` without an SE) and ``cells_to_resolve`` (the cells at which the
        observed mean would stand z standard errors from 0 if it held, n·(z·SE/|mean|)², for an unresolved
        difference; else ``None``).
    """
    has_se = diff.n > 1 and math.isfinite(diff.se)
    resolved = abs(diff.mean) > z * diff.se if has_se else None
    cells = (math.ceil(diff.n * (z * diff.se / abs(diff.mean)) ** 2)
             if has_se and not resolved and diff.mean != 0 else None)
    floor = bool(room.n and room.mean < z * diff.se) if has_se else None
    return dict(below=bool(diff.mean < 0), resolved=resolved, floor=floor, cells_to_resolve=cells)


def _ranks(xs: Sequence[float]) -> List[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of two equally long sequences (NaN for fewer than 3 pairs or a constant)."""
    if len(a) != len(b):
        raise ValueError(f"spearman: sequences of different lengths ({len(a)} and {len(b)})")
    if len(a) < 3:
        return float("nan")
    ra, rb = _ranks([float(x) for x in a]), _ranks([float(x) for x in b])
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va, vb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    return cov / math.sqrt(va * vb) if va > 0 and vb > 0 else float("nan")
