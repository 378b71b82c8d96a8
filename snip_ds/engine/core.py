"""``snip_ds.initialize`` and :class:`SnipEngine`: a DeepSpeed engine plus the current precision plan."""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

from snip_ds import distributed as sdist
from snip_ds.engine import checkpoint as ckpt
from snip_ds.metrics import NullLogger, precision_map_image
from snip_ds.plan import Plan
from snip_ds.snip_config import SnipSettings
from snip_ds.swap import LayerInfo, block_index, snip_layers, swap_linears


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> None:
    """Initialises torch.distributed the way DeepSpeed does: gloo on CPU, nccl on GPU.

    Works under the ``deepspeed`` launcher, ``torchrun``, and a plain ``python`` process (one rank).
    """
    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ or os.environ.get("SNIP_DS_SINGLE_PROCESS") == "1":
        # A plain `python launch/train.py` (or a test calling it in-process): one rank on a fresh port.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()), SNIP_DS_SINGLE_PROCESS="1")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend=backend)


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
        self.last_first_loss = float("nan")  # global mean loss of the last step's first micro-batch

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
            self.logger.image("plan/precision_map", precision_map_image(plan.assignment, block_index), self.step)
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
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches; returns the global mean loss."""
        ga = self.ds.gradient_accumulation_steps()
        if len(micro_batches) != ga:
            raise ValueError(f"train_step needs {ga} micro-batches (gradient_accumulation_steps), "
                             f"got {len(micro_batches)}")
        losses = []
        for batch in micro_batches:
            loss = self._forward_loss(batch)
            self.ds.backward(loss)
            self.ds.step()
            losses.append(loss.detach().double().cpu())
        local = torch.stack(losses)
        # One collective for both: the step's mean loss and the first micro-batch's (for the measured FLD).
        mean_first = sdist.dist_mean(torch.stack([local.mean(), local[0]]))
        self.last_first_loss = float(mean_first[1])
        return float(mean_first[0])

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
        meta = {"step": self.step, "plan": self.plan.to_dict() if self.plan else None,
                "settings": self.settings.to_dict(), **extra}
        return ckpt.save(self.ds, Path(save_dir), f"step_{self.step}", meta, state,
                         ckpt.model_fingerprint(self.ds.module), sdist.world_size())

    def load_checkpoint(self, path: str | Path) -> Dict[str, Any]:
        """Restores a checkpoint written by :meth:`save_checkpoint`; returns its metadata.

        Raises:
            CheckpointError: missing/incomplete checkpoint, a different model or a different world size.
        """
        tag_dir = ckpt.resolve(Path(path))
        meta = ckpt.validate(tag_dir, ckpt.model_fingerprint(self.ds.module), sdist.world_size())
        state = ckpt.load(self.ds, tag_dir, sdist.rank())
        for fqn, gen_state in state["generators"].items():
            self.layers[fqn].generator.set_state(gen_state)
        torch.set_rng_state(state["torch_rng"])
        if meta.get("plan"):
            self.set_plan(Plan.from_dict(meta["plan"], source=str(tag_dir / ckpt.META_FILE)), "restored")
        return meta


def initialize(model: nn.Module, config: Mapping[str, Any], settings: SnipSettings, *,
               tokens_per_step: int, logger=None, seed: int = 0) -> SnipEngine:
    """Swaps the decoder linears, builds the DeepSpeed engine and returns a :class:`SnipEngine`.

    Args:
        model: a Llama-family causal LM (not yet wrapped by DeepSpeed).
        config: the DeepSpeed config *without* its ``"snip"`` section.
        settings: the validated ``"snip"`` section.
        tokens_per_step: tokens per optimizer step on one rank (scales FLOPs; shares do not depend on it).
        logger: a TensorBoard logger on the logging rank (see :mod:`snip_ds.metrics`), else None.
        seed: seeds the stochastic-rounding generators.

    The engine starts with no plan: call :meth:`SnipEngine.set_plan` before the first step.
    """
    if not any(getattr(p, "ds_id", None) is not None for p in model.parameters()):  # not zero.Init-partitioned
        model.to(device())  # so the stochastic-rounding generators live where the activations do
    infos = swap_linears(model, "bf16", settings.quant, seed=seed, rank=sdist.rank())
    params = [p for p in model.parameters() if p.requires_grad]
    ds_engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=dict(config))
    ckpt.install_safe_loader(ds_engine)
    return SnipEngine(ds_engine, infos, settings, tokens_per_step, logger)
