"""The embedded default run (model, corpus, byte tokenizer) through the Hugging Face ``Trainer`` + ``SnipCallback``.

Takes ``TrainingArguments``' own flags (``HfArgumentParser``); their defaults are the embedded run's
(learning rate 2e-3, AdamW betas 0.9/0.95, weight decay 0.1, 4 sequences per device, 120 steps, 10% warm-up)::

    deepspeed launch/train_hf.py --deepspeed ds_configs/zero3.json --output_dir runs/hf
    torchrun --nproc_per_node 2 launch/train_hf.py --deepspeed ds_configs/zero2.json --output_dir runs/hf
    accelerate launch --config_file ACCELERATE.yaml launch/train_hf.py   # deepspeed_config_file: a ds_configs JSON
    python launch/train_hf.py --output_dir runs/hf_adamw   # no DeepSpeed: torch AdamW, --snip_config's "snip"

Model and data flags default to the config's ``snip.train`` section; the plan to its ``"snip"`` section.
``--ddp_timeout SECONDS`` (default 1800) bounds every collective: a rank whose peer dies or stops answering
(in a step or in SNIP's statistics collection) prints one ``error: rank R: a collective failed ...`` line and
exits 1.
"""
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformers import HfArgumentParser, TrainingArguments  # noqa: E402

from snip_ds.hf import share_cpu_ranks_with_accelerate  # noqa: E402
from snip_ds.config.settings import ConfigError  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class SnipTrainingArguments(TrainingArguments):
    """``TrainingArguments`` with the embedded run's defaults (``launch/train.py``'s "auto" values)."""

    learning_rate: float = field(default=2e-3, metadata={"help": "AdamW learning rate"})
    adam_beta2: float = field(default=0.95, metadata={"help": "AdamW beta2"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay"})
    per_device_train_batch_size: int = field(default=4, metadata={"help": "sequences per device and micro-batch"})
    per_device_eval_batch_size: int = field(default=4, metadata={"help": "sequences per device in evaluation"})
    max_steps: int = field(default=120, metadata={"help": "optimizer steps"})
    warmup_steps: float = field(default=0.1, metadata={"help": "warm-up steps, or a fraction of max_steps"})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "without DeepSpeed's scheduler section"})
    logging_steps: float = field(default=1, metadata={"help": "log every this many steps"})
    eval_strategy: str = field(default="steps", metadata={"help": "evaluate every eval_steps"})
    eval_steps: float = field(default=40, metadata={"help": "evaluate every this many steps"})
    save_steps: float = field(default=60, metadata={"help": "checkpoint every this many steps"})
    report_to: Optional[str] = field(default="tensorboard", metadata={"help": "logging integrations"})
    output_dir: Optional[str] = field(default="runs/hf", metadata={"help": "checkpoints and logs"})


@dataclass
class SnipDataArguments:
    """Model and data (None: the config's ``snip.train`` value, else the embedded default)."""

    model_name_or_path: Optional[str] = field(default=None, metadata={"help": "local Hugging Face causal LM dir"})
    model_config: Optional[str] = field(default=None, metadata={"help": "JSON model config, from scratch"})
    dataset: Optional[str] = field(default=None, metadata={"help": "text/JSON-lines file or prepared dir"})
    tokenizer_name_or_path: Optional[str] = field(default=None, metadata={"help": "local tokenizer for raw text"})
    block_size: Optional[int] = field(default=None, metadata={"help": "tokens per sequence"})
    eval_batches: Optional[int] = field(default=None, metadata={"help": "validation batches per evaluation"})
    snip_config: str = field(default=os.path.join(REPO, "ds_configs", "zero3.json"),
                             metadata={"help": "without --deepspeed: the JSON whose 'snip' section to use"})


def build(args: SnipTrainingArguments, data: SnipDataArguments):
    """The Trainer with SnipCallback; every user error is raised here, before training."""
    import torch
    from torch.utils.data import Subset
    from transformers import Trainer, default_data_collator

    from snip_ds.run.data import load_dataset_blocks
    from snip_ds.hf import add_snip
    from snip_ds.run.model import build_model
    from snip_ds.config.settings import load_ds_config

    deepspeed = bool(args.deepspeed) or args.deepspeed_plugin is not None  # the flag, or accelerate launch's plugin
    plugin_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") if args.deepspeed_plugin is not None else None
    cfg_path = args.deepspeed if isinstance(args.deepspeed, str) else plugin_file or data.snip_config
    raw, settings = load_ds_config(cfg_path)
    t = settings.train
    pick = lambda name: getattr(data, name) if getattr(data, name) is not None else getattr(t, name)  # noqa: E731
    block = pick("block_size")
    train_ds, val_ds, vocab, _ = load_dataset_blocks(
        pick("dataset"), block, pick("tokenizer_name_or_path"), seed=args.seed, max_bytes=t.max_corpus_bytes,
        max_validation_bytes=max(t.max_corpus_bytes // 16, block * 64))
    n_eval = min(len(val_ds), pick("eval_batches") * args.per_device_eval_batch_size * max(args.world_size, 1))
    model = build_model(pick("model_name_or_path"), pick("model_config"), vocab_size=vocab, seed=args.seed,
                        dtype=torch.float32, block_size=block)
    trainer = Trainer(model=model, args=args, train_dataset=train_ds, eval_dataset=Subset(val_ds, range(n_eval)),
                      data_collator=default_data_collator)
    add_snip(trainer, settings=None if deepspeed else _snip_section(data.snip_config))
    return trainer


def _snip_section(path: str) -> dict:
    import json

    return json.loads(open(path).read()).get("snip") or {}


def main(argv=None) -> int:
    args, data = HfArgumentParser((SnipTrainingArguments, SnipDataArguments)).parse_args_into_dataclasses(argv)
    share_cpu_ranks_with_accelerate(args)
    try:
        trainer = build(args, data)
    except (ConfigError, ValueError, FileNotFoundError, OSError) as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        return 2
    try:
        trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    except Exception as err:
        from snip_ds.runtime.distributed import lost_peer, lost_peer_line

        if not lost_peer(err):
            raise
        # Another rank died, or stopped answering for TrainingArguments.ddp_timeout seconds: one line, exit 1.
        sys.stderr.write(lost_peer_line(err, "resume it from its last checkpoint-N with --resume_from_checkpoint")
                         + "\n")
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    # Skip the interpreter's teardown (see launch/train.py's finish()); after a lost peer no collective of the
    # teardown could complete either.
    os._exit(code)
