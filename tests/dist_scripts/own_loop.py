"""A user's own training loop on ``snip_ds.initialize`` alone: the DeepSpeed JSON (with its "snip" section)
goes in, ``engine.train_step`` is called with the user's batches, and SNIP re-plans by itself.

Run by tests/test_own_loop.py under the deepspeed launcher (2 ranks, ZeRO-3). ``--case``:

* ``replan``: adaptive SNIP every 2 steps for 5 steps; writes each rank's re-plan history and plan digests.
* ``first_unsolvable``: every layer pinned to fp8, so no plan reaches the FP4 target: every rank must stop
  with the same ConfigError (none may hang in the broadcast).
* ``replan_fails``: at the second re-plan (step 2) the user's forward hook on ``model.layers.1.mlp`` turns
  its output to NaN on rank 1 in the statistics' forward only: the all-reduced statistics of every layer are
  non-finite, every layer is pinned to fp8, and rank 0's real solve cannot reach efficiency_saving 0.5: every
  rank keeps the plan in force and trains on (the training forward is clean).
* ``save``: adaptive SNIP every 2 steps, ZeRO-1, 3 steps, then ``engine.save_checkpoint``; writes each rank's
  parameter sum, plan digest and re-plan history. ``resume`` (``--resume PATH``, 1 rank, accumulation 2: the
  same global batch): ``snip_ds.initialize(..., resume_from=PATH)``, then one more step; writes the same
  figures after the resume, the step's loss, or the error (``CheckpointError``) a refused resume raises.
* ``nonfinite_stop`` / ``nonfinite_skip`` (``_bf16``: with DeepSpeed's bf16; ``_z0``, ``_z2``: ZeRO
  stage 0 or 2 instead of 3): the user's own forward hook on ``model.layers.1.mlp`` turns its
  output to NaN on rank 1 in step 3 (a custom module that overflows); with ``snip.nonfinite`` "stop" every
  rank raises the same NonFiniteError, with "skip" step 3 leaves every parameter and the learning rate (a linear
  warm-up) as they were and training goes on. Writes each rank's losses, parameter sums (float64, gathered) and
  learning rates after every step, the error or the skip count.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import snip_ds  # noqa: E402
from snip_ds.runtime import distributed as sdist  # noqa: E402
from snip_ds.engine import init_distributed  # noqa: E402
from snip_ds.config.settings import ConfigError  # noqa: E402

from probes import param_sum  # noqa: E402  (tests/dist_scripts, the script's folder)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--case", required=True, choices=("replan", "first_unsolvable", "replan_fails", "nonfinite_stop",
                                                     "nonfinite_skip", "nonfinite_skip_bf16", "nonfinite_skip_z0",
                                                     "nonfinite_skip_z2", "save", "resume"))
    p.add_argument("--out", required=True)
    p.add_argument("--resume", help="resume: the checkpoint to resume from")
    args = p.parse_args()
    init_distributed()
    rank = sdist.rank()
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=32))
    snip = {"plan": "adaptive", "replan_every": 2, "efficiency_saving": 0.5,
            "additional_bf16_fwd_every_n_steps": 0, "train": {"seed": 0}}
    if args.case == "first_unsolvable":
        snip["pinned"] = {f"model.layers.{i}.{m}": "fp8" for i in range(2)
                          for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    collect_poison = {"on": False}
    if args.case == "replan_fails":
        def overflow_once(module, inputs, output):  # NaN out of the next forward only, when switched on
            if collect_poison["on"]:
                collect_poison["on"] = False
                return output * float("nan")
            return output
        model.model.layers[1].mlp.register_forward_hook(overflow_once)
    poison = {"on": False}
    logger = None
    if args.case.startswith("nonfinite"):
        snip = {"plan": "fp8", "nonfinite": args.case.split("_")[1], "train": {"seed": 0}}

        def overflow(module, inputs, output):  # the user's own module overflowing: NaN out, when switched on
            poison["calls"] = poison.get("calls", 0) + 1
            return output * float("nan") if poison["on"] and poison["calls"] >= 2 else output
        model.model.layers[1].mlp.register_forward_hook(overflow)
        from snip_ds.report.tensorboard import make_logger
        logger = make_logger(Path(f"{args.out}.tb"), rank)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2 if logger else 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "steps_per_print": 10 ** 9, "snip": snip}
    if logger:  # a learning rate that rises every step: a skipped step must leave it where it was
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                              "warmup_num_steps": 10, "warmup_type": "linear"}}
    if args.case.endswith("_bf16"):
        config["bf16"] = {"enabled": True}
    if args.case.endswith(("_z0", "_z2")):
        config["zero_optimization"] = {"stage": int(args.case[-1])}
    out = {"rank": rank}
    if args.case in ("save", "resume"):
        config["zero_optimization"] = {"stage": 1}
        config["gradient_accumulation_steps"] = 2 if args.case == "resume" else 1
        out.update(_save_or_resume(model, config, args, rank))
        Path(f"{args.out}.{rank}").write_text(json.dumps(out))
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        return 0
    if args.case.startswith("nonfinite"):
        try:
            out.update(_nonfinite_run(model, config, logger, poison, rank))
        except snip_ds.NonFiniteError as err:
            out["error"] = str(err)
        logger.close()
        Path(f"{args.out}.{rank}").write_text(json.dumps(out))
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        return 0
    try:
        engine = snip_ds.initialize(model, config, tokens_per_step=2 * 16)
        gen = torch.Generator().manual_seed(1 + rank)
        digests, shares = [], []
        for _ in range(5):
            ids = torch.randint(0, 64, (2, 16), generator=gen)
            # replan_fails: the first forward of step 3 is the statistics collection of the re-plan at step 2
            collect_poison["on"] = args.case == "replan_fails" and rank == 1 and engine.step == 2
            engine.train_step([{"input_ids": ids, "labels": ids}])
            digests.append(engine.plan.digest())
            shares.append(engine.plan_fp4_share())
        out.update(history=engine.planner.history, digests=digests, shares=shares, method=engine.plan.method)
    except ConfigError as err:
        out["error"] = str(err)
    Path(f"{args.out}.{rank}").write_text(json.dumps(out))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


def _save_or_resume(model, config, args, rank) -> dict:
    from snip_ds.engine.checkpoint_layout import CheckpointError

    micro = config["gradient_accumulation_steps"]
    try:
        engine = snip_ds.initialize(model, config, tokens_per_step=micro * 2 * 16, resume_from=args.resume)
    except CheckpointError as err:
        return {"error": str(err)}
    after = {"step": engine.step, "sum": param_sum(engine.ds.module), "digest": engine.plan.digest(),
             "history": engine.planner.history}
    gen = torch.Generator().manual_seed(1 + rank)
    batches = lambda: [{"input_ids": ids, "labels": ids} for ids in  # noqa: E731
                       (torch.randint(0, 64, (2, 16), generator=gen) for _ in range(micro))]
    if args.case == "resume":
        return {**after, "loss": engine.train_step(batches())}
    for _ in range(3):
        engine.train_step(batches())
    engine.save_checkpoint(f"{args.out}.ckpt", {})
    return {"step": engine.step, "sum": param_sum(engine.ds.module), "digest": engine.plan.digest(),
            "history": engine.planner.history}


def _nonfinite_run(model, config, logger, poison, rank) -> dict:
    """5 steps of 2 micro-batches; on rank 1 in step 3 the hook poisons every forward from the second on (the
    second micro-batch, and the re-run of it that locates the module)."""
    engine = snip_ds.initialize(model, config, tokens_per_step=2 * 2 * 16, logger=logger)
    gen = torch.Generator().manual_seed(1 + rank)
    rec = {"losses": [], "sums": [param_sum(engine.ds.module)], "steps": [], "lrs": [engine.ds.get_lr()[0]]}
    for step in range(1, 6):
        batches = []
        for _ in range(2):
            ids = torch.randint(0, 64, (2, 16), generator=gen)
            batches.append({"input_ids": ids, "labels": ids})
        poison.update(on=rank == 1 and step == 3, calls=0)
        rec["losses"].append(engine.train_step(batches))
        poison["on"] = False
        rec["sums"].append(param_sum(engine.ds.module))
        rec["steps"].append(engine.step)
        rec["lrs"].append(engine.ds.get_lr()[0])  # the next step's
    rec["skipped"] = engine.skipped_steps
    return rec


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as launch/train.py's finish(): skip the interpreter teardown (gloo's threads may abort it)
