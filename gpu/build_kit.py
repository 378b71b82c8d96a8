"""Assembles .kit/: the wheels a GPU machine's image lacks for snip_ds (CPython 3.12, manylinux x86_64, no network).

    cd REPO && .venv/bin/python gpu/build_kit.py [--kit .kit] [--cache ~/.cache/snip_ds_kit]

Run it with the repository's virtual environment (Python 3.11 with torch and pip; building DeepSpeed's wheel
imports torch). What goes in the kit is derived, not listed by hand:

- roots: setup.cfg's install_requires and its ``dev`` extra (the tests' needs), and the peers a GPU benchmark
  measures beside snip_ds (:data:`PEERS`: torchao's float8);
- each root or requirement (the wheels' Requires-Dist, markers evaluated for CPython 3.12 on x86_64 Linux, no
  extras) that gpu/image_packages.txt, the image's package list, lacks is carried, at the version
  constraints.txt pins (an error if it pins none);
- one the image has at a known version is not carried; a requirement it breaks is printed as a conflict and
  recorded in .kit/kit.json;
- one the image has at an unknown version, under a version specifier, is carried when a carried wheel
  requires it and its constraints.txt version is a pure-Python wheel (then the specifier holds whatever the
  image has); otherwise (setup.cfg's own needs, compiled packages) it is recorded for gpu/run_device.sh to
  check there before anything runs.

DeepSpeed is built here from its PyPI sdist with ``DS_BUILD_OPS=0 DS_ACCELERATOR=cuda`` (no compiled op: the
GPU machine JIT-builds FusedAdam with its nvcc) and checked to hold no compiled file. cbcbox (mip's CBC, ~191 MB
with its AVX2 and debug builds) is repacked with the generic x86_64 Linux build alone, which cbcbox picks at
import when the AVX2 folder is absent; the repacked wheel's RECORD is rewritten. Downloads and builds are kept
in the cache and reused; .kit/ is rewritten to hold exactly this kit, .kit/kit.json describes it and .kit/COMMIT
records HEAD (run it again, seconds with the cache, right before a device call: .git may not travel).
"""
from __future__ import annotations

import argparse
import base64
import configparser
import email.parser
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
IMAGE_LIST = REPO / "gpu" / "image_packages.txt"
CONSTRAINTS = REPO / "constraints.txt"
SETUP_CFG = REPO / "setup.cfg"
TARGET_PYTHON = "3.12"
TARGET_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
              "platform_machine": "x86_64", "os_name": "posix", "extra": ""}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]
# Carried beside snip_ds's own needs: the peer that benchmarks/bench_layer_gpu.py measures in the same process.
# torchao 0.18.0 is the release for torch >= 2.11 (its __init__ checks for it), the image's torch 2.11.0+cu130;
# its float8 training (the tensorwise recipe) is Python over torch._scaled_mm, so the wheel's compiled
# extensions (built for PyPI's CUDA) are not needed: where they do not load, torchao says so and goes on.
PEERS = {"torchao": ("0.18.0", "the peer of benchmarks/bench_layer_gpu.py and bench_layer_host.py (torchao float8)")}
BUILT_FROM_SDIST = {"deepspeed": {"DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cuda"}}
CBCBOX_DROPPED = re.compile(r"/cbcbox/cbc_dist_[^/]+/")  # cbc_dist_avx2/, cbc_dist_debug_avx2/: all but generic
TRANSFER_LIMIT = 64 * 2 ** 20  # what one device call may send: working tree + carried folders


class KitError(Exception):
    """A package that cannot be fetched or built, or an input file that is wrong; one line, exit code 2."""


def read_image(path: Path = IMAGE_LIST) -> dict:
    """{canonical name: Version or None} of the GPU image."""
    image = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        try:
            image[canonicalize_name(name)] = Version(version) if version else None
        except ValueError:
            raise KitError(f"{path}:{n}: {line!r} is not NAME or NAME==VERSION") from None
    return image


def read_constraints(path: Path = CONSTRAINTS) -> dict:
    """{canonical name: pinned version string}."""
    pins = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep:
            raise KitError(f"{path}:{n}: {line!r} is not NAME==VERSION")
        pins[canonicalize_name(name)] = version.strip()
    return pins


def read_roots(path: Path = SETUP_CFG) -> list:
    """setup.cfg's install_requires and its dev extra, as Requirements."""
    cfg = configparser.ConfigParser()
    cfg.read(path)
    try:
        lines = cfg["options"]["install_requires"].splitlines() + cfg["options.extras_require"]["dev"].splitlines()
    except KeyError as err:
        raise KitError(f"{path}: no {err.args[0]} entry") from None
    return [Requirement(line.strip()) for line in lines if line.strip() and not line.strip().startswith("#")]


def applies(req: Requirement) -> bool:
    return req.marker is None or req.marker.evaluate(TARGET_ENV)


def wheel_metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        name = next((n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)), None)
        if name is None:
            raise KitError(f"{wheel.name}: no .dist-info/METADATA inside")
        return email.parser.Parser().parsestr(z.read(name).decode())


def requirements(wheel: Path) -> list:
    """The wheel's Requires-Dist that apply on the target (no extras)."""
    return [r for r in map(Requirement, wheel_metadata(wheel).get_all("Requires-Dist") or []) if applies(r)]


def is_pure(wheel: Path) -> bool:
    return all(t.abi == "none" and t.platform == "any" for t in parse_wheel_filename(wheel.name)[3])


def run_pip(args: list, what: str, env: dict | None = None) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        lines = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        tail = "; ".join([line for line in lines if line.startswith("ERROR")][-3:] or lines[-3:])
        raise KitError(f"{what}: pip failed ({tail})")


def fetch_wheel(name: str, version: str, cache: Path) -> Path:
    """The target wheel of name==version from the cache, else downloaded from PyPI into it."""
    found = find_wheel(cache / "wheels", name, version)
    if found:
        return found
    args = ["download", "--no-deps", "--only-binary=:all:", "--python-version", TARGET_PYTHON, "--implementation",
            "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none"]
    for plat in PLATFORMS + ["any"]:
        args += ["--platform", plat]
    run_pip(args + ["--quiet", "-d", str(cache / "wheels"), f"{name}=={version}"],
            f"{name}=={version}: cannot fetch a CPython 3.12 manylinux x86_64 wheel")
    found = find_wheel(cache / "wheels", name, version)
    if not found:
        raise KitError(f"{name}=={version}: pip reported success but no wheel is in {cache / 'wheels'}")
    return found


def find_wheel(folder: Path, name: str, version: str) -> Path | None:
    if not folder.is_dir():
        return None
    for w in sorted(folder.glob("*.whl")):
        wname, wver = parse_wheel_filename(w.name)[:2]
        if canonicalize_name(wname) == canonicalize_name(name) and wver == Version(version):
            return w
    return None


def build_from_sdist(name: str, version: str, cache: Path) -> Path:
    """A pure-Python wheel of name==version built from its PyPI sdist (no compiled ops), cached."""
    built = find_wheel(cache / "built", name, version)
    if built:
        return built
    sdists = cache / "sdists"
    if not list(sdists.glob(f"{name}-{version}.tar.gz")):
        # --no-build-isolation: DeepSpeed's setup.py imports torch, which this environment has
        run_pip(["download", "--no-deps", "--no-binary=:all:", "--no-build-isolation", "--quiet", "-d", str(sdists),
                 f"{name}=={version}"], f"{name}=={version}: cannot fetch the sdist")
    sdist = next(iter(sdists.glob(f"{name}-{version}.tar.gz")), None)
    if sdist is None:
        raise KitError(f"{name}=={version}: no {name}-{version}.tar.gz in {sdists} after the download")
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, **BUILT_FROM_SDIST[name])
        run_pip(["wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "--quiet", "-w", tmp, str(sdist)],
                f"{name}=={version}: cannot build a wheel from {sdist.name}", env=env)
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise KitError(f"{name}=={version}: the build left {len(wheels)} wheels, expected one")
        check_no_compiled(wheels[0])
        (cache / "built").mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy2(wheels[0], cache / "built" / wheels[0].name))


def check_no_compiled(wheel: Path) -> None:
    """A wheel built with DS_BUILD_OPS=0 must be pure Python and record no installed op."""
    if not is_pure(wheel):
        raise KitError(f"{wheel.name}: built as a platform wheel; DS_BUILD_OPS=0 should give py3-none-any")
    with zipfile.ZipFile(wheel) as z:
        compiled = [n for n in z.namelist() if n.endswith((".so", ".pyd", ".dll", ".dylib"))]
        if compiled:
            raise KitError(f"{wheel.name}: holds compiled files {compiled[:3]}")
        info = next((n for n in z.namelist() if n.endswith("git_version_info_installed.py")), None)
        if info:
            ops = re.search(r"installed_ops=(\{.*\})", z.read(info).decode())
            if ops and "True" in ops.group(1):
                raise KitError(f"{wheel.name}: {info} records prebuilt ops: {ops.group(1)}")


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _duplicate_libraries(src: zipfile.ZipFile) -> set:
    """Copies of a shared library the generic build's lib/ holds under several names (the wheel stores the
    symbolic links libX.so -> libX.so.0 -> libX.so.0.0.0 as three files): all but the SONAME name
    (libX.so.N, what the libraries' and programs' NEEDED entries name) and libCbc.so (the file mip dlopens)."""
    groups: dict = {}
    for info in src.infolist():
        m = re.search(r"/cbcbox/cbc_dist/lib/([^/]+\.so[.0-9]*)$", info.filename)
        if m:
            groups.setdefault(hashlib.sha256(src.read(info)).digest(), []).append((m.group(1), info.filename))
    dropped = set()
    for members in groups.values():
        keep = [path for name, path in members if re.fullmatch(r"lib[^/]+\.so\.[0-9]+", name) or name == "libCbc.so"]
        if len(members) > 1 and keep:
            dropped |= {path for _, path in members if path not in keep}
    return dropped


def repack_cbcbox(wheel: Path, cache: Path) -> Path:
    """cbcbox's wheel with only the generic CBC build (cbcbox/cbc_dist), each shared library once under the
    names it is loaded by; RECORD rewritten. Cached."""
    out = cache / "repacked" / wheel.name
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    records = []
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        names = src.namelist()
        record_name = next((n for n in names if re.fullmatch(r"[^/]+\.dist-info/RECORD", n)), None)
        if record_name is None:
            raise KitError(f"{wheel.name}: no RECORD inside")
        if not any("/cbcbox/cbc_dist/lib/libCbc.so" in n for n in names):
            raise KitError(f"{wheel.name}: no generic build (cbcbox/cbc_dist/lib/libCbc.so): the wheel's layout "
                           "changed, repacking would break it")
        duplicates = _duplicate_libraries(src)
        for info in src.infolist():
            if info.filename == record_name or CBCBOX_DROPPED.search(info.filename) or info.filename in duplicates:
                continue
            data = src.read(info)
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            if not info.is_dir():
                records.append(f"{info.filename},{_record_hash(data)},{len(data)}")
        records.append(f"{record_name},,")
        dst.writestr(record_name, "\n".join(records) + "\n")
    tmp.replace(out)
    return out


def check_record(wheel: Path) -> None:
    """Every file of the wheel is in its RECORD with the right hash and size, and nothing else is."""
    with zipfile.ZipFile(wheel) as z:
        record_name = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        listed = {}
        for line in z.read(record_name).decode().splitlines():
            path, digest, size = line.rsplit(",", 2)
            listed[path] = (digest, size)
        files = [i.filename for i in z.infolist() if not i.is_dir()]
        for name in files:
            if name == record_name:
                continue
            data = z.read(name)
            if listed.get(name) != (_record_hash(data), str(len(data))):
                raise KitError(f"{wheel.name}: RECORD is wrong for {name}")
        extra = set(listed) - set(files)
        if extra:
            raise KitError(f"{wheel.name}: RECORD lists files the wheel lacks: {sorted(extra)[:3]}")


def resolve(cache: Path, image: dict, pins: dict) -> tuple:
    """Walks the requirements from setup.cfg's roots. Returns (carried {name: entry}, conflicts, device_checks)."""
    carried: dict = {}
    conflicts: list = []
    device_checks: dict = {}
    queue = [(r, "setup.cfg") for r in read_roots() if applies(r)]
    queue += [(Requirement(f"{name}=={version}"), f"peer: {why}") for name, (version, why) in PEERS.items()]
    pins = {**pins, **{canonicalize_name(name): version for name, (version, _) in PEERS.items()}}
    while queue:
        req, by = queue.pop(0)
        name = canonicalize_name(req.name)
        if name in carried:
            if carried[name]["version"] not in req.specifier:
                raise KitError(f"{name}: {by} requires {req}, but the kit carries {carried[name]['version']}")
            carried[name]["required_by"].append(by)
            continue
        reason = None
        if name not in image:
            reason = "missing from the image" + (f"; {by}" if by.startswith("peer: ") else "")
        elif image[name] is not None:
            if image[name] not in req.specifier:
                conflicts.append(f"{by} requires {req}; the image has {image[name]}")
            continue
        elif not str(req.specifier):
            continue
        elif by == "setup.cfg":  # snip_ds's own need: the image's version is what GPU users have
            device_checks.setdefault(name, []).append(f"{req} ({by})")
            continue
        if name not in pins:
            raise KitError(f"{name}: {by} requires {req} and the image lacks it (or its version is unknown), but "
                           f"{CONSTRAINTS.name} pins no version of it")
        version = pins[name]
        if Version(version) not in req.specifier:
            raise KitError(f"{name}: {by} requires {req}, but {CONSTRAINTS.name} pins {version}")
        if name in BUILT_FROM_SDIST:
            wheel = build_from_sdist(name, version, cache)
        else:
            wheel = fetch_wheel(name, version, cache)
        if reason is None:  # in the image at an unknown version, under a specifier
            if by == "setup.cfg" or not is_pure(wheel):
                device_checks.setdefault(name, []).append(f"{req} ({by})")
                continue
            reason = f"the image's version is unknown and {by} requires {req} (pure Python: carried)"
        if name == "cbcbox":
            wheel = repack_cbcbox(wheel, cache)
            check_record(wheel)
            reason += "; repacked: the generic x86_64 Linux CBC build only, each library once"
        if name in BUILT_FROM_SDIST:
            reason += f"; built from the sdist with {' '.join(f'{k}={v}' for k, v in BUILT_FROM_SDIST[name].items())}"
        carried[name] = {"version": version, "wheel": wheel.name, "path": wheel, "reason": reason,
                         "required_by": [by]}
        queue += [(r, f"{name}=={version}") for r in requirements(wheel)]
    return carried, conflicts, device_checks


def repo_bytes() -> int:
    """Bytes of the repository's tracked files (what a device call sends besides carried folders)."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return sum((REPO / p).stat().st_size for p in out.decode().split("\0") if p and (REPO / p).is_file())


def stamp_commit(kit: Path) -> None:
    """kit/COMMIT: HEAD and whether tracked files differ from it, for gpu/run_device.sh where .git does not travel."""
    git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()  # noqa: E731
    head = git("rev-parse", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    (kit / "COMMIT").write_text(f"{head}\nstamped {when}{', tracked files modified' if dirty else ''}\n")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kit", type=Path, default=REPO / ".kit", help="output folder (default: .kit, git-ignored)")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "snip_ds_kit",
                   help="downloads and builds, reused by later runs (default: ~/.cache/snip_ds_kit)")
    args = p.parse_args(argv)
    try:
        image, pins = read_image(), read_constraints()
        carried, conflicts, device_checks = resolve(args.cache, image, pins)
    except KitError as err:
        print(f"build_kit: error: {err}", file=sys.stderr)
        return 2
    args.kit.mkdir(parents=True, exist_ok=True)
    wanted = {e["wheel"] for e in carried.values()}
    for old in args.kit.glob("*.whl"):
        if old.name not in wanted:
            old.unlink()
    for e in carried.values():
        dst = args.kit / e["wheel"]
        if not dst.exists() or dst.stat().st_size != e["path"].stat().st_size or sha256(dst) != sha256(e["path"]):
            shutil.copy2(e["path"], dst)
    manifest = {
        "target": "CPython 3.12, manylinux x86_64 (the GPU machines' image)",
        "install": "python3 -m pip install --no-index --no-deps --no-compile --target /tmp/site .kit/*.whl",
        "packages": {n: {"version": e["version"], "wheel": e["wheel"], "bytes": (args.kit / e["wheel"]).stat().st_size,
                         "sha256": sha256(args.kit / e["wheel"]), "reason": e["reason"],
                         "required_by": sorted(set(e["required_by"]))} for n, e in sorted(carried.items())},
        "conflicts_with_image": conflicts,
        "check_on_device": device_checks,
    }
    (args.kit / "kit.json").write_text(json.dumps(manifest, indent=2) + "\n")
    stamp_commit(args.kit)
    kit_bytes = sum(f.stat().st_size for f in args.kit.iterdir() if f.is_file())
    repo = repo_bytes()
    print(f"build_kit: {args.kit}: {len(carried)} wheels")
    for n, e in manifest["packages"].items():
        print(f"  {e['bytes'] / 2 ** 20:8.2f} MiB  {e['wheel']}  ({e['reason']})")
    for c in conflicts:
        print(f"  conflict (not carried, the image's version stays): {c}")
    for n, reqs in device_checks.items():
        print(f"  checked on the device: {n}: {'; '.join(reqs)}")
    total = kit_bytes + repo
    print(f"build_kit: kit {kit_bytes / 2 ** 20:.2f} MiB + tracked files {repo / 2 ** 20:.2f} MiB = "
          f"{total / 2 ** 20:.2f} MiB of the {TRANSFER_LIMIT / 2 ** 20:.0f} MiB a device call sends")
    if total > TRANSFER_LIMIT:
        print("build_kit: error: kit + repository exceed what a device call sends", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
