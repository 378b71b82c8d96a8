"""Tensor parallelism under the Hugging Face Trainer: ``add_snip(trainer)`` with ``"tensor_parallel":
{"autotp_size": N}`` in the Trainer's DeepSpeed config.

Run by tests/test_tensor_parallel.py under the deepspeed launcher. A tiny Llama on fixed random sequences; the
Trainer reads its batches (accelerate gives the ranks of one tensor-parallel group the same ones), so TP = 2 on
2 ranks and TP = 1 on 1 rank see the same data. ``--zero_init`` builds the model after ``TrainingArguments`` (as
run_clm.py does: under ZeRO-3, partitioned at construction). Writes ``<out>.<rank>`` (JSON): the logged losses,
the class, precision and shape of every planned layer, how many quantized GEMMs ran per precision, the re-plan
steps, the plan's digest and the parameter sum; or the one-line error a user would see.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator  # noqa: E402

from snip_ds.runtime import distributed as sdist  # noqa: E402
from snip_ds.hf import add_snip, share_cpu_ranks_with_accelerate  # noqa: E402
from snip_ds.config.settings import ConfigError  # noqa: E402

from probes import count_gemms, param_sum  # noqa: E402  (tests/dist_scripts, the script's folder)

HIDDEN, VOCAB, SEQ = 128, 96, 16
REPO = Path(__file__).resolve().parents[2]


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=SEQ, tie_word_embeddings=False))


def _config(args) -> dict:
    cfg = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    cfg["zero_optimization"] = {**cfg["zero_optimization"], "stage": args.zero} if args.zero == 3 else \
        {"stage": args.zero, "gather_16bit_weights_on_model_save": args.gather}
    if args.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": args.tp}
    snip = {"plan": args.plan, "quant": {"stochastic_rounding": False}, **json.loads(args.snip)}
    cfg["snip"] = snip
    return cfg


class PlanInForce(TrainerCallback):
    """After SnipCallback's ``on_step_begin``: the digest of the plan each step trains with."""

    def __init__(self, snip) -> None:
        self.snip, self.digests = snip, []

    def on_step_begin(self, args, state, control, **kwargs):
        self.digests.append(self.snip.state.plan.digest())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--zero", type=int, default=1)
    p.add_argument("--plan", default="fp8")
    p.add_argument("--snip", default="{}", help="more of the 'snip' section (JSON)")
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--max_steps", type=int, default=3)
    p.add_argument("--save_steps", type=int, default=0)
    p.add_argument("--resume", default=None)
    p.add_argument("--zero_init", action="store_true")
    p.add_argument("--gather", action="store_true", help="ZeRO 1-2: the Trainer saves the gathered weights")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=-1)
    a = p.parse_args()

    gen = torch.Generator().manual_seed(100)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, VOCAB, (256, SEQ), generator=gen)]
    model = None if a.zero_init else _model()
    args = TrainingArguments(output_dir=a.output_dir, deepspeed=_config(a), per_device_train_batch_size=a.micro,
                             max_steps=a.max_steps, learning_rate=1e-2, warmup_steps=0, logging_steps=1,
                             save_strategy="steps" if a.save_steps else "no", save_steps=a.save_steps or 500,
                             report_to="none", disable_tqdm=True, seed=0, data_seed=0)
    share_cpu_ranks_with_accelerate(args)
    model = model if model is not None else _model()
    rank = int(os.environ.get("RANK", "0"))
    out = {"rank": rank}
    try:
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator)
        snip = add_snip(trainer)
        in_force = PlanInForce(snip)
        trainer.add_callback(in_force)
        counts: dict = {}
        count_gemms(counts)
        trainer.train(resume_from_checkpoint=a.resume)
    except ConfigError as err:
        out["error"] = str(err)
        Path(f"{a.out}.{rank}").write_text(json.dumps(out))
        return 0
    history = snip.planner.history if snip.planner is not None else []
    out.update(losses=[e["loss"] for e in trainer.state.log_history if "loss" in e], gemms=counts,
               history=[h["step"] for h in history], plan=snip.state.plan.digest(), plans=in_force.digests,
               dp_size=snip.state.dp_size,
               param_sum=param_sum(trainer.model), step=trainer.state.global_step,
               layers={f: [type(m).__name__, m.precision, list(getattr(m.weight, "ds_shape", m.weight.shape))]
                       for f, m in snip.state.layers.items()})
    Path(f"{a.out}.{rank}").write_text(json.dumps(out))
    if sdist.is_initialized() and sdist.world_size() > 1:
        torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
