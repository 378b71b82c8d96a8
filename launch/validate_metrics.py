"""Validate SNIP's statistics against measured truths on fixed batches (SNIP.md section 7, metric validity).

Warms a model up (plain torch AdamW, unquantized, FP32), then for every decoder linear measures

* (a) the symmetrised FLD truth ``[ℒ(Y+E) + ℒ(Y-E) - 2ℒ(Y)]/2`` with only that layer's output perturbed by
  its FP4 (RNE) fprop error E (in FP64), its Gauss-Newton part ``(1/2N)Σ_t (JE)_tᵀ(diag p - ppᵀ)(JE)_t`` from
  the same two passes, and the one-shot ``ℒ(layer at fp4) - ℒ(bf16)`` for information;
* (b) the true one-step parameter drift ``Σ‖θ' - θ'_ref‖²`` after one AdamW step from the warmed-up state
  with only that layer's backward (dgrad + wgrad) at FP4 (RNE), against the unquantized step;
* (with ``--fwd_truth``) what only that layer's FP4 fprop does to the *update*: the drift of the decoder
  linears' weights after one AdamW step, against the unquantized step, priced in loss units with an explicit
  Fisher quadratic form from ``--fwd_probes`` sampled-label probes, ``(1/2N)·mean_r ⟨G^probe_r, Δθ⟩²``
  (what the collector's ``fwd`` estimates from a linearisation, with one probe);
* (c) each truth's split-half reproducibility (Spearman between the means over two disjoint halves of the
  batches),

and rank-correlates the predictions of :func:`snip_ds.stats.collect_statistics` (every estimator variant
and the quantization-error baselines) with them. Prints a per-layer table, then one JSON line (last).

Examples::

    python launch/validate_metrics.py                       # embedded default model and stdlib corpus
    python launch/validate_metrics.py --seed 1 --checkpoint /tmp/warm   # reuse a warm-up
    python launch/validate_metrics.py --quick               # tiny model, seconds (used by the tests)
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snip_ds.quant_config import BWD_ROUNDINGS  # noqa: E402
from snip_ds.backend import get_backend  # noqa: E402
from snip_ds.stats import CollectSettings, adam_precond, collect_statistics  # noqa: E402
from snip_ds.compare import spearman as rank_correlation  # noqa: E402
from snip_ds.swap import snip_layers, swap_linears  # noqa: E402

QUICK = dict(warmup_steps=40, batches=4, batch_size=2, block_size=64, lr=3e-3)
DEFAULTS = dict(warmup_steps=200, batches=16, batch_size=2, block_size=256, lr=2e-3)  # 16: see docs/experiments.md
CKPT_MODEL, CKPT_OPT, CKPT_META = "model.safetensors", "optimizer.pt", "validate_meta.json"


# --------------------------------------------------------------------------------------------------------
# Model, data, warm-up
# --------------------------------------------------------------------------------------------------------
def _tiny_config():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, use_cache=False,
                       tie_word_embeddings=False)


def build(args) -> tuple:
    from snip_ds.data import load_dataset_blocks
    from snip_ds.model import build_model
    caps = dict(max_bytes=2 ** 18, max_validation_bytes=2 ** 16) if args.quick and args.dataset is None else {}
    train_ds, val_ds, vocab, _ = load_dataset_blocks(args.dataset, args.block_size, **caps)
    config = args.model_config if args.model_config else (_tiny_config() if args.quick else None)
    model = build_model(model_config=config, vocab_size=vocab, seed=args.seed, block_size=args.block_size)
    swap_linears(model, "bf16", seed=args.seed)
    return model, train_ds, val_ds


def lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def warm_up(model, opt, train_ds, args) -> float:
    g = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    for step in range(args.warmup_steps):
        idx = torch.randint(0, len(train_ds), (args.batch_size,), generator=g).tolist()
        loss = lm_loss(model, train_ds.get_batch(idx)["input_ids"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if args.verbose and (step % 50 == 0 or step == args.warmup_steps - 1):
            print(f"warm-up step {step}: loss {loss.item():.4f}", file=sys.stderr)
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def load_or_warm(model, opt, train_ds, args) -> Dict[str, Any]:
    from safetensors.torch import load_file, save_file
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    if ckpt is not None and (ckpt / CKPT_MODEL).is_file():
        model.load_state_dict(load_file(str(ckpt / CKPT_MODEL)))
        opt.load_state_dict(torch.load(ckpt / CKPT_OPT, weights_only=True))
        return {"warmup_s": 0.0, "checkpoint": "loaded"}
    seconds = warm_up(model, opt, train_ds, args)
    if ckpt is not None:
        ckpt.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt / CKPT_MODEL))
        torch.save(opt.state_dict(), ckpt / CKPT_OPT)
        (ckpt / CKPT_META).write_text(json.dumps({"warmup_steps": args.warmup_steps, "seed": args.seed}))
    return {"warmup_s": seconds, "checkpoint": "saved" if ckpt is not None else "none"}


# --------------------------------------------------------------------------------------------------------
# Truths
# --------------------------------------------------------------------------------------------------------
def _rne(cfg):
    return replace(cfg, stochastic_rounding=False)


@torch.no_grad()
def _loss_and_logits(model, ids: torch.Tensor) -> tuple:
    """Mean next-token CE and the shifted logits ``[N, V]`` it is computed from."""
    logits = model(input_ids=ids).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))[:, :-1].reshape(-1, logits.shape[-1])
    return F.cross_entropy(logits, ids[:, 1:].reshape(-1)), logits


def fld_truth(model, batches: Sequence[torch.Tensor]) -> tuple:
    """Per layer, per batch: symmetrised FLD, its Gauss-Newton part, and the one-shot loss change (fp4 fprop).

    * symmetrised: ``[ℒ(Y+E) + ℒ(Y-E) - 2ℒ(Y)]/2`` (SNIP.md section 3): ``½ Eᵀ H E`` with the full, indefinite
      Hessian (plus 4th-order terms).
    * Gauss-Newton part, from the same two passes: ``d = [z(Y+E) - z(Y-E)]/2 = J E + O(E³)`` (z: logits) and
      ``(1/2N) Σ_t d_tᵀ (diag p_t - p_t p_tᵀ) d_t``: the PSD part that a Fisher estimator can see.

    Runs on an FP64 copy of the model: the symmetrised difference of three losses is often below FP32's
    resolution of a loss near 2-3 nats (2.4e-7). E = Q(X)Q(W)ᵀ - XWᵀ uses the quantized operands exactly.
    """
    model = copy.deepcopy(model).double()
    layers, be = snip_layers(model), get_backend()
    sym = {f: [] for f in layers}
    one = {f: [] for f in layers}
    gn = {f: [] for f in layers}
    for ids in batches:
        base, z0 = _loss_and_logits(model, ids)
        p0 = torch.softmax(z0, -1)
        for fqn, mod in layers.items():
            out, z = {}, {}
            for sign in (1.0, -1.0):
                def hook(m, inp, y, sign=sign):
                    x2 = inp[0].reshape(-1, inp[0].shape[-1])
                    w, cfg = m.weight, _rne(m.quant_config)
                    x_lp = be.quantize(x2, "fp4", "x", -1, cfg).to(x2.dtype)
                    w_lp = be.quantize(w, "fp4", "w", -1, cfg).to(w.dtype)
                    e = x_lp @ w_lp.t() - x2 @ w.t()
                    return y + sign * e.reshape(y.shape).to(y.dtype)
                h = mod.register_forward_hook(hook)
                try:
                    loss, z[sign] = _loss_and_logits(model, ids)
                    out[sign] = loss.item()
                finally:
                    h.remove()
            d = (z[1.0] - z[-1.0]) / 2  # [N, V]
            quad = (p0 * d * d).sum(-1) - (p0 * d).sum(-1) ** 2  # dᵀ(diag p - p pᵀ)d per token
            gn[fqn].append(quad.mean().item() / 2)
            sym[fqn].append((out[1.0] + out[-1.0] - 2 * base.item()) / 2)
            one[fqn].append(out[1.0] - base.item())
    return sym, one, gn


def _adamw_step(params: List[torch.Tensor], opt_state: Dict, hyper: Dict, grads: List[torch.Tensor]):
    """One torch AdamW step on copies of the parameters from a copy of the optimizer state."""
    ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = torch.optim.AdamW(ps, **hyper)
    opt.load_state_dict(copy.deepcopy(opt_state))  # load_state_dict keeps same-device tensors: copy first
    for p, g in zip(ps, grads):
        p.grad = g
    opt.step()
    return [p.detach() for p in ps]


BWD_TRUTHS = {"both": {"fprop": "bf16", "dgrad": "fp4", "wgrad": "fp4"},
              "wgrad": {"fprop": "bf16", "dgrad": "bf16", "wgrad": "fp4"},
              "dgrad": {"fprop": "bf16", "dgrad": "fp4", "wgrad": "bf16"}}


def bwd_truth(model, opt, batches: Sequence[torch.Tensor], gemms: Sequence[str] = ("both",),
              rounding: str = "recipe", draws: int = 1) -> Dict[str, Dict]:
    """Per GEMM set, layer and batch: Σ‖θ' - θ'_ref‖² after one AdamW step with only that layer's backward
    GEMM(s) at fp4 (:data:`BWD_TRUTHS`: ``both``, ``wgrad`` only, ``dgrad`` only), against the unquantized step.

    ``rounding="recipe"`` quantizes as training does (FP4 gradients stochastically rounded, by default) and
    averages the drift over ``draws`` rounding draws per batch (the layer's generator is restored after);
    ``"nearest"`` rounds every operand to nearest (one deterministic draw).

    Returns ``{gemms: {fqn: [drift per batch]}}``; for ``dgrad`` also ``dgrad_linears``, the drift of the
    decoder linears' weights alone (what the propagated estimate models: it leaves out the embedding).
    """
    layers = snip_layers(model)
    params = [p for p in model.parameters()]
    linear_ids = {id(m.weight) for m in layers.values()}
    is_linear = [id(p) in linear_ids for p in params]
    state = opt.state_dict()
    group = opt.param_groups[0]
    hyper = dict(lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"])

    def grads() -> List[torch.Tensor]:
        out = torch.autograd.grad(lm_loss(model, ids), params, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(params, out)]

    keys = list(gemms) + (["dgrad_linears"] if "dgrad" in gemms else [])
    drift = {k: {f: [] for f in layers} for k in keys}
    for ids in batches:
        ref = _adamw_step(params, state, hyper, grads())
        for fqn, mod in layers.items():
            for which in gemms:
                saved_prec, saved_cfg = mod.precision, mod.quant_config
                saved_gen = mod.generator.get_state() if mod.generator is not None else None
                mod.precision = dict(BWD_TRUTHS[which])
                n = draws if rounding == "recipe" else 1
                if rounding == "nearest":
                    mod.quant_config = _rne(saved_cfg)
                sq = [0.0] * len(params)
                try:
                    for _ in range(n):
                        new = _adamw_step(params, state, hyper, grads())
                        sq = [s + float(((a - b) ** 2).sum()) / n for s, a, b in zip(sq, new, ref)]
                finally:
                    mod.precision, mod.quant_config = saved_prec, saved_cfg
                    if saved_gen is not None:
                        mod.generator.set_state(saved_gen)
                drift[which][fqn].append(sum(sq))
                if which == "dgrad":
                    drift["dgrad_linears"][fqn].append(sum(v for v, lin in zip(sq, is_linear) if lin))
    return drift


def fwd_truth(model, opt, batches: Sequence[torch.Tensor], probes: int = 8, seed: int = 0) -> Dict[str, List[float]]:
    """Per layer and batch: the loss-unit price of the one-step drift that only that layer's fprop at FP4 (RNE)
    causes, ``(1/2N)·mean_r ⟨G^probe_r, θ' - θ'_ref⟩²`` over the decoder linears' weights, where ``θ'`` is one
    AdamW step from the warmed-up state with that layer's forward at FP4, ``θ'_ref`` the unquantized step, and
    ``G^probe_r`` the weight gradients of ``Σ_t CE(logits_t, ŷ_t)`` with ``ŷ`` drawn from the model's softmax
    (``probes`` draws per batch, seeded by ``seed``). Returns ``{fqn: [price per batch]}``."""
    layers = snip_layers(model)
    params = [p for p in model.parameters()]
    linear_ids = {id(m.weight) for m in layers.values()}
    idx = [i for i, p in enumerate(params) if id(p) in linear_ids]
    weights = [params[i] for i in idx]
    state = opt.state_dict()
    group = opt.param_groups[0]
    hyper = dict(lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"])
    gen = torch.Generator().manual_seed(seed + 4242)
    out: Dict[str, List[float]] = {f: [] for f in layers}
    for ids in batches:
        flat = model(input_ids=ids).logits[:, :-1].float()
        flat = flat.reshape(-1, flat.shape[-1])
        probs = torch.softmax(flat.detach(), dim=-1)
        probe = []
        for r in range(probes):
            y_hat = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            probe.append(torch.autograd.grad(F.cross_entropy(flat, y_hat, reduction="sum"), weights,
                                             retain_graph=r < probes - 1))
        n = flat.shape[0]

        def grads() -> List[torch.Tensor]:
            g = torch.autograd.grad(lm_loss(model, ids), params, allow_unused=True)
            return [torch.zeros_like(p) if x is None else x for p, x in zip(params, g)]
        ref = _adamw_step(params, state, hyper, grads())
        for fqn, mod in layers.items():
            saved_prec, saved_cfg = mod.precision, mod.quant_config
            mod.precision, mod.quant_config = {"fprop": "fp4", "dgrad": "bf16", "wgrad": "bf16"}, _rne(saved_cfg)
            try:
                new = _adamw_step(params, state, hyper, grads())
            finally:
                mod.precision, mod.quant_config = saved_prec, saved_cfg
            drift = [new[i] - ref[i] for i in idx]
            dots = [float(sum((g.double() * d.double()).sum() for g, d in zip(pg, drift))) for pg in probe]
            out[fqn].append(sum(x * x for x in dots) / len(dots) / (2.0 * n))
    return out


# --------------------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------------------
TABLE_COLUMNS = {"FLD truth": "sym", "GN part": "gn", "one-shot": "one", "BWD truth": "drift"}


def read_truth_table(path: str, fqns: Sequence[str]) -> tuple:
    """The per-layer truths of an earlier run's printed table, as one-"batch" lists ``(sym, one, gn, drift)``.

    The table holds means only, so split-half figures are not available from it (they come out null).

    Raises:
        ValueError: the file is not such a table, or its layers are not this model's.
    """
    text = Path(path).read_text(encoding="utf-8").splitlines()
    header = next((i for i, line in enumerate(text) if line.startswith("layer ")), None)
    if header is None:
        raise ValueError(f"--truth_table {path}: no table header (a line starting with 'layer') found")
    names = [c.strip() for c in text[header][len("layer"):].strip().split("  ") if c.strip()]
    missing = [c for c in TABLE_COLUMNS if c not in names]
    if missing:
        raise ValueError(f"--truth_table {path}: the table lacks column(s) {missing}")
    out = {key: {} for key in TABLE_COLUMNS.values()}
    for line in text[header + 1:]:
        cells = line.split()
        if len(cells) != len(names) + 1 or not cells[0].startswith("model."):
            continue
        try:
            for col, key in TABLE_COLUMNS.items():
                out[key][cells[0]] = [float(cells[1 + names.index(col)])]
        except ValueError:
            raise ValueError(f"--truth_table {path}: unreadable row {line!r}")
    if set(out["sym"]) != set(fqns):
        raise ValueError(f"--truth_table {path}: its {len(out['sym'])} layers are not this model's {len(fqns)} "
                         f"(e.g. {sorted(set(fqns) ^ set(out['sym']))[:2]})")
    return out["sym"], out["one"], out["gn"], out["drift"]


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    rho = rank_correlation(a, b)
    return rho if rho == rho else 0.0  # constant input -> NaN -> 0


def split_half(per_batch: Dict[str, List[float]]) -> Optional[float]:
    fqns = list(per_batch)
    half = len(next(iter(per_batch.values()))) // 2
    if half == 0:
        return None
    a = [_mean(per_batch[f][:half]) for f in fqns]
    b = [_mean(per_batch[f][half:2 * half]) for f in fqns]
    return spearman(a, b)


def _median(xs: List[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def run(args) -> Dict[str, Any]:
    torch.manual_seed(args.seed)
    model, train_ds, val_ds = build(args)
    need = args.batches * args.batch_size
    if len(val_ds) < need:
        raise ValueError(f"validation split has {len(val_ds)} blocks; --batches x --batch_size needs {need}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    info = load_or_warm(model, opt, train_ds, args)
    g = torch.Generator().manual_seed(args.seed + 12345)
    order = torch.randperm(len(val_ds), generator=g).tolist()[:need]
    batches = [val_ds.get_batch(order[i * args.batch_size:(i + 1) * args.batch_size])["input_ids"]
               for i in range(args.batches)]
    fqns = list(snip_layers(model))
    table = read_truth_table(args.truth_table, fqns) if args.truth_table else None  # fail before the work

    t0 = time.perf_counter()
    for _ in range(2):  # one training-step equivalent (fwd + bwd), warm then timed, for the cost figure
        t_step = time.perf_counter()
        loss = lm_loss(model, batches[0])
        torch.autograd.grad(loss, [p for p in model.parameters()])
        t_step = time.perf_counter() - t_step
    pc = adam_precond(model, opt)
    preds, timing = {}, {}
    for est in ("mc_fisher", "empirical", "isotropic"):
        t = time.perf_counter()
        how = CollectSettings(estimator=est, bwd_propagated=(est == "mc_fisher"), seed=args.seed,
                              bwd_rounding=args.bwd_rounding)
        preds[est] = collect_statistics(model, batches, how, lr=pc.lr, precond=pc.precond,
                                        step_scale=pc.step_scale, step=pc.step)
        timing[est] = time.perf_counter() - t
    t = time.perf_counter()
    if args.truth_table:  # re-score against the truths an earlier run printed (their means only)
        sym, one, gn, drift = table
    else:
        sym, one, gn = fld_truth(model, batches)
    t_fld = time.perf_counter() - t
    t = time.perf_counter()
    if not args.truth_table:
        drift = (bwd_truth(model, opt, batches, rounding=args.bwd_rounding, draws=args.sr_draws)["both"]
                 if args.bwd_truth else None)
    t_bwd = time.perf_counter() - t
    t = time.perf_counter()
    split = (bwd_truth(model, opt, batches, ("wgrad", "dgrad"), rounding=args.bwd_rounding, draws=args.sr_draws)
             if args.bwd_truth_per_gemm else None)
    t_split = time.perf_counter() - t
    fwd, fwd_pred, t_fwd = None, None, 0.0
    if args.fwd_truth:
        t = time.perf_counter()
        how = CollectSettings(seed=args.seed, bwd_rounding=args.bwd_rounding, forward_drift=True)
        fwd_stats = collect_statistics(model, batches, how, lr=pc.lr, precond=pc.precond,
                                       step_scale=pc.step_scale, step=pc.step)
        timing["forward_drift"] = time.perf_counter() - t
        fwd_pred = [fwd_stats["layers"][f]["fwd"]["fp4"] for f in fqns]
        t = time.perf_counter()
        fwd = fwd_truth(model, opt, batches, probes=args.fwd_probes, seed=args.seed)
        t_fwd = time.perf_counter() - t

    truth_fld = [_mean(sym[f]) for f in fqns]
    truth_one = [_mean(one[f]) for f in fqns]
    truth_gn = [_mean(gn[f]) for f in fqns]
    truth_bwd = [_mean(drift[f]) for f in fqns] if drift is not None else [float("nan")] * len(fqns)

    def pred(est: str, key: str) -> List[float]:
        return [preds[est]["layers"][f][key]["fp4"] for f in fqns]

    main = preds["mc_fisher"]
    prop_total = [a + b for a, b in zip(pred("mc_fisher", "bwd_drift"), pred("mc_fisher", "bwd_drift_propagated"))]
    fld_variants = {
        "mc_fisher": pred("mc_fisher", "fld"), "empirical": pred("empirical", "fld"),
        "isotropic": pred("isotropic", "fld"), "mc_fisher_channel": pred("mc_fisher", "fld_channel"),
        "empirical_channel": pred("empirical", "fld_channel"), "isotropic_channel": pred("isotropic", "fld_channel"),
        "quant_err": pred("mc_fisher", "quant_err"),
        "rel_quant_err": pred("mc_fisher", "rel_quant_err"), "first_order": pred("mc_fisher", "first_order"),
        "one_shot_truth": truth_one}
    bwd_variants = {
        "direct": pred("mc_fisher", "bwd_drift"), "loss_units_mc_fisher": pred("mc_fisher", "bwd"),
        "direct_systematic": pred("mc_fisher", "bwd_drift_bias"),
        "loss_units_empirical": pred("empirical", "bwd"), "direct_plus_propagated": prop_total,
        "propagated_only": pred("mc_fisher", "bwd_drift_propagated"),
        "quant_err": pred("mc_fisher", "quant_err"), "rel_quant_err": pred("mc_fisher", "rel_quant_err")}

    per_gemm = per_gemm_figures(split, fqns, preds["mc_fisher"]) if split is not None else None

    # table
    extra = f" {'wgrad only':>10} {'dgrad only':>10} {'dgrad lin':>10} {'prop pred':>10}" if split else ""
    extra += f" {'FWD truth':>10} {'FWD pred':>10}" if fwd is not None else ""
    print(f"{'layer':<34} {'FLD truth':>10} {'GN part':>10} {'FLD mcF':>10} {'mcF chan':>10} {'one-shot':>10} "
          f"{'BWD truth':>10} {'BWD pred':>10}" + extra)
    for i, f in enumerate(fqns):
        row = "".join(f" {_mean(split[k][f]):10.3e}" for k in ("wgrad", "dgrad", "dgrad_linears")) if split else ""
        row += f" {bwd_variants['propagated_only'][i]:10.3e}" if split else ""
        row += f" {_mean(fwd[f]):10.3e} {fwd_pred[i]:10.3e}" if fwd is not None else ""
        print(f"{f:<34} {truth_fld[i]:10.3e} {truth_gn[i]:10.3e} {fld_variants['mc_fisher'][i]:10.3e} "
              f"{fld_variants['mc_fisher_channel'][i]:10.3e} {truth_one[i]:10.3e} {truth_bwd[i]:10.3e} "
              f"{bwd_variants['direct'][i]:10.3e}" + row)

    result = {
        "spearman_fld": spearman(fld_variants["mc_fisher"], truth_fld),
        "spearman_bwd": spearman(bwd_variants["direct"], truth_bwd),
        "repro_fld": split_half(sym), "repro_bwd": split_half(drift) if drift is not None else None, "repro_one_shot": split_half(one),
        "spearman_fld_gn": spearman(fld_variants["mc_fisher"], truth_gn), "repro_fld_gn": split_half(gn),
        "fld_variants_vs_gn": {k: spearman(v, truth_gn) for k, v in fld_variants.items() if k != "one_shot_truth"},
        "gn_share_of_fld_truth": _median([a / b for a, b in zip(truth_gn, truth_fld) if b > 0]),
        "calibration_fld_gn": _median([p / t for p, t in zip(fld_variants["mc_fisher"], truth_gn) if t > 0]),
        "calibration_fld_gn_channel": _median([p / t for p, t in zip(fld_variants["mc_fisher_channel"], truth_gn)
                                               if t > 0]),
        "spearman_gn_truth_vs_fld_truth": spearman(truth_gn, truth_fld),
        "fld_variants": {k: spearman(v, truth_fld) for k, v in fld_variants.items()},
        "bwd_variants": {k: spearman(v, truth_bwd) for k, v in bwd_variants.items()},
        "calibration_fld": _median([p / t for p, t in zip(fld_variants["mc_fisher"], truth_fld) if t > 0]),
        "calibration_bwd": _median([p / t for p, t in zip(bwd_variants["direct"], truth_bwd) if t > 0]),
        "bwd_rounding": args.bwd_rounding, "sr_draws": args.sr_draws if args.bwd_rounding == "recipe" else 1,
        "calibration_fld_isotropic": _median([p / t for p, t in zip(fld_variants["isotropic"], truth_fld) if t > 0]),
        "bwd_over_fld": _median([b / f for b, f in zip(pred("mc_fisher", "bwd"), fld_variants["mc_fisher"])
                                 if f > 0]),
        "layers": len(fqns), "batches": args.batches, "tokens": main["tokens"], "loss": main["loss"],
        "optimizer_step": pc.step, "step_scale": pc.step_scale, "precond": main["precond"],
        "alpha": preds["isotropic"].get("alpha"), "quadratic_ratio": preds["isotropic"].get("quadratic_ratio"),
        "bwd_per_gemm": per_gemm,
        "fwd": None if fwd is None else {
            "spearman": spearman(fwd_pred, [_mean(fwd[f]) for f in fqns]), "repro": split_half(fwd),
            "calibration": _median([p / _mean(fwd[f]) for p, f in zip(fwd_pred, fqns) if _mean(fwd[f]) > 0]),
            "truth_vs_fld_truth": spearman([_mean(fwd[f]) for f in fqns], truth_fld),
            "estimate_vs_fld": spearman(fwd_pred, fld_variants["mc_fisher"]),
            "truth_over_fld_truth": sum(_mean(fwd[f]) for f in fqns) / sum(truth_fld),
            "probes": args.fwd_probes},
        "seconds": {"warmup": info["warmup_s"], "collect": timing, "fld_truth": t_fld, "bwd_truth": t_bwd,
                    "bwd_truth_per_gemm": t_split, "fwd_truth": t_fwd,
                    "total": time.perf_counter() - t0 + info["warmup_s"]},
        "collect_step_equivalents": timing["mc_fisher"] / (args.batches * t_step),
        "checkpoint": info["checkpoint"], "quick": bool(args.quick), "seed": args.seed,
    }
    if drift is None:  # --no_bwd_truth: no BWD figure at all rather than ones computed against NaN
        for key in ("spearman_bwd", "repro_bwd", "bwd_variants", "calibration_bwd"):
            result[key] = None
    return result


def per_gemm_figures(split: Dict[str, Dict], fqns: Sequence[str], stats: Dict[str, Any]) -> Dict[str, Any]:
    """How well each per-GEMM cost ranks and scales against the wgrad-only and dgrad-only drift truths.

    ``calibration_*`` is the median over layers of prediction / truth (as elsewhere in this script). The
    per-GEMM baselines price a GEMM by half its two operands' quantization errors (dgrad: G_Y and W; wgrad:
    G_Y and X), as :func:`snip_ds.planner.quant_err_costs` does; SNIP's default split gives dgrad and wgrad
    half of the direct BWD each, so its dgrad ranking is the direct estimate's.
    """
    def field(key: str) -> List[float]:
        return [float(stats["layers"][f][key]["fp4"]) for f in fqns]

    def half(field_name: str, a: str, b: str) -> List[float]:
        return [0.5 * (x + y) for x, y in zip(field(f"{field_name}_{a}"), field(f"{field_name}_{b}"))]

    truth = {k: [_mean(split[k][f]) for f in fqns] for k in split}
    direct, prop = field("bwd_drift"), field("bwd_drift_propagated")
    dgrad_preds = {"direct": direct, "propagated": prop,
                   "quant_err": half("quant_err", "g", "w"), "rel_quant_err": half("rel_quant_err", "g", "w")}
    wgrad_preds = {"direct": direct,
                   "quant_err": half("quant_err", "g", "x"), "rel_quant_err": half("rel_quant_err", "g", "x")}
    ratios = [d / w for d, w in zip(truth["dgrad"], truth["wgrad"]) if w > 0]
    return {
        "wgrad_vs": {k: spearman(v, truth["wgrad"]) for k, v in wgrad_preds.items()},
        "dgrad_vs": {k: spearman(v, truth["dgrad"]) for k, v in dgrad_preds.items()},
        "dgrad_linears_vs": {k: spearman(v, truth["dgrad_linears"]) for k, v in dgrad_preds.items()},
        "calibration_direct_wgrad": _median([p / t for p, t in zip(direct, truth["wgrad"]) if t > 0]),
        "calibration_propagated_dgrad": _median([p / t for p, t in zip(prop, truth["dgrad"]) if t > 0]),
        "calibration_propagated_dgrad_linears": _median([p / t for p, t in zip(prop, truth["dgrad_linears"])
                                                         if t > 0]),
        "dgrad_over_wgrad_median": _median(ratios) if ratios else None,
        "dgrad_over_wgrad_total": sum(truth["dgrad"]) / sum(truth["wgrad"]) if sum(truth["wgrad"]) > 0 else None,
        "linears_share_of_dgrad_total": (sum(truth["dgrad_linears"]) / sum(truth["dgrad"])
                                         if sum(truth["dgrad"]) > 0 else None),
        "repro": {k: split_half(split[k]) for k in split},
    }


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model_config", default=None, help="JSON config of a model trained from scratch "
                    "(default: the embedded ~10M Llama; with --quick a 2-block hidden-64 Llama)")
    ap.add_argument("--dataset", default=None, help="text/JSON-lines file or prepared directory "
                    "(default: the Python stdlib corpus)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup_steps", type=int, default=None)
    ap.add_argument("--checkpoint", default=None, help="directory: load the warmed-up model and optimizer "
                    "from it if present, else save them there after warm-up")
    ap.add_argument("--batches", type=int, default=None, help="fixed batches measured (>= 2 for split-half)")
    ap.add_argument("--batch_size", type=int, default=None)
    ap.add_argument("--block_size", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: 1 with --quick, whose tiny GEMMs only lose to threading "
                         "on a busy machine; else torch's default)")
    ap.add_argument("--truth_table", default=None, help="re-score the estimators against the truths an earlier "
                    "run printed for the same checkpoint and batches, instead of measuring them again")
    ap.add_argument("--no_bwd_truth", dest="bwd_truth", action="store_false",
                    help="measure only the FLD truths (BWD figures are null): halves the time of long FLD runs")
    ap.add_argument("--bwd_truth_per_gemm", action="store_true",
                    help="also measure the one-step drift with only the wgrad or only the dgrad GEMM at fp4 (two "
                         "more backward passes per layer and batch) and score the per-GEMM costs against them")
    ap.add_argument("--bwd_rounding", default="recipe", choices=BWD_ROUNDINGS,
                    help="how G_Y is rounded, in the BWD estimate and the drift truths alike: 'recipe' (as training "
                         "does: stochastically for FP4 by default) or 'nearest'")
    ap.add_argument("--sr_draws", type=int, default=4,
                    help="with --bwd_rounding recipe: stochastic-rounding draws averaged per batch in the truths")
    ap.add_argument("--fwd_truth", action="store_true",
                    help="also measure what each layer's FP4 fprop does to one AdamW step (one more backward "
                         "pass per layer and batch) and score the collector's forward-drift estimate (fwd)")
    ap.add_argument("--fwd_probes", type=int, default=8, help="with --fwd_truth: Fisher probes per batch that "
                    "price the truth's drift")
    ap.add_argument("--quick", action="store_true", help="tiny model and data: a smoke run of seconds")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.threads is None:
        args.threads = 1 if args.quick else 0
    for key, val in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    for key in ("warmup_steps",):
        if getattr(args, key) < 0:
            ap.error(f"--{key} must be >= 0")
    for key in ("batches", "batch_size", "block_size", "sr_draws", "fwd_probes"):
        if getattr(args, key) < 1:
            ap.error(f"--{key} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        result = run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"validate_metrics: error: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
