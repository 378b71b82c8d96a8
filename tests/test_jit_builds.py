"""Where JIT-compiled ops build (one folder per environment) and what happens to a lock a killed build left."""
import os
import shutil
import subprocess
import sys
import time

import pytest

from snip_ds.runtime import jit_builds


def _lock(root, op, age_s, subfolder="py311_cpu"):
    """A build's lock: ``<root>/<subfolder>/<op>/lock`` (torch's default root, snip_ds's CPU kernels), or
    ``<root>/<op>/lock`` with ``subfolder=None`` (torch's layout under $TORCH_EXTENSIONS_DIR: DeepSpeed's ops)."""
    folder = root / subfolder / op if subfolder else root / op
    folder.mkdir(parents=True)
    lock = folder / "lock"
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_old_locks_are_stale_and_young_ones_are_a_build_in_progress(tmp_path):
    old = _lock(tmp_path, "fused_adam", jit_builds.STALE_LOCK_SECONDS + 60)
    old_top = _lock(tmp_path, "cpu_adam", jit_builds.STALE_LOCK_SECONDS + 60, subfolder=None)
    young = _lock(tmp_path, "cpu_adam", 60)
    young_top = _lock(tmp_path, "fused_adam", 60, subfolder=None)
    (tmp_path / "py311_cpu" / "shm").mkdir()
    assert jit_builds.stale_locks(tmp_path) == [old_top, old]
    assert jit_builds.remove_stale_locks(tmp_path) == [old_top, old]
    assert not old.exists() and not old_top.exists() and young.exists() and young_top.exists()
    assert jit_builds.remove_stale_locks(tmp_path) == []


def test_prepare_keeps_the_users_root_and_otherwise_sets_the_environments_own(tmp_path, monkeypatch):
    monkeypatch.setenv(jit_builds.ENV_VAR, str(tmp_path / "mine"))
    stale = _lock(tmp_path / "mine", "fused_adam", jit_builds.STALE_LOCK_SECONDS + 1)
    assert jit_builds.prepare() == tmp_path / "mine" and not stale.exists()
    monkeypatch.delenv(jit_builds.ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = jit_builds.prepare()
    assert os.environ[jit_builds.ENV_VAR] == str(root)
    assert root == tmp_path / "cache" / "torch_extensions" / f"snip_ds-{jit_builds.environment_key()}"


def test_environment_key_differs_between_environments(monkeypatch):
    key = jit_builds.environment_key()
    assert key == jit_builds.environment_key() and len(key) == 12
    monkeypatch.setattr(sys, "prefix", "/elsewhere/.venv")
    assert jit_builds.environment_key() != key


def test_builds_run_the_environments_own_ninja_activated_or_not(tmp_path, monkeypatch):
    """Another ninja first on PATH (a bare venv python, the system's ninja): prepare puts the environment's own
    first, once; torch and DeepSpeed run the first on PATH."""
    own = jit_builds.environment_ninja()
    if own is None:
        pytest.skip("this environment installs no ninja of its own")
    other = tmp_path / "other"
    other.mkdir()
    (other / "ninja").write_text("#!/bin/sh\nexit 1\n")
    (other / "ninja").chmod(0o755)
    monkeypatch.setenv("PATH", os.pathsep.join([str(other), "/usr/bin", "/bin"]))
    monkeypatch.setenv(jit_builds.ENV_VAR, str(tmp_path / "root"))
    jit_builds.prepare()
    assert os.path.realpath(shutil.which("ninja")) == os.path.realpath(own)
    path = os.environ["PATH"]
    assert jit_builds.pin_ninja() == own and os.environ["PATH"] == path  # idempotent


_NINJA_RUN = """
import subprocess, sys
from snip_ds.runtime import jit_builds
jit_builds.prepare()
out = subprocess.run(["ninja"], cwd=sys.argv[1], capture_output=True, text=True, check=True).stdout
print("rebuilt" if "cp in.txt out.txt" in out else "up to date")
"""


def test_switching_between_activated_and_bare_python_does_not_rebuild(tmp_path):
    """The environment's python run bare (PATH without its scripts folder, where a system ninja may be found
    first) and activated (its scripts folder first), in turn, over one build folder: only the first run builds.
    Ninja versions discard each other's build log, so before ninja was pinned each switch rebuilt everything."""
    if jit_builds.environment_ninja() is None:
        pytest.skip("this environment installs no ninja of its own")
    build = tmp_path / "build"
    build.mkdir()
    (build / "build.ninja").write_text("rule cp\n  command = cp $in $out\nbuild out.txt: cp in.txt\n")
    (build / "in.txt").write_text("x")
    scripts = os.path.dirname(jit_builds.environment_ninja())
    bare = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != scripts)
    runs = []
    for path in (bare, os.pathsep.join([scripts, bare]), bare, os.pathsep.join([scripts, bare])):
        env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
        env.update(PATH=path, **{jit_builds.ENV_VAR: str(tmp_path / "root")})
        proc = subprocess.run([sys.executable, "-c", _NINJA_RUN, str(build)], env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs.append(proc.stdout.strip())
    assert runs == ["rebuilt", "up to date", "up to date", "up to date"]


@pytest.mark.slow
def test_a_killed_builds_lock_does_not_hang_the_next_load(tmp_path):
    """A real load of snip_ds's CPU kernels in a fresh process, with a lock a killed build left 31 minutes ago
    in its build folder: torch's builder would wait for it forever; the load removes it, warns naming it, and
    completes (the folder holds this environment's finished build, so nothing recompiles)."""
    from snip_ds.backend import cpu
    if not cpu.available():
        pytest.skip(f"no CPU kernels here: {cpu.unavailable_reason()}")
    built = cpu.build_directory()
    root = tmp_path / "ext"
    target = root / os.path.relpath(built, os.path.dirname(os.path.dirname(built)))
    shutil.copytree(built, target)  # copy2: mtimes kept, so ninja finds it up to date
    lock = target / "lock"
    lock.touch()
    then = time.time() - jit_builds.STALE_LOCK_SECONDS - 60
    os.utime(lock, (then, then))
    env = {**os.environ, jit_builds.ENV_VAR: str(root)}
    code = "from snip_ds.backend import cpu; assert cpu.load(), cpu.unavailable_reason(); print(cpu.build_directory())"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(target)
    assert f"removed {lock}" in proc.stderr and not lock.exists()


def _build(parent, key, identity=None, ninja=None, lock=False):
    """A build folder ``<parent>/snip_ds_cpu_quant-<key>`` with a library, and a record naming ``identity`` or a
    ``build.ninja`` (a folder written before builds recorded who built them), or neither."""
    folder = parent / f"snip_ds_cpu_quant-{key}"
    folder.mkdir(parents=True)
    (folder / "snip_ds_cpu_quant.so").write_bytes(b"\0" * 2048)
    if identity is not None:
        jit_builds.record_build(folder, identity)
    if ninja is not None:
        (folder / "build.ninja").write_text(ninja)
    if lock:
        (folder / "lock").touch()
    return folder


def test_only_this_checkouts_earlier_builds_are_pruned_with_one_line(tmp_path, caplog):
    import logging

    me = {"python": "/env/bin/python", "prefix": "/env", "source_path": "/repo/snip_ds/backend/cpu/quantize.cpp"}
    parent = tmp_path / "py311_cpu"
    own = _build(parent, "own", me)
    earlier = _build(parent, "earlier", me)  # another source hash, torch or flags: this key is never loaded again
    legacy = _build(parent, "legacy", ninja="mine")  # written before records: legacy() decides
    kept = [_build(parent, "other_checkout", {**me, "source_path": "/repo2/snip_ds/backend/cpu/quantize.cpp"}),
            _build(parent, "other_env", {**me, "prefix": "/env2", "python": "/env2/bin/python"}),
            _build(parent, "other_legacy", ninja="theirs"), _build(parent, "unknown"),
            _build(parent, "building", me, lock=True), _build(tmp_path / "py310_cpu", "earlier", me)]
    (parent / "fused_adam").mkdir()

    def legacy_check(folder):
        return (folder / "build.ninja").is_file() and (folder / "build.ninja").read_text() == "mine"

    assert jit_builds.superseded_builds(own, me, legacy_check) == [earlier, legacy]
    with caplog.at_level(logging.WARNING, logger="snip_ds"):
        assert jit_builds.prune_superseded_builds(own, me, "snip_ds's CPU kernels", legacy_check) == [earlier, legacy]
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"snip_ds: removed 2 build folder(s) of earlier versions of snip_ds's CPU kernels that this "
                     f"version never loads (0.0 MiB) from {parent}: snip_ds_cpu_quant-earlier, "
                     f"snip_ds_cpu_quant-legacy"]
    assert not earlier.exists() and not legacy.exists() and own.exists() and all(k.exists() for k in kept)
    assert (parent / "fused_adam").exists()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="snip_ds"):  # nothing left to prune: nothing said
        assert jit_builds.prune_superseded_builds(own, me, "snip_ds's CPU kernels", legacy_check) == []
    assert not caplog.records


def test_the_build_record_names_who_built_the_folder(tmp_path):
    folder = tmp_path / "b"
    folder.mkdir()
    jit_builds.record_build(folder, {"prefix": "/env"})
    first = (folder / jit_builds.BUILD_RECORD).stat().st_mtime_ns
    jit_builds.record_build(folder, {"prefix": "/env"})  # the same: not rewritten
    assert (folder / jit_builds.BUILD_RECORD).stat().st_mtime_ns == first
    assert jit_builds.superseded_builds(tmp_path / "a-x", {"prefix": "/env"}) == []  # "b" has another name
