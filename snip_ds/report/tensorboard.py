"""TensorBoard logging: the logging rank gets a real writer, every other rank a null logger.

Call sites never test the rank (``logger.scalar(...)`` is a no-op off rank 0). The precision map is a labelled
matplotlib figure, rendered to an RGB image: ``blocks x kinds`` cells (a kind is a layer's path inside its block:
q, k, v, o, gate, up, down in a Llama; qkv, o, gate_up, down in a Phi-3), one colour per precision, with the step
and FP4 share in its title and a legend.
"""
from __future__ import annotations

import gc
import json
import os
import socket
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np
from tensorboard.compat.proto import event_pb2
from tensorboard.summary.writer.record_writer import RecordWriter

from snip_ds.runtime.console import say
from snip_ds.types import display_kinds, kind_labels
from snip_ds.types import GEMMS, expert_pair, layer_kind

_files_opened = 0  # numbers this process's event files (two loggers in one second get two files)

PRECISION_COLOURS = {  # RGB
    "bf16": (158, 158, 158),  # grey
    "fp8": (33, 113, 181),    # blue
    "fp4": (230, 85, 13),     # orange
}


GEMM_SHORT = {"fprop": "F", "dgrad": "D", "wgrad": "W"}
_DPI = 100


def _group_label(kinds, labels) -> str:
    """``self_attn (q k v o)  |  mlp (gate up down)``: the columns' labels grouped by the module they live in."""
    groups: list = []
    for kind in kinds:
        parent = kind.rsplit(".", 1)[0] if "." in kind else ""
        if not groups or groups[-1][0] != parent:
            groups.append((parent, []))
        groups[-1][1].append(labels[kind])
    return "  |  ".join(f"{parent} ({' '.join(names)})" if parent else " ".join(names) for parent, names in groups)


def precision_map_figure(assignment: Mapping[str, object], block_of, *, kinds: Optional[Sequence[str]] = None,
                         step: Optional[int] = None, fp4_share: Optional[float] = None,
                         method: Optional[str] = None):
    """The precision map as a matplotlib ``Figure`` (not attached to pyplot): one row per decoder block, one
    column per kind of layer (its path inside the block), coloured by precision; a per-GEMM plan splits each
    cell into fprop | dgrad | wgrad stripes (labelled F D W along the top). The title gives the step, the FP4
    share of the linear-GEMM FLOPs and the method; a legend names the colours. A plan with MoE pairs
    (:func:`snip_ds.types.expert_pair`) gets a second panel below: one row per expert, one column per MoE block
    and projection, readable from 4 to 256 experts.

    Args:
        assignment: ``{fqn: precision}`` or ``{fqn: {gemm: precision}}``.
        block_of: maps an fqn to its block index.
        kinds: the columns in model order (e.g. ``[info.kind for info in infos.values()]``; repeats are
            dropped); None: :func:`snip_ds.decoder.display_kinds` of the assignment's names.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    experts = {f: v for f, v in assignment.items() if expert_pair(f) is not None}
    assignment = {f: v for f, v in assignment.items() if f not in experts}
    blocks = sorted({block_of(fqn) for fqn in assignment})
    row_of = {b: i for i, b in enumerate(blocks)}
    per_gemm = any(isinstance(v, Mapping) for v in assignment.values())
    sub = len(GEMMS) if per_gemm else 1
    present = display_kinds(assignment)
    columns = [k for k in dict.fromkeys(kinds) if k in present] if kinds is not None else list(present)
    columns += [k for k in present if k not in columns]
    col_of, labels = {k: i for i, k in enumerate(columns)}, kind_labels(columns)
    n_cols = len(columns)
    grid = np.full((len(blocks), n_cols * sub, 3), 255, dtype=np.uint8)  # white: not in the plan
    for fqn, prec in assignment.items():
        precs = [prec[g] for g in GEMMS] if isinstance(prec, Mapping) else [prec]
        for s, p in enumerate(precs):
            grid[row_of[block_of(fqn)], col_of[layer_kind(fqn)] * sub + s] = PRECISION_COLOURS[p]

    n_rows = max(len(blocks), 1)
    long_labels = max((len(labels[k]) for k in columns), default=0) > 6  # slanted, with more room below
    top_in, cells_in = 0.95, max(0.26 * n_rows, 1.0)  # margins for title and labels, inches
    bottom_in = 0.75 + 0.035 * max((len(labels[k]) for k in columns), default=0) if long_labels else 0.75
    experts_grid = _experts_grid(experts, block_of, sub) if experts else None
    experts_in = 0.0 if experts_grid is None else min(max(0.12 * experts_grid[0].shape[0], 1.0), 6.0) + 0.95
    height = top_in + bottom_in + cells_in + experts_in
    fig = Figure(figsize=(7.2, height), dpi=_DPI)
    if experts_grid is not None:
        _draw_experts(fig, experts_grid, sub, per_gemm, height, experts_in)
    ax = fig.add_axes((0.09, (bottom_in + experts_in) / height, 0.66, cells_in / height))
    ax.imshow(grid, aspect="auto", interpolation="nearest",
              extent=(-0.5, n_cols - 0.5, len(blocks) - 0.5, -0.5))
    ax.set_xticks(range(n_cols), [labels[k] for k in columns], rotation=30 if long_labels else 0,
                  ha="right" if long_labels else "center", fontsize=8 if long_labels else None)
    ax.set_xlabel(_group_label(columns, labels), fontsize=9 if long_labels else None)
    stride = max(1, -(-len(blocks) // 32))  # at most ~32 block labels
    ax.set_yticks(range(0, len(blocks), stride), [str(b) for b in blocks[::stride]])
    ax.set_ylabel("decoder block")
    ax.set_xticks([c + 0.5 for c in range(n_cols - 1)], minor=True)
    ax.set_yticks([r + 0.5 for r in range(len(blocks) - 1)], minor=True)
    ax.grid(which="minor", color="white", linewidth=2)
    ax.tick_params(which="minor", length=0)
    if per_gemm:
        top = ax.secondary_xaxis("top")
        top.set_xticks([c - 0.5 + (s + 0.5) / sub for c in range(n_cols) for s in range(sub)],
                       [GEMM_SHORT[g] for _ in columns for g in GEMMS], fontsize=7)
        top.tick_params(length=0)
        ax.vlines([c - 0.5 + s / sub for c in range(n_cols) for s in range(1, sub)], -0.5,
                  len(blocks) - 0.5, colors="white", linewidth=0.6)
    title = "precision plan" + ("" if step is None else f" at step {step}")
    details = []
    if fp4_share is not None:
        details.append(f"FP4 share {fp4_share:.1%} of linear FLOPs")
    if method:
        details.append(f"method {method}")
    ax.set_title(title + ("\n" + ", ".join(details) if details else ""), fontsize=11,
                 pad=16 if per_gemm else 6)
    handles = [Patch(facecolor=np.array(c) / 255.0, edgecolor="black", linewidth=0.5, label=p)
               for p, c in PRECISION_COLOURS.items()]
    legend_title = "per GEMM:\nF fprop\nD dgrad\nW wgrad" if per_gemm else "precision"
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.77, (bottom_in + experts_in + cells_in) / height),
               title=legend_title, frameon=False)
    return fig


def _experts_grid(experts: Mapping[str, object], block_of, sub: int):
    """The MoE pairs as an RGB grid: one row per expert, one column per (block, projection) of each experts
    module (``sub`` stripes for a per-GEMM plan); and the columns' ``(block, projection)`` labels."""
    cells = {}
    for fqn, prec in experts.items():
        path, expert, projection = expert_pair(fqn)
        cells[(block_of(fqn), path, projection, expert)] = prec
    columns = sorted({(b, path, proj) for b, path, proj, _ in cells}, key=lambda c: (c[0], c[1], c[2].startswith("down")))
    col_of = {c: i for i, c in enumerate(columns)}
    n_experts = max(e for *_, e in cells) + 1
    grid = np.full((n_experts, len(columns) * sub, 3), 255, dtype=np.uint8)
    for (b, path, proj, e), prec in cells.items():
        precs = [prec[g] for g in GEMMS] if isinstance(prec, Mapping) else [prec]
        for s, p in enumerate(precs):
            grid[e, col_of[(b, path, proj)] * sub + s] = PRECISION_COLOURS[p]
    return grid, [(b, proj) for b, _, proj in columns]


def _draw_experts(fig, experts_grid, sub: int, per_gemm: bool, height: float, panel_in: float) -> None:
    """The experts panel at the bottom of the precision map: experts as rows, each MoE block's projections as
    columns (labelled ``<block>:<projection>``, thinned out to about 24 labels)."""
    grid, columns = experts_grid
    n_experts, n_cols = grid.shape[0], len(columns)
    cells_in = panel_in - 0.95
    ax = fig.add_axes((0.09, 0.6 / height, 0.66, cells_in / height))
    ax.imshow(grid, aspect="auto", interpolation="nearest", extent=(-0.5, n_cols - 0.5, n_experts - 0.5, -0.5))
    stride = max(1, -(-n_cols // 24))
    ax.set_xticks(range(0, n_cols, stride), [f"{b}:{p.removesuffix('_proj')}" for b, p in columns[::stride]],
                  rotation=30, ha="right", fontsize=7)
    estride = max(1, -(-n_experts // 16))
    ax.set_yticks(range(0, n_experts, estride), [str(e) for e in range(0, n_experts, estride)], fontsize=7)
    ax.set_ylabel("expert", fontsize=9)
    ax.set_title("Mixture-of-Experts pairs (block:projection)", fontsize=9, pad=4)
    if n_cols <= 64 and n_experts <= 64:
        ax.set_xticks([c + 0.5 for c in range(n_cols - 1)], minor=True)
        ax.set_yticks([r + 0.5 for r in range(n_experts - 1)], minor=True)
        ax.grid(which="minor", color="white", linewidth=1)
        ax.tick_params(which="minor", length=0)
    if per_gemm and n_cols <= 64:
        ax.vlines([c - 0.5 + s / sub for c in range(n_cols) for s in range(1, sub)], -0.5, n_experts - 0.5,
                  colors="white", linewidth=0.4)


def precision_map_image(assignment: Mapping[str, object], block_of, *, kinds: Optional[Sequence[str]] = None,
                        step: Optional[int] = None, fp4_share: Optional[float] = None,
                        method: Optional[str] = None) -> np.ndarray:
    """:func:`precision_map_figure` rendered as a ``[3, H, W]`` uint8 image (720 pixels wide) for TensorBoard.

    A matplotlib figure is a web of reference cycles, which only a collection by Python's garbage collector
    frees; left to the collector's own schedule (its full collections are rare in a process of a training run's
    size), each re-plan's figure kept about 1 MiB alive, RSS rising by tens of MiB between two full
    collections. So the figure is collected here, once its pixels are copied (one full collection per plan
    change)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = precision_map_figure(assignment, block_of, kinds=kinds, step=step, fp4_share=fp4_share, method=method)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    chw = np.ascontiguousarray(np.asarray(canvas.buffer_rgba())[..., :3].transpose(2, 0, 1))
    del fig, canvas
    gc.collect()  # the figure's cycles, its pixel buffer with them
    return chw


class NullLogger:
    """The logger of every rank but the logging one: accepts everything, writes nothing.

    ``writes_images`` tells callers whether an image would be written at all, so that they render one (a
    precision map takes a figure and a garbage collection) only where it is.
    """

    writes_images = False

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
    """Writes one TensorBoard event file under ``log_dir``, in the calling thread.

    Each call (``scalar``, ``scalars``, ``image``, ``text``) writes its records and flushes them to the file
    before it returns, so whatever was logged is on disk if the process stops right after (a lost peer, a
    kill). A write that fails (a full disk, a file-size limit, a directory removed or made read-only) is
    reported once, as ``snip_ds: warning: TensorBoard: cannot write to <log_dir> (<cause>); ...``, and every
    later record is dropped: training goes on, and the file keeps the records written before the failure
    (TensorBoard reads a file up to a last, partial record). Writes are not retried, as a full disk stays full
    and a record written after a partial one would be unreadable.
    """

    writes_images = True

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        self.error: Optional[str] = None  # why writing stopped; None while it works
        self._file = None
        self._records = None
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            global _files_opened
            _files_opened += 1
            name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}."
                    f"{_files_opened}")
            self._file = open(self.log_dir / name, "xb")
            self._records = RecordWriter(self._file)
            self._write([event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2")])
        except OSError as err:
            self._fail(err)

    def _fail(self, err: BaseException) -> None:
        cause = f"{err.strerror} [errno {err.errno}]" if isinstance(err, OSError) and err.errno else str(err)
        self.error = f"{type(err).__name__}: {cause}" if not isinstance(err, OSError) else cause
        say(f"snip_ds: warning: TensorBoard: cannot write to {self.log_dir} ({self.error}); later TensorBoard "
            f"records of this run are dropped, training goes on")
        file, self._file, self._records = self._file, None, None
        if file is not None:
            try:
                file.close()
            except OSError:
                pass  # the buffered rest could not be written either

    def _write(self, events) -> None:
        if self._records is None:
            return
        try:
            for event in events:
                self._records.write(event.SerializeToString())
            self._file.flush()
        except OSError as err:
            self._fail(err)

    @staticmethod
    def _event(summary, step: int):
        return event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary)

    def scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars({tag: value}, step)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        if self._records is not None:
            from torch.utils.tensorboard.summary import scalar
            self._write([self._event(scalar(tag, float(value)), step) for tag, value in values.items()])

    def image(self, tag: str, chw: np.ndarray, step: int) -> None:
        if self._records is not None:
            from torch.utils.tensorboard.summary import image
            self._write([self._event(image(tag, chw, dataformats="CHW"), step)])

    def text(self, tag: str, text: str, step: int) -> None:
        if self._records is not None:
            from torch.utils.tensorboard.summary import text as text_summary
            self._write([self._event(text_summary(tag, text), step)])

    def flush(self) -> None:
        if self._file is not None:
            try:
                self._file.flush()
                os.fsync(self._file.fileno())
            except OSError as err:
                self._fail(err)

    def close(self) -> None:
        self.flush()
        file, self._file, self._records = self._file, None, None
        if file is not None:
            try:
                file.close()
            except OSError:
                pass


def make_logger(log_dir: Optional[str | Path], rank: int) -> NullLogger:
    """A :class:`TensorBoardLogger` on rank 0 when ``log_dir`` is set, else a :class:`NullLogger`."""
    if rank != 0 or log_dir is None:
        return NullLogger()
    return TensorBoardLogger(log_dir)


def config_text(settings: Mapping) -> str:
    """The run's settings as a Markdown code block for TensorBoard's text tab."""
    return "```json\n" + json.dumps(settings, indent=2, sort_keys=True, default=str) + "\n```"
