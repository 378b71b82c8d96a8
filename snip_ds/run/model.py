"""Model construction: the embedded default Llama, user models, and the decoder-linear inventory.

The default is a ~10M-parameter Llama (6 blocks, hidden 384, GQA with 2 KV heads) built from a
``LlamaConfig`` in code, so training works on a fresh machine with nothing to download. Every GEMM
contraction width (384, 128, 1024) is a multiple of 32, the largest block size any SNIP format uses.

Users may instead pass a local Hugging Face model directory or a JSON config file. Any causal LM whose decoder
blocks hold linear GEMMs is accepted (:mod:`snip_ds.decoder` finds them by structure: Llama, Mistral, Qwen2,
Phi-3, GPT-NeoX, GPT-2, OPT, the Mixture-of-Experts families whose experts layout it proves, ...); a model
without such layers, or with experts modules whose layout cannot be proved, is refused in one line naming the
model class or the module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedModel

from snip_ds import decoder as _decoder

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_VOCAB_SIZE",
    "build_model",
    "count_parameters",
    "decoder_blocks",
    "decoder_linear_names",
    "default_model_config",
    "pad_vocab_size",
]

DEFAULT_VOCAB_SIZE = 257  # ByteTokenizer: 256 bytes + EOS
DEFAULT_BLOCK_SIZE = 256
_VOCAB_MULTIPLE = 8  # pad the embedding rows so GEMM widths stay aligned


def pad_vocab_size(vocab_size: int, multiple: int = _VOCAB_MULTIPLE) -> int:
    """Round ``vocab_size`` up to a multiple of ``multiple`` (the extra rows are never targets)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return -(-vocab_size // multiple) * multiple


def default_model_config(
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    block_size: int = DEFAULT_BLOCK_SIZE,
    eos_token_id: int | None = DEFAULT_VOCAB_SIZE - 1,
) -> LlamaConfig:
    """The embedded default: a ~10M-parameter Llama sized for CPU training in minutes.

    Args:
        vocab_size: The tokenizer's vocabulary size; the model's is padded up to a multiple of 8.
        block_size: Training sequence length; ``max_position_embeddings`` is at least this.
        eos_token_id: Recorded in the config for generation (the ByteTokenizer's EOS by default).

    Returns:
        A ``LlamaConfig`` with 6 blocks, hidden 384, 6 query heads of width 64, 2 KV heads (GQA),
        SwiGLU width 1024, RoPE, untied embeddings.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return LlamaConfig(
        vocab_size=pad_vocab_size(vocab_size),
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        hidden_act="silu",
        max_position_embeddings=max(block_size, DEFAULT_BLOCK_SIZE),
        initializer_range=0.02,
        rms_norm_eps=1e-5,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=None,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=False,
        mlp_bias=False,
    )


def build_model(
    model_name_or_path: str | Path | None = None,
    model_config: str | Path | Mapping[str, Any] | PretrainedConfig | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> PreTrainedModel:
    """Build the causal LM to train.

    Exactly one source is used: a local pretrained directory, a config (JSON file, dict or
    ``PretrainedConfig``, initialised from scratch), or, with neither, :func:`default_model_config`.
    Initialisation from scratch is deterministic in ``seed`` and leaves the global RNG untouched.

    Args:
        model_name_or_path: Local Hugging Face model directory (``config.json`` + weights). Never downloads.
        model_config: Config for a model trained from scratch.
        vocab_size: The tokenizer's vocabulary size; the model's must be at least this.
        seed: Seed for the from-scratch initialisation.
        dtype: Parameter dtype of the returned model.
        block_size: Sequence length, only used to size the default config.

    Returns:
        The model, in train mode, on CPU.

    Raises:
        FileNotFoundError: A path does not exist or lacks ``config.json``.
        ValueError: Both sources given, malformed config, no quantizable linears or MoE experts whose layout
            cannot be proved (:func:`decoder_linear_names`), vocab too small.
    """
    if model_name_or_path is not None and model_config is not None:
        raise ValueError("pass model_name_or_path or model_config, not both")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if model_name_or_path is not None:
            model = _load_pretrained(Path(model_name_or_path), dtype)
            source = f"model directory {model_name_or_path}"
        else:
            if model_config is None:
                config = default_model_config(vocab_size or DEFAULT_VOCAB_SIZE, block_size)
                source = "default model config"
            else:
                config, source = _resolve_config(model_config)
            model = _from_config(config, source)
    model = model.to(dtype)
    from snip_ds.swap import layer_infos
    layer_infos(model)  # raises, naming the class or the module, if nothing or not all can be quantized
    embedding = model.get_input_embeddings().weight
    model_vocab = getattr(embedding, "ds_shape", embedding.shape)[0]  # ds_shape: built partitioned (ZeRO-3 zero.Init)
    if vocab_size is not None and model_vocab < vocab_size:
        raise ValueError(
            f"{source}: model vocab_size {model_vocab} is smaller than the tokenizer's {vocab_size}"
        )
    model.config.use_cache = False
    model.train()
    return model


def _load_pretrained(path: Path, dtype: torch.dtype) -> PreTrainedModel:
    if not path.exists():
        raise FileNotFoundError(f"model_name_or_path {str(path)!r} does not exist (only local directories load)")
    if not path.is_dir():
        raise ValueError(
            f"model_name_or_path {str(path)!r} is not a directory; pass a config file as model_config instead"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model_name_or_path {str(path)!r} has no config.json")
    _read_json(path / "config.json")  # a clear error for malformed JSON before transformers sees it
    return AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, trust_remote_code=False, dtype=dtype
    )


def _resolve_config(model_config: str | Path | Mapping[str, Any] | PretrainedConfig) -> tuple[PretrainedConfig, str]:
    if isinstance(model_config, PretrainedConfig):
        return model_config, f"{type(model_config).__name__}"
    if isinstance(model_config, Mapping):
        return _config_from_dict(dict(model_config), "model_config dict"), "model_config dict"
    path = Path(model_config)
    if not path.exists():
        raise FileNotFoundError(f"model_config {str(path)!r} does not exist")
    if not path.is_file():
        raise ValueError(f"model_config {str(path)!r} is not a file; pass a model directory as model_name_or_path")
    source = f"model_config {str(path)!r}"
    return _config_from_dict(_read_json(path), source), source


def _from_config(config: PretrainedConfig, source: str) -> PreTrainedModel:
    try:
        return AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except ValueError:  # transformers lists every known class; keep the message to one line
        raise ValueError(f"{source}: model_type {config.model_type!r} has no causal-LM class; expected a "
                         "decoder-only causal LM such as 'llama', 'qwen2', 'phi3', 'gpt_neox'") from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: malformed JSON config: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a model config must be a JSON object, got {type(data).__name__}")
    return data


def _config_from_dict(data: dict[str, Any], source: str) -> PretrainedConfig:
    """A dict with ``model_type`` goes through ``AutoConfig``; without one it is a ``LlamaConfig``."""
    model_type = data.pop("model_type", None)
    if model_type is not None and model_type not in CONFIG_MAPPING:
        raise ValueError(f"{source}: unknown model_type {model_type!r}; expected a decoder-only causal LM "
                         "such as 'llama', 'qwen2', 'phi3', 'gpt_neox'")
    from huggingface_hub.errors import StrictDataclassError  # a field's value out of its range: no ValueError

    try:
        if model_type is None:
            return LlamaConfig(**data)
        return AutoConfig.for_model(model_type, **data)
    except (TypeError, ValueError, StrictDataclassError) as err:
        raise ValueError(
            f"{source}: invalid config ({' '.join(str(err).split())}); expected LlamaConfig fields or a "
            "'model_type' of a decoder-only causal LM such as 'llama', 'qwen2', 'phi3', 'gpt_neox'"
        ) from None


# ------------------------------------------------------------------ decoder inventory


def decoder_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The decoder blocks as ``(fqn, module)`` in model order (:func:`snip_ds.decoder.decoder_blocks`)."""
    return _decoder.decoder_blocks(model)


def decoder_linear_names(model: nn.Module) -> list[str]:
    """Fully qualified names of the quantizable linears of every decoder block, lm_head excluded
    (:func:`snip_ds.decoder.decoder_linears`): block by block, each in its module order (a Llama's q, k, v, o,
    gate, up, down). Pure: only reads the model. Any class proved to compute a linear GEMM counts (GPT-2's
    ``Conv1D``, ``nn.Linear`` subclasses that keep its forward).

    Raises:
        ValueError: the model has no quantizable linear (named by its class) or MoE experts whose layout cannot be
            proved (the module named, and why).
    """
    return _decoder.decoder_linears(model)


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements (each shared Parameter counted once)."""
    return sum(p.numel() for p in model.parameters())
