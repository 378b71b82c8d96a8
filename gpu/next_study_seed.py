"""Prints the first model seed of the GPU plan study (``--regime gpu``) that ``FOLDER/cells.json`` lacks a finished
cell of; exits 1 when every model seed is done. Used by gpu/run_device.sh's ``plan_study`` step.

    python gpu/next_study_seed.py benchmarks/results/plan_study/gpu
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from snip_ds.experiments.plan_study import REGIMES  # noqa: E402


def next_seed(folder: Path):
    """The first of the regime's model seeds with a data seed whose cell has no row yet (``None``: all done).
    A cell counts as finished when it has a row for uniform FP8 (the first arm a cell runs) and for SNIP."""
    regime = REGIMES["gpu"]
    model_seeds = [int(v) for v in regime["model_seeds"].split(",")]
    data_seeds = [int(v) for v in regime["data_seeds"].split(",")]
    path = folder / "cells.json"
    rows = json.loads(path.read_text(encoding="utf-8"))["rows"] if path.is_file() else []
    done = {}
    for r in rows:
        done.setdefault((r["model_seed"], r["data_seed"]), set()).add(r["arm"])
    for ms in model_seeds:
        if any(not {"uniform_fp8", "snip"} <= done.get((ms, ds), set()) for ds in data_seeds):
            return ms
    return None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python gpu/next_study_seed.py FOLDER", file=sys.stderr)
        return 2
    seed = next_seed(Path(argv[0]))
    if seed is None:
        print("next_study_seed: every model seed of the GPU study is done", file=sys.stderr)
        return 1
    print(seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
