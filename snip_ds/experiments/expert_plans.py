"""Per-expert precisions against one precision for all experts of a (block, projection), on an MoE model.

SNIP plans every (expert, projection) pair of an MoE experts module as a layer of its own
(``<experts path>.<expert>.<projection>``; :mod:`snip_ds.experts`). The comparison here asks whether that
freedom helps: the same statistics are solved twice at the same FP4 share,

* ``per_expert``: SNIP's ordinary plan, every pair free (:func:`~snip_ds.planner.solve_baseline`, ``best``);
* ``shared``: every (experts path, projection) *group* of pairs merged into one pseudo-layer whose costs and
  FLOPs are the sums over its experts (:func:`merge_expert_groups`; the planner's objective is a sum of per-layer
  costs, so the pseudo-layer's cost at a precision is exactly what its experts cost together at that precision),
  solved with the same solver and λ, then expanded back to every pair of the group (:func:`expand_assignment`).

Dense layers (attention, shared experts) are free in both arms. Both arms are solved at one FP4 share: the
smallest share ≥ ρ that whole groups and dense layers reach exactly (:func:`~snip_ds.experiments.plans.attainable_share`
over the merged units), which the per-expert arm can reach too (any shared plan is a per-expert plan).

:func:`run_comparison` warms the model up, collects the statistics, solves both arms (and uniform FP8/FP4 as
references), then trains every plan from the checkpoint for every seed with the paired machinery of
:mod:`snip_ds.experiments.runs` (:func:`~snip_ds.experiments.runs.run_cell`) and writes
``compare_expert_plans.json`` and ``.md``. The grouping functions are pure (no torch).
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Sequence

from snip_ds.plan import Plan, fp4_share

SHARED_MARK = "*"  # the expert index of a group's pseudo-layer: <experts path>.*.<projection>
PREFIX = "compare_expert_plans"
ARMS = ("per_expert", "shared")


# --------------------------------------------------------------------------------------------------------
# Grouping (pure)
# --------------------------------------------------------------------------------------------------------
def group_name(pair: str) -> str:
    """``model.layers.0.mlp.experts.3.gate_up_proj`` -> ``model.layers.0.mlp.experts.*.gate_up_proj``.

    Raises:
        ValueError: ``pair`` is not ``<path>.<expert index>.<projection>``.
    """
    parts = pair.rsplit(".", 2)
    if len(parts) != 3 or not parts[1].isdigit() or not parts[0] or not parts[2]:
        raise ValueError(f"{pair!r} is not an expert pair name '<experts path>.<expert>.<projection>'")
    return f"{parts[0]}.{SHARED_MARK}.{parts[2]}"


def expert_groups(layers: Mapping[str, Mapping[str, Any]]) -> Dict[str, List[str]]:
    """``{group name: [pair names]}`` of a statistics artifact's ``layers``: every record with ``routed_tokens``
    (an MoE (expert, projection) pair, :mod:`snip_ds.stats.experts`) joins the group of its experts path and
    projection; pairs listed in expert order. Dense layers belong to no group."""
    groups: Dict[str, List[str]] = {}
    for name, rec in layers.items():
        if "routed_tokens" in rec:
            groups.setdefault(group_name(name), []).append(name)
    for pairs in groups.values():
        pairs.sort(key=lambda n: int(n.rsplit(".", 2)[1]))
    return groups


def _sum_field(records: Sequence[Mapping[str, Any]], field: str) -> Any:
    """The sum over ``records`` of a per-precision field (``{precision: number}``); None when a record lacks it
    or it is not such a mapping. A non-finite member makes the sum non-finite (the planner then pins the group)."""
    values = [r.get(field) for r in records]
    if not all(isinstance(v, Mapping) for v in values):
        return None
    keys = set(values[0])
    if any(set(v) != keys for v in values) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for v in values for x in v.values()):
        return None
    return {k: sum(float(v[k]) for v in values) for k in sorted(keys)}


def merge_expert_groups(stats: Mapping[str, Any], groups: Mapping[str, Sequence[str]]) -> Dict[str, Any]:
    """A statistics artifact whose expert pairs are replaced by one pseudo-layer per group.

    The pseudo-layer's ``flops`` and every per-precision field (``fld``, ``bwd``, ``quant_err``, ...) are the sums
    over its pairs; it is ``nonfinite`` if any pair is; ``routed_tokens`` is the sum. Dense layers and the
    artifact's other keys are kept as they are.

    Raises:
        ValueError: a group is empty, or names a layer the statistics lack.
    """
    layers = stats["layers"]
    grouped = {p for pairs in groups.values() for p in pairs}
    out_layers: Dict[str, Any] = {n: rec for n, rec in layers.items() if n not in grouped}
    for name, pairs in groups.items():
        if not pairs:
            raise ValueError(f"group {name!r} has no expert pairs")
        missing = [p for p in pairs if p not in layers]
        if missing:
            raise ValueError(f"group {name!r}: the statistics have no layer {missing[0]!r}")
        recs = [layers[p] for p in pairs]
        merged: Dict[str, Any] = dict(flops=sum(float(r["flops"]) for r in recs),
                                      nonfinite=any(bool(r.get("nonfinite", False)) for r in recs),
                                      routed_tokens=sum(float(r.get("routed_tokens", 0.0)) for r in recs))
        for field in recs[0]:
            if field not in merged:
                total = _sum_field(recs, field)
                if total is not None:
                    merged[field] = total
        out_layers[name] = merged
    return {**{k: v for k, v in stats.items() if k != "layers"}, "layers": out_layers}


def expand_assignment(assignment: Mapping[str, Any], groups: Mapping[str, Sequence[str]]) -> Dict[str, Any]:
    """A plan's assignment over pseudo-layers made one over pairs: every pair of a group takes the group's
    precision (a per-GEMM dict is copied per pair); other entries are kept.

    Raises:
        ValueError: a group of ``groups`` is not in ``assignment``.
    """
    out = {n: v for n, v in assignment.items() if n not in groups}
    for name, pairs in groups.items():
        if name not in assignment:
            raise ValueError(f"the assignment has no precision for group {name!r}")
        value = assignment[name]
        for p in pairs:
            out[p] = value if isinstance(value, str) else dict(value)
    return out


def differing_layers(a: Mapping[str, Any], b: Mapping[str, Any], names: Sequence[str]) -> List[str]:
    """The names among ``names`` whose precision differs between assignments ``a`` and ``b``."""
    return [n for n in names if a[n] != b[n]]


def is_shared(assignment: Mapping[str, Any], groups: Mapping[str, Sequence[str]]) -> bool:
    """Whether every group's pairs have one precision in ``assignment``."""
    return all(len({repr(assignment[p]) for p in pairs}) == 1 for pairs in groups.values())


# --------------------------------------------------------------------------------------------------------
# Solving both arms
# --------------------------------------------------------------------------------------------------------
def solve_arms(stats: Mapping[str, Any], rho: float, lam: float) -> Dict[str, Any]:
    """Both arms' plans at FP4 share ρ (raised to the smallest share the merged units reach exactly).

    Returns:
        ``dict(share=, groups=, per_expert=Plan, shared=Plan)``; both plans per layer, at λ ``lam``.
    """
    from snip_ds.experiments.plans import attainable_share
    from snip_ds.runtime.omp import preserve_torch_threads
    from snip_ds.planner import CostSettings, SolverSettings, solve_baseline

    groups = expert_groups(stats["layers"])
    if not groups:
        raise ValueError("the statistics have no MoE expert pairs (no layer has routed_tokens)")
    merged = merge_expert_groups(stats, groups)
    share = attainable_share({n: float(r["flops"]) for n, r in merged["layers"].items()}, rho)
    cost, solver = CostSettings(lam=lam), SolverSettings(max_share=min(share + 1e-9, 1.0))
    with preserve_torch_threads():  # CBC would leave torch single-threaded
        per_expert = solve_baseline("best", stats, share, cost, solver)[0]
        grouped = solve_baseline("best", merged, share, cost, solver)[0]
    flops = {n: float(r["flops"]) for n, r in stats["layers"].items()}
    assignment = expand_assignment(grouped.assignment, groups)
    shared = Plan(assignment=assignment, fp4_share=fp4_share(assignment, flops), objective=grouped.objective,
                  status=grouped.status, method="best_shared",
                  meta={**grouped.meta, "expert_groups": len(groups)})
    return dict(share=share, groups=groups, per_expert=per_expert, shared=shared)


# --------------------------------------------------------------------------------------------------------
# The comparison run
# --------------------------------------------------------------------------------------------------------
def _shown(path) -> str:
    """A path as the result files show it: relative to the repository when inside it."""
    root = Path(__file__).resolve().parents[2]
    try:
        return str(Path(path).resolve().relative_to(root))
    except ValueError:
        return str(path)


def _log(args, msg: str) -> None:
    if not args.silent:
        print(msg, file=sys.stderr, flush=True)


def _plan_entry(method: str, label: str, rho, plan: Plan, stats, lam: float) -> Dict[str, Any]:
    from snip_ds.planner.costs import predicted_divergence

    fld, bwd = predicted_divergence(stats["layers"], plan.assignment)
    return dict(method=method, label=label, rho=rho, plan=plan, predicted_fld=fld, predicted_bwd=bwd,
                **({"lambda": float(lam)} if rho is not None else {}))


def trained_share(assignment: Mapping[str, Any], dense_flops: Mapping[str, float],
                  pair_flops_per_token: Mapping[str, float], routed: Mapping[str, float]) -> float:
    """The FP4 share of a plan under the routing a run really had: dense layers at their (fixed) FLOPs per
    step, each expert pair at ``6·k·n`` times its routed tokens per step in the run (per-GEMM entries count a
    third per GEMM, as :func:`~snip_ds.plan.fp4_share` does)."""
    flops = dict(dense_flops)
    flops.update({p: pair_flops_per_token[p] * float(routed.get(p, 0.0)) for p in pair_flops_per_token})
    return fp4_share(assignment, flops)


def summarize(records: Sequence[Mapping[str, Any]], rhos: Sequence[float]) -> Dict[str, Any]:
    """Per ρ: per_expert − shared (quantized and BF16 forward) as mean ± SE over seeds with its verdict, and
    each arm's gap to uniform FP8; uniform FP4's gap to FP8."""
    from snip_ds.experiments.paired import mean_se, paired_differences, paired_verdict

    cell = ("phase", "seed")
    out: Dict[str, Any] = {"rho": {}}
    fp8 = lambda r: r["method"] == "uniform_fp8"  # noqa: E731
    for key, tag in (("val_loss", "q"), ("val_loss_bf16_forward", "bf16")):
        out.setdefault("uniform_fp4_minus_fp8", {})[tag] = mean_se(1e3 * d for d in paired_differences(
            records, key, cell, lambda r: r["method"] == "uniform_fp4", fp8)).to_dict()
    for rho in rhos:
        for name in ARMS:
            shares = [r["fp4_share_trained"] for r in records
                      if r["method"] == name and r["rho"] == rho and r.get("fp4_share_trained") is not None]
            if shares:
                out.setdefault("fp4_share_trained", {}).setdefault(f"{rho:g}", {})[name] = dict(
                    mean=sum(shares) / len(shares), min=min(shares), max=max(shares), n=len(shares))

        def arm(name, rho=rho):
            return lambda r: r["method"] == name and r["rho"] == rho
        entry: Dict[str, Any] = {}
        for key, tag in (("val_loss", "q"), ("val_loss_bf16_forward", "bf16")):
            diff = mean_se(1e3 * d for d in paired_differences(records, key, cell, arm("per_expert"), arm("shared")))
            room = mean_se(1e3 * d for d in paired_differences(records, key, cell, arm("shared"), fp8))
            entry[tag] = dict(per_expert_minus_shared=diff.to_dict(), verdict=paired_verdict(diff, room),
                              shared_minus_fp8=room.to_dict(),
                              per_expert_minus_fp8=mean_se(1e3 * d for d in paired_differences(
                                  records, key, cell, arm("per_expert"), fp8)).to_dict())
        out["rho"][f"{rho:g}"] = entry
    return out


def _fmt(ms: Mapping[str, Any]) -> str:
    if ms.get("mean") is None:
        return "n/a"
    se = ms.get("se")
    return f"{ms['mean']:+.2f}" + ("" if se is None else f" ± {se:.2f}")


def _pred(p: Mapping[str, float]) -> str:
    return f"{1e3 * p['objective']:.3f} ({1e3 * p['fld']:.3f}, {1e3 * p['bwd']:.4f})"


def write_markdown(data: Mapping[str, Any], path: Path) -> None:
    """``compare_expert_plans.md``: settings, the plans, the paired result."""
    s, summ = data["settings"], data["summary"]
    lines = ["# Per-expert precisions vs one precision per (block, projection)", "",
             f"`{s['command']}`", "",
             f"Model `{s['model']}`: {s['parameters']:,} parameters, {s['blocks']} blocks, {s['experts']} experts "
             f"(top-{s['top_k']}), {s['expert_pairs']} expert pairs in {s['expert_groups']} groups, "
             f"{s['dense_layers']} dense planned linears. Warm-up {s['warmup_steps']} steps (BF16), statistics from "
             f"{s['stat_batches']} batches, then {s['steps']} steps per run from the checkpoint (learning rate "
             f"{s['lr']:g} decaying {s['lr_decay']}), validation on {s['eval_batches']} batches of "
             f"{s['batch_size']}×{s['block_size']} tokens. SNIP at λ = {s['lambda']:g}, per layer. Seeds "
             f"{', '.join(str(x) for x in s['seeds'])} (data order and rounding, paired). Wall time "
             f"{data.get('wall_seconds', 0) / 60:.1f} min.", "",
             "Losses in millinats; ± is one standard error over seeds of the paired difference.", "",
             "## Plans", "",
             "Predicted: FLD + λ·BWD of the plan from the statistics (FLD, BWD), in millinats. Measured: the plan's validation "
             "loss at the checkpoint minus the BF16 one, in millinats (one evaluation, no training).", "",
             "| ρ | FP4 share (both) | expert pairs that differ | dense layers that differ | per-expert FP4 pairs "
             "| shared FP4 pairs | predicted per-expert | predicted shared | measured per-expert | measured shared |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    measured = {(r["method"], r["rho"]): r.get("measured_fld_at_ckpt") for r in data["records"]}

    def mn(method, rho):
        value = measured.get((method, rho))
        return "n/a" if value is None else f"{1e3 * value:+.2f}"
    for p in data["plan_comparison"]:
        lines.append(f"| {p['rho']:g} | {p['share_per_expert']:.4f} / {p['share_shared']:.4f} | "
                     f"{p['pairs_differ']} of {s['expert_pairs']} | {p['dense_differ']} of {s['dense_layers']} | "
                     f"{p['fp4_pairs_per_expert']} | {p['fp4_pairs_shared']} | "
                     f"{_pred(p['predicted_per_expert'])} | {_pred(p['predicted_shared'])} | "
                     f"{mn('per_expert', p['rho'])} | {mn('shared', p['rho'])} |")
    trained = summ.get("fp4_share_trained")
    if trained:
        lines += ["", "FP4 share under the routing of the training runs themselves (the plans were solved at the "
                  "statistics' routing; mean, min–max over runs): " + "; ".join(
                      f"ρ {rho}: " + ", ".join(f"{name} {v['mean']:.4f} ({v['min']:.4f}–{v['max']:.4f})"
                                               for name, v in arms.items()) for rho, arms in trained.items()) + "."]
    idle = data.get("idle_pairs") or []
    lines += ["", f"Expert pairs no token reached in the statistics' batches (no FLOPs, no cost; planned "
              f"freely): {len(idle)}" + (f" ({', '.join(idle)})" if idle else "") + ".",
              "", "## Validation loss", "",
              f"Uniform FP4 − uniform FP8: {_fmt(summ['uniform_fp4_minus_fp8']['q'])} (BF16 forward: "
              f"{_fmt(summ['uniform_fp4_minus_fp8']['bf16'])}).", "",
              "| ρ | forward | per-expert − shared | resolved (> 2 SE) | per-expert − FP8 | shared − FP8 |",
              "|---|---|---|---|---|---|"]
    for rho, entry in summ["rho"].items():
        for tag, name in (("q", "quantized"), ("bf16", "BF16")):
            e = entry[tag]
            lines.append(f"| {rho} | {name} | {_fmt(e['per_expert_minus_shared'])} | "
                         f"{e['verdict']['resolved']} | {_fmt(e['per_expert_minus_fp8'])} | "
                         f"{_fmt(e['shared_minus_fp8'])} |")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def run_comparison(args) -> Dict[str, Any]:
    """Runs the comparison ``args`` describes (the parsed flags of ``launch/compare_expert_plans.py``)."""
    import shlex

    import torch

    from snip_ds.experiments.plans import collect_phase_stats
    from snip_ds.experiments.results import write_json
    from snip_ds.experiments.runs import checkpoint_fld, prepare_run, run_cell, warm_up
    from snip_ds.experts.model import expert_layers
    from snip_ds.experts.points import routed_flops
    from snip_ds.swap import block_index

    t0 = time.perf_counter()
    out_dir, settings, model, train_ds, val_batches, layers = prepare_run(args)
    config = model.config
    data: Dict[str, Any] = dict(settings=dict(
        command="python launch/compare_expert_plans.py " + " ".join(shlex.quote(a) for a in args.argv),
        model=_shown(args.model_config), parameters=sum(p.numel() for p in model.parameters()),
        blocks=len({block_index(f) for f in layers}), experts=int(getattr(config, "num_local_experts", 0)),
        top_k=int(getattr(config, "num_experts_per_tok", 0)), block_size=args.block_size,
        batch_size=args.batch_size, lr=args.lr, lr_warmup_steps=args.lr_warmup_steps, lr_decay=args.lr_decay,
        warmup_steps=args.warmup_steps, steps=args.steps, seeds=args.seeds, rhos=args.rhos,
        **{"lambda": args.lambda_default}, eval_batches=args.eval_batches, stat_batches=args.stat_batches,
        dataset=args.dataset, fp4_recipe=args.quant.fp4_recipe,
        stochastic_rounding=args.quant.stochastic_rounding, threads=torch.get_num_threads()),
        records=[], plans={}, plan_comparison=[])
    json_path = out_dir / f"{PREFIX}.json"

    pair_flops: Dict[str, float] = {}  # per expert pair: 6·k·n, its FLOPs per routed token

    def sink(record: Dict[str, Any]) -> None:
        routed = record.pop("trained_routed_tokens", None)
        if routed is not None and pair_flops:
            plan = plan_by_label[record["label"]]
            record["fp4_share_trained"] = trained_share(plan.assignment, dense_flops, pair_flops, routed)
            record["trained_routed_tokens"] = routed
        data["records"].append(record)
        data["wall_seconds"] = time.perf_counter() - t0
        write_json(data, json_path)

    phase = "early"
    with tempfile.TemporaryDirectory(prefix="compare_expert_plans_") as tmp:
        ckpt = warm_up(model, train_ds, settings, args, Path(tmp))[phase]
        stats = collect_phase_stats(model, ckpt, train_ds, settings, args)
        groups = expert_groups(stats["layers"])
        pairs = [p for ps in groups.values() for p in ps]
        dense = sorted(n for n in stats["layers"] if n not in set(pairs))
        data["settings"].update(expert_pairs=len(pairs), expert_groups=len(groups), dense_layers=len(dense))
        data["idle_pairs"] = sorted(p for p in pairs if stats["layers"][p].get("no_tokens"))
        fqns = sorted(stats["layers"])
        flops = {f: float(stats["layers"][f]["flops"]) for f in fqns}
        dense_flops = {f: flops[f] for f in dense}
        pair_flops.update({n: routed_flops(info, 1.0) for n, info in expert_layers(model).items()})
        lam = args.lambda_default
        plans = [_plan_entry(m, m, None, Plan.uniform(fqns, m.split("_")[1], flops), stats, lam)
                 for m in ("uniform_fp8", "uniform_fp4")]
        for rho in args.rhos:
            arms = solve_arms(stats, rho, lam)
            if not is_shared(arms["shared"].assignment, groups):
                raise AssertionError("the shared arm's plan gives one group two precisions")
            for name in ARMS:
                plans.append(_plan_entry(name, f"{name} ρ={rho:g}", rho, arms[name], stats, lam))
            a, b = arms["per_expert"].assignment, arms["shared"].assignment
            pe, sh = plans[-2], plans[-1]
            data["plan_comparison"].append(dict(
                rho=rho, share=arms["share"], share_per_expert=arms["per_expert"].fp4_share,
                share_shared=arms["shared"].fp4_share,
                pairs_differ=len(differing_layers(a, b, pairs)), dense_differ=len(differing_layers(a, b, dense)),
                fp4_pairs_per_expert=sum(a[p] == "fp4" for p in pairs), fp4_pairs_shared=sum(b[p] == "fp4" for p in pairs),
                fp4_groups_per_expert={g: sum(a[p] == "fp4" for p in ps) for g, ps in groups.items()},
                fp4_groups_shared={g: sum(b[p] == "fp4" for p in ps) for g, ps in groups.items()},
                predicted_per_expert=dict(fld=pe["predicted_fld"], bwd=pe["predicted_bwd"],
                                          objective=pe["predicted_fld"] + lam * pe["predicted_bwd"]),
                predicted_shared=dict(fld=sh["predicted_fld"], bwd=sh["predicted_bwd"],
                                      objective=sh["predicted_fld"] + lam * sh["predicted_bwd"])))
            _log(args, f"rho {rho:g}: share {arms['share']:.4f}; {data['plan_comparison'][-1]['pairs_differ']} of "
                 f"{len(pairs)} pairs differ; predicted objective per-expert "
                 f"{data['plan_comparison'][-1]['predicted_per_expert']['objective']:.4g}, shared "
                 f"{data['plan_comparison'][-1]['predicted_shared']['objective']:.4g}")
        data["plans"][phase] = [dict(label=p["label"], rho=p["rho"], assignment=p["plan"].to_dict()["assignment"],
                                     fp4_share=p["plan"].fp4_share) for p in plans]
        data["stats_layers"] = {n: {k: rec[k] for k in ("flops", "fld", "bwd", "routed_tokens") if k in rec}
                                for n, rec in stats["layers"].items()}
        plan_by_label = {p["label"]: p["plan"] for p in plans}
        checkpoint_fld(model, ckpt, plans, val_batches, settings, args.quant)
        for seed in args.seeds:
            run_cell(model, ckpt, phase, args.warmup_steps, seed, plans, train_ds, val_batches, settings, args, sink)
    data["summary"] = summarize(data["records"], args.rhos)
    data["wall_seconds"] = time.perf_counter() - t0
    write_json(data, json_path)
    write_markdown(data, out_dir / f"{PREFIX}.md")
    return dict(records=len(data["records"]), wall_seconds=data["wall_seconds"], summary=data["summary"],
                output_dir=str(out_dir))


def rerender(output_dir: str, merge: Sequence[str] | None = None) -> Dict[str, Any]:
    """Rewrites the summary and markdown of finished (or stopped) comparisons; with ``merge``, joins the records
    of several result directories (e.g. extra seeds) into ``output_dir``.

    Raises:
        FileNotFoundError: a result file is missing.
        ValueError: the merged comparisons differ in anything but their seeds, or in their plans.
    """
    import json

    from snip_ds.experiments.results import write_json

    dirs = list(merge or [output_dir])
    datas = []
    for d in dirs:
        path = Path(d) / f"{PREFIX}.json"
        if not path.is_file():
            raise FileNotFoundError(f"no {PREFIX}.json in {d!r}")
        datas.append(json.loads(path.read_text(encoding="utf-8")))
    data = datas[0]
    ignore = ("command", "seeds", "threads")
    for other, d in zip(datas[1:], dirs[1:]):
        a = {k: v for k, v in data["settings"].items() if k not in ignore}
        b = {k: v for k, v in other["settings"].items() if k not in ignore}
        if a != b:
            diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            raise ValueError(f"{d!r} ran other settings ({', '.join(diff)})")
        if other["plans"] != data["plans"]:
            raise ValueError(f"{d!r} ran other plans")
        seen = {(r["seed"], r["label"]) for r in data["records"]}
        data["records"] += [r for r in other["records"] if (r["seed"], r["label"]) not in seen]
        data["wall_seconds"] = data.get("wall_seconds", 0) + other.get("wall_seconds", 0)
    seeds = sorted({r["seed"] for r in data["records"]})
    data["settings"]["seeds"] = seeds
    if merge:
        data["settings"]["command"] += "  # merged with: " + ", ".join(dirs[1:])
    data["summary"] = summarize(data["records"], data["settings"]["rhos"])
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(data, out / f"{PREFIX}.json")
    write_markdown(data, out / f"{PREFIX}.md")
    return dict(records=len(data["records"]), seeds=seeds, output_dir=str(out))
