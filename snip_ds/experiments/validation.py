"""validate_metrics: SNIP's statistics against measured truths on fixed batches (docs/experiments.md, metric
validity).

:func:`run` warms a model up (plain torch AdamW, unquantized, FP32) or loads the warm-up; :func:`measure`
collects the statistics with every estimator and measures the truths (:mod:`snip_ds.experiments.truths`);
:mod:`snip_ds.experiments.scores` prints the per-layer table and computes the figures (the script prints
them as one JSON line).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

from snip_ds.stats import STUDY_FIELDS, CollectSettings, adam_precond, collect_statistics
from snip_ds.experiments.scores import print_table, read_truth_table, score, variants
from snip_ds.experiments.training import lm_loss
from snip_ds.experiments.truths import Measured, bwd_truth, fld_truth, fwd_truth
from snip_ds.swap import snip_layers, swap_linears

QUICK = dict(warmup_steps=40, batches=4, batch_size=2, block_size=64, lr=3e-3)
DEFAULTS = dict(warmup_steps=200, batches=16, batch_size=2, block_size=256, lr=2e-3)  # 16: see docs/experiments.md
CKPT_MODEL, CKPT_OPT, CKPT_META = "model.safetensors", "optimizer.pt", "validate_meta.json"


# --------------------------------------------------------------------------------------------------------
# Model, data, warm-up
# --------------------------------------------------------------------------------------------------------
def _tiny_config():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, use_cache=False,
                       tie_word_embeddings=False)


def build(args) -> tuple:
    """The model (every linear a BF16 SnipLinear), training blocks and validation blocks of ``args``."""
    from snip_ds.run.data import load_dataset_blocks
    from snip_ds.run.model import build_model
    caps = dict(max_bytes=2 ** 18, max_validation_bytes=2 ** 16) if args.quick and args.dataset is None else {}
    train_ds, val_ds, vocab, _ = load_dataset_blocks(args.dataset, args.block_size, **caps)
    config = args.model_config if args.model_config else (_tiny_config() if args.quick else None)
    model = build_model(model_config=config, vocab_size=vocab, seed=args.seed, block_size=args.block_size)
    swap_linears(model, "bf16", seed=args.seed)
    return model, train_ds, val_ds


def warm_up(model, opt, train_ds, args) -> float:
    """``args.warmup_steps`` unquantized AdamW steps on random training blocks; returns the seconds taken."""
    g = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    for step in range(args.warmup_steps):
        idx = torch.randint(0, len(train_ds), (args.batch_size,), generator=g).tolist()
        loss = lm_loss(model, train_ds.get_batch(idx)["input_ids"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if args.verbose and (step % 50 == 0 or step == args.warmup_steps - 1):
            print(f"warm-up step {step}: loss {loss.item():.4f}", file=sys.stderr)
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def load_or_warm(model, opt, train_ds, args) -> Dict[str, Any]:
    """Loads the warm-up from ``args.checkpoint`` if it holds one, else warms up (and saves it there if given)."""
    from safetensors.torch import load_file, save_file
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    if ckpt is not None and (ckpt / CKPT_MODEL).is_file():
        model.load_state_dict(load_file(str(ckpt / CKPT_MODEL)))
        opt.load_state_dict(torch.load(ckpt / CKPT_OPT, weights_only=True))
        return {"warmup_s": 0.0, "checkpoint": "loaded"}
    seconds = warm_up(model, opt, train_ds, args)
    if ckpt is not None:
        ckpt.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt / CKPT_MODEL))
        torch.save(opt.state_dict(), ckpt / CKPT_OPT)
        (ckpt / CKPT_META).write_text(json.dumps({"warmup_steps": args.warmup_steps, "seed": args.seed}))
    return {"warmup_s": seconds, "checkpoint": "saved" if ckpt is not None else "none"}


def run(args) -> Dict[str, Any]:
    """Measures and scores everything ``args`` (the parsed flags of ``launch/validate_metrics.py``) asks for;
    prints the per-layer table and returns the figures.

    Raises:
        ValueError: Too few validation blocks for the batches, or an unusable ``--truth_table``.
    """
    torch.manual_seed(args.seed)
    model, train_ds, val_ds = build(args)
    need = args.batches * args.batch_size
    if len(val_ds) < need:
        raise ValueError(f"validation split has {len(val_ds)} blocks; --batches x --batch_size needs {need}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    info = load_or_warm(model, opt, train_ds, args)
    g = torch.Generator().manual_seed(args.seed + 12345)
    order = torch.randperm(len(val_ds), generator=g).tolist()[:need]
    batches = [val_ds.get_batch(order[i * args.batch_size:(i + 1) * args.batch_size])["input_ids"]
               for i in range(args.batches)]
    fqns = list(snip_layers(model))
    table = read_truth_table(args.truth_table, fqns) if args.truth_table else None  # fail before the work

    t0 = time.perf_counter()
    measured = measure(model, opt, batches, fqns, args, table)
    truth, fld_variants, bwd_variants = variants(measured)
    print_table(measured, truth, fld_variants, bwd_variants)
    return score(measured, truth, fld_variants, bwd_variants, args, info,
                 total_seconds=time.perf_counter() - t0 + info["warmup_s"])


def measure(model, opt, batches: List[torch.Tensor], fqns: List[str], args, table=None) -> Measured:
    """The statistics of every estimator and the truths ``args`` asks for, on ``batches``.

    Args:
        model: The warmed-up model (every linear a BF16 SnipLinear).
        opt: Its AdamW optimizer, with the warm-up's state.
        batches: The fixed batches (token ids ``[B, L]`` each).
        fqns: The layers, in model order.
        args: The parsed flags (``bwd_rounding``, ``sr_draws``, ``bwd_truth``, ``bwd_truth_per_gemm``,
            ``fwd_truth``, ``fwd_probes``, ``seed``).
        table: ``(sym, one, gn, drift)`` read from ``--truth_table``: used instead of measuring FLD and BWD.
    """
    for _ in range(2):  # one training-step equivalent (fwd + bwd), warm then timed, for the cost figure
        t_step = time.perf_counter()
        loss = lm_loss(model, batches[0])
        torch.autograd.grad(loss, [p for p in model.parameters()])
        t_step = time.perf_counter() - t_step
    pc = adam_precond(model, opt)
    preds, timing = {}, {}
    for est in ("mc_fisher", "empirical", "isotropic"):
        t = time.perf_counter()
        how = CollectSettings(estimator=est, bwd_propagated=(est == "mc_fisher"), seed=args.seed,
                              bwd_rounding=args.bwd_rounding, study_fields=tuple(STUDY_FIELDS))
        preds[est] = collect_statistics(model, batches, how, lr=pc.lr, precond=pc.precond,
                                        step_scale=pc.step_scale, step=pc.step)
        timing[est] = time.perf_counter() - t
    t = time.perf_counter()
    if table is not None:  # re-score against the truths an earlier run printed (their means only)
        sym, one, gn, drift = table
    else:
        sym, one, gn = fld_truth(model, batches)
    t_fld = time.perf_counter() - t
    t = time.perf_counter()
    if table is None:
        drift = (bwd_truth(model, opt, batches, rounding=args.bwd_rounding, draws=args.sr_draws)["both"]
                 if args.bwd_truth else None)
    t_bwd = time.perf_counter() - t
    t = time.perf_counter()
    split = (bwd_truth(model, opt, batches, ("wgrad", "dgrad"), rounding=args.bwd_rounding, draws=args.sr_draws)
             if args.bwd_truth_per_gemm else None)
    t_split = time.perf_counter() - t
    fwd, fwd_pred, t_fwd = None, None, 0.0
    if args.fwd_truth:
        t = time.perf_counter()
        how = CollectSettings(seed=args.seed, bwd_rounding=args.bwd_rounding, forward_drift=True,
                              study_fields=tuple(STUDY_FIELDS))
        fwd_stats = collect_statistics(model, batches, how, lr=pc.lr, precond=pc.precond,
                                       step_scale=pc.step_scale, step=pc.step)
        timing["forward_drift"] = time.perf_counter() - t
        fwd_pred = [fwd_stats["layers"][f]["fwd"]["fp4"] for f in fqns]
        t = time.perf_counter()
        fwd = fwd_truth(model, opt, batches, probes=args.fwd_probes, seed=args.seed)
        t_fwd = time.perf_counter() - t
    return Measured(fqns=fqns, stats=preds, sym=sym, one=one, gn=gn, drift=drift, split=split, fwd=fwd,
                    fwd_pred=fwd_pred, optimizer_step=pc.step, step_scale=pc.step_scale,
                    seconds={"collect": timing, "fld_truth": t_fld, "bwd_truth": t_bwd,
                             "bwd_truth_per_gemm": t_split, "fwd_truth": t_fwd},
                    step_seconds=t_step)
