"""``snip-ds export`` of a Hugging Face Trainer's ``checkpoint-N`` (saved with :class:`snip_ds.hf.SnipCallback`:
``snip_state.json`` there), or of its output directory (the last such ``checkpoint-N``).

The config is the Trainer's ``config.json``; the weights the FP32 masters in DeepSpeed's ``global_stepN`` folder
(named by its ``latest``) when there is one, else the Trainer's ``model.safetensors`` (read with safetensors, no
unpickling); the tokenizer the one the Trainer saved with it. The Trainer records no checksums, so those files are
checked by name and shape only.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

import torch

from snip_ds.report.artifacts import checkpoint_meta
from snip_ds.engine.checkpoint_layout import LATEST_FILE, CheckpointError
from snip_ds.engine.universal import unmergeable_shards
from snip_ds.export.files import DTYPES, FORMAT, ExportError, check_out_dir, one_line, write_export
from snip_ds.export.serve import ServeOptions, finish_model, plan_and_settings, plan_note
from snip_ds.export.weights import master_weights, merged_shards


def warn_if_saved_later(run: Path, folder: Path, warn: Callable[[str], None]) -> None:
    """A Trainer output directory whose own ``trainer.save_model()`` / ``save_state()`` came after its last
    checkpoint: the export is the checkpoint's, which ``warn`` says."""
    try:
        step = json.loads((run / "trainer_state.json").read_text())["global_step"]
        saved = int(folder.name.rsplit("-", 1)[1])
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return
    if isinstance(step, int) and step > saved:
        warn(f"{run}: the Trainer saved there at step {step}, after its last checkpoint; exporting {folder.name} "
             f"(the weights the callback's plan and state belong to)")


def _trainer_weights(folder: Path, model: torch.nn.Module, state: Dict[str, Any], scratch: Path,
                     warn: Callable[[str], None]) -> Tuple[Dict[str, torch.Tensor], str]:
    """The weights of a Trainer checkpoint and what they are: DeepSpeed's FP32 masters (``latest`` names the
    ``global_stepN`` folder), else the Trainer's own safetensors file(s). With tensor parallelism (a degree above
    1) the Trainer's safetensors first, which DeepSpeed gathered from the shards when the Trainer saved (with
    ``gather_16bit_weights_on_model_save``); else the masters, merged by DeepSpeed's universal conversion, unless
    ``state`` (the checkpoint's ``snip_state.json``) says that cannot merge them (:func:`unmergeable_shards`)."""
    tp = state.get("tensor_parallel", 1)
    advice = ("set zero_optimization.gather_16bit_weights_on_model_save (ZeRO-3: "
              "stage3_gather_16bit_weights_on_model_save) to true so that the Trainer saves the gathered "
              "model.safetensors, which export reads")
    latest = folder / LATEST_FILE
    index = folder / "model.safetensors.index.json"
    saved = index.is_file() or (folder / "model.safetensors").is_file()
    if latest.is_file() and not (tp > 1 and saved):
        tag_dir = folder / latest.read_text().strip()
        if not tag_dir.is_dir():
            raise ExportError(f"{latest}: names {tag_dir}, which does not exist; the checkpoint is incomplete")
        if tp > 1:
            why = unmergeable_shards(state)
            if why is not None:  # up front: the converter would only stop part-way
                raise ExportError(f"{folder}: holds no gathered model.safetensors, and its FP32 master weights "
                                  f"cannot be merged: {why}; {advice}")
            try:
                return (merged_shards(tag_dir, model, tp, scratch, warn),
                        f"DeepSpeed's FP32 master weights ({tag_dir.name}, {tp} tensor-parallel shards merged)")
            except CheckpointError as err:
                raise ExportError(f"{err}; {advice}") from None
        return master_weights(tag_dir), f"DeepSpeed's FP32 master weights ({tag_dir.name})"
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ExportError(f"{index}: not a safetensors index ({one_line(err)})") from None
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ExportError(f"{folder}: holds neither DeepSpeed's '{LATEST_FILE}' and global_stepN folder nor "
                          f"the Trainer's model.safetensors; the checkpoint has no weights")
    weights: Dict[str, torch.Tensor] = {}
    for name in files:
        try:
            weights.update(load_file(str(folder / name), device="cpu"))
        except (OSError, SafetensorError, ValueError) as err:
            raise ExportError(f"{folder / name}: cannot be read ({one_line(err)})") from None
    source = f"the Trainer's {files[0] if len(files) == 1 else index.name}"
    if tp > 1:
        source += f" ({tp} tensor-parallel shards gathered by DeepSpeed when the Trainer saved)"
    if not set(weights) <= set(model.state_dict()):
        converted = _converted(folder)
        if converted is not None:
            return converted, source + " (converted from the family's saved layout by transformers)"
    return {k: v.float() for k, v in weights.items()}, source


def _converted(folder: Path) -> Dict[str, torch.Tensor] | None:
    """The Trainer's saved weights as transformers loads them, or None where that does not load every parameter
    exactly. ``save_pretrained`` writes some families in their original layout (transformers 5: a Mixtral's
    experts one tensor each, ``block_sparse_moe.experts.N.w1.weight``, where the model holds them fused, as
    ``mlp.experts.gate_up_proj``); loading converts them back (concatenations: the same values)."""
    from transformers import AutoModelForCausalLM

    try:
        loaded, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True,
                                                            trust_remote_code=False, output_loading_info=True)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError):
        return None
    if any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")):
        return None
    return {k: v.detach() for k, v in loaded.state_dict().items()}


def export_trainer_checkpoint(folder: Path, out_dir: Path, dtype: str, force: bool,
                               warn: Callable[[str], None], serve: ServeOptions = ServeOptions()) -> Dict[str, Any]:
    """Exports the Trainer checkpoint ``folder`` to ``out_dir`` (as :func:`snip_ds.export.export_checkpoint`
    does a ``step_N``); returns what the export records."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        meta = checkpoint_meta(folder)
    except ValueError as err:
        raise ExportError(str(err)) from None
    check_out_dir(out_dir, folder, force)
    if serve.format != "hf":
        plan_and_settings(meta, folder)  # before any weight is read
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ExportError(f"{config_file}: missing; the Trainer writes the model's config there when it saves")
    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ExportError(f"{config_file}: builds no causal LM ({one_line(err)})") from None
    tp = meta.get("tensor_parallel", 1)
    weights, source = _trainer_weights(folder, model, meta, out_dir.parent, warn)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in weights.items()}
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    wrong = sorted(k for k in set(expected) & set(got) if expected[k] != got[k])
    if not (extra or wrong):
        model.load_state_dict(weights, strict=False, assign=True)
        if missing:  # a safetensors file holds tied weights once: tie them, then nothing may be left unloaded
            model.tie_weights()
            missing = sorted(k for k, v in model.state_dict().items() if v.is_meta)
    if missing or extra or wrong:
        raise ExportError(f"{folder}: {source} do not hold the parameters of the model {config_file.name} "
                          f"describes (missing {missing[:3]}, unexpected {extra[:3]}, other shape {wrong[:3]})")
    model.config.use_cache = True
    parameters = int(sum(v.numel() for k, v in model.named_parameters()))  # the model's, before any packing
    served, after_save = finish_model(model, meta, folder, serve, DTYPES[dtype], warn)
    record = {"format": FORMAT, "checkpoint": str(folder.resolve()), "step": meta.get("step"), "dtype": dtype,
              "world_size": meta.get("world_size"), "tensor_parallel": tp, "weights": source,
              "plan": f"{folder.resolve() / 'snip_state.json'} (key 'plan'); " + plan_note(serve, dtype),
              "parameters": parameters, **served}
    return write_export(model, record, lambda tmp: _copy_trainer_tokenizer(folder, tmp, warn), out_dir, folder,
                         force, after_save)


def _copy_trainer_tokenizer(folder: Path, out: Path, warn: Callable[[str], None]) -> Dict[str, Any]:
    if not (folder / "tokenizer_config.json").is_file():
        reason = f"{folder} holds no tokenizer (the Trainer saves one given as processing_class)"
        warn(f"no tokenizer exported: {reason}; copy the run's tokenizer files into the export yourself")
        return {"kind": "unknown", "source": None, "exported": False, "note": reason}
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, TypeError) as err:
        raise ExportError(f"tokenizer {folder}: cannot be loaded ({one_line(err)})") from None
    tok.save_pretrained(str(out))
    return {"kind": "huggingface", "source": str(folder), "exported": True}
