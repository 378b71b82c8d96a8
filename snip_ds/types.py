"""The words every module shares: precisions, GEMMs and their operands, layer kinds, the block index.

A layer's precision is one of ``bf16`` (no quantization), ``fp8`` or ``fp4``, either for the whole layer or
separately for each of its three GEMMs (fprop, dgrad, wgrad); :class:`GemmPrecision` is that triple.
The swapped layers are the linears of the decoder blocks (the entries of the model's block list, ``...layers.<i>``
or ``...h.<i>``; :mod:`snip_ds.decoder` finds them); a layer's kind is its path inside its block
(``self_attn.q_proj``, ``mlp.dense_h_to_4h``, ``attn.c_attn``).

This module is pure data: no torch, no torch.distributed.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

PRECISIONS = ("bf16", "fp8", "fp4")
QUANTIZED = ("fp8", "fp4")  # the precisions that quantize (bf16 runs the GEMM as it is)
GEMMS = ("fprop", "dgrad", "wgrad")

# The operands of a linear Y = X·Wᵀ (x: input, w: weight, g: output gradient) and which two each GEMM
# quantizes, first operand first.
OPERANDS = ("x", "w", "g")
GEMM_OPERANDS = {"fprop": ("x", "w"), "dgrad": ("g", "w"), "wgrad": ("g", "x")}
# The axis each of those two operands is quantized along (the GEMM's reduction axis).
GEMM_OPERAND_AXES = {"fprop": (-1, -1), "dgrad": (-1, 0), "wgrad": (0, 0)}

LayerPrecision = Union[str, Mapping[str, str]]

# A Llama-family block's kinds in block order: how displays without the model order those kinds.
LLAMA_KINDS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")

def _block_position(fqn: str) -> Optional[int]:
    """The index, in ``fqn``'s dotted components, of the decoder block's number: the first all-digit component
    that follows a named one, after any wrapper in front (``module`` and the numbers of a container around the
    model: DeepSpeed, DDP, ``nn.Sequential``). A model's blocks are the entries of its block list
    (:mod:`snip_ds.layouts.blocks`), so a layer's name is ``<block list>.<i>.<path in the block>`` whatever the
    list is called (``model.layers``, ``transformer.h``, ``gpt_neox.layers``, ``model.decoder.layers``)."""
    parts = fqn.split(".")
    start = 0
    if parts and parts[0] == "module":
        start = 1
        while start < len(parts) and parts[start].isdigit():
            start += 1
    for i in range(start + 1, len(parts)):
        if parts[i].isdigit() and not parts[i - 1].isdigit():
            return i
    return None


def block_index(fqn: str) -> int:
    """The decoder block number in a layer name: ``3`` for ``model.layers.3.self_attn.q_proj`` or
    ``transformer.h.3.attn.c_attn``, the first number that follows a named component (wrappers such as
    ``module.`` or ``module.0.`` in front do not count).

    Raises:
        ValueError: the name has no such component.
    """
    at = _block_position(fqn)
    if at is None:
        raise ValueError(f"layer {fqn!r}: no decoder block index ('<blocks>.<i>.') in its name")
    return int(fqn.split(".")[at])


def layer_kind(fqn: str) -> str:
    """A layer's path inside its decoder block: ``self_attn.q_proj`` for ``model.layers.3.self_attn.q_proj``
    (the whole name where it has no block index)."""
    at = _block_position(fqn)
    parts = fqn.split(".")
    return ".".join(parts[at + 1:]) if at is not None and at + 1 < len(parts) else fqn


def check_precision(name: object, field: str = "precision") -> str:
    """Returns ``name`` if it is a valid precision, else raises a ValueError naming ``field``."""
    if not isinstance(name, str) or name not in PRECISIONS:
        raise ValueError(f"{field}: unknown precision {name!r}; valid: {', '.join(PRECISIONS)}")
    return name


@dataclass(frozen=True)
class GemmPrecision:
    """The precision of each GEMM of one linear layer."""

    fprop: str
    dgrad: str
    wgrad: str

    def __post_init__(self) -> None:
        for gemm in GEMMS:
            check_precision(getattr(self, gemm), field=gemm)

    @classmethod
    def of(cls, value: "LayerPrecision | GemmPrecision", field: str = "precision") -> "GemmPrecision":
        """Normalises ``"fp8"`` or ``{"fprop": "fp4", "dgrad": "fp8", "wgrad": "fp8"}`` to a triple."""
        if isinstance(value, GemmPrecision):
            return value
        if isinstance(value, str):
            check_precision(value, field)
            return cls(value, value, value)
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - set(GEMMS))
            missing = [g for g in GEMMS if g not in value]
            if unknown or missing:
                raise ValueError(
                    f"{field}: a per-GEMM precision needs exactly the keys {', '.join(GEMMS)}"
                    f" (unknown: {unknown}, missing: {missing})")
            return cls(*(check_precision(value[g], f"{field}.{g}") for g in GEMMS))
        raise ValueError(f"{field}: expected a precision name or a per-GEMM mapping, got {type(value).__name__}")

    @property
    def uniform(self) -> "str | None":
        """The single precision if all three GEMMs agree, else None."""
        return self.fprop if self.fprop == self.dgrad == self.wgrad else None

    def to_json(self) -> "str | dict[str, str]":
        """A plain string when uniform, else a ``{gemm: precision}`` dict."""
        return self.uniform or {g: getattr(self, g) for g in GEMMS}

    def fp4_fraction(self) -> float:
        """Share of the layer's FLOPs that run in FP4 (each GEMM is a third of them)."""
        return sum(getattr(self, g) == "fp4" for g in GEMMS) / 3.0


def expert_pair(fqn: str) -> Optional[Tuple[str, int, str]]:
    """``(experts module path, expert, projection)`` for an MoE pair's layer name: a number inside the decoder
    block followed by one last name (``model.layers.3.mlp.experts.17.down_proj`` ->
    ``("model.layers.3.mlp.experts", 17, "down_proj")``; an expert list's linear ``...experts.17.w1`` alike);
    None for any other layer. Displays split a plan's experts from its dense layers with it."""
    at = _block_position(fqn)
    parts = fqn.split(".")
    if at is None or len(parts) < at + 4 or not parts[-2].isdigit() or parts[-1].isdigit():
        return None
    return ".".join(parts[:-2]), int(parts[-2]), parts[-1]


def layer_kinds(fqns: Iterable[str]) -> Tuple[str, ...]:
    """The distinct kinds (paths inside a block) of ``fqns``, in order of first appearance."""
    return tuple(dict.fromkeys(layer_kind(f) for f in fqns))


def display_kinds(fqns: Iterable[str]) -> Tuple[str, ...]:
    """The kinds of ``fqns`` in an order for displays that have only names (a plan's keys are sorted): a
    Llama-family block's kinds in their block order; any other model's grouped by the module they live in,
    attention's (a module named ``*attn*``/``*attention*``) first, each group in order of first appearance.
    Where the model is at hand, :func:`layer_kinds` of its layers gives its own order."""
    kinds = layer_kinds(fqns)
    if set(kinds) <= set(LLAMA_KINDS):
        return tuple(k for k in LLAMA_KINDS if k in kinds)
    parents: Dict[str, List[str]] = {}
    for kind in kinds:
        parents.setdefault(kind.rsplit(".", 1)[0] if "." in kind else "", []).append(kind)
    attention = [p for p in parents if "attn" in p.lower() or "attention" in p.lower()]
    order = attention + [p for p in parents if p not in attention]
    return tuple(k for p in order for k in parents[p])


def kind_labels(kinds: Sequence[str]) -> Dict[str, str]:
    """Short column labels: each kind's last name without ``_proj`` (``q``, ``gate_up``, ``dense_h_to_4h``),
    the full path where two kinds would share a label."""
    short = {k: k.rsplit(".", 1)[-1].removesuffix("_proj") or k for k in kinds}
    counts: Dict[str, int] = {}
    for label in short.values():
        counts[label] = counts.get(label, 0) + 1
    return {k: (label if counts[label] == 1 else k) for k, label in short.items()}


def layer_seed(seed: int, fqn: str, rank: int) -> int:
    """The stochastic-rounding seed of the planned layer ``fqn`` on ``rank`` (a linear, or an MoE pair): a hash
    of ``(seed, rank, fqn)``, so that every layer draws its own rounding noise, the same at every resume."""
    digest = hashlib.sha256(f"{seed}:{rank}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def full_shape(param) -> Tuple[int, ...]:
    """A Parameter's shape, also when ZeRO-3 has partitioned it (its data then an empty placeholder, its shape in
    ``ds_shape``)."""
    return tuple(getattr(param, "ds_shape", param.shape))

