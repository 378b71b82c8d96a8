"""py-cpuinfo's description of this machine's CPU, computed once per CPU instead of at every op load.

DeepSpeed's CPU op builders (``fused_adam`` and ``cpu_adam`` on a CPU machine) compute their compiler flags
from ``cpuinfo.get_cpu_info()`` every time an op is loaded, also when its build is cached and nothing compiles:
py-cpuinfo answers from a new Python process that probes the CPU, about 1.2 s, and the builder asks twice (the
architecture, then the SIMD width). Every rank of every run paid that at start.

:func:`install` (called by :func:`snip_ds.runtime.jit_builds.prepare`) wraps ``cpuinfo.get_cpu_info`` so that its first
answer is kept in memory and in a JSON file under the JIT build root, named by a hash of the CPU as the kernel
describes it (vendor, family, model, stepping, flags: not the clock speeds, which change) and py-cpuinfo's
version. A home directory shared by nodes with different CPUs keeps one answer per CPU, so no node builds with
another's flags. Where there is no ``/proc/cpuinfo`` only the in-memory copy is kept. A file that cannot be read
or parsed is asked again and rewritten; an empty answer (py-cpuinfo's probe failed) is never kept.

Pure standard library; py-cpuinfo itself is imported only by :func:`install`.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Dict, Optional

PROC_CPUINFO = Path("/proc/cpuinfo")
CACHE_DIR = "cpuinfo"  # under the JIT build root
# The fields of /proc/cpuinfo that name the CPU (x86, Arm, POWER, RISC-V); the clock speeds and the per-core
# numbering are left out.
IDENTITY_FIELDS = frozenset({"vendor_id", "cpu family", "model", "model name", "stepping", "flags", "Features",
                             "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "CPU revision",
                             "cpu", "revision", "isa", "uarch"})


def cpu_key(cpuinfo_text: str, version: str) -> Optional[str]:
    """16 hex digits naming the CPU described by ``cpuinfo_text`` (the contents of /proc/cpuinfo) for
    py-cpuinfo ``version``; None when the text names no CPU field."""
    fields = set()
    for line in cpuinfo_text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in IDENTITY_FIELDS:
            fields.add(f"{key.strip()}={' '.join(value.split())}")
    if not fields:
        return None
    text = "\n".join([f"py-cpuinfo={version}", *sorted(fields)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _read(path: Path) -> Optional[dict]:
    try:
        answer = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return answer if isinstance(answer, dict) and answer else None


def _write(path: Path, answer: dict) -> None:
    """Writes ``answer`` whole or not at all (a concurrent reader sees the old file or the new one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(answer))
        os.replace(tmp, path)
    except OSError:  # a read-only build root: the in-memory copy still serves this process
        tmp.unlink(missing_ok=True)


def cached(ask: Callable[[], Dict], root: Path, version: str,
           proc_cpuinfo: Path = PROC_CPUINFO) -> Callable[[], Dict]:
    """``ask`` (py-cpuinfo's ``get_cpu_info``) answered once: from memory, else from this CPU's file under
    ``root``, else by asking and keeping a non-empty answer. Each call returns a copy."""
    memo: Dict[str, dict] = {}

    @functools.wraps(ask)
    def get_cpu_info() -> Dict:
        if "answer" not in memo:
            try:
                key = cpu_key(proc_cpuinfo.read_text(), version)
            except OSError:
                key = None
            path = root / CACHE_DIR / f"{key}.json" if key is not None else None
            answer = _read(path) if path is not None else None
            if answer is None:
                answer = ask()
                if not answer:
                    return answer  # the probe failed: ask again next time
                if path is not None:
                    _write(path, answer)
            memo["answer"] = answer
        return copy.deepcopy(memo["answer"])

    get_cpu_info.snip_ds_root = root  # type: ignore[attr-defined]
    return get_cpu_info


def install(root: Path) -> bool:
    """Replaces py-cpuinfo's ``get_cpu_info`` by :func:`cached` keeping its files under ``root`` (again when
    ``root`` changed: the build root in use); False when py-cpuinfo is not installed (DeepSpeed then reads
    ``lscpu``)."""
    try:
        import cpuinfo
    except ImportError:
        return False
    current = cpuinfo.get_cpu_info
    if getattr(current, "snip_ds_root", None) != root:
        original = current.__wrapped__ if hasattr(current, "snip_ds_root") else current
        version = ".".join(str(v) for v in getattr(cpuinfo, "CPUINFO_VERSION", ())) or "unknown"
        cpuinfo.get_cpu_info = cached(original, root, version)
    return True
