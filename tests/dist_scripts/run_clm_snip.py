"""A causal-LM training script in the shape of transformers' ``examples/pytorch/language-modeling/run_clm.py``,
with the two lines SNIP adds (marked ``# SNIP``); everything else is what that script does with local files.

``HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))``; the config and tokenizer
from local directories (``--config_name``, ``--tokenizer_name``), a new model from the config; a local text
file (``--train_file``, the ``text`` loader of ``datasets``) with a validation split taken from it,
tokenized, concatenated and cut into ``--block_size`` blocks whose labels are their inputs;
``Trainer(..., processing_class=tokenizer, data_collator=default_data_collator)``;
``trainer.train(resume_from_checkpoint=...)``, ``trainer.save_model()``, the train metrics and state, then
``trainer.evaluate()``. Runs under any launcher (deepspeed, torchrun, accelerate launch).
"""
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from itertools import chain
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import datasets  # noqa: E402
import transformers  # noqa: E402
from datasets import load_dataset  # noqa: E402
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, Trainer,  # noqa: E402
                          TrainingArguments, default_data_collator, set_seed)

from snip_ds.hf import add_snip, share_cpu_ranks_with_accelerate  # noqa: E402  # SNIP

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    config_name: Optional[str] = field(default=None, metadata={"help": "local config directory"})
    tokenizer_name: Optional[str] = field(default=None, metadata={"help": "local tokenizer directory"})


@dataclass
class DataTrainingArguments:
    train_file: Optional[str] = field(default=None, metadata={"help": "a .txt file"})
    validation_split_percentage: int = field(default=5, metadata={"help": "percent of train held out"})
    block_size: Optional[int] = field(default=None, metadata={"help": "tokens per block"})
    keep_linebreaks: bool = field(default=True, metadata={"help": "keep line breaks in the text loader"})


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    share_cpu_ranks_with_accelerate(training_args)  # SNIP (CPU ranks only; a no-op on GPUs)

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        handlers=[logging.StreamHandler(sys.stdout)])
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    set_seed(training_args.seed)

    data_files = {"train": data_args.train_file}
    pct = data_args.validation_split_percentage
    raw = load_dataset("text", data_files=data_files, keep_linebreaks=data_args.keep_linebreaks)
    raw["validation"] = load_dataset("text", data_files=data_files, split=f"train[:{pct}%]",
                                     keep_linebreaks=data_args.keep_linebreaks)
    raw["train"] = load_dataset("text", data_files=data_files, split=f"train[{pct}%:]",
                                keep_linebreaks=data_args.keep_linebreaks)

    config = AutoConfig.from_pretrained(model_args.config_name)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name)
    model = AutoModelForCausalLM.from_config(config)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))

    column_names = list(raw["train"].features)
    text_column = "text" if "text" in column_names else column_names[0]
    with training_args.main_process_first(desc="dataset map tokenization"):
        tokenized = raw.map(lambda ex: tokenizer(ex[text_column]), batched=True, remove_columns=column_names)
    block_size = min(data_args.block_size or 1024, tokenizer.model_max_length)

    def group_texts(examples):
        joined = {k: list(chain(*examples[k])) for k in examples}
        total = (len(joined[list(examples.keys())[0]]) // block_size) * block_size
        result = {k: [t[i:i + block_size] for i in range(0, total, block_size)] for k, t in joined.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    with training_args.main_process_first(desc="grouping texts together"):
        lm = tokenized.map(group_texts, batched=True)

    trainer = Trainer(model=model, args=training_args,
                      train_dataset=lm["train"] if training_args.do_train else None,
                      eval_dataset=lm["validation"] if training_args.do_eval else None,
                      processing_class=tokenizer, data_collator=default_data_collator)
    add_snip(trainer)  # SNIP: the "snip" section of the DeepSpeed config

    if training_args.do_train:
        checkpoint = training_args.resume_from_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()
        metrics = train_result.metrics
        metrics["train_samples"] = len(lm["train"])
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["perplexity"] = math.exp(metrics["eval_loss"])
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
