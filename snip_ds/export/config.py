"""What an exported model holds besides its weights: the Hugging Face config the checkpoint recorded
(:func:`hf_config`) and the tokenizer the run used (:func:`write_tokenizer`; the byte-level default as an
equivalent Hugging Face tokenizer, :func:`byte_tokenizer`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from snip_ds.run.corpus import BYTE_EOS_ID, PREPARE_META_FILE, ByteTokenizer
from snip_ds.export.files import ExportError, one_line


def hf_config(meta: Mapping[str, Any], meta_path: Path, warn: Callable[[str], None]):
    """The model's Hugging Face config: the full one the checkpoint recorded (``model_config``), or for a
    checkpoint that predates it, one rebuilt from its ``model_architecture`` fields (the others, such as
    ``max_position_embeddings`` or the special token ids, then take transformers' defaults: ``warn`` says so)."""
    from transformers import CONFIG_MAPPING

    fields = meta.get("model_config")
    if not fields:
        fields = meta.get("model_architecture")
        if not fields:
            raise ExportError(f"{meta_path}: records neither model_config nor model_architecture; the "
                              f"model's Hugging Face config cannot be rebuilt")
        warn(f"{meta_path}: records only the architecture fields (written before model_config was stored); "
             f"the other config fields take transformers' defaults")
    if not isinstance(fields, dict):
        raise ExportError(f"{meta_path}: model_config is not a JSON object")
    fields = dict(fields)
    model_type = fields.pop("model_type", None)
    if model_type not in CONFIG_MAPPING:
        raise ExportError(f"{meta_path}: model_config.model_type {model_type!r} is not a transformers model type")
    try:
        return CONFIG_MAPPING[model_type].from_dict(fields)
    except (TypeError, ValueError) as err:
        raise ExportError(f"{meta_path}: model_config is not a valid {model_type} config "
                          f"({one_line(err)})") from None


def byte_tokenizer():
    """A Hugging Face fast tokenizer that encodes and decodes exactly as :class:`snip_ds.run.corpus.ByteTokenizer`:
    every UTF-8 byte is one token whose id is the byte's value, ``<|endoftext|>`` is EOS (id 256).

    GPT-2's byte-level pre-tokenizer (no regex split, no prefix space) maps each byte to one printable
    character, a BPE without merges maps that character to the byte's value, and the byte-level decoder
    inverts it. ``split_special_tokens`` keeps a literal ``<|endoftext|>`` in text as bytes, as the
    ByteTokenizer does. One difference: decoding with ``skip_special_tokens``, the ByteTokenizer decodes the
    bytes on each side of an EOS separately, this decoder joins them (only a UTF-8 sequence cut by an EOS
    decodes differently).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    eos = ByteTokenizer.eos_text
    tok.add_special_tokens([AddedToken(eos, special=True, normalized=False)])
    if tok.token_to_id(eos) != BYTE_EOS_ID:
        raise AssertionError(f"byte tokenizer: EOS got id {tok.token_to_id(eos)}, expected {BYTE_EOS_ID}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, split_special_tokens=True)


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's byte -> character table: printable Latin-1 bytes map to themselves, the other 68 to U+0100..."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    for n, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + n)
    return table


def tokenizer_source(meta: Mapping[str, Any]) -> Tuple[Optional[str], str]:
    """``("byte", why)``, ``(path, why)`` of a local Hugging Face tokenizer, or ``(None, why)`` when the
    checkpoint does not tell. Checkpoints record it (``tokenizer``); older ones are read from the settings; a
    checkpoint of the user's own loop records neither (unless its ``extra`` names a ``tokenizer``)."""
    recorded = meta.get("tokenizer")
    if recorded == "unknown":
        return None, "the run's dataset did not record its tokenizer"
    if isinstance(recorded, str) and recorded:
        return recorded, "recorded in the checkpoint"
    if not isinstance(meta.get("settings"), Mapping):  # launch/train.py records both; a user's own loop neither
        return None, ("a run of your own loop records no tokenizer (engine.save_checkpoint's extra "
                      "{'tokenizer': PATH} names one)")
    train = ((meta.get("settings") or {}).get("train") or {})
    if train.get("tokenizer_name_or_path"):
        return str(train["tokenizer_name_or_path"]), "settings.train.tokenizer_name_or_path"
    dataset = train.get("dataset")
    if dataset is None:
        return "byte", "the default corpus"
    prepared = Path(dataset) / PREPARE_META_FILE if isinstance(dataset, str) else None
    if prepared is not None and (Path(dataset) / "dataset_dict.json").is_file():
        try:
            return str(json.loads(prepared.read_text())["tokenizer"]), str(prepared)
        except (OSError, ValueError, KeyError, TypeError):
            return None, f"prepared dataset {dataset} records no tokenizer"
    if prepared is not None and not Path(dataset).exists():
        return None, f"dataset {dataset} (named in the settings) is not here"
    return "byte", "raw text without tokenizer_name_or_path"


def write_tokenizer(meta: Mapping[str, Any], out: Path, warn: Callable[[str], None]) -> Dict[str, Any]:
    """Writes the run's tokenizer (:func:`tokenizer_source`) into ``out``: the byte-level one, or a local Hugging
    Face tokenizer's files; where there is none to write, ``warn`` says why. Returns what :data:`~snip_ds.
    export_files.EXPORT_FILE` records of it."""
    source, why = tokenizer_source(meta)
    if source == "byte":
        byte_tokenizer().save_pretrained(str(out))
        return {"kind": "byte", "exported": True, "note": (
            "snip_ds's byte-level tokenizer as a Hugging Face tokenizer: token id = UTF-8 byte value, "
            "<|endoftext|> (id 256) = EOS separating documents; the model's vocabulary is padded to a "
            "multiple of 8 and the extra ids are never produced. Encoding is identical; decoding too, except "
            "that with skip_special_tokens a UTF-8 sequence cut by an EOS is joined rather than replaced by U+FFFD")}
    if source is not None and Path(source).is_dir():
        from transformers import AutoTokenizer
        try:
            tok = AutoTokenizer.from_pretrained(source, local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError, TypeError) as err:
            raise ExportError(f"tokenizer {source}: cannot be loaded ({one_line(err)})") from None
        tok.save_pretrained(str(out))
        return {"kind": "huggingface", "source": source, "exported": True}
    reason = why if source is None else f"the run's tokenizer {source} ({why}) is not a directory here"
    warn(f"no tokenizer exported: {reason}; copy the run's tokenizer files into the export yourself")
    return {"kind": "unknown" if source is None else "huggingface", "source": source, "exported": False,
            "note": reason}
