"""A/B of precision plans on your own model, data and hardware: the same short training under bf16, fp8, fp4 and
adaptive SNIP, one table of tokens/s, peak memory and loss (the logic: :mod:`snip_ds.run.ab`).

    python launch/ab.py --deepspeed ds_configs/zero3.json                        # the embedded default, 30 steps
    python launch/ab.py --deepspeed ds_configs/zero3.json --model_config my.json --dataset corpus.txt \\
        --max_steps 50 --plans fp8,adaptive
    python launch/ab.py --launcher "deepspeed --num_gpus 8" --deepspeed ds_configs/zero3.json ...

Every flag but ``--plans``, ``--max_steps``, ``--output_dir`` and ``--launcher`` is launch/train.py's, passed on
to each run. On a CPU FP8 and FP4 are emulated: compare the losses there, not the speed.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from snip_ds.run.ab import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
