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

``--calibration-data`` names other data: token ids (a ``.safetensors`` file's ``input_ids``), or text read as the
run read its own. A run of the user's own loop records no training data (snip_ds never reads it), so its export
needs the flag; token ids outside the model's vocabulary are refused, which catches a recorded corpus that is not
what the run trained on.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
from torch import nn

from snip_ds.export.files import ExportError, one_line
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


def calibration_batches(settings: Mapping[str, Any], n: int, source: str, data: Optional[str] = None,
                        vocab_size: Optional[int] = None) -> Tuple[List[Dict[str, torch.Tensor]], str]:
    """At most ``n`` batches of :data:`CALIBRATION_BATCH` blocks, and what they are (the export's record):
    ``data`` (``--calibration-data``: token ids in a ``.safetensors`` file's ``input_ids``, or text read with the
    run's tokenizer and block size), else the run's training split as its ``"snip"`` ``settings`` (the
    checkpoint's) name it in their ``train`` section, in the order of the run's first epoch on rank 0. A
    checkpoint whose settings hold no ``train`` section recorded no training data (a run of the user's own loop,
    which reads its own).

    Raises:
        ExportError: no data to calibrate on, data that cannot be read, or token ids outside the model's
            vocabulary of ``vocab_size`` (naming the flag or the data and ``source``).
    """
    settings = settings or {}
    if data is None and "train" not in settings:
        raise ExportError(f"{source}: the run recorded no training data (snip_ds.initialize in your own loop reads "
                          f"its own) to calibrate the NVFP4 activation global scales on; pass --calibration-data "
                          f"PATH (token ids: a .safetensors file holding 'input_ids' [blocks, tokens]; or text read "
                          f"with the run's tokenizer)")
    if data is not None and str(data).endswith(".safetensors"):
        ids = _token_ids(Path(data))
        batches = [{"input_ids": ids[i:i + CALIBRATION_BATCH]}
                   for i in range(0, min(len(ids), n * CALIBRATION_BATCH), CALIBRATION_BATCH)]
        what, where = f"{data} (token ids)", f"--calibration-data {data}"
    else:
        train = dict(settings.get("train") or {})
        batches = _text_batches(train, n, source, data)
        what = f"{data} (read with the run's tokenizer)" if data is not None else "the run's training split"
        where = (f"--calibration-data {data}" if data is not None else
                 f"{source}: the run's training data ({train.get('dataset') or 'the default corpus'})")
    low = min(int(b["input_ids"].min()) for b in batches)
    top = max(int(b["input_ids"].max()) for b in batches)
    if low < 0 or (vocab_size is not None and top >= vocab_size):
        bad = low if low < 0 else top
        hint = "" if data is not None else (" (not what the run trained on: pass --calibration-data PATH, token "
                                            "ids in a .safetensors file's 'input_ids')")
        vocab = "0 and up" if vocab_size is None else f"0..{vocab_size - 1}"
        raise ExportError(f"{where}: token id {bad} lies outside the model's vocabulary ({vocab}){hint}")
    return batches, what


def _token_ids(path: Path) -> torch.Tensor:
    """The ``input_ids`` [blocks, tokens] of a safetensors file (read without unpickling anything)."""
    from safetensors import SafetensorError, safe_open

    flag = f"--calibration-data {path}"
    try:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            if "input_ids" not in names:
                held = ", ".join(sorted(names)[:5]) or "none"
                raise ExportError(f"{flag}: holds no 'input_ids' tensor (it holds {held})")
            ids = f.get_tensor("input_ids")
    except (SafetensorError, OSError) as err:
        raise ExportError(f"{flag}: not a readable safetensors file ({one_line(err)})") from None
    if ids.ndim != 2 or ids.numel() == 0 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ExportError(f"{flag}: 'input_ids' must be a non-empty 2-D integer tensor [blocks, tokens], got "
                          f"{str(ids.dtype).replace('torch.', '')} {list(ids.shape)}")
    return ids.long()


def _text_batches(train: Mapping[str, Any], n: int, source: str, data: Optional[str]
                  ) -> List[Dict[str, torch.Tensor]]:
    """``n`` batches of the run's training split (``data`` None) or of ``data``'s, read as the run read its data:
    tokenizer, block size and seed from the checkpoint's ``train`` settings."""
    from snip_ds.run.data import DataStream, load_dataset_blocks

    block = int(train.get("block_size", 256))
    dataset = train.get("dataset") if data is None else data
    caps = int(train.get("max_corpus_bytes", 4_000_000))
    try:
        train_ds, _, _, _ = load_dataset_blocks(dataset, block, train.get("tokenizer_name_or_path"),
                                                seed=int(train.get("seed", 0)), max_bytes=caps,
                                                max_validation_bytes=max(caps // 16, block * 64))
        stream = DataStream(train_ds, CALIBRATION_BATCH, seed=int(train.get("seed", 0)), rank=0, world_size=1)
    except (ValueError, FileNotFoundError, OSError) as err:
        if data is not None:
            raise ExportError(f"--calibration-data {data}: cannot be read ({one_line(err)})") from None
        raise ExportError(f"{source}: the run's training data ({dataset or 'the default corpus'}) cannot be read "
                          f"for --calibration-batches ({one_line(err)}); --calibration-data PATH gives other "
                          f"data") from None
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
