"""A Trainer run under DeepSpeed whose user module overflows on the last rank in step 3 (``snip.nonfinite``).

Run by tests/test_hf.py under the deepspeed launcher (2 ranks, ZeRO-2, CPU): ``model.layers.1.mlp`` returns NaN
on the last rank in every forward of step 3. Each rank writes ``--out.<rank>`` (JSON): the float64 sum of its
parameters before step 1 and after every finished step, the learning rates logged after every step, the steps
taken, the skipped steps, and the NonFiniteError's message if one stopped the run.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator  # noqa: E402

from snip_ds import NonFiniteError  # noqa: E402
from snip_ds.runtime import distributed as sdist  # noqa: E402
from snip_ds.run.data import BlockDataset  # noqa: E402
from snip_ds.hf import add_snip, share_cpu_ranks_with_accelerate  # noqa: E402
from snip_ds.run.model import build_model  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--deepspeed", required=True)
p.add_argument("--model_config", required=True)
p.add_argument("--output_dir", required=True)
p.add_argument("--out", required=True)
p.add_argument("--local_rank", type=int, default=-1)
a = p.parse_args()

args = TrainingArguments(output_dir=a.output_dir, deepspeed=a.deepspeed, per_device_train_batch_size=2,
                         max_steps=5, learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none",
                         disable_tqdm=True, seed=0)
share_cpu_ranks_with_accelerate(args)
rank, world = sdist.rank(), sdist.world_size()
model = build_model(None, a.model_config, vocab_size=257, seed=0, block_size=64)
poison = {"on": False}
model.model.layers[1].mlp.register_forward_hook(lambda mod, inputs, out: out * float("nan") if poison["on"] else out)
sums = [float(sum(p.detach().double().sum() for p in model.parameters()))]


class Probe(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        poison["on"] = state.global_step == 2 and rank == world - 1  # step 3, last rank

    def on_step_end(self, args, state, control, model=None, **kwargs):
        poison["on"] = False
        sums.append(float(sum(p.detach().double().sum() for p in model.parameters())))


data = BlockDataset(torch.randint(0, 257, (32, 64), generator=torch.Generator().manual_seed(0)))
trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator,
                  callbacks=[Probe()])
snip = add_snip(trainer)
out = {"rank": rank}
try:
    trainer.train()
except NonFiniteError as err:
    out["error"] = str(err)
out.update(sums=sums, steps=trainer.state.global_step, skipped=snip.state.skipped_steps,
           lrs=[e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e])
with open(f"{a.out}.{rank}", "w") as f:
    json.dump(out, f)
sys.stdout.flush()
os._exit(0)
