"""What a snip_ds checkpoint is on disk, and reading it: the layout, the metadata, the model it was saved from.

Layout, under ``save_dir``::

    latest                           # tag of the newest *complete* checkpoint (written last)
    step_120/                        # DeepSpeed's files for that tag, and ours:
        snip_rng_rank0.safetensors   # per rank: stochastic-rounding generator states, torch's, Python's and
                                     # NumPy's RNG states
        snip_state.json              # rank 0: SNIP's state (plan, planner, streams, skipped steps, settings)
        snip_meta.json               # rank 0, written after every rank has finished: marks completion

``snip_state.json`` and ``snip_rng_rank<r>.safetensors`` are :class:`snip_ds.engine.state.SnipState`'s, the same
files a Hugging Face Trainer's ``checkpoint-N`` holds. A checkpoint without ``snip_meta.json`` is incomplete
and is never resumed from. ``snip_meta.json`` records the size and sha256 of every other file of the
checkpoint (key ``files``: DeepSpeed's shards of every rank and ours, :mod:`snip_ds.engine.checkpoint_verify`),
the model (:func:`model_fingerprint`, :func:`model_architecture`, :func:`model_config`), the data stream's
position, the lr schedule and the tokenizer. Checkpoints of older snip_ds versions (plan, planner state and
skipped steps inside ``snip_meta.json``, ``snip_rank00000.safetensors`` per rank) still resume
(:func:`read_snip_state`, :func:`rank_file`). A universal checkpoint (``snip-ds universal``'s,
:mod:`snip_ds.engine.universal`) is marked by the ``universal`` field of its ``snip_meta.json``.

Writing and restoring one: :mod:`snip_ds.engine.checkpoint`. Pure file reading: no DeepSpeed, no
torch.distributed.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, Mapping

import torch

from snip_ds.report.artifacts import (CHECKPOINT_FORMAT, CHECKPOINT_LATEST_FILE, CHECKPOINT_META_FILE, CHECKPOINT_RUN_DIR,
                               STATE_FILE, rng_file)

META_FILE = CHECKPOINT_META_FILE
LATEST_FILE = CHECKPOINT_LATEST_FILE
FORMAT = CHECKPOINT_FORMAT
RUN_CHECKPOINTS = CHECKPOINT_RUN_DIR  # a training run's save directory, inside its output directory
UNIVERSAL_FIELD = "universal"  # in snip_meta.json: what `snip-ds universal` converted (absent in a plain one)
UNIVERSAL_LATEST_FILE = "latest_universal"  # ds_to_universal writes it beside its output folder


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed from; the message names the file."""


def is_universal(meta: Mapping[str, Any]) -> bool:
    """Whether ``meta`` (``snip_meta.json``) is a universal checkpoint's (``snip-ds universal``'s)."""
    return meta.get(UNIVERSAL_FIELD) is not None


def check_universal_field(meta: Mapping[str, Any], path: Path) -> None:
    """A universal checkpoint's ``universal`` field has what a resume reads (``path``: its ``snip_meta.json``)."""
    u = meta[UNIVERSAL_FIELD]
    ok = (isinstance(u, dict) and u.get("zero_stage") in (1, 2, 3) and isinstance(u.get("train_batch_size"), int)
          and "files" in meta)
    if not ok:
        raise CheckpointError(f"{path}: field '{UNIVERSAL_FIELD}' must be an object with zero_stage 1-3 and "
                              f"train_batch_size, and the checkpoint must record 'files'; got "
                              f"{json.dumps(u)[:80]}")


# Hugging Face config fields that change a decoder's arithmetic. Parameter names and shapes (the
# fingerprint) miss some of them: 8 heads of 8 have the shapes of 4 heads of 16, and eps or RoPE's base none.
# max_position_embeddings is left out: the default model sizes it from block_size, and a run may resume at
# another sequence length (RoPE scalings that read it carry their own original length in rope_scaling).
ARCHITECTURE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                     "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "attention_bias",
                     "mlp_bias", "tie_word_embeddings", "sliding_window", "use_sliding_window", "max_window_layers",
                     "layer_types",
                     # other families' (GPT-NeoX, Phi-3, DeepSeek-V3's MLA, Mixture-of-Experts routing)
                     "layer_norm_eps", "use_parallel_residual", "rotary_pct", "rotary_emb_base", "qk_rope_head_dim",
                     "qk_nope_head_dim", "v_head_dim", "q_lora_rank", "kv_lora_rank", "first_k_dense_replace",
                     "num_experts", "num_local_experts", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                     "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
                     "routed_scaling_factor", "n_group", "topk_group", "decoder_sparse_step", "mlp_only_layers",
                     "rope_interleave")


def model_architecture(model: torch.nn.Module) -> Dict[str, Any]:
    """The :data:`ARCHITECTURE_KEYS` of ``model.config`` that it has, as JSON values; ``{}`` for a model without
    a Hugging Face config (then only the fingerprint is checked)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return {}
    values = config.to_dict()
    return {k: json.loads(json.dumps(values[k], default=str)) for k in ARCHITECTURE_KEYS if k in values}


def model_config(model: torch.nn.Module) -> Dict[str, Any]:
    """``model.config`` in full as JSON values (what ``snip-ds export`` writes as ``config.json``); ``{}`` for a
    model without a Hugging Face config."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return {}
    return json.loads(config.to_json_string(use_diff=False))


def model_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of every parameter's name and full shape (``ds_shape`` under ZeRO-3; a tensor-parallel shard's
    whole, unsharded shape, so that a model fingerprints alike before and after DeepSpeed shards it)."""
    whole = {}
    for module in model.modules():  # DeepSpeed's tensor-parallel layers remember their unsharded shapes
        for attr, shape_attr in (("weight", "_orig_weight_shape"), ("bias", "_orig_bias_shape")):
            param, shape = getattr(module, attr, None), getattr(module, shape_attr, None)
            if isinstance(param, torch.nn.Parameter) and shape is not None:
                whole[id(param)] = tuple(shape)
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        shape = whole.get(id(p), tuple(getattr(p, "ds_shape", p.shape)))
        h.update(f"{name}:{shape};".encode())
    return h.hexdigest()


def rank_file(tag_dir: Path, rank: int) -> Path:
    """``rank``'s SNIP tensors: ``snip_rng_rank<r>.safetensors``, or in an older checkpoint
    ``snip_rank<rrrrr>.safetensors`` (the same tensors under the same keys)."""
    new = tag_dir / rng_file(rank)
    old = tag_dir / f"snip_rank{rank:05d}.safetensors"
    return old if old.is_file() and not new.is_file() else new


def read_snip_state(tag_dir: Path, meta: Mapping[str, Any]) -> tuple[Dict[str, Any], str]:
    """SNIP's state in the checkpoint and the file it came from: ``snip_state.json``, or in a checkpoint of an
    older snip_ds the plan, planner state and skipped steps inside ``snip_meta.json``.

    Raises:
        CheckpointError: ``snip_state.json`` is unreadable or not an object.
    """
    path = tag_dir / STATE_FILE
    if path.is_file():
        try:
            state = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{path}: unreadable ({err})") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"{path}: not a JSON object")
        return state, str(path)
    return ({k: meta.get(k) for k in ("plan", "planner", "skipped_steps", "settings")}, str(tag_dir / META_FILE))


def resolve(path: Path) -> Path:
    """The checkpoint directory ``path`` names: a tag directory, a save directory with ``latest``, or a run's
    output directory (its ``checkpoints/latest``: the last complete checkpoint)."""
    if not path.exists():
        raise CheckpointError(f"{path}: checkpoint path does not exist")
    if (path / META_FILE).is_file():
        return path
    if not (path / LATEST_FILE).exists() and (path / RUN_CHECKPOINTS).is_dir():
        saves = path / RUN_CHECKPOINTS
        if not (saves / LATEST_FILE).is_file():
            raise CheckpointError(f"{saves}: no '{LATEST_FILE}' file: the run has saved no complete checkpoint")
        return resolve(saves)
    latest = path / LATEST_FILE
    if latest.is_file():
        tag_dir = path / latest.read_text().strip()
        if (tag_dir / META_FILE).is_file():
            return tag_dir
        raise CheckpointError(f"{latest}: points to {tag_dir}, which is not a complete snip_ds checkpoint")
    universal_latest = path / UNIVERSAL_LATEST_FILE  # ds_to_universal's, beside the folder it wrote
    if universal_latest.is_file() and (path / universal_latest.read_text().strip()).is_dir():
        return resolve(path / universal_latest.read_text().strip())
    if (path / "zero").is_dir():  # ds_to_universal's output: a folder per Parameter under zero/
        if (path / STATE_FILE).is_file():
            raise CheckpointError(f"{path}: an unfinished 'snip-ds universal' conversion (no {META_FILE}, which it "
                                  f"writes last): remove the folder and convert again")
        raise CheckpointError(f"{path}: a DeepSpeed universal checkpoint without snip_ds's files (no {META_FILE}, "
                              f"{STATE_FILE}, rank RNG files): convert the snip_ds checkpoint it came from with "
                              f"'snip-ds universal CHECKPOINT OUT_DIR' instead of ds_to_universal alone")
    if any(path.glob("*_model_states.pt")):
        raise CheckpointError(f"{path}: not a complete snip_ds checkpoint: it holds DeepSpeed's files but no "
                              f"{META_FILE}, which snip_ds writes last, so its save was interrupted")
    raise CheckpointError(f"{path}: not a snip_ds checkpoint (no {META_FILE}, and no '{LATEST_FILE}' file)")


def read_meta(tag_dir: Path) -> Dict[str, Any]:
    """``tag_dir``'s ``snip_meta.json``, its fields type-checked.

    Raises:
        CheckpointError: unreadable, not snip_ds's, or a field of the wrong type (named).
    """
    path = tag_dir / META_FILE
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: unreadable ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} metadata file")
    _check_fields(meta, path)
    return meta


_SHA256_HEX = frozenset("0123456789abcdef")


def _check_fields(meta: Mapping[str, Any], path: Path) -> None:
    """The fields a resume reads have their types where present (a hand-edited or damaged file is named, not
    crashed on); :func:`snip_ds.engine.checkpoint_verify.validate` requires the ones a resume cannot do without."""
    def bad(field: str, want: str) -> CheckpointError:
        return CheckpointError(f"{path}: field '{field}' must be {want}, got {json.dumps(meta.get(field))[:80]}")

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if "tag" in meta and not isinstance(meta["tag"], str):
        raise bad("tag", "a string")
    if "world_size" in meta and (not is_int(meta["world_size"]) or meta["world_size"] < 1):
        raise bad("world_size", "a positive integer")
    if "step" in meta and (not is_int(meta["step"]) or meta["step"] < 0):
        raise bad("step", "a non-negative integer")
    if "model_fingerprint" in meta and not isinstance(meta["model_fingerprint"], str):
        raise bad("model_fingerprint", "a string")
    for field in ("model_architecture", "plan", "data", "planner"):
        if meta.get(field) is not None and not isinstance(meta[field], dict):
            raise bad(field, "an object")
    if "files" in meta:
        files = meta["files"]
        if not isinstance(files, dict):
            raise bad("files", "an object")
        for name, rec in files.items():
            ok = (isinstance(rec, dict) and is_int(rec.get("size")) and rec["size"] >= 0
                  and isinstance(rec.get("sha256"), str) and len(rec["sha256"]) == 64
                  and set(rec["sha256"]) <= _SHA256_HEX)
            if not ok or name.startswith("/") or ".." in Path(name).parts:
                raise CheckpointError(f"{path}: field 'files' entry {json.dumps(name)} must be a relative path "
                                      f"with {{\"size\": bytes, \"sha256\": 64 hex digits}}, got "
                                      f"{json.dumps(rec)[:80]}")
