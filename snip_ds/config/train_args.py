"""``launch/train.py``'s command line: its flags (:func:`build_parser`, Hugging Face Trainer names, each
overriding the ``"snip"`` section of the DeepSpeed JSON), the settings they give (:func:`settings_from_args`) and
the errors a run reports as one line (:class:`UserError`, :class:`RunFault`). Imports neither torch nor DeepSpeed,
so that ``--help`` answers at once.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any, Dict

from snip_ds.config.deepspeed_config import AUTO_DEFAULTS
from snip_ds.options import OPTIONS
from snip_ds.config.settings import (COMPILE_MODES, ConfigError, SnipSettings, TrainSettings, load_ds_config,
                                    with_overrides)

TRAIN_FLAGS = ("model_name_or_path", "model_config", "dataset", "tokenizer_name_or_path", "block_size",
               "max_steps", "eval_steps", "eval_batches", "save_steps", "logging_steps", "seed", "output_dir",
               "torch_compile", "torch_compile_backend", "torch_compile_mode")


class UserError(Exception):
    """A mistake in the user's input; reported as one line, no traceback (by rank 0, or with ``all_ranks``,
    for an error the ranks agreed on, by every rank)."""

    code = 2

    def __init__(self, message: str, all_ranks: bool = False) -> None:
        super().__init__(message)
        self.all_ranks = all_ranks


class RunFault(UserError):
    """A fault during training (a checkpoint that cannot be written, a non-finite loss or gradient): the same
    one line on every rank (``all_ranks``), exit code 1."""

    code = 1

    def __init__(self, message: str) -> None:
        super().__init__(message, all_ranks=True)


_TRAIN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainSettings)}


def _train(name: str, what: str, unset: str = "") -> str:
    """Help for a flag that overrides ``snip.train.<name>``: what it is, and its default (``unset``: what a
    default of None means)."""
    default = _TRAIN_DEFAULTS[name]
    return f"{what} (default: the JSON's snip.train.{name}, else {unset if default is None else default})"


def _auto(key: str, what: str) -> str:
    """Help for a flag that fills a DeepSpeed value the JSON leaves "auto"."""
    return f"{what} (default: the JSON's {key}; when that is \"auto\", {AUTO_DEFAULTS[key]:g})"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train a decoder-only causal LM with SNIP FP8/FP4 mixed precision on DeepSpeed. Every flag but "
                    "--deepspeed is optional and overrides the JSON.",
        epilog="Example: deepspeed launch/train.py --deepspeed ds_configs/zero3.json")
    p.add_argument("--deepspeed", required=True, metavar="PATH", help="DeepSpeed JSON with a 'snip' section "
                   "(required; ds_configs/ has the shipped ones)")
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    g = p.add_argument_group("model and data (override snip.train in the JSON)")
    g.add_argument("--model_name_or_path", help=_train("model_name_or_path", "local Hugging Face model directory",
                   "--model_config's model, without it the embedded 9.6M-parameter Llama"))
    g.add_argument("--model_config", help=_train("model_config", "JSON model config, trained from scratch",
                                                    "none"))
    g.add_argument("--dataset", help=_train("dataset", "text/JSON-lines file or a launch/prepare_dataset.py "
                   "directory", "the running Python's standard-library sources"))
    g.add_argument("--tokenizer_name_or_path", help=_train("tokenizer_name_or_path", "local Hugging Face tokenizer "
                   "for raw text", "the byte-level tokenizer"))
    g.add_argument("--block_size", type=int, metavar="TOKENS", help=_train("block_size", "tokens per training "
                   "sequence"))
    g = p.add_argument_group("training (Hugging Face Trainer names; override the JSON)")
    g.add_argument("--output_dir", help=_train("output_dir", "checkpoints, plan.json, stats.json and TensorBoard go "
                   "here"))
    g.add_argument("--max_steps", type=int, help=_train("max_steps", "optimizer steps"))
    g.add_argument("--eval_steps", type=int, help=_train("eval_steps", "validate every this many steps and at the "
                   "end"))
    g.add_argument("--eval_batches", type=int, help=_train("eval_batches", "validation batches per evaluation, per "
                   "rank"))
    g.add_argument("--save_steps", type=int, help=_train("save_steps", "checkpoint every this many steps; 0: at the "
                   "end and on SIGTERM/SIGINT only"))
    g.add_argument("--logging_steps", type=int, help=_train("logging_steps", "log training scalars every this many "
                   "steps"))
    g.add_argument("--learning_rate", type=float, help=_auto("optimizer.params.lr", "peak learning rate"))
    g.add_argument("--per_device_train_batch_size", type=int, help=_auto("train_micro_batch_size_per_gpu",
                   "sequences per micro-batch per data-parallel rank"))
    g.add_argument("--gradient_accumulation_steps", type=int, help=_auto("gradient_accumulation_steps",
                   "micro-batches per optimizer step"))
    g.add_argument("--seed", type=int, help=_train("seed", "seeds the model init, the data order and the "
                   "stochastic rounding"))
    g.add_argument("--torch_compile", action="store_true", default=None,
                   help=_train("torch_compile", "compile the model with torch.compile (DeepSpeed's engine.compile)"))
    g.add_argument("--torch_compile_backend", metavar="NAME", help=_train(
        "torch_compile_backend", "torch.compile backend; turns --torch_compile on", "inductor"))
    g.add_argument("--torch_compile_mode", choices=COMPILE_MODES, help=_train(
        "torch_compile_mode", "torch.compile mode; turns --torch_compile on", "torch.compile's default"))
    g.add_argument("--resume_from_checkpoint", metavar="DIR",
                   help="a checkpoint directory (step_N), the checkpoints directory (its 'latest') or a run's output "
                        "directory (its last complete checkpoint); default: start afresh")
    g.add_argument("--reset_lr_schedule", action="store_true",
                   help="on resume, follow this run's learning-rate schedule (resolved from its --max_steps) "
                        "instead of the checkpoint's")
    g = p.add_argument_group(f"precision plan (override snip.plan; default: the JSON's snip.plan, else "
                             f"{OPTIONS['plan'].default})")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--precision", choices=("bf16", "fp8", "fp4", "adaptive"), help="uniform plan, or adaptive SNIP")
    x.add_argument("--plan", metavar="PLAN.json", help="a fixed plan: {fqn: precision} or a snip-ds plan file")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.add_argument("--dist_timeout", type=float, metavar="SECONDS",
                   help="process-group timeout: a rank whose peer stops answering in a collective for this long "
                        "exits with an error (default 600, DeepSpeed's; must exceed the longest legitimate wait "
                        "of one rank for another)")
    return p


def settings_from_args(args: argparse.Namespace) -> tuple[Dict[str, Any], SnipSettings]:
    """The DeepSpeed config and the validated ``"snip"`` settings of ``--deepspeed``, the flags applied; a flag's
    bad value is an error naming the flag (``--max_steps: must be at least 1, got 0``)."""
    ds_cfg, settings = load_ds_config(args.deepspeed)
    overrides = {k: getattr(args, k) for k in TRAIN_FLAGS}
    if args.precision or args.plan:
        overrides["plan"] = args.precision or args.plan
    try:
        return ds_cfg, with_overrides(settings, **overrides)
    except ConfigError as err:
        raise ConfigError(_in_flag_words(str(err), args, overrides)) from None


def _in_flag_words(message: str, args: argparse.Namespace, overrides: Dict[str, Any]) -> str:
    """``message`` (``command line: snip.train.max_steps: ...``) naming the flag that set the field, where one did."""
    m = re.match(r"command line: snip\.(?:train\.)?(\w+)(.*)", message, re.S)
    if m is None or overrides.get(m.group(1)) is None:
        return message
    name = m.group(1)
    flag = ("--precision" if args.precision else "--plan") if name == "plan" else f"--{name}"
    return f"{flag}{m.group(2)}"
