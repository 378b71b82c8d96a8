"""One rank of ZeRO-3 training a tiny Mixtral whose experts modules are (or are not) swapped for SnipExperts.

Started by tests/test_experts.py as a plain ``python`` process with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
set (no launcher). Three runs from the same initial weights, each built under ``deepspeed.zero.Init`` (the
experts' 3-D Parameters partitioned before the swap) and trained one SGD step on one batch: the family's own
experts, SnipExperts at bf16, SnipExperts at fp8. Each run's loss and its parameters after the step (gathered)
go to ``<out>/<run>.safetensors``; ``<out>/swap.json`` says what the swap saw.
"""
import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import MixtralConfig, MixtralForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from snip_ds.experts.module import SnipExperts  # noqa: E402
from snip_ds.experts.model import swap_experts  # noqa: E402

CONFIG = MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=64)
DS_CONFIG = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, "steps_per_print": 10_000,
             "zero_allow_untested_optimizer": True}


def run(precision, initial, ids, report):
    with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG):
        model = MixtralForCausalLM(CONFIG)
    if precision is not None:
        before = {n: p for n, p in model.named_parameters()}
        replaced = swap_experts(model, precision)
        first = model.get_submodule(next(iter(replaced)))
        report[precision] = {
            "replaced": list(replaced),
            "same_parameters": all(p is before[n] for n, p in model.named_parameters()),
            "partitioned_numel": first.down_proj.numel(),  # what the swap saw of a 3-D Parameter
            "layers": {fqn: len(m.layers()) for fqn, m in model.named_modules() if isinstance(m, SnipExperts)},
            "down_proj_shape": list(first.projection_shape(1)),
        }
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            p.data.copy_(initial[name])
    engine, _, _, _ = deepspeed.initialize(model=model, config=DS_CONFIG,
                                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    out = {"loss": loss.detach().reshape(1)}
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out[name] = p.data.clone()
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    initial = {n: p.detach().clone() for n, p in MixtralForCausalLM(CONFIG).named_parameters()}
    ids = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    report = {}
    for name, precision in (("family", None), ("bf16", "bf16"), ("fp8", "fp8")):
        save_file(run(precision, initial, ids, report), str(out / f"{name}.safetensors"))
    (out / "swap.json").write_text(json.dumps(report))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as launch/train.py's finish(): skip the interpreter teardown (gloo's threads may abort it)
