"""Train a Llama-family model with SNIP FP8/FP4 mixed precision on DeepSpeed.

One rank on this machine, the embedded default (a ~11M-parameter Llama on Python's stdlib sources)::

    deepspeed launch/train.py --deepspeed ds_configs/zero3.json

Two ranks (gloo on CPU, nccl on GPU), torchrun, or several nodes through DeepSpeed's hostfile::

    deepspeed --num_gpus 2 launch/train.py --deepspeed ds_configs/zero3.json
    torchrun --nproc_per_node 2 launch/train.py --deepspeed ds_configs/zero3.json
    deepspeed --hostfile hostfile launch/train.py --deepspeed ds_configs/zero3.json

Flags (``--max_steps``, ``--precision fp4``, ``--plan plan.json``, ``--resume_from_checkpoint DIR`` ...)
override the JSON; ``--help`` lists them.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from snip_ds.trainer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
