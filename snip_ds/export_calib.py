"""What a compressed-tensors export needs of the run besides its weights: snip_ds's own forward of the trained
model at the plan's precisions (:func:`planned_forward_model`), and the static activation global scales NVFP4 needs,
calibrated on the run's own training data (:func:`calibration_batches`, :func:`input_amax`).

NVFP4 quantizes a layer's input in blocks of 16 with an E4M3 scale each, times one FP32 global scale. The training
forward takes that global scale from the current input (``S = amax / (448 * 6)``); a compressed-tensors checkpoint
holds it as a constant, ``input_global_scale = 448 * 6 / amax``, which vLLM's kernels need before they see an
input. The export sets ``amax`` to the largest input magnitude of the layer over ``--calibration-batches`` batches
of the run's training split, read as the run read it (dataset, tokenizer, block size and seed from the
checkpoint's settings), through the planned forward. An input above that amax at serving time saturates its
block scale at 448 (its values at 6 x 448 / input_global_scale); one below it gets block scales of a coarser
E4M3 grid than the training forward's (fewer of E4M3's normal binades are used).
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Iterable, List, Mapping

import torch
from torch import nn

from snip_ds.export_files import ExportError, one_line
from snip_ds.quant_config import QuantConfig

CALIBRATION_BATCH = 2  # blocks per calibration batch


def planned_forward_model(model: nn.Module, assignment: Mapping[str, Any], quant: QuantConfig) -> nn.Module:
    """A copy of ``model`` whose decoder linears and MoE experts run at ``assignment``'s precisions (snip_ds's
    swap; fprop is what a forward uses), in eval mode: snip_ds's own forward of the trained model."""
    from snip_ds.plan import Plan
    from snip_ds.swap import apply_plan, swap_model

    planned = copy.deepcopy(model)
    _real_buffers(planned)
    swap_model(planned, "bf16", quant)
    apply_plan(planned, Plan.fixed(dict(assignment)))
    return planned.eval()


def _real_buffers(model: nn.Module) -> None:
    """Fills the buffers a model built on the meta device left empty (those no checkpoint holds: rotary
    frequencies, ...) from the same config built on the CPU, without initialising its weights."""
    meta = [name for name, b in model.named_buffers() if b.is_meta]
    if not meta:
        return
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():
        fresh = AutoModelForCausalLM.from_config(model.config, trust_remote_code=False)
    buffers = dict(fresh.named_buffers())
    for name in meta:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        owner._buffers[leaf] = buffers[name].clone()


def calibration_batches(settings: Mapping[str, Any], n: int, source: str) -> List[Dict[str, torch.Tensor]]:
    """``n`` batches of :data:`CALIBRATION_BATCH` blocks of the run's training split (``settings``: the
    checkpoint's ``"snip"`` settings; its ``train`` section names the data as the run read it), in the order of
    the run's first epoch on rank 0.

    Raises:
        ExportError: the data cannot be read here (naming it and ``source``).
    """
    from snip_ds.data import DataStream, load_dataset_blocks

    train = dict((settings or {}).get("train") or {})
    block = int(train.get("block_size", 256))
    dataset = train.get("dataset")
    caps = int(train.get("max_corpus_bytes", 4_000_000))
    try:
        train_ds, _, _, _ = load_dataset_blocks(dataset, block, train.get("tokenizer_name_or_path"),
                                                seed=int(train.get("seed", 0)), max_bytes=caps,
                                                max_validation_bytes=max(caps // 16, block * 64))
        stream = DataStream(train_ds, CALIBRATION_BATCH, seed=int(train.get("seed", 0)), rank=0, world_size=1)
    except (ValueError, FileNotFoundError, OSError) as err:
        raise ExportError(f"{source}: the run's training data ({dataset or 'the default corpus'}) cannot be read "
                          f"for --calibration-batches ({one_line(err)})") from None
    return [stream.next_batch() for _ in range(min(n, stream.steps_per_epoch))]


@torch.no_grad()
def input_amax(planned: nn.Module, layers: Iterable[str], batches: List[Dict[str, torch.Tensor]]
               ) -> Dict[str, torch.Tensor]:
    """The largest input magnitude of each of ``layers`` (module names of ``planned``) over ``batches``, through
    ``planned``'s forward."""
    amax: Dict[str, torch.Tensor] = {}
    hooks = []

    def hook(name):
        def record(module, args):
            value = args[0].detach().abs().amax().float()
            amax[name] = torch.maximum(amax[name], value) if name in amax else value
        return record

    for name in layers:
        hooks.append(planned.get_submodule(name).register_forward_pre_hook(hook(name)))
    try:
        for batch in batches:
            planned(input_ids=batch["input_ids"])
    finally:
        for h in hooks:
            h.remove()
    return amax
