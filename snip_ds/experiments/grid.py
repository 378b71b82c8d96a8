"""The plan-comparison grid: which methods run, the presets of a quick and a full grid, the warm-up phases,
and the study model with its data and fixed validation batches.

A grid is phases (warm-up checkpoints) × seeds (data order and rounding) × FP4 shares ρ × methods (and λ for
SNIP, plan seeds for the random plans); a *cell* is one phase × one seed, and all runs of a cell are paired.
"""
from __future__ import annotations

from typing import Dict

import torch

from snip_ds.run.data import load_dataset_blocks
from snip_ds.run.model import build_model
from snip_ds.planner.costs import METHODS
from snip_ds.swap import swap_model

# the planner's methods that an ILP solves at the grid's share (the uniform ones are plans without a solve, and
# so is BF16; last_k_fp8 is a rule whose share moves in whole blocks, so it cannot be paired at one share)
SOLVED = tuple(m for m in METHODS if not m.startswith("uniform_") and m != "last_k_fp8")
UNIFORM = ("bf16", "uniform_fp8", "uniform_fp4")
# one GEMM kind in FP4 in every layer, the rest FP8 (ρ-independent, opt-in): what each kind costs on its own
KIND_PLANS = {"fp4_fprop": ("fprop",), "fp4_dgrad": ("dgrad",), "fp4_wgrad": ("wgrad",),
              "fp4_backward": ("dgrad", "wgrad")}
DEFAULT_METHODS = UNIFORM + SOLVED
METHOD_CHOICES = DEFAULT_METHODS + tuple(KIND_PLANS)
# model: "tiny" (--quick) or "small" (default), see _model_config; the rest are argparse defaults
QUICK = dict(model="tiny", block_size=32, batch_size=4, phases="30", seeds="0", rhos="0.5", lambdas="1,2,1000",
             num_random=1, steps=4, eval_batches=2, stat_batches=2, lr_warmup_steps=5)
FULL = dict(model="small", block_size=64, batch_size=8, phases="200,800", seeds="0,1,2", rhos="0.5,0.75,0.9",
            lambdas="1,2,30,100,1000", num_random=3, steps=100, eval_batches=64, stat_batches=64, lr_warmup_steps=20)


def snip_label(lam: float) -> str:
    """The label of SNIP's plan at λ ``lam`` in records and reports, e.g. ``best λ=2``."""
    return f"best λ={lam:g}"


# --------------------------------------------------------------------------------------------------------
# Set-up: model, data, validation batches
# --------------------------------------------------------------------------------------------------------
def _model_config(name: str, block_size: int):
    from transformers import LlamaConfig
    sizes = {"tiny": dict(hidden_size=32, intermediate_size=96, num_attention_heads=2),
             "small": dict(hidden_size=128, intermediate_size=384, num_attention_heads=4)}
    return LlamaConfig(vocab_size=264, num_hidden_layers=4, num_key_value_heads=2, max_position_embeddings=max(
        block_size, 256), use_cache=False, tie_word_embeddings=False, **sizes[name])


def build(args):
    """The grid's model (every decoder linear a BF16 SnipLinear, every MoE experts module a BF16
    :class:`~snip_ds.experts.module.SnipExperts`), training blocks and fixed validation batches."""
    caps = dict(max_bytes=2 ** 18, max_validation_bytes=2 ** 15) if args.quick and args.dataset is None else {}
    train_ds, val_ds, vocab, _ = load_dataset_blocks(args.dataset, args.block_size, **caps)
    config = args.model_config or _model_config(args.model, args.block_size)
    model = build_model(model_config=config, vocab_size=vocab, seed=args.seed, block_size=args.block_size)
    model.to(getattr(args, "device", "cpu"))  # before the swap: stochastic-rounding generators live on the weights' device
    swap_model(model, "bf16", args.quant, seed=args.seed)
    need = args.eval_batches * args.batch_size
    if len(val_ds) < need:
        raise ValueError(f"validation split has {len(val_ds)} blocks; --eval_batches x --batch_size needs {need}")
    g = torch.Generator().manual_seed(12345)
    order = torch.randperm(len(val_ds), generator=g).tolist()[:need]
    val_batches = [val_ds.get_batch(order[i * args.batch_size:(i + 1) * args.batch_size])["input_ids"]
                   for i in range(args.eval_batches)]
    return model, train_ds, val_batches


def parse_phases(text: str) -> Dict[str, int]:
    """``"100,400"`` -> ``{"early": 100, "late": 400}``; ``"late:400"`` names a phase explicitly."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    default = ["early"] if len(items) == 1 else ["early", "late"] if len(items) == 2 else \
        [f"phase{i}" for i in range(len(items))]
    phases = {}
    for item, name in zip(items, default):
        if ":" in item:
            name, item = item.split(":", 1)
        try:
            phases[name] = int(item)
        except ValueError:
            raise ValueError(f"--phases: {item!r} is not a step count; expected e.g. '100,400' or 'late:400'")
    steps = list(phases.values())
    if not steps or len(phases) != len(items) or any(s < 1 for s in steps) or steps != sorted(set(steps)):
        raise ValueError(f"--phases: warm-up step counts must be positive, increasing and uniquely named, "
                         f"got {text!r}")
    return phases

