"""Where JIT-compiled ops (DeepSpeed's ``fused_adam``, ``cpu_adam``, ``deepspeed_shm_comm``; snip_ds's CPU
kernels) are built, and what is done about a build that was killed half-way.

``torch.utils.cpp_extension.load`` builds an op in ``$TORCH_EXTENSIONS_DIR/pyXY_<device>/<name>`` (default root
``~/.cache/torch_extensions``) and guards the folder with a ``lock`` file that the builder deletes when it is
done. Three things go wrong (the first two on a shared machine):

* every virtual environment and checkout builds DeepSpeed's ops into the same folder, and each one's build
  command differs (paths of its headers), so they rebuild over each other in turn;
* a build killed half-way (Ctrl-C, a job's time limit) leaves its ``lock`` behind, and every later process
  that loads the op waits for it forever, silently;
* torch runs ``ninja`` as ``PATH`` finds it, and ninja versions keep their build logs in formats each other
  discards (1.11's v5, 1.13's v7): the environment's python run bare (``.venv/bin/python``, the system's
  ``/usr/bin/ninja`` on ``PATH``) and with the environment activated (its own ``ninja`` first) rebuild every op
  at each switch, though the commands, flags and folders are the same.

:func:`prepare` (called before DeepSpeed can build anything: by :mod:`snip_ds.engine`, :mod:`snip_ds.hf` and
``launch/warm_ops.py``) gives each environment a root of its own when the user has not set
``TORCH_EXTENSIONS_DIR``: ``<default root>/snip_ds-<key>``, the key a hash of the Python prefix and the
installed torch and DeepSpeed. Ranks started by a launcher compute the same root. It then removes ``lock``
files under that root older than :data:`STALE_LOCK_SECONDS` (no build of these ops takes that long; a live
build's lock is younger), naming each one in a warning. It also pins the ``ninja`` the builds run to the
environment's own (:func:`pin_ninja`), so that a switch between activated and bare no longer rebuilds.

:func:`prune_superseded_builds` removes the build folders of snip_ds's own ops (the CPU kernels,
``<name>-<key>``, one per build key) that the same environment and checkout built from an earlier source, flags
or compiler: this version never loads them again. Each build folder records who built it (:func:`record_build`);
those of other environments or checkouts sharing the root are theirs and stay.

:func:`deepspeed_arch_list_set` wraps DeepSpeed's CUDA builds: it rewrites a ``TORCH_CUDA_ARCH_LIST`` that torch
accepts but DeepSpeed cannot read (``9.0a``, ``Hopper``) for their duration.

:func:`prepare` also has py-cpuinfo's description of the CPU computed once per CPU (:mod:`snip_ds.runtime.cpuinfo_cache`):
DeepSpeed's CPU builders ask for it at every op load, 1.2 s each time.

Pure standard library: no torch or DeepSpeed import.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import sysconfig
import time
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterator, List, Mapping, Optional

from snip_ds.runtime import cpuinfo_cache

log = logging.getLogger("snip_ds")

ENV_VAR = "TORCH_EXTENSIONS_DIR"
STALE_LOCK_SECONDS = 30 * 60  # fused_adam, the slowest, compiles in about 2 minutes on 2 loaded cores


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def _location(module: str) -> str:
    spec = importlib.util.find_spec(module)
    return os.path.realpath(spec.origin) if spec is not None and spec.origin else "none"


def environment_key() -> str:
    """12 hex digits naming this environment's builds: a hash of the Python executable and prefix, Python's
    version, and the versions and locations of torch and DeepSpeed (whose paths end up in the build commands)."""
    parts = [os.path.realpath(sys.executable), os.path.realpath(sys.prefix), sys.version,
             _version("torch"), _location("torch"), _version("deepspeed"), _location("deepspeed")]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def default_root() -> Path:
    """torch's default build root, without importing torch: ``$XDG_CACHE_HOME`` or ``~/.cache``, then
    ``torch_extensions`` (torch's ``get_default_build_root``)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "torch_extensions"


def build_root() -> Path:
    """The root this process builds in: ``$TORCH_EXTENSIONS_DIR`` when set, else this environment's own."""
    given = os.environ.get(ENV_VAR)
    return Path(given) if given else default_root() / f"snip_ds-{environment_key()}"


def stale_locks(root: Path, max_age_s: float = STALE_LOCK_SECONDS, now: Optional[float] = None) -> List[Path]:
    """The ``lock`` files of builds under ``root`` older than ``max_age_s``: ``<root>/<op>/lock`` (torch's layout
    when ``$TORCH_EXTENSIONS_DIR`` is set, as :func:`prepare` sets it: DeepSpeed's ops) and
    ``<root>/<python>_<device>/<op>/lock`` (torch's default root; snip_ds's CPU kernels under any root)."""
    now = time.time() if now is None else now
    found = []
    for lock in sorted([*root.glob("*/lock"), *root.glob("*/*/lock")]):
        try:
            if now - lock.stat().st_mtime > max_age_s:
                found.append(lock)
        except FileNotFoundError:  # its build just finished
            continue
    return found


def remove_stale_locks(root: Path, max_age_s: float = STALE_LOCK_SECONDS) -> List[Path]:
    """Removes :func:`stale_locks` under ``root``, warning once per file; returns those removed."""
    removed = []
    for lock in stale_locks(root, max_age_s):
        try:
            lock.unlink()
        except FileNotFoundError:
            continue
        except OSError as err:  # not ours to remove: say so, the build will wait on it
            log.warning("snip_ds: %s is left from a build killed %.0f min ago and cannot be removed (%s); "
                        "delete it, or loading that op waits forever", lock, max_age_s / 60, err)
            continue
        log.warning("snip_ds: removed %s, left by a build of that op killed more than %.0f min ago (a later "
                    "load would have waited for it forever)", lock, max_age_s / 60)
        removed.append(lock)
    return removed


BUILD_RECORD = "snip_ds_build.json"  # in a build folder of snip_ds's own ops: who built it (:func:`record_build`)


def record_build(folder: Path, identity: Mapping[str, str]) -> None:
    """Writes :data:`BUILD_RECORD` into the build folder ``folder``: ``identity`` says which environment and
    checkout built it (:func:`superseded_builds` reads it). Atomic; a no-op when it says so already."""
    path = Path(folder) / BUILD_RECORD
    text = json.dumps({"identity": dict(identity)}, sort_keys=True)
    try:
        if path.read_text() == text:
            return
    except (OSError, UnicodeDecodeError):
        pass
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def superseded_builds(own: Path, identity: Mapping[str, str],
                      legacy: Optional[Callable[[Path], bool]] = None) -> List[Path]:
    """The build folders beside ``own`` (``<name>-<key>``, the same ``<name>``) that the same environment and
    checkout built from an earlier source, flags or compiler, so that this build never loads them again: their
    :data:`BUILD_RECORD` names ``identity``, or, in a folder built before records were written, ``legacy(folder)``
    says it is this checkout's. Never ``own``, a folder whose build is under way (a ``lock``), or one of another
    environment or checkout (they load their own: removing it would make them rebuild)."""
    own = Path(own)
    name = own.name.rsplit("-", 1)[0]
    found = []
    for folder in sorted(own.parent.glob(f"{name}-*")):
        if folder == own or not folder.is_dir() or folder.is_symlink() or (folder / "lock").exists():
            continue
        try:
            record = json.loads((folder / BUILD_RECORD).read_text())
            mine = isinstance(record, dict) and record.get("identity") == dict(identity)
        except FileNotFoundError:
            mine = legacy is not None and legacy(folder)
        except (OSError, ValueError):  # unreadable: not known to be ours
            mine = False
        if mine:
            found.append(folder)
    return found


def prune_superseded_builds(own: Path, identity: Mapping[str, str], what: str,
                            legacy: Optional[Callable[[Path], bool]] = None) -> List[Path]:
    """Removes :func:`superseded_builds` of ``own`` and says so in one line (``what``: the op); returns those
    removed. A folder that cannot be removed is left, and named in the same line."""
    removed, kept, size = [], [], 0
    for folder in superseded_builds(own, identity, legacy):
        bytes_ = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
        shutil.rmtree(folder, ignore_errors=True)
        if folder.exists():
            kept.append(folder.name)
        else:
            removed.append(folder)
            size += bytes_
    if removed or kept:
        line = (f"snip_ds: removed {len(removed)} build folder(s) of earlier versions of {what} that this version "
                f"never loads ({size / 2**20:.1f} MiB) from {Path(own).parent}: "
                f"{', '.join(f.name for f in removed) or 'none'}")
        if kept:
            line += f"; could not remove {', '.join(kept)}"
        log.warning(line)
    return removed


def environment_ninja() -> Optional[Path]:
    """The ``ninja`` this environment installs (pip's ``ninja`` package puts it in the environment's scripts
    folder, ``.venv/bin``), or None where it has none."""
    path = Path(sysconfig.get_path("scripts")) / ("ninja.exe" if os.name == "nt" else "ninja")
    return path if path.is_file() and os.access(path, os.X_OK) else None


def pin_ninja() -> Optional[Path]:
    """Makes the ``ninja`` that torch's ``cpp_extension`` and DeepSpeed's builders run (the first on ``PATH``) this
    environment's own (:func:`environment_ninja`), whether or not the environment is activated: its folder is put
    first on ``PATH`` where another ``ninja`` comes first (as activating the environment does). Returns the
    ``ninja`` the builds run, None where the environment has none (``PATH``'s is left to serve)."""
    own = environment_ninja()
    if own is None:
        return None
    found = shutil.which("ninja")
    if found is None or os.path.realpath(found) != os.path.realpath(own):
        path = os.environ.get("PATH")
        os.environ["PATH"] = os.pathsep.join([str(own.parent), path]) if path else str(own.parent)
    return own


def prepare() -> Path:
    """Sets ``$TORCH_EXTENSIONS_DIR`` to this environment's root if the user has not set it, removes stale
    build locks under the root in use, pins the ``ninja`` the builds run (:func:`pin_ninja`), and has
    py-cpuinfo's answer, from which DeepSpeed's CPU builders derive their flags, kept per CPU under it
    (:mod:`snip_ds.runtime.cpuinfo_cache`). Idempotent; returns the root."""
    if not os.environ.get(ENV_VAR):
        os.environ[ENV_VAR] = str(build_root())
    root = Path(os.environ[ENV_VAR])
    remove_stale_locks(root)
    pin_ninja()
    cpuinfo_cache.install(root)
    return root


# ---------------------------------------------------------------------------------------------------------------
# TORCH_CUDA_ARCH_LIST as DeepSpeed's JIT builder reads it
# ---------------------------------------------------------------------------------------------------------------

ARCH_VAR = "TORCH_CUDA_ARCH_LIST"
# torch's named architectures (torch.utils.cpp_extension._get_cuda_arch_flags), which DeepSpeed 0.19 cannot read
_NAMED_ARCHES = {"Kepler+Tesla": "3.7", "Kepler": "3.5+PTX", "Maxwell+Tegra": "5.3", "Maxwell": "5.0;5.2+PTX",
                 "Pascal": "6.0;6.1+PTX", "Volta+Tegra": "7.2", "Volta": "7.0+PTX", "Turing": "7.5+PTX",
                 "Ampere+Tegra": "8.7", "Ampere": "8.0;8.6+PTX", "Ada": "8.9+PTX", "Hopper": "9.0+PTX"}
_ARCH = re.compile(r"^(\d+)\.(\d+)[a-z]*(\+PTX)?$")


def deepspeed_arch_list(value: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` rewritten so that DeepSpeed's JIT builder can read it.

    torch accepts entries with an architecture-specific suffix (``9.0a``, ``10.0f``) and named architectures
    (``Hopper``); DeepSpeed 0.19 parses every entry as ``<int>.<int>[+PTX]`` and stops with ``invalid literal
    for int()`` on anything else, before it compiles a line (CUDA images set such lists). Each suffixed entry
    becomes its plain architecture (``9.0a`` -> ``9.0``: the ops DeepSpeed builds use no architecture-specific
    instruction), each name its numbers; other entries are kept as given, order kept, duplicates dropped."""
    out: List[str] = []
    for entry in value.replace(" ", ";").split(";"):
        entry = entry.strip()
        if not entry:
            continue
        for part in _NAMED_ARCHES.get(entry, entry).split(";"):
            m = _ARCH.match(part)
            fixed = f"{m.group(1)}.{m.group(2)}{m.group(3) or ''}" if m else part
            if fixed not in out:
                out.append(fixed)
    return ";".join(out)


@contextmanager
def deepspeed_arch_list_set() -> Iterator[None]:
    """For the duration of the block (DeepSpeed's JIT builds), ``$TORCH_CUDA_ARCH_LIST`` as
    :func:`deepspeed_arch_list` rewrites it, with an info line when it changes; restored afterwards, so other
    builds of the process see the user's own list."""
    given = os.environ.get(ARCH_VAR)
    fixed = deepspeed_arch_list(given) if given else given
    if fixed == given:
        yield
        return
    log.info("snip_ds: %s=%r read as %r while DeepSpeed builds its ops (DeepSpeed reads only <major>.<minor>"
             "[+PTX] entries)", ARCH_VAR, given, fixed)
    os.environ[ARCH_VAR] = fixed
    try:
        yield
    finally:
        os.environ[ARCH_VAR] = given
