"""TensorBoard logging: the logging rank gets a real writer, every other rank a null logger.

Call sites never test the rank (``logger.scalar(...)`` is a no-op off rank 0). The precision map is an RGB
image of ``blocks x 7`` cells (q, k, v, o, gate, up, down), one colour per precision.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Optional

import numpy as np

from snip_ds.precision import GEMMS

LAYER_KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PRECISION_COLOURS = {  # RGB
    "bf16": (158, 158, 158),  # grey
    "fp8": (33, 113, 181),    # blue
    "fp4": (230, 85, 13),     # orange
}


def precision_map_image(assignment: Mapping[str, object], block_of, cell: int = 12) -> np.ndarray:
    """An ``[3, H, W]`` uint8 image: one row of 7 cells per block (one sub-row per GEMM if per-GEMM).

    Args:
        assignment: ``{fqn: precision}`` or ``{fqn: {gemm: precision}}``.
        block_of: maps an fqn to its block index.
        cell: pixels per cell side.
    """
    blocks = sorted({block_of(fqn) for fqn in assignment})
    row_of = {b: i for i, b in enumerate(blocks)}
    per_gemm = any(isinstance(v, Mapping) for v in assignment.values())
    sub = len(GEMMS) if per_gemm else 1
    img = np.full((len(blocks) * sub * cell, len(LAYER_KINDS) * cell, 3), 255, dtype=np.uint8)
    for fqn, prec in assignment.items():
        kind = fqn.rsplit(".", 1)[-1]
        if kind not in LAYER_KINDS:
            continue
        col = LAYER_KINDS.index(kind)
        precs = [prec[g] for g in GEMMS] if isinstance(prec, Mapping) else [prec]
        for s, p in enumerate(precs):
            top = (row_of[block_of(fqn)] * sub + s) * cell
            img[top + 1:top + cell - 1, col * cell + 1:(col + 1) * cell - 1] = PRECISION_COLOURS[p]
    return img.transpose(2, 0, 1)


class NullLogger:
    """The logger of every rank but the logging one: accepts everything, writes nothing."""

    def scalar(self, tag: str, value: float, step: int) -> None:
        pass

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        pass

    def image(self, tag: str, chw: np.ndarray, step: int) -> None:
        pass

    def text(self, tag: str, text: str, step: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardLogger(NullLogger):
    """Writes TensorBoard event files under ``log_dir``."""

    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def scalar(self, tag: str, value: float, step: int) -> None:
        self._writer.add_scalar(tag, float(value), step)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        for tag, value in values.items():
            self.scalar(tag, value, step)

    def image(self, tag: str, chw: np.ndarray, step: int) -> None:
        self._writer.add_image(tag, chw, step, dataformats="CHW")

    def text(self, tag: str, text: str, step: int) -> None:
        self._writer.add_text(tag, text, step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def make_logger(log_dir: Optional[str | Path], rank: int) -> NullLogger:
    """A :class:`TensorBoardLogger` on rank 0 when ``log_dir`` is set, else a :class:`NullLogger`."""
    if rank != 0 or log_dir is None:
        return NullLogger()
    return TensorBoardLogger(log_dir)


def config_text(settings: Mapping) -> str:
    """The run's settings as a Markdown code block for TensorBoard's text tab."""
    return "```json\n" + json.dumps(settings, indent=2, sort_keys=True, default=str) + "\n```"
