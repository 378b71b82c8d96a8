"""A Trainer run with SnipCallback, and snip_ds.initialize's statistics on the same model and batch.

Run under the deepspeed launcher (1 or 2 ranks): builds two identical tiny models; on the first,
``snip_ds.initialize`` + its planner's first collection (no optimizer state yet) on the private stream
``DataStream(train, micro, seed=seed + 7919)``; on the second, a ``transformers.Trainer`` with ``SnipCallback``
trains ``--max_steps`` steps. Rank 0 writes both first collections, the callback's re-plan history and the
Trainer's losses to ``--out`` (JSON).
"""
import argparse
import copy
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator  # noqa: E402

from snip_ds.runtime import distributed as sdist  # noqa: E402
from snip_ds.run.data import DataStream, load_dataset_blocks  # noqa: E402
from snip_ds.engine.core import init_distributed, initialize  # noqa: E402
from snip_ds.hf import SnipCallback, share_cpu_ranks_with_accelerate  # noqa: E402
from snip_ds.engine.state import STATS_SEED_OFFSET  # noqa: E402
from snip_ds.run.model import build_model  # noqa: E402
from snip_ds.config.settings import load_ds_config  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--deepspeed", required=True)
p.add_argument("--model_config", required=True)
p.add_argument("--output_dir", required=True)
p.add_argument("--out", required=True)
p.add_argument("--max_steps", type=int, default=5)
p.add_argument("--local_rank", type=int, default=-1)
a = p.parse_args()
MICRO, BLOCK, SEED = 2, 64, 0

raw, settings = load_ds_config(a.deepspeed)
train_ds, val_ds, vocab, _ = load_dataset_blocks(None, BLOCK, None, seed=SEED, max_bytes=200_000,
                                                 max_validation_bytes=BLOCK * 64)
# Both models before TrainingArguments exists: with a ZeRO-3 config it makes from_config build partitioned.
ref_model = build_model(None, a.model_config, vocab_size=vocab, seed=SEED, block_size=BLOCK)
hf_model = build_model(None, a.model_config, vocab_size=vocab, seed=SEED, block_size=BLOCK)

init_distributed()
rank, world = sdist.rank(), sdist.world_size()
cfg = dict(raw, train_micro_batch_size_per_gpu=MICRO)
stream = DataStream(train_ds, MICRO, seed=SEED + STATS_SEED_OFFSET, rank=rank, world_size=world)
engine = initialize(ref_model, cfg, settings, tokens_per_step=MICRO * BLOCK, seed=SEED, statistics_stream=stream)
reference = engine.planner.collect()

args = TrainingArguments(output_dir=a.output_dir, deepspeed=a.deepspeed, per_device_train_batch_size=MICRO,
                         max_steps=a.max_steps, learning_rate=2e-3, adam_beta2=0.95, weight_decay=0.1,
                         warmup_steps=0.1, logging_steps=1, save_strategy="no", report_to="none",
                         disable_tqdm=True, seed=SEED)
share_cpu_ranks_with_accelerate(args)
snip = SnipCallback()


class Grab(TrainerCallback):
    """Runs after SnipCallback: keeps the statistics of the collection before step 1."""

    first = None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            Grab.first = copy.deepcopy(snip.planner.last_stats)


trainer = Trainer(model=hf_model, args=args, train_dataset=train_ds, data_collator=default_data_collator,
                  callbacks=[snip, Grab()])
snip.attach(trainer)
trainer.train()
if rank == 0:
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    with open(a.out, "w") as f:
        json.dump({"reference": reference, "first": Grab.first, "history": snip.planner.history,
                   "rho": settings.efficiency_saving, "world": world, "losses": losses,
                   "swapped_same_params": all(snip.state.layers[f].weight is hf_model.get_submodule(f).weight
                                              for f in snip.state.layers)}, f)
sys.stdout.flush()
os._exit(0)
