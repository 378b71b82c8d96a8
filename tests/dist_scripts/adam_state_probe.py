"""Trains a tiny Llama for 3 steps under DeepSpeed, then writes Σ_ranks precond(fqn, t) per layer and one
statistics collection as JSON.

Run by tests/test_zero_state.py under the deepspeed launcher: ZeRO stage 0 on one rank with the whole
global batch is the reference for stages 1-3 on two ranks with half the batch each.

``--dump FILE`` writes the trained model's full parameters and every layer's Adam second moment (safetensors;
gathered over the ranks), and ``--load FILE`` (stage 0) collects a second time on another run's dumped parameters and
Adam state (``"stats_cross"``): the difference between a ZeRO-0 and a ZeRO-3 run's statistics then splits
into what the training drift between the two runs causes and what the collection itself does.
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
from snip_ds.engine.adam_state import layer_preconditioner  # noqa: E402
from snip_ds.engine.core import initialize  # noqa: E402
from snip_ds.plan import Plan  # noqa: E402
from snip_ds.config.settings import parse_snip_section  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--global_batch", type=int, default=4)
    # FLD's probe labels are drawn per rank, so 1 and 2 ranks see different draws: 16 probes x 4 rows keep
    # the sequence form's sampling error near sqrt(2/64) = 18%
    p.add_argument("--num_probes", type=int, default=16)
    p.add_argument("--out", required=True)
    p.add_argument("--dump", help="one rank: write the parameters and Adam's exp_avg_sq here (safetensors)")
    p.add_argument("--load", help="stage 0, one rank: also collect on these dumped parameters and Adam state")
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
    from snip_ds.stats import STUDY_FIELDS, CollectSettings, collect_statistics
    ids = torch.randint(0, 64, (args.global_batch, 16), generator=gen)
    mine = ids[rank * micro:(rank + 1) * micro]

    def collect(precond_fn):  # the collection draws its probe labels from its own seeded generator
        return collect_statistics(engine.ds.module, [{"input_ids": mine, "labels": mine}],
                                  CollectSettings(retain_graph=engine.zero_stage < 3, num_probes=args.num_probes,
                                                  study_fields=tuple(STUDY_FIELDS)),
                                  layers=list(engine.layers), lr=engine.lr(), precond=precond_fn,
                                  reduce=sdist.dist_sum, world_size=world, step=engine.step)
    out["stats"] = collect(precond)
    if args.dump:
        _dump(engine, args.dump if rank == 0 else None)
    tgen = torch.Generator().manual_seed(2)
    for fqn, info in engine.infos.items():
        t = torch.randn(info.out_features, info.in_features, generator=tgen)
        out["layers"][fqn] = float(sdist.dist_sum(precond(fqn, t).double().reshape(1))[0])
    if args.load:  # after everything else has read this run's own state
        assert world == 1 and engine.zero_stage == 0, "--load needs stage 0 on one rank"
        _load(engine, args.load)
        out["stats_cross"] = collect(layer_preconditioner(engine.ds.optimizer, weights, engine.step)[0])
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


def _dump(engine, path) -> None:
    """``param.<name>``: every full FP32 parameter; ``v.<name>``: the layer weights' Adam exp_avg_sq. Every
    rank takes part in the gathers; the rank given a path writes the file."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import save_file
    inner = getattr(engine.ds.optimizer, "optimizer", engine.ds.optimizer)
    tensors = {}
    for name, prm in engine.ds.module.named_parameters():
        full = safe_get_full_fp32_param(prm) if engine.zero_stage > 0 else prm.detach()
        tensors[f"param.{name}"] = full.detach().float().reshape(prm.ds_shape if hasattr(prm, "ds_shape")
                                                                 else prm.shape).contiguous().clone()
        if name.endswith(".weight") and name[:-len(".weight")] in engine.layers:
            v = (safe_get_full_optimizer_state(prm, "exp_avg_sq") if engine.zero_stage > 0
                 else inner.state[prm]["exp_avg_sq"])
            tensors[f"v.{name}"] = v.detach().float().reshape(tensors[f"param.{name}"].shape).contiguous().clone()
    if path:
        save_file(tensors, path)


def _load(engine, path: str) -> None:
    """Overwrites the stage-0 model's parameters and its layer weights' exp_avg_sq with a dump's."""
    from safetensors.torch import load_file
    tensors = load_file(path)
    inner = getattr(engine.ds.optimizer, "optimizer", engine.ds.optimizer)
    with torch.no_grad():
        for name, prm in engine.ds.module.named_parameters():
            prm.copy_(tensors[f"param.{name}"])
            if f"v.{name}" in tensors:
                inner.state[prm]["exp_avg_sq"].copy_(tensors[f"v.{name}"])


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as launch/train.py's finish(): skip the interpreter teardown (gloo's threads may abort it)
