"""The GPU machine's environment as gpu/run_device.sh finds it, and whether the kit makes snip_ds importable there.

    python3 gpu/device_env.py --output env.json [--pip_list pip_list.txt]

(run_device.sh runs it as its first step, with the kit on PYTHONPATH.) Records the interpreter, torch / CUDA /
triton / transformers versions, the GPU (name, capability, memory), nvidia-smi's and nvcc's words, and checks:

- every wheel .kit/kit.json lists is the version imported (from the kit's folder, not the image's);
- every Requires-Dist of those wheels and every need in setup.cfg (install_requires and the dev extra) holds for
  the versions importable here; a need that does not hold is listed (the image's own package stays: the run
  goes on, the summary shows it);
- deepspeed, mip (a tiny ILP solved by CBC), pydantic, hjson, datasets and snip_ds import; DeepSpeed's
  accelerator and whether its FusedAdam builder can JIT-compile here.

Exit status 1 if an import fails (the later steps would fail the same way), else 0.
"""
from __future__ import annotations

import argparse
import configparser
import importlib
import importlib.metadata as md
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KIT_MANIFEST = REPO / ".kit" / "kit.json"


def _run(cmd: list, timeout: float = 30) -> str:
    if not shutil.which(cmd[0]):
        return f"{cmd[0]}: not found"
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (p.stdout + p.stderr).strip()
    except (subprocess.TimeoutExpired, OSError) as err:
        return f"{' '.join(cmd)}: {err}"


def _version(name: str):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def unmet(requirements: list, source: str) -> list:
    """The requirements (strings) that the importable versions do not meet, each with its source."""
    from packaging.requirements import Requirement

    out = []
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        have = _version(req.name)
        if have is None:
            out.append(f"{source}: {req}: not installed")
        elif req.specifier and not req.specifier.contains(have, prereleases=True):
            out.append(f"{source}: {req}: {have} is installed")
    return out


def setup_cfg_needs() -> list:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines() + cfg["options.extras_require"]["dev"].splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def check_imports() -> dict:
    results = {}

    def attempt(name, fn):
        start = time.perf_counter()
        try:
            results[name] = {"ok": True, "detail": fn(), "seconds": round(time.perf_counter() - start, 2)}
        except Exception as err:  # noqa: BLE001 - every failure is reported, none stops the others
            results[name] = {"ok": False, "detail": f"{type(err).__name__}: {err}",
                             "traceback": traceback.format_exc()[-2000:]}

    def deepspeed_check():
        import deepspeed
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import installed_ops

        acc = get_accelerator()
        builder = acc.create_op_builder("FusedAdamBuilder")
        return {"version": deepspeed.__version__, "file": deepspeed.__file__, "accelerator": acc.device_name(),
                "prebuilt_ops": sorted(k for k, v in installed_ops.items() if v),
                "fused_adam_jit_compatible": bool(builder and builder.is_compatible(verbose=False))}

    def mip_check():
        import mip

        m = mip.Model(sense=mip.MAXIMIZE, solver_name=mip.CBC)
        m.verbose = 0
        x = [m.add_var(var_type=mip.BINARY) for _ in range(4)]
        m.objective = mip.xsum(v * xi for v, xi in zip([4, 5, 6, 8], x))
        m += mip.xsum(w * xi for w, xi in zip([3, 4, 5, 6], x)) <= 10
        status = m.optimize()
        if status != mip.OptimizationStatus.OPTIMAL or round(m.objective_value) != 13:
            raise RuntimeError(f"CBC solved a knapsack to {status}, objective {m.objective_value} (13 expected)")
        import cbcbox
        return {"version": _version("mip"), "cbc": cbcbox.cbc_dist_dir(), "knapsack_objective": m.objective_value}

    def plain(name):
        return lambda: {"version": getattr(importlib.import_module(name), "__version__", _version(name)),
                        "file": importlib.import_module(name).__file__}

    def snip_check():
        import snip_ds
        from snip_ds.planner import ilp  # noqa: F401 - imports mip

        if not Path(snip_ds.__file__).resolve().is_relative_to(REPO):
            raise RuntimeError(f"snip_ds imports from {snip_ds.__file__}, not from {REPO}")
        return {"file": snip_ds.__file__}

    attempt("deepspeed", deepspeed_check)
    attempt("mip", mip_check)
    for name in ("pydantic", "hjson", "datasets", "triton", "transformers"):
        attempt(name, plain(name))
    attempt("snip_ds", snip_check)
    return results


def torch_facts() -> dict:
    import torch

    facts = {"torch": torch.__version__, "cuda_runtime": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
             "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(device_count=torch.cuda.device_count(), gpu=props.name,
                     capability=list(torch.cuda.get_device_capability(0)), gpu_memory_bytes=props.total_memory,
                     nccl=".".join(map(str, torch.cuda.nccl.version())))
    return facts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", type=Path, required=True, help="env.json to write")
    p.add_argument("--pip_list", type=Path, help="write `pip list --format freeze` here")
    args = p.parse_args(argv)
    env = {"python": sys.version, "executable": sys.executable, "platform": platform.platform(),
           "cpus": os.cpu_count(), "pythonpath": os.environ.get("PYTHONPATH", ""),
           "build_env": {k: os.environ.get(k) for k in ("TORCH_CUDA_ARCH_LIST", "CUDA_HOME", "MAX_JOBS",
                                                         "TORCH_EXTENSIONS_DIR")},
           "install": os.environ.get("SNIP_DEVICE_INSTALL_NOTE", ""),
           "commit": os.environ.get("SNIP_DEVICE_COMMIT", "unknown"),
           "commit_source": os.environ.get("SNIP_DEVICE_COMMIT_SOURCE", ""),
           "nvidia_smi": _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap",
                               "--format=csv,noheader"]),
           "nvcc": _run(["nvcc", "--version"]).splitlines()[-1:] or [""],
           "ninja": shutil.which("ninja")}
    try:
        env.update(torch_facts())
    except Exception as err:  # noqa: BLE001
        env["torch_error"] = f"{type(err).__name__}: {err}"
    env["versions"] = {n: _version(n) for n in ("torch", "triton", "transformers", "accelerate", "numpy", "deepspeed",
                                                "mip", "cbcbox", "pydantic", "pydantic-core", "datasets",
                                                "huggingface-hub", "tokenizers", "safetensors", "tensorboard",
                                                "pytest", "typing-extensions", "packaging", "fsspec", "pyarrow")}
    kit_problems, needs = [], []
    if KIT_MANIFEST.is_file():
        kit = json.loads(KIT_MANIFEST.read_text())
        for name, entry in kit["packages"].items():
            have = _version(name)
            if have != entry["version"]:
                kit_problems.append(f"{name}: the kit carries {entry['version']}, {have} is imported")
            try:
                needs += unmet(md.requires(name) or [], f"{name}=={have}")
            except md.PackageNotFoundError:
                pass
        env["kit_conflicts_noted_at_build"] = kit.get("conflicts_with_image", [])
    else:
        kit_problems.append(f"{KIT_MANIFEST} is absent (a dry run, or .kit was not carried)")
    needs += unmet(setup_cfg_needs(), "setup.cfg")
    env["kit_problems"], env["unmet_requirements"] = kit_problems, needs
    env["imports"] = check_imports()
    failed = [n for n, r in env["imports"].items() if not r["ok"]]
    env["import_failures"] = failed
    args.output.write_text(json.dumps(env, indent=2, default=str) + "\n")
    if args.pip_list:
        args.pip_list.write_text(_run([sys.executable, "-m", "pip", "list", "--format", "freeze"], timeout=60) + "\n")
    print(json.dumps({k: env.get(k) for k in ("python", "torch", "cuda_runtime", "gpu", "capability", "nvidia_smi",
                                              "nvcc", "commit")}, default=str))
    for line in kit_problems + needs:
        print(f"note: {line}")
    for name in failed:
        print(f"error: import {name}: {env['imports'][name]['detail']}")
    print(f"env: {len(env['imports']) - len(failed)}/{len(env['imports'])} imports ok, {len(needs)} unmet "
          f"requirement(s), {len(kit_problems)} kit problem(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
