"""The plan study: does SNIP's plan beat simpler plans, across model seeds? (``launch/plan_study.py``;
docs/experiments.md, "The plan study").

Design. Per **model seed** (model init and warm-up data order) the 8-block study model
(``benchmarks/configs/llama_8x96.json``: 56 planned linears of four shapes) warms up unquantized for
``--warmup_steps`` steps; SNIP's statistics are collected at that checkpoint and every arm's plan is solved from
them at the one FP4 share ``s`` that whole layers reach at or above ρ (:func:`solve_arms`). A *cell* is one model
seed × one **data seed**: every arm trains ``--steps`` steps from the model seed's checkpoint with the same
batches and rounding seeds (``run seed = 1000 · model_seed + data_seed``), the learning rate decaying linearly to
0, and is scored by validation loss with its own quantized forward. Arms: uniform FP8 and FP4, SNIP per layer
(``snip``) and per GEMM (``snip_gemm``) at the default λ, ``quant_err``, ``rel_quant_err``, ``first_last_fp8``
(where it reaches ``s``), ``last_k_fp8`` (a rule in whole blocks: where its share differs from ``s``, SNIP is
solved again at the share it reached, arm ``snip@<share>``, and the two are paired), and one ``random`` plan per
cell, drawn afresh from a seed derived from (model seed, data seed). Every plan is checked to sit at its
partner's share (:data:`~snip_ds.experiments.study_stats.SHARE_TOL`); a plan that does not is refused.

Resumable. ``cells.json`` (the settings and one row per cell and arm) is rewritten atomically after every
cell; a rerun into the same ``--output_dir`` skips every (model seed, data seed, arm, ρ, plan hash) it holds,
reuses the warm-up checkpoints and statistics under ``--checkpoint_dir`` and refuses other settings. Cells
run in ``--workers`` processes of one thread each.

Budget (2 cores, two workers; one-thread timings of 100 steps plus evaluation on the 4-block × 128 model:
uniform FP8 9.4 s, FP4 12.6 s, mixed plans 11.7 s, per-GEMM plans 13.7 s; the 8 × 96 model measured 1.2× (FP8)
to 1.4× (FP4) slower per step, so about 11.3, 17.6, 15.2 and 17.8 s, less ~1 s each for the BF16-forward
evaluation the study skips): a cell of the 9 main arms is 10.3 + 16.6 + 16.8 + 6 × 14.2 ≈ 129 s; 4 model seeds
× 12 data seeds = 48 cells ≈ 103 CPU-minutes ≈ 52 minutes on two workers; each model seed's warm-up (800 BF16
steps), statistics (64 batches) and solves take ≈ 1.5–2 minutes, ≈ 4 minutes for four seeds on two workers.
Whole main study ≈ 55 minutes (an estimate: no run of it yet). One cell at these settings, run alone on a
machine shared with other work (load ≈ 5 on 2 cores), used 168 s of CPU for the whole process (50 warm-up
steps, statistics, 9 runs): ≈ 140 s per cell, so the estimate may be 10 % low and the study take up to
≈ 60 minutes. ``--max_minutes`` stops it cleanly (finished cells kept; the same command resumes). The stress
regime (``--regime stress``: MXFP4, the same decaying schedule; 2 model seeds × 6 data seeds × 7 arms
≈ 12 × 105 s / 2 + 2 min ≈ 12 minutes) is a separate, smaller grid, run only if NVFP4's cost is too small to resolve the differences, and reported apart.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import sys
import time
import types
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from snip_ds.experiments.results import json_default, write_json
from snip_ds.experiments.study_stats import SHARE_TOL

ARMS = ("uniform_fp8", "uniform_fp4", "snip", "snip_gemm", "quant_err", "rel_quant_err", "last_k_fp8",
        "first_last_fp8", "random")
_METHOD = {"snip": "best", "snip_gemm": "best"}  # the planner's name of an arm (the others are their own)
REGIMES = {
    "main": dict(fp4_recipe="nvfp4", model_seeds="0,1,2,3", data_seeds=",".join(map(str, range(12))),
                 arms=",".join(ARMS), subdir=""),
    "stress": dict(fp4_recipe="mxfp4", model_seeds="0,1", data_seeds="0,1,2,3,4,5",
                   arms="uniform_fp8,uniform_fp4,snip,quant_err,rel_quant_err,last_k_fp8,random", subdir="stress"),
    # the main grid's design on a GPU, with a larger model (benchmarks/configs/llama_12x256.json), one model seed
    # per piece (gpu/run_device.sh's plan_study step): a piece's warm-up, statistics and cells run in one loan
    "gpu": dict(fp4_recipe="nvfp4", model_seeds="0,1,2,3", data_seeds=",".join(map(str, range(12))),
                arms=",".join(ARMS), subdir="gpu", device="cuda", model_config="benchmarks/configs/llama_12x256.json"),
}
# what a study recorded before it had the setting (its cells.json lacks the key)
LEGACY = {"device": "cpu"}
# settings every piece of one study must share (a resume into the same output folder is refused otherwise)
FIXED = ("regime", "model_config", "blocks", "dataset", "warmup_steps", "steps", "rho", "lam", "batch_size", "block_size",
         "eval_batches", "stat_batches", "lr", "lr_warmup_steps", "fp4_recipe", "stochastic_rounding", "device")
CELLS, PLANS = "cells.json", "plans.json"


def _log(args, msg: str) -> None:
    if not getattr(args, "silent", False):
        print(msg, file=sys.stderr, flush=True)


def run_seed(model_seed: int, data_seed: int) -> int:
    """The data-order and rounding seed of a cell (distinct for every cell of a study)."""
    return 1000 * model_seed + data_seed


def random_seed(model_seed: int, data_seed: int) -> int:
    """The seed of the random plan drawn for one cell: the same for the same cell, different across cells."""
    return int(hashlib.sha256(f"plan_study random {model_seed} {data_seed}".encode()).hexdigest()[:8], 16)


def row_key(row: Mapping[str, Any]) -> Tuple:
    """What identifies a finished run: (model seed, data seed, arm, ρ, plan hash)."""
    return (row["model_seed"], row["data_seed"], row["arm"], row["rho"], row["plan_hash"])


def study_settings(args) -> Dict[str, Any]:
    return {k: getattr(args, k, LEGACY.get(k)) for k in FIXED}


# --------------------------------------------------------------------------------------------------------
# Plans at one share
# --------------------------------------------------------------------------------------------------------
def _check_share(arm: str, plan, share: float) -> None:
    if abs(plan.fp4_share - share) > SHARE_TOL:
        raise ValueError(f"{arm}: solved at FP4 share {plan.fp4_share:.6f}, not {share:.6f}; refusing to pair it "
                         f"with SNIP at another share")


def _solve(method: str, stats, share: float, lam: float, per_gemm: bool = False, seed: int = 0):
    from snip_ds.runtime.omp import preserve_torch_threads
    from snip_ds.planner import CostSettings, SolverSettings, solve_baseline
    with preserve_torch_threads():
        return solve_baseline(method, stats, share, CostSettings(lam=lam, per_gemm=per_gemm),
                              SolverSettings(max_share=min(share + 1e-9, 1.0)), seed=seed)[0]


def solve_arms(stats: Mapping[str, Any], arms: Sequence[str], rho: float, lam: float) -> Dict[str, Any]:
    """Every arm's plan but ``random`` (drawn per cell, :func:`random_plan`) from one model seed's statistics.

    Returns ``share`` (the smallest FP4 share ≥ ρ whole layers reach: every solved arm lands on it),
    ``plans`` ``{arm: Plan}``, ``pair_with`` ``{arm: the SNIP arm it is compared with}`` and ``skipped``
    (``first_last_fp8`` where its pins make the share unreachable, with the reason).

    Raises:
        ValueError: A solved arm missed the share (:func:`_check_share`).
    """
    from snip_ds.experiments.plans import attainable_share
    flops = {f: float(v["flops"]) for f, v in stats["layers"].items()}
    share = attainable_share(flops, rho)
    plans, pair_with, skipped = {}, {}, []
    for arm in arms:
        if arm == "random":
            pair_with[arm] = "snip"
            continue
        method = _METHOD.get(arm, arm)
        try:
            plan = _solve(method, stats, share, lam, per_gemm=arm == "snip_gemm")
        except ValueError as err:
            if arm != "first_last_fp8":
                raise
            skipped.append(dict(arm=arm, reason=str(err)))
            continue
        if arm == "last_k_fp8" and abs(plan.fp4_share - share) > SHARE_TOL:
            ref = f"snip@{plan.fp4_share:.4f}"  # SNIP where the rule landed
            plans[ref] = _solve("best", stats, plan.fp4_share, lam)
            _check_share(ref, plans[ref], plan.fp4_share)
            pair_with[arm] = ref
        elif not arm.startswith("uniform_"):
            _check_share(arm, plan, share)
            if arm != "snip":
                pair_with[arm] = "snip"
        plans[arm] = plan
    return dict(share=share, plans=plans, pair_with=pair_with, skipped=skipped)


def random_plan(stats: Mapping[str, Any], share: float, model_seed: int, data_seed: int):
    """The cell's own random plan at ``share`` (seeded by :func:`random_seed`)."""
    plan = _solve("random", stats, share, 0.0, seed=random_seed(model_seed, data_seed))
    _check_share("random", plan, share)
    return plan


# --------------------------------------------------------------------------------------------------------
# A worker: one model, per model seed its checkpoint, statistics and plans; cells run on it
# --------------------------------------------------------------------------------------------------------
class Worker:
    """Trains the study's runs in one process (one torch thread)."""

    def __init__(self, args) -> None:
        import torch
        torch.set_num_threads(1)
        self.args = args
        self.ready: Dict[int, Dict[str, Any]] = {}
        self.built = None

    def _ns(self, seed: int):
        from snip_ds.quant_config import QuantConfig
        a = self.args
        config = getattr(a, "model_config_path", a.model_config)
        if a.blocks:  # the config's model at another depth
            config = dict(json.loads(Path(config).read_text(encoding="utf-8")), num_hidden_layers=a.blocks)
        return types.SimpleNamespace(
            quick=False, dataset=a.dataset, block_size=a.block_size, model="small", model_config=config,
            seed=seed, quant=QuantConfig(fp4_recipe=a.fp4_recipe, stochastic_rounding=a.stochastic_rounding),
            eval_batches=a.eval_batches, batch_size=a.batch_size, phases={"warm": a.warmup_steps},
            silent=a.silent, stat_batches=a.stat_batches, lambda_default=a.lam, dgrad_cost="split", bwd_key="bwd",
            bwd_rounding="recipe", forward_drift=False, device=getattr(a, "device", "cpu"))

    def settings(self):
        from snip_ds.experiments.training import TrainSettings
        return TrainSettings(lr=self.args.lr, batch_size=self.args.batch_size,
                             lr_warmup_steps=self.args.lr_warmup_steps)

    def prepare(self, model_seed: int) -> Dict[str, Any]:
        """The model seed's warm-up checkpoint, statistics and plans (from ``--checkpoint_dir`` when there);
        returns what ``plans.json`` records of them."""
        if model_seed in self.ready:
            return self.ready[model_seed]["record"]
        import torch
        from snip_ds.experiments.grid import build
        from snip_ds.experiments.plans import collect_phase_stats
        from snip_ds.experiments.runs import warm_up
        ns = self._ns(model_seed)
        torch.manual_seed(model_seed)
        self.built = build(ns)  # the model initialised from this seed (its warm-up starts here)
        model, train_ds, _ = self.built
        folder = Path(self.args.checkpoint_dir) / f"model_seed_{model_seed}"
        ckpt, stats_path = folder / f"warm_{self.args.warmup_steps}", folder / "stats.json"
        if not (ckpt / "meta.json").is_file():
            stats_path.unlink(missing_ok=True)
            warm_up(model, train_ds, self.settings(), ns, folder)
        if stats_path.is_file():
            stats = json.loads(stats_path.read_text(encoding="utf-8"))
        else:
            # solved from what the file holds, as a resumed or another worker's solve will be
            stats = json.loads(json.dumps(collect_phase_stats(model, ckpt, train_ds, self.settings(), ns),
                                          default=json_default))
            write_json(stats, stats_path)
        solved = solve_arms(stats, self.args.arms, self.args.rho, self.args.lam)
        digest = hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest()[:16]
        record = dict(share=solved["share"], skipped=solved["skipped"], pair_with=solved["pair_with"],
                      checkpoint=digest,
                      plans={arm: dict(plan_hash=p.digest()[:16], fp4_share=p.fp4_share,
                                       assignment=p.to_dict()["assignment"]) for arm, p in solved["plans"].items()})
        self.ready[model_seed] = dict(ckpt=ckpt, stats=stats, record=record, digest=digest, **solved)
        _log(self.args, f"[model seed {model_seed}] share {solved['share']:.4f}; arms "
                        f"{', '.join(solved['plans'])}" + "".join(f"; skipped {s['arm']}" for s in solved["skipped"]))
        return record

    def cell(self, model_seed: int, data_seed: int, done: Mapping[Tuple, Mapping[str, Any]]) -> List[Dict[str, Any]]:
        """Runs every arm of one cell that ``done`` (finished rows by :func:`row_key`) lacks; returns the rows.
        A row trained from another checkpoint (a warm-up redone, e.g. after the checkpoints were deleted, that did
        not come out bit for bit the same) counts as not done: a cell's runs must share their checkpoint."""
        from snip_ds.experiments.runs import run_plan, run_settings
        self.prepare(model_seed)
        ready, a = self.ready[model_seed], self.args
        done = {k: r for k, r in done.items() if r.get("checkpoint") == ready["digest"]}
        model, train_ds, val_batches = self.built
        plans = dict(ready["plans"])
        if "random" in a.arms:
            plans["random"] = random_plan(ready["stats"], ready["share"], model_seed, data_seed)
        order = sorted(plans, key=lambda arm: arm != "uniform_fp8")
        by_hash = {r["plan_hash"]: r for r in done.values()
                   if r["model_seed"] == model_seed and r["data_seed"] == data_seed}
        rows, seed = [], run_seed(model_seed, data_seed)
        settings = run_settings(self.settings(), a.warmup_steps, a.steps, "linear")
        for arm in order:
            plan = plans[arm]
            row = dict(model_seed=model_seed, data_seed=data_seed, arm=arm, rho=a.rho, fp4_share=plan.fp4_share,
                       plan_hash=plan.digest()[:16], method=plan.method, run_seed=seed, checkpoint=ready["digest"])
            if arm in ready["pair_with"]:
                row["pair_with"] = ready["pair_with"][arm]
            if arm == "random":
                row["random_seed"] = random_seed(model_seed, data_seed)
            if row_key(row) in done:
                continue
            same = by_hash.get(row["plan_hash"])
            if same is not None:  # the same plan already ran in this cell: one run, two rows
                row.update(val_loss=same["val_loss"], seconds=0.0, shared_with=same["arm"])
            else:
                out = run_plan(model, ready["ckpt"], plan, train_ds, val_batches, settings, seed, a.warmup_steps,
                               a.steps, self._ns(model_seed).quant, bf16_eval=False)
                row.update(val_loss=out["val_loss"], seconds=out["seconds"], final_train_loss=out["train_losses"][-1])
            by_hash.setdefault(row["plan_hash"], row)
            rows.append(row)
        return rows


_WORKER: Optional[Worker] = None


def _init(factory, args) -> None:
    global _WORKER
    _WORKER = factory(args)


def _prepare(model_seed: int):
    return model_seed, _WORKER.prepare(model_seed)


def _cell(task):
    model_seed, data_seed, done = task
    return model_seed, data_seed, _WORKER.cell(model_seed, data_seed, done)


# --------------------------------------------------------------------------------------------------------
# The study
# --------------------------------------------------------------------------------------------------------
def load_cells(out_dir: Path, settings: Mapping[str, Any]) -> Tuple[List[Dict[str, Any]], float]:
    """The finished rows of ``out_dir/cells.json`` and the minutes spent on them, in seconds (none, 0 without
    the file).

    Raises:
        ValueError: The file was written by a study with other settings (named, with the flag to change).
    """
    path = out_dir / CELLS
    if not path.is_file():
        return [], 0.0
    data = json.loads(path.read_text(encoding="utf-8"))
    old = data.get("settings", {})
    diff = [k for k in FIXED if old.get(k, LEGACY.get(k)) != settings.get(k)]
    if diff:
        raise ValueError(f"{path} holds a study with other settings ({', '.join(f'--{k} {old.get(k)!r}' for k in diff)}"
                         f"); resume it with those flags or pick another --output_dir")
    return list(data["rows"]), float(data.get("wall_seconds", 0.0))


def merge_rows(rows: List[Dict[str, Any]], new: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """``rows`` with ``new`` added; a new row replaces an older one of the same cell, arm and ρ (its plan
    changed, e.g. other statistics), so every (cell, arm, ρ) has one row."""
    fresh = {row_key(r)[:4] for r in new}
    return [r for r in rows if row_key(r)[:4] not in fresh] + [dict(r) for r in new]


def run_study(args, factory=Worker) -> Dict[str, Any]:
    """Runs (or resumes) the study ``args`` describe into ``args.output_dir``; returns the JSON line's content.

    ``factory(args)`` makes the object whose ``prepare(model_seed)`` and ``cell(model_seed, data_seed, done)``
    do the work (:class:`Worker`; tests pass a fake). With ``args.workers > 1`` each of that many processes
    makes its own. With ``args.max_minutes`` (0: no limit) it stops starting cells once that much time has
    passed, and summarises what is done; ``cells_left`` in the result counts the cells a rerun will run.
    """
    t0 = time.perf_counter()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = study_settings(args)
    rows, before = load_cells(out, settings)
    done = {row_key(r): r for r in rows}
    plans_path = out / PLANS
    plans = json.loads(plans_path.read_text(encoding="utf-8")) if plans_path.is_file() else {}
    data = dict(settings=settings, rows=rows, wall_seconds=0.0)
    pool = None
    if args.workers > 1:
        pool = multiprocessing.get_context("spawn").Pool(args.workers, initializer=_init, initargs=(factory, args))
        mapper = pool.imap_unordered
    else:
        _init(factory, args)
        mapper = map
    try:
        for ms, record in mapper(_prepare, args.model_seeds):
            plans[str(ms)] = record
            write_json(plans, plans_path)
        tasks = [(ms, ds, {k: r for k, r in done.items() if k[:2] == (ms, ds)})
                 for ms in args.model_seeds for ds in args.data_seeds]
        ran = worked = stopped = 0
        for ms, ds, new in mapper(_cell, tasks):
            ran, worked = ran + 1, worked + bool(new)  # a finished cell comes back at once, without runs
            data["rows"] = rows = merge_rows(rows, new)
            data["wall_seconds"] = before + time.perf_counter() - t0  # every piece of the study
            write_json(data, out / CELLS)
            spent = time.perf_counter() - t0
            _log(args, f"[model seed {ms}, data seed {ds}] {len(new)} run(s); {ran}/{len(tasks)} cells, "
                       f"{spent / 60:.1f} min, at most about {spent / max(worked, 1) * (len(tasks) - ran) / 60:.1f} "
                       f"min to go")
            if args.max_minutes and spent > 60 * args.max_minutes and ran < len(tasks):
                stopped = len(tasks) - ran
                _log(args, f"stopped after {spent / 60:.1f} min (--max_minutes {args.max_minutes:g}) with {stopped} "
                           f"cell(s) left: the same command resumes")
                break
    except BaseException:
        if pool is not None:
            pool.terminate()  # do not wait for the other worker's queued cells
        raise
    if pool is not None:
        if stopped:
            pool.terminate()  # the cells under way are lost; a rerun runs them
        else:
            pool.close()
        pool.join()
    from snip_ds.experiments.study_report import write_summary
    summary = write_summary(out)
    return dict(rows=len(rows), wall_seconds=time.perf_counter() - t0, output_dir=str(out),
                cells_left=stopped, targets=summary["targets"])
