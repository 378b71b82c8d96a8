"""Precision names and per-GEMM precision triples.

A layer's precision is one of ``bf16`` (no quantization), ``fp8`` or ``fp4``, either for the whole layer or
separately for each of its three GEMMs (fprop, dgrad, wgrad). Everything in the package normalises to a
:class:`GemmPrecision` triple.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Union

PRECISIONS = ("bf16", "fp8", "fp4")
GEMMS = ("fprop", "dgrad", "wgrad")

LayerPrecision = Union[str, Mapping[str, str]]


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
