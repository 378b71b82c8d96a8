"""Trains a tiny Llama for 3 steps under DeepSpeed, then writes Σ_ranks precond(fqn, t) per layer and one
statistics collection as JSON.

Run by tests/test_adam_state.py under the deepspeed launcher: ZeRO stage 0 on one rank with the whole
global batch is the reference for stages 1-3 on two ranks with half the batch each.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from snip_ds import distributed as sdist  # noqa: E402
from snip_ds.engine import init_distributed  # noqa: E402
from snip_ds.engine.adam_state import layer_preconditioner  # noqa: E402
from snip_ds.engine.core import initialize  # noqa: E402
from snip_ds.plan import Plan  # noqa: E402
from snip_ds.snip_config import parse_snip_section  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--global_batch", type=int, default=4)
    # FLD's probe labels are drawn per rank, so 1 and 2 ranks see different draws: 16 probes x 4 rows keep
    # the sequence form's sampling error near sqrt(2/64) = 18%
    p.add_argument("--num_probes", type=int, default=16)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    init_distributed()
    rank, world = sdist.rank(), sdist.world_size()
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=32))
    micro = args.global_batch // world
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8}},
           "zero_optimization": {"stage": args.stage}, "steps_per_print": 10 ** 9}
    engine = initialize(model, cfg, parse_snip_section({"plan": "bf16"}), tokens_per_step=micro * 16)
    engine.set_plan(Plan.uniform(list(engine.infos), "bf16"))
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 64, (args.global_batch, 16), generator=gen)
        mine = ids[rank * micro:(rank + 1) * micro]
        engine.train_step([{"input_ids": mine, "labels": mine}])
    weights = {fqn: layer.weight for fqn, layer in engine.layers.items()}
    precond, source = layer_preconditioner(engine.ds.optimizer, weights, engine.step)
    out = {"source": source, "layers": {}}
    # One statistics collection on the same global batch, split over the ranks (retain_graph as the engine).
    from snip_ds.collect import collect_statistics
    ids = torch.randint(0, 64, (args.global_batch, 16), generator=gen)
    mine = ids[rank * micro:(rank + 1) * micro]
    out["stats"] = collect_statistics(engine.ds.module, [{"input_ids": mine, "labels": mine}],
                                      layers=list(engine.layers), lr=engine.lr(), precond=precond,
                                      reduce=sdist.dist_sum, world_size=world, step=engine.step,
                                      retain_graph=engine.zero_stage < 3, num_probes=args.num_probes)
    tgen = torch.Generator().manual_seed(2)
    for fqn, info in engine.infos.items():
        t = torch.randn(info.out_features, info.in_features, generator=tgen)
        out["layers"][fqn] = float(sdist.dist_sum(precond(fqn, t).double().reshape(1))[0])
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
