"""The plan and statistics files a run leaves, and reading a plan or statistics back from any of them.

A training run writes, under its output directory (rank 0, each file atomically)::

    plan.json    # the plan in force (snip_ds.plan/1): at the start, and again at every adaptive re-plan
    stats.json   # adaptive runs: the statistics the last re-plan solved from (snip_ds.stats/1)

and each checkpoint ``checkpoints/step_N/snip_state.json`` (snip_ds.state/1, completed by ``snip_meta.json``,
snip_ds.checkpoint/1) holds the plan and the adaptive planner's state, whose ``last_stats`` are statistics
too. Under the Hugging Face Trainer, :class:`snip_ds.hf.SnipCallback` writes the same file into each
``checkpoint-N``. Older checkpoints hold them in ``snip_meta.json`` (``launch/train.py``) or in a
``snip_state.json`` of format snip_ds.hf_checkpoint/1 (the Trainer); both are read too. :func:`load_plan` and :func:`load_stats` read a plan or statistics from any such
file or directory (a Trainer's output directory: its last ``checkpoint-N``), and say what a wrong one is.
No torch.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Tuple

from snip_ds.plan import GEMMS, PLAN_FORMAT, Plan
from snip_ds.stats_file import STATS_FORMAT, save_stats, validate_stats

PLAN_FILE = "plan.json"
STATS_FILE = "stats.json"
CHECKPOINT_FORMAT = "snip_ds.checkpoint/1"
CHECKPOINT_META_FILE = "snip_meta.json"
CHECKPOINT_LATEST_FILE = "latest"
CHECKPOINT_RUN_DIR = "checkpoints"  # a training run's save directory, inside its output directory
STATE_FILE = "snip_state.json"  # SNIP's own state (snip_ds.engine.state.SnipState), in either loop's checkpoint folder
STATE_FORMAT = "snip_ds.state/1"
TRAINER_STATE_FILE = STATE_FILE  # the name the Trainer's checkpoints have always used
TRAINER_STATE_FORMAT = "snip_ds.hf_checkpoint/1"  # SnipCallback's snip_state.json before snip_ds.state/1
TRAINER_CHECKPOINT_PREFIX = "checkpoint-"


# --------------------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------------------
def rng_file(rank: int) -> str:
    """The name of ``rank``'s stochastic-rounding generator and RNG states in a checkpoint folder."""
    return f"snip_rng_rank{rank}.safetensors"


def write_plan(out_dir: str | os.PathLike, plan: Plan) -> Path:
    """Writes ``out_dir/plan.json`` atomically (never half-written); returns its path."""
    path = Path(out_dir) / PLAN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    plan.save(path)
    return path


def write_stats(out_dir: str | os.PathLike, stats: Mapping[str, Any]) -> Path:
    """Writes ``out_dir/stats.json`` (a snip_ds.stats/1 artifact) atomically; returns its path."""
    path = Path(out_dir) / STATS_FILE
    save_stats(stats, str(path), final_newline=True)
    return path


# --------------------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------------------
_KIND_OF_FORMAT = {PLAN_FORMAT: "plan", STATS_FORMAT: "statistics",
                   CHECKPOINT_FORMAT: "checkpoint metadata", TRAINER_STATE_FORMAT: "checkpoint metadata",
                   STATE_FORMAT: "checkpoint metadata"}


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a snip_ds plan or statistics file (not UTF-8 text)") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _looks_like_bare_plan(data: Mapping) -> bool:
    """A user-written ``{fqn: precision}`` or ``{fqn: {gemm: precision}}`` mapping (no 'format' field)."""
    def value_ok(v: Any) -> bool:
        if isinstance(v, str):
            return True
        return isinstance(v, Mapping) and bool(v) and set(v) <= set(GEMMS)
    return bool(data) and "assignment" not in data and all(value_ok(v) for v in data.values())


def kind_of(data: Any) -> str:
    """What a decoded JSON file is: ``plan``, ``statistics``, ``checkpoint metadata``, ``bare plan`` (a
    user-written mapping), ``unknown format`` (a 'format' field of another kind) or ``unknown``."""
    if not isinstance(data, Mapping):
        return "unknown"
    if "format" in data:
        return _KIND_OF_FORMAT.get(data["format"], "unknown format")
    if "assignment" in data:
        return "plan"  # a plan file written before plans carried 'format'
    if _looks_like_bare_plan(data):
        return "bare plan"
    return "unknown"


def _not_this(path: Path, data: Any, wanted: str) -> ValueError:
    kind = kind_of(data)
    if kind == "checkpoint metadata":
        return ValueError(f"{path}: is a snip_ds checkpoint metadata file, not {wanted}; pass its directory "
                          f"({path.parent})")
    if kind == "unknown format":
        return ValueError(f"{path}: 'format' is {data['format']!r}, not a snip_ds plan ({PLAN_FORMAT}) or "
                          f"statistics ({STATS_FORMAT}) file")
    if kind == "unknown":
        what = "no 'format' field" if isinstance(data, Mapping) else f"a JSON {type(data).__name__}"
        return ValueError(f"{path}: is not a snip_ds plan or statistics file ({what})")
    if kind == "statistics":
        return ValueError(f"{path}: is a snip_ds statistics file, not {wanted}; solve a plan from it with "
                          f"'snip-ds plan {path} --efficiency-saving RHO -o plan.json'")
    return ValueError(f"{path}: is a snip_ds plan file, not {wanted}")


def _checkpoint_dir(path: Path) -> Path | None:
    """The checkpoint directory ``path`` names (itself, or its ``latest``; a Trainer's ``checkpoint-N``), else
    None."""
    if (path / CHECKPOINT_META_FILE).is_file() or _trainer_state(path):
        return path
    latest = path / CHECKPOINT_LATEST_FILE
    if latest.is_file():
        tag_dir = path / latest.read_text(encoding="utf-8").strip()
        if not (tag_dir / CHECKPOINT_META_FILE).is_file():
            if path.name.startswith(TRAINER_CHECKPOINT_PREFIX):  # DeepSpeed's 'latest' in a Trainer checkpoint
                raise ValueError(f"{path}: a Trainer checkpoint without {TRAINER_STATE_FILE}: it was not saved by "
                                 f"a run with snip_ds.hf's SnipCallback, or its save was interrupted")
            raise ValueError(f"{latest}: points to {tag_dir}, which is not a complete snip_ds checkpoint")
        return tag_dir
    return None


def _trainer_state(folder: Path) -> bool:
    """Whether ``folder`` holds a Trainer's ``snip_state.json``: an engine checkpoint's (``driver`` "engine")
    counts only with its ``snip_meta.json``, which marks it complete."""
    path = folder / STATE_FILE
    if not path.is_file():
        return False
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return True  # a damaged file: reading it names it
    return not (isinstance(data, Mapping) and data.get("driver") == "engine")


def last_trainer_checkpoint(path: Path) -> Path | None:
    """A Hugging Face Trainer's output directory: its ``checkpoint-N`` with the highest N that holds
    ``snip_state.json`` (as ``transformers.trainer_utils.get_last_checkpoint`` picks, among complete ones);
    None when ``path`` has no ``checkpoint-N`` folder."""
    found = []
    for child in path.iterdir() if path.is_dir() else ():
        step = child.name[len(TRAINER_CHECKPOINT_PREFIX):]
        if child.name.startswith(TRAINER_CHECKPOINT_PREFIX) and step.isdigit() and child.is_dir():
            found.append((int(step), child))
    if not found:
        return None
    complete = [c for n, c in sorted(found) if _trainer_state(c)]
    if not complete:
        raise ValueError(f"{path}: none of its {len(found)} checkpoint-N folder(s) holds {TRAINER_STATE_FILE}: "
                         f"they were not saved by a run with snip_ds.hf's SnipCallback")
    return complete[-1]


def trainer_checkpoint(path: Path) -> Path | None:
    """The Trainer ``checkpoint-N`` that ``path`` names (itself, or an output directory's last one), or None
    when ``path`` is not a Trainer's (then it is read as a snip_ds checkpoint).

    Raises:
        ValueError: a Trainer checkpoint (or output directory of them) without SnipCallback's state.
    """
    if not path.is_dir() or (path / CHECKPOINT_META_FILE).is_file():  # launch/train.py's (its snip_state.json too)
        return None
    if (path / TRAINER_STATE_FILE).is_file():
        return path
    if path.name.startswith(TRAINER_CHECKPOINT_PREFIX) and (path / "trainer_state.json").is_file():
        raise ValueError(f"{path}: a Trainer checkpoint without {TRAINER_STATE_FILE}: it was not saved by a run "
                         f"with snip_ds.hf's SnipCallback, or its save was interrupted")
    if (path / CHECKPOINT_LATEST_FILE).exists() or (path / CHECKPOINT_RUN_DIR).is_dir():
        return None
    return last_trainer_checkpoint(path)


def _snip_state(path: Path) -> dict:
    """A ``snip_state.json``: :data:`STATE_FORMAT` (either loop) or :data:`TRAINER_STATE_FORMAT` (the Trainer's
    before it; files from before the 'format' field have the keys SnipCallback has always written)."""
    state = _read_json(path)
    if (not isinstance(state, Mapping) or state.get("format", TRAINER_STATE_FORMAT) not in (
            TRAINER_STATE_FORMAT, STATE_FORMAT) or not {"step", "plan", "planner"} <= set(state)):
        raise ValueError(f"{path}: not a {STATE_FORMAT} or {TRAINER_STATE_FORMAT} file (SNIP's plan and planner "
                         f"state)")
    return dict(state)


def checkpoint_meta(tag_dir: Path) -> dict:
    """What a checkpoint records: ``snip_meta.json`` of ``launch/train.py``'s (with the plan and planner state
    of its ``snip_state.json``, or inside it in an older one), or a Trainer's ``snip_state.json``."""
    if (tag_dir / CHECKPOINT_META_FILE).is_file():
        path = tag_dir / CHECKPOINT_META_FILE
        meta = _read_json(path)
        if kind_of(meta) != "checkpoint metadata":
            raise ValueError(f"{path}: not a {CHECKPOINT_FORMAT} metadata file")
        if (tag_dir / STATE_FILE).is_file():
            state = _snip_state(tag_dir / STATE_FILE)
            meta.update(plan=state["plan"], planner=state["planner"])
        return meta
    return _snip_state(tag_dir / STATE_FILE)


def _meta_file(tag_dir: Path) -> Path:
    """The file a checkpoint's plan and planner state are read from."""
    state = tag_dir / STATE_FILE
    return state if state.is_file() else tag_dir / CHECKPOINT_META_FILE


def _resolve_dir(path: Path, run_file: str) -> Tuple[str, Path]:
    """``("checkpoint", tag_dir)`` or ``("file", path/run_file)`` for a directory; a clear error otherwise."""
    tag_dir = _checkpoint_dir(path)
    if tag_dir is not None:
        return "checkpoint", tag_dir
    if (path / run_file).is_file():
        return "file", path / run_file
    if (path / CHECKPOINT_RUN_DIR).is_dir() and _checkpoint_dir(path / CHECKPOINT_RUN_DIR) is not None:
        return "checkpoint", _checkpoint_dir(path / CHECKPOINT_RUN_DIR)
    trainer_checkpoint = last_trainer_checkpoint(path)
    if trainer_checkpoint is not None:
        return "checkpoint", trainer_checkpoint
    raise ValueError(f"{path}: a directory with neither {run_file} nor a snip_ds checkpoint "
                     f"({CHECKPOINT_META_FILE}, a '{CHECKPOINT_LATEST_FILE}' file, or a Trainer's checkpoint-N "
                     f"with {TRAINER_STATE_FILE})")


def load_plan(path: str | os.PathLike) -> Tuple[Plan, str]:
    """The plan in a plan file (full or bare), a run's output directory (its ``plan.json``) or a checkpoint
    directory (``step_N``, or the ``checkpoints`` directory and its ``latest``; a Trainer's ``checkpoint-N``
    or output directory); returns it and where it came from (for messages).

    Raises:
        FileNotFoundError: no such file or directory.
        ValueError: anything else, in one line naming the file and saying what kind of file it is.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"plan file {str(path)!r} does not exist")
    if path.is_dir():
        how, where = _resolve_dir(path, PLAN_FILE)
        if how == "checkpoint":
            meta = checkpoint_meta(where)
            source = str(_meta_file(where))
            if not isinstance(meta.get("plan"), Mapping):
                raise ValueError(f"{source}: the checkpoint holds no plan")
            return Plan.from_dict(meta["plan"], source=f"{source}: plan"), str(where)
        path = where
    data = _read_json(path)
    if kind_of(data) not in ("plan", "bare plan"):
        # a bare plan with a bad precision is reported by Plan itself ('fp5' ...), so only other kinds here
        raise _not_this(path, data, "a plan")
    return Plan.from_dict(data, source=str(path)), str(path)


def load_stats(path: str | os.PathLike) -> Tuple[dict, str]:
    """The statistics in a ``snip_ds.stats/1`` file, a run's output directory (its ``stats.json``) or a
    checkpoint directory of an adaptive run (the planner's last statistics); returns them, validated, and
    where they came from.

    Raises:
        FileNotFoundError: no such file or directory.
        ValueError: anything else, in one line naming the file and the field or kind of file.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"statistics file {str(path)!r} does not exist")
    if path.is_dir():
        how, where = _resolve_dir(path, STATS_FILE)
        if how == "checkpoint":
            meta = checkpoint_meta(where)
            source = str(_meta_file(where))
            planner = meta.get("planner")
            stats = planner.get("last_stats") if isinstance(planner, Mapping) else None
            if stats is None:
                raise ValueError(f"{source}: the checkpoint holds no statistics (it was saved by a run with a "
                                 "fixed plan, or before its first re-plan)")
            return validate_stats(stats, source=f"{source}: planner.last_stats"), str(where)
        path = where
    data = _read_json(path)
    if kind_of(data) != "statistics":
        raise _not_this(path, data, "a statistics file")
    return validate_stats(data, source=str(path)), str(path)

