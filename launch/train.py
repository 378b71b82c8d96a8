"""Train a decoder-only causal LM (Llama, Qwen2, Phi-3, GPT-NeoX, ...) with SNIP FP8/FP4 mixed precision on DeepSpeed.

One rank on this machine, the embedded default (a ~11M-parameter Llama on Python's stdlib sources)::

    deepspeed launch/train.py --deepspeed ds_configs/zero3.json

Two ranks (gloo on CPU, nccl on GPU), torchrun, or several nodes through DeepSpeed's hostfile::

    deepspeed --num_gpus 2 launch/train.py --deepspeed ds_configs/zero3.json
    torchrun --nproc_per_node 2 launch/train.py --deepspeed ds_configs/zero3.json
    deepspeed --hostfile hostfile launch/train.py --deepspeed ds_configs/zero3.json

Flags (``--max_steps``, ``--precision fp4``, ``--plan plan.json``, ``--resume_from_checkpoint DIR`` ...)
override the JSON; ``--help`` lists them.
"""
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from snip_ds.run.trainer import main  # noqa: E402


def finish(code: int) -> None:
    """Exits with ``code`` without the interpreter's teardown, whether the run finished or failed.

    By then the run has saved its checkpoints, closed its TensorBoard writer and destroyed the process group
    (or, after a lost peer, given up on it). What is left is the interpreter's finalization, and there a rank
    of a 2-rank CPU ZeRO-3 run aborted with SIGABRT ("terminate called without an active exception", no
    Python frame left on the stack): a finished rank in 1 of 21 launches here, and a rank stopping at a
    non-finite step (exit 1) in a CI run, which the launcher then reports as exit 250 instead of the run's
    own code. The same abort is described in pytorch/pytorch#179291: gloo's worker threads, kept alive by
    references the process group's users still hold, release tensors during finalization and take the GIL.
    ``os._exit`` after flushing skips the finalization. An uncaught exception (a bug, not a user's mistake)
    never reaches here and keeps Python's traceback and exit.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    finish(main())
