"""Trains a tiny Mixtral (its experts swapped for SnipExperts) for 3 steps under DeepSpeed at one ZeRO stage,
then writes, as JSON, each expert pair's Σ_owned (t⊙P)² from snip_ds.engine.expert_state beside the same sum
from the full Adam state DeepSpeed gathers for it, and one statistics collection of the experts.

Run by tests/test_collect_experts.py as a plain one-rank process (``python experts_state_probe.py --stage 3
--out FILE``) or on two ranks through the deepspeed launcher: each rank trains on its half of a global batch
of 2 sequences per rank, the owned sums are summed over the ranks, and the collection is all-reduced.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from snip_ds.runtime import distributed as sdist  # noqa: E402
from snip_ds.engine import init_distributed  # noqa: E402
from snip_ds.engine.expert_state import expert_preconditioner  # noqa: E402
from snip_ds.experts.model import expert_points, swap_experts  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    init_distributed()
    rank, world = sdist.rank(), sdist.world_size()
    import deepspeed
    from deepspeed.utils import safe_get_full_optimizer_state
    from transformers import MixtralConfig, MixtralForCausalLM

    from snip_ds.stats import CollectSettings, collect_statistics

    torch.manual_seed(0)  # 3 experts: a ZeRO-3 rank boundary (half of each Parameter) falls inside expert 1
    model = MixtralForCausalLM(MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, num_local_experts=3,
                                             num_experts_per_tok=2, vocab_size=64, max_position_embeddings=32))
    swap_experts(model, "bf16", seed=1)
    betas, eps, steps = (0.9, 0.95), 1e-8, 3
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": list(betas), "eps": eps}},
           "zero_optimization": {"stage": args.stage}, "steps_per_print": 10 ** 9}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 64, (2 * world, 16), generator=gen)[2 * rank:2 * rank + 2]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    points = expert_points(engine.module)
    fn, source = expert_preconditioner(optimizer, points, steps)
    inner = getattr(optimizer, "optimizer", optimizer)
    tgen = torch.Generator().manual_seed(2)
    out = {"source": source, "pairs": {}}
    for name, point in points.items():
        v = (safe_get_full_optimizer_state(point.parameter, "exp_avg_sq") if args.stage > 0
             else inner.state[point.parameter]["exp_avg_sq"])
        v = point.slice(v.detach().float().reshape(point.parameter.ds_shape if args.stage == 3
                                                   else point.parameter.shape))
        pre = 1.0 / ((v / (1.0 - betas[1] ** steps)).sqrt() + eps)
        t = torch.randn(point.out_features, point.in_features, generator=tgen)
        owned = sdist.dist_sum(fn(name, t).double().reshape(1))[0]  # every element is owned by one rank
        out["pairs"][name] = {"owned": float(owned), "full": float(((t * pre) ** 2).sum())}
    ids = torch.randint(0, 64, (2 * world, 16), generator=gen)[2 * rank:2 * rank + 2]
    stats = collect_statistics(engine.module, [ids], CollectSettings(retain_graph=args.stage < 3), lr=1e-2,
                               precond=fn, step=steps, reduce=sdist.dist_sum, world_size=world)
    out["stats"] = {name: {k: rec[k] for k in ("fld", "bwd", "routed_tokens", "no_tokens", "nonfinite")}
                    for name, rec in stats["layers"].items()}
    out["precond"] = stats["precond"]
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as launch/train.py's finish(): skip the interpreter teardown (gloo's threads may abort it)
