"""summary.md and summary.json of one gpu/run_device.sh call, from its work folder.

    python3 gpu/device_summary.py --work WORK --results OUT/results --started EPOCH_S --deadline SECONDS

(run_device.sh runs it last.) Per step: status (pass / fail / skip / timeout / not run), seconds, the last log
line; for the pytest steps the counts from their junit XML and the names of failed tests; for the training run
its logged losses and its plan's FP4 share; for each benchmark the headline figures of its JSON. The machine's
facts come from env.json (gpu/device_env.py).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def junit(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as err:
        return {"error": f"{path.name}: {err}"}
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["failed_tests"] = failed[:40]
    return counts


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def train_facts(work: Path) -> dict:
    log = (work / "logs" / "train.log")
    text = log.read_text(errors="replace") if log.is_file() else ""
    losses = [{"step": int(m[1]), "train": float(m[2]), "validation": float(m[3])}
              for m in re.finditer(r"step (\d+) train loss ([\d.naif]+) validation loss ([\d.naif]+)", text)]
    facts = {"eval_points": losses}
    first = re.search(r"snip_ds: .*GEMM backends: .*", text)
    if first:
        facts["start_line"] = first.group(0)[:400]
    plan = _load(work / "train" / "plan.json")
    if isinstance(plan, dict):
        facts["plan_fp4_share"] = plan.get("fp4_share")
        assignment = plan.get("assignment", {})
        facts["plan_fp4_layers"] = sum(1 for v in assignment.values() if v == "fp4")
        facts["plan_layers"] = len(assignment)
    facts["stats_json"] = (work / "train" / "stats.json").is_file()
    return facts


def bench_facts(work: Path) -> dict:
    b, out = work / "bench", {}
    scale = _load(b / "bench_scale.json") or _load(b / "bench_scale_cpu.json")
    if scale:
        out["bench_scale"] = {k: scale.get(k) for k in ("device", "parameters", "median_step_s", "collect_s",
                                                        "collect_step_equivalents", "memory_ratio", "allreduce_bytes",
                                                        "solve_s")}
        out["bench_scale"]["peak_bytes"] = scale.get("peak_bytes")
        out["bench_scale"]["fp4_share"] = scale.get("plan", {}).get("fp4_share")
        out["bench_scale"]["fp4_layers"] = scale.get("plan", {}).get("fp4_layers")
        out["bench_scale"]["collect_by_chunk_elements"] = scale.get("collect_by_chunk_elements")
        out["bench_scale"]["collect_ieee_fp32"] = scale.get("collect_ieee_fp32")
        prof = scale.get("collection_profile") or {}
        out["bench_scale"]["collection_profile"] = {k: prof.get(k) for k in ("step_us", "launches_per_step",
                                                                              "share")} if prof else None
    for key, name in (("bench_train", "bench_train_cuda.json"),
                      ("bench_train_compiled", "bench_train_cuda_compiled.json")):
        train = _load(b / name)
        if train:
            out[key] = {p: {k: r.get(k) for k in ("step_time_s", "tokens_per_s", "tokens_per_s_ratio_vs_bf16",
                                                  "collect_s", "snip_overhead_share")}
                        for p, r in train.get("rows", {}).items()}
    layer = _load(b / "bench_layer_gpu.json")
    if layer:
        out["bench_layer"] = {
            "torchao": layer.get("torchao"), "not_reached": len(layer.get("not_reached", [])),
            "rows": {f"{r['shape']}@{r['tokens']} {r['mode']} {r['variant']}":
                     r.get("error") or {k: round(r[k], 3) for k in ("wall_vs_bf16", "kernel_vs_bf16", "peak_vs_bf16")
                                        if isinstance(r.get(k), float)} | {"host_us": round(r["host_issue_us"])}
                     for r in layer.get("rows", [])}}
    host = _load(b / "bench_layer_host_cuda.json")
    if host:
        out["bench_layer_host"] = {
            "not_reached": len(host.get("not_reached", [])),
            "rows": {f"{r['scope']} {r['mode']} {r['variant']}":
                     r.get("error") or {k: round(r[k], 3) for k in ("launches", "host_us", "host_ratio_vs_bf16", "syncs",
                                                                    "saved_bytes_ratio_vs_bf16",
                                                                    "peak_bytes_ratio_vs_bf16")
                                        if isinstance(r.get(k), (int, float))}
                     for r in host.get("rows", [])}}
    gemm = _load(b / "bench_gpu_gemm.json")
    if gemm:
        out["bench_gpu_gemm"] = {f"{r['k']}x{r['n']}": r.get("step_vs_bf16") for r in gemm.get("rows", [])}
    quant = _load(b / "bench_quant_kernels.json")
    if quant:
        shares = [r["total_share"] for s in quant.get("shapes", []) for r in s.get("results", []) if "total_share" in r]
        out["bench_quant_kernels"] = {"configurations": len(shares),
                                      "copy_bandwidth_share": {"min": min(shares), "median": statistics.median(shares),
                                                               "max": max(shares)} if shares else None}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--results", type=Path, required=True)
    p.add_argument("--started", type=float, required=True)
    p.add_argument("--deadline", type=float, required=True)
    args = p.parse_args(argv)
    steps = [json.loads(line) for line in (args.work / "steps.jsonl").read_text().splitlines() if line.strip()]
    for s in steps:
        tests = junit(args.work / f"junit_{s['step']}.xml")
        if tests:
            s["tests"] = tests
            if s["status"] == "pass" and tests.get("tests") and tests.get("skipped") == tests.get("tests"):
                s["status"] = "skip"  # every test skipped (no CUDA)
    env = _load(args.work / "env.json") or {}
    summary = {"finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "wall_s": round(time.time() - args.started), "deadline_s": args.deadline,
               "dry_run": os.environ.get("SNIP_DEVICE_DRY_RUN") == "1",
               "commit": env.get("commit"), "commit_source": env.get("commit_source"),
               "machine": {k: env.get(k) for k in ("gpu", "capability", "gpu_memory_bytes", "nvidia_smi", "torch",
                                                   "cuda_runtime", "nccl", "nvcc", "python", "cpus")},
               "versions": env.get("versions"), "install": env.get("install"),
               "import_failures": env.get("import_failures"), "unmet_requirements": env.get("unmet_requirements"),
               "kit_problems": env.get("kit_problems"),
               "steps": steps, "train": train_facts(args.work), "benchmarks": bench_facts(args.work)}
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    m = summary["machine"]
    lines = [f"# run_device summary{' (DRY RUN, CPU)' if summary['dry_run'] else ''}", "",
             f"- finished {summary['finished']}, {summary['wall_s']} s after the start (deadline {args.deadline:.0f} s)",
             f"- commit `{summary['commit']}` ({summary['commit_source']})",
             f"- GPU: {m.get('gpu') or 'none'} (capability {m.get('capability')}), nvidia-smi: {m.get('nvidia_smi')}",
             f"- torch {m.get('torch')}, CUDA {m.get('cuda_runtime')}, NCCL {m.get('nccl')}, "
             f"triton {(summary['versions'] or {}).get('triton')}, nvcc: {' '.join(m.get('nvcc') or [])}",
             f"- Python: {(m.get('python') or '').split()[0] if m.get('python') else None}; {summary['install']}"]
    for key, label in (("import_failures", "imports that failed"), ("unmet_requirements", "unmet requirements"),
                       ("kit_problems", "kit problems")):
        if summary[key]:
            lines.append(f"- **{label}**: " + "; ".join(map(str, summary[key])))
    lines += ["", "| step | status | seconds | detail |", "|---|---|---|---|"]
    for s in steps:
        detail = s.get("detail", "")
        if "tests" in s and "error" not in s["tests"]:
            t = s["tests"]
            detail = f"{t['passed']} passed, {t['failures'] + t['errors']} failed, {t['skipped']} skipped"
            if t["failed_tests"]:
                detail += ": " + ", ".join(t["failed_tests"][:8])
        detail = detail.replace("|", "\\|")
        lines.append(f"| {s['step']} | **{s['status']}** | {s.get('seconds', 0):.0f} | {detail} |")
    tr = summary["train"]
    if tr.get("eval_points") or tr.get("plan_fp4_share") is not None:
        pts = ", ".join(f"step {e['step']}: {e['train']:.3f} / {e['validation']:.3f}" for e in tr["eval_points"])
        lines += ["", f"**train** (train / validation loss): {pts or 'none logged'}; plan FP4 share "
                  f"{tr.get('plan_fp4_share')} ({tr.get('plan_fp4_layers')} of {tr.get('plan_layers')} layers FP4); "
                  f"stats.json {'written' if tr.get('stats_json') else 'absent'}"]
    for name, facts in summary["benchmarks"].items():
        lines += ["", f"**{name}**: `{json.dumps(facts, default=str)[:1500]}`"]
    (args.results / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
