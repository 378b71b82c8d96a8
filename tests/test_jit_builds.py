"""Where JIT-compiled ops build (one folder per environment) and what happens to a lock a killed build left."""
import os
import shutil
import subprocess
import sys
import time

import pytest

from snip_ds import jit_builds


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
