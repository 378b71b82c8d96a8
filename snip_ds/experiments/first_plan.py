"""Does the first adaptive plan (before step 1, no Adam state yet) depend on round-off? And which prior for
the backward's preconditioner makes it both stable and close to the plan Adam's real state gives?

The study (``launch/first_plan_stability.py``; docs/experiments.md, "The first plan"):

* For each model seed, the first collection of a run (a fresh model, every layer at FP8, one batch of the
  private stream) is repeated under *perturbations* that are exact in real arithmetic and change only
  round-off, as another GPU or BLAS does: every matrix product's FP32 operands rounded to TF32 (:class:`TF32`),
  and every matrix product's reduction split in two halves whose FP32 partial sums are added
  (:class:`SplitK`: cuBLAS's split-K kernels, another order of summation). Each prior's plan and BWD under a
  perturbation are compared with its unperturbed ones.
* The model then trains ``replan_step`` steps with AdamW (FP32 master weights); the statistics with the
  optimizer's real state at that step give the reference plan the first re-plan would make. Each prior's first
  plan and first BWD are compared with it: layers assigned differently, and Spearman's ρ of the FP4 BWD.
* ``fld_only`` is the first plan priced without BWD (λ = 0: waiting for Adam's state).

Research code: never imported by the training package.
"""
from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Any, Dict, List, Mapping, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from snip_ds.run.data import DataStream, load_dataset_blocks
from snip_ds.experiments.paired import finite_mean, spearman
from snip_ds.experiments.training import TrainSettings, make_optimizer, train_steps
from snip_ds.run.model import build_model
from snip_ds.runtime.omp import preserve_torch_threads
from snip_ds.planner import CostSettings, SolverSettings, solve_baseline
from snip_ds.quant_config import QuantConfig
from snip_ds.stats import CollectSettings, adam_precond, collect_statistics
from snip_ds.swap import swap_model

aten = torch.ops.aten
PERTURBATIONS = ("tf32", "split_k_fp32", "split_k")


def round_to_tf32(t: Any) -> Any:
    """FP32 values rounded to nearest-even at TF32's 10 mantissa bits (anything else unchanged)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
        return t
    bits = t.contiguous().view(torch.int32)
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF
    return bits.view(torch.float32).view(t.shape)


class TF32(TorchDispatchMode):
    """Every FP32 operand of aten's mm, bmm and addmm rounded to TF32 (as ``collect_tf32`` does on CUDA)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (aten.mm.default, aten.bmm.default):
            args = tuple(round_to_tf32(a) for a in args)
        elif func in (aten.addmm.default,):
            args = (args[0], round_to_tf32(args[1]), round_to_tf32(args[2])) + tuple(args[3:])
        return func(*args, **(kwargs or {}))


def _split_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (2-D or batched) as the FP32 sum of two halves of the reduction, in ``a``'s dtype."""
    k = a.shape[-1]
    if k < 2:
        return torch.matmul(a, b)
    h = k // 2
    af, bf = a.float(), b.float()
    out = torch.matmul(af[..., :h], bf[..., :h, :]) + torch.matmul(af[..., h:], bf[..., h:, :])
    return out.to(a.dtype)


class SplitK(TorchDispatchMode):
    """Every mm, bmm and addmm (``beta = alpha = 1``) computed as two half reductions added in FP32: the same
    product in another order of summation (BF16 products round once, as a BF16 GEMM with FP32 accumulation).
    ``fp32_only``: only the FP32 products (a BF16 model's own GEMMs keep their order: what the statistics' FP32
    products on another kernel change)."""

    def __init__(self, fp32_only: bool = False) -> None:
        super().__init__()
        self.fp32_only = fp32_only

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch.utils._python_dispatch._disable_current_modes():
            if self.fp32_only and not (len(args) > 1 and getattr(args[1], "dtype", None) == torch.float32):
                return func(*args, **kwargs)
            if func in (aten.mm.default, aten.bmm.default) and not kwargs:
                return _split_product(args[0], args[1])
            if func is aten.addmm.default and not kwargs and len(args) == 3:
                return (args[0].float() + _split_product(args[1], args[2]).float()).to(args[1].dtype)
            return func(*args, **kwargs)


def perturbation(name: str):
    """The context that applies perturbation ``name`` (``"none"``: nothing)."""
    if name == "none":
        return nullcontext()
    return {"tf32": TF32, "split_k_fp32": lambda: SplitK(fp32_only=True), "split_k": SplitK}[name]()


def solve(stats: Mapping[str, Any], rho: float, lam: float) -> Dict[str, str]:
    """SNIP's plan (``best``) at FP4 share ``rho`` and BWD weight ``lam``: ``{fqn: precision}``."""
    with preserve_torch_threads():
        plan = solve_baseline("best", stats, rho, CostSettings(lam=lam), SolverSettings())[0]
    return dict(plan.assignment)


def fp4_bwd(stats: Mapping[str, Any]) -> Dict[str, float]:
    return {f: float(v["bwd"]["fp4"]) for f, v in stats["layers"].items()}


def changed(a: Mapping[str, str], b: Mapping[str, str]) -> int:
    return sum(a[f] != b[f] for f in a)


def run_seed(seed: int, priors: Sequence[str], *, rho: float = 0.75, lam: float = 2.0, replan_step: int = 16,
             lr: float = 2e-3, warmup_steps: int = 12, micro_batch: int = 4, block_size: int = 256,
             data=None, log=print) -> Dict[str, Any]:
    """One model seed's records (the module docstring): per prior and perturbation the first plan, its
    changes and its largest relative FP4-BWD change; per prior its distance to the step-``replan_step`` plan."""
    train_ds, vocab = data if data is not None else load_dataset_blocks(None, block_size)[::2]
    model = build_model(vocab_size=vocab, seed=seed, block_size=block_size)  # FP32 master weights
    swap_model(model, "fp8", QuantConfig(), seed=seed)
    settings = TrainSettings(lr=lr, batch_size=micro_batch, lr_warmup_steps=warmup_steps)
    private = DataStream(train_ds, micro_batch, seed=seed + 777)

    def collect(batch, prior, precond=None, step=0, perturb="none"):
        work = copy.deepcopy(model).to(torch.bfloat16)  # the engine's BF16 module
        how = CollectSettings(seed=seed + step, lam=lam, precond_fallback=prior)
        with perturbation(perturb):
            return collect_statistics(work, [batch], how, lr=settings.lr_at(step), precond=precond, step=step)

    first_batch = private.next_batch()["input_ids"]
    record: Dict[str, Any] = {"seed": seed, "rho": rho, "lambda": lam, "priors": {}}
    for prior in priors:
        base = collect(first_batch, prior)
        entry = {"plan": solve(base, rho, lam), "bwd_fp4": fp4_bwd(base), "perturbed": {}}
        moved_stats = {}
        for name in PERTURBATIONS:
            moved = moved_stats[name] = collect(first_batch, prior, perturb=name)
            plan, moved_bwd = solve(moved, rho, lam), fp4_bwd(moved)
            rel = max(abs(moved_bwd[f] - b) / b for f, b in entry["bwd_fp4"].items() if b > 0)
            entry["perturbed"][name] = {"changed": changed(entry["plan"], plan), "max_rel_bwd": rel}
        record["priors"][prior] = entry
        if prior == priors[0]:  # FLD does not depend on the prior
            record["fld_only_plan"] = solve(base, rho, 0.0)
            record["fld_only_perturbed"] = {name: changed(record["fld_only_plan"], solve(moved_stats[name], rho, 0.0))
                                            for name in PERTURBATIONS}
        log(f"seed {seed} {prior}: " + ", ".join(f"{n} changed {v['changed']} max rel BWD {v['max_rel_bwd']:.2e}"
                                                 for n, v in entry["perturbed"].items()))
    opt = make_optimizer(model, settings)
    stream = DataStream(train_ds, micro_batch, seed=seed)
    train_steps(model, opt, stream.next_batch, replan_step, settings)
    pc = adam_precond(model, opt)
    ref = collect(private.next_batch()["input_ids"], priors[0], precond=pc.precond, step=pc.step)
    ref_plan, ref_bwd = solve(ref, rho, lam), fp4_bwd(ref)
    record["reference"] = {"step": pc.step, "plan": ref_plan, "bwd_fp4": ref_bwd}
    for prior, entry in record["priors"].items():
        entry["vs_reference"] = {"changed": changed(entry["plan"], ref_plan),
                                 "spearman_bwd": spearman([entry["bwd_fp4"][f] for f in ref_bwd],
                                                          list(ref_bwd.values()))}
    record["fld_only_vs_reference"] = changed(record["fld_only_plan"], ref_plan)
    return record


def summary(records: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Per prior: the share of seeds whose first plan changes under each perturbation, the mean layers changed,
    the largest relative BWD change; mean layers apart from and Spearman to the reference."""
    out: Dict[str, Any] = {"seeds": len(records), "layers": len(records[0]["reference"]["plan"]), "priors": {}}
    priors = list(records[0]["priors"])
    for prior in priors:
        rows = [r["priors"][prior] for r in records]
        s = {name: {"plans_changed": sum(e["perturbed"][name]["changed"] > 0 for e in rows) / len(rows),
                    "mean_layers_changed": sum(e["perturbed"][name]["changed"] for e in rows) / len(rows),
                    "max_rel_bwd": max(e["perturbed"][name]["max_rel_bwd"] for e in rows)} for name in PERTURBATIONS}
        s["vs_reference_changed"] = sum(e["vs_reference"]["changed"] for e in rows) / len(rows)
        # a constant BWD (e.g. all zero) has no rank correlation: skipped, and counted
        s["vs_reference_spearman"], s["vs_reference_spearman_skipped"] = finite_mean(
            e["vs_reference"]["spearman_bwd"] for e in rows)
        out["priors"][prior] = s
    out["fld_only_vs_reference_changed"] = sum(r["fld_only_vs_reference"] for r in records) / len(records)
    out["fld_only_plans_changed"] = {name: sum(r["fld_only_perturbed"][name] > 0 for r in records) / len(records)
                                     for name in PERTURBATIONS}
    return out


def markdown(summ: Mapping[str, Any], header: str = "") -> str:
    """The summary as the Markdown table docs/experiments.md quotes."""
    lines = [header, "", f"{summ['seeds']} model seeds, {summ['layers']} planned layers, ρ and λ as the default run.",
             "", "First plans changed (mean layers changed) and the largest relative change of a layer's FP4 BWD, "
             "per perturbation; then the distance to the plan and BWD of Adam's real state at step 16.", "",
             "| prior | TF32 operands | split-K, FP32 products | split-K, all products | layers apart from the "
             "step-16 plan | Spearman to step-16 BWD |", "|---|---|---|---|---|---|"]
    for prior, s in summ["priors"].items():
        cells = [f"{s[n]['plans_changed']:.0%} ({s[n]['mean_layers_changed']:.2f}); {s[n]['max_rel_bwd']:.1e}"
                 for n in PERTURBATIONS]
        lines.append(f"| `{prior}` | " + " | ".join(cells) + f" | {s['vs_reference_changed']:.2f} | "
                     f"{s['vs_reference_spearman']:.3f}" + (f" ({s['vs_reference_spearman_skipped']} undefined, "
                                                             f"skipped)" if s.get("vs_reference_spearman_skipped")
                                                             else "") + " |")
    f = summ["fld_only_plans_changed"]
    lines.append("| FLD only (λ = 0 before Adam has state) | " + " | ".join(f"{f[n]:.0%}" for n in PERTURBATIONS)
                 + f" | {summ['fld_only_vs_reference_changed']:.2f} | – |")
    return "\n".join(lines) + "\n"


def run(seeds: Sequence[int], priors: Sequence[str], log=print, **kw) -> List[Dict[str, Any]]:
    data = load_dataset_blocks(None, kw.get("block_size", 256))[::2]
    return [run_seed(s, priors, data=data, log=log, **kw) for s in seeds]
