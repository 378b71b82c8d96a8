"""One SNIP statistics collection: hooks on every :class:`~snip_ds.linear.SnipLinear` (SNIP.md sections 3, 4, 6).

For each batch the model runs one BF16 (unquantized) forward with a graph, one backward of the training loss
and, for the Monte-Carlo Fisher estimator, one backward per probe of ``Σ_t CE(logits_t, ŷ_t)`` with labels
``ŷ`` sampled from the model's own softmax. Every backward is ``torch.autograd.grad`` with respect to the
embedding output only (made a fresh leaf by a hook), so no parameter ``.grad`` is touched and no
gradient-accumulation hook (DeepSpeed's included) fires. Hooks on each layer's output see ``G_Y`` (training)
and ``g`` (probe) and reduce everything at once to per-channel vectors or scalars (at the end of each batch the
per-channel vectors are priced with that batch's probes and folded into per-layer scalars, so only a few
scalars per layer are all-reduced, whatever the model's width):

* forward hook: keeps the layer's input X for its training-gradient hook;
* training-gradient hook: ``Σ_t E_tj²`` with ``E = Q_p(X)Q_p(W)ᵀ - XWᵀ``, the operand errors of X and W and
  ``⟨G_Y, E⟩`` (one E serves both), ``ΔG_W = Q_p(G_Y)ᵀQ_p(X) - G_YᵀX`` with G_Y rounded as training rounds
  it (``bwd_rounding="recipe"``: where that is stochastic, the exact expectation over the rounding, its
  systematic part ``E[ΔG_W]`` plus the noise ``Var[G_W]``; ``"nearest"``: round to nearest),
  ``‖ΔG_W ⊙ P‖²``, the per-channel ``Σ_t (X (ΔG_W ⊙ P)ᵀ)²`` that prices the drift in loss units, the G_Y
  operand error and (``bwd_propagated``) the dgrad error and upstream terms;
* probe hook: ``Σ_t g_tj²`` and, with E recomputed from the layer's saved input, ``Σ_rows (Σ_t g_t·E_t)²``
  (the sequence-form FLD: the Gauss-Newton form of E in expectation over the probe labels).
* ``forward_drift=True``: after each probe, two more forward and backward passes of the training loss with
  every layer's output shifted as its weight would be by ``±ε·P ⊙ G^probe`` give, for every layer at once,
  ``⟨P ⊙ G^probe, ΔG⟩``: how the layer's fprop error E changes the update (``fwd``,
  :meth:`_Collector._forward_drift_passes`).

The statistics of all batches are packed into one flat tensor and summed across data-parallel ranks with a
single call of ``reduce``; then :mod:`snip_ds.divergence` turns them into the artifact that
:func:`snip_ds.planner.load_stats` reads.

Distributed conventions (exact for one rank; for several, rank-local quantization errors are taken as
independent, so the error of the averaged gradient has ``1/W`` of a rank's squared norm):

* ``precond={fqn: P}`` (full weight shape, e.g. from :func:`adam_precond`): every rank computes the full
  ``‖ΔG_W,r ⊙ P‖²``; after the sum over ranks it is divided by ``W²``.
* ``precond=callable`` (partitioned optimizer states, ZeRO 1-3): the engine passes
  ``precond(fqn, t) -> 0-dim tensor`` = ``Σ (t ⊙ P)²`` over the elements of the flattened weight whose
  optimizer state **this rank owns**, with ``P = 1/(sqrt(exp_avg_sq/(1-β₂ᵗ)) + eps)`` of that partition
  (``t`` is a full ``[n, k]`` FP32 tensor, rank-local). The sum over ranks then covers every element once;
  it is divided by ``W``. The loss-unit price then assumes P constant within the layer (scaled by
  ``‖ΔG⊙P‖²/‖ΔG‖²``). A mapping may also hold such callables per fqn.

Limits: gradient checkpointing must be off during a collection (recomputation would re-run the forward hooks).
Under ZeRO-3 no gathering is needed: the layer hooks run before ZeRO-3 releases a weight after forward and
after it re-gathers it for backward.
"""
from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from snip_ds import divergence as dv
from snip_ds.backend import get_backend
from snip_ds.config import BWD_ROUNDINGS, ESTIMATORS, FLD_FORMS
from snip_ds.fileio import atomic_write_text
from snip_ds.linear import SnipLinear
from snip_ds.plan import OPERANDS
from snip_ds.swap import snip_layers

STATS_FORMAT = "snip_ds.stats/1"
QUANTIZED = ("fp8", "fp4")
ISO_DELTA = 0.02  # δ of the isotropic ablation's forward-noise passes, relative to rms(z)
PRICE_TOKENS_MIN = 256  # tokens that price stochastic rounding's noise: at least this many (all, if fewer)
FWD_STEP = 3e-4  # forward_drift's finite difference: the weight perturbation's norm relative to the weights'
IGNORE_INDEX = -100

Reduce = Callable[[torch.Tensor], torch.Tensor]
PrecondFn = Callable[[str, torch.Tensor], torch.Tensor]
Precond = Union[None, Mapping[str, Union[torch.Tensor, PrecondFn]], PrecondFn]


# --------------------------------------------------------------------------------------------------------
# Optimizer state -> preconditioner
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AdamPrecond:
    """Adam preconditioners read from a torch optimizer.

    Attributes:
        precond: ``{fqn: P}`` with ``P = 1/(sqrt(v̂) + eps)``; empty when the optimizer has no state yet.
        step: optimizer steps taken (0 before the first).
        step_scale: ``(1-β₁)/(1-β₁^(step+1))``, the share of a gradient change in the next update.
        lr: the learning rate of the layers' param group.
    """

    precond: Dict[str, torch.Tensor]
    step: int
    step_scale: float
    lr: float


def adam_precond(model: nn.Module, optimizer: torch.optim.Optimizer,
                 layers: Optional[Iterable[str]] = None) -> AdamPrecond:
    """Reads ``exp_avg_sq`` and ``step`` of the layers' weights from a torch Adam/AdamW optimizer."""
    mods = _select_layers(model, layers)
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    precond, steps, lrs, beta1 = {}, set(), set(), None
    for fqn, mod in mods.items():
        group = group_of.get(id(mod.weight))
        if group is None:
            raise ValueError(f"optimizer: layer {fqn!r}'s weight is in no param group")
        if "betas" not in group or "eps" not in group:
            raise ValueError(f"optimizer: param group of {fqn!r} has no 'betas'/'eps'; expected Adam or AdamW")
        beta1, beta2 = group["betas"]
        lrs.add(float(group["lr"]))
        state = optimizer.state.get(mod.weight, {})
        if "exp_avg_sq" not in state:
            continue
        step = int(state["step"])
        steps.add(step)
        precond[fqn] = dv.adam_preconditioner(state["exp_avg_sq"], step, beta2, group["eps"])
    step = max(steps) if steps else 0
    if precond and len(precond) != len(mods):
        raise ValueError(f"optimizer: only {len(precond)} of {len(mods)} layers have Adam state")
    return AdamPrecond(precond, step, dv.adam_step_scale(step, beta1 if beta1 is not None else 0.9),
                       max(lrs) if lrs else 0.0)


# --------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------
def _select_layers(model: nn.Module, layers: Optional[Iterable[str]]) -> Dict[str, SnipLinear]:
    found = snip_layers(model)
    if not found:
        raise ValueError("model has no SnipLinear layers; call snip_ds.swap.swap_linears(model) first")
    if layers is None:
        return found
    names = list(layers)
    unknown = [n for n in names if n not in found]
    if unknown:
        raise ValueError(f"layers: {unknown[:5]} are not SnipLinear layers of the model; valid names look like "
                         f"{next(iter(found))!r} ({len(found)} in all)")
    return {n: found[n] for n in names}


def _unpack(batch: Any) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """``(input_ids, attention_mask, labels)`` from a LongTensor ``[B, L]`` or a mapping with ``input_ids``."""
    if isinstance(batch, torch.Tensor):
        ids, mask, labels = batch, None, None
    elif isinstance(batch, Mapping) and "input_ids" in batch:
        ids, mask, labels = batch["input_ids"], batch.get("attention_mask"), batch.get("labels")
    else:
        raise ValueError("batches: each batch must be a LongTensor [B, L] of token ids or a mapping with "
                         f"'input_ids' (optional 'attention_mask', 'labels'); got {type(batch).__name__}")
    if ids.dim() != 2:
        raise ValueError(f"batches: input_ids must be [B, L], got shape {tuple(ids.shape)}")
    if labels is None:
        labels = ids if mask is None else ids.masked_fill(mask == 0, IGNORE_INDEX)
    return ids, mask, labels


def _targets(logits: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Shifted next-token logits ``[N, V]`` and targets ``[N]`` of the valid positions."""
    lg = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    tg = labels[:, 1:].reshape(-1).to(logits.device)
    keep = tg != IGNORE_INDEX
    return lg[keep], tg[keep]


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _as_json_number(x: float) -> Optional[float]:
    return float(x) if math.isfinite(x) else None


class _Stats:
    """Named per-layer accumulators, packed into one flat vector for a single reduction."""

    def __init__(self) -> None:
        self.data: Dict[Tuple[str, str], torch.Tensor] = {}

    def add(self, fqn: str, key: str, value: torch.Tensor) -> None:
        value = value.detach().float().reshape(-1)
        k = (fqn, key)
        self.data[k] = self.data[k] + value if k in self.data else value.clone()

    def pop(self, fqn: str, key: str) -> Optional[torch.Tensor]:
        return self.data.pop((fqn, key), None)

    def get(self, fqn: str, key: str, default: float = 0.0) -> torch.Tensor:
        t = self.data.get((fqn, key))
        return torch.tensor([default]) if t is None else t

    def reduce(self, reduce: Optional[Reduce], device: torch.device) -> None:
        keys = sorted(self.data)  # the same order on every rank
        flat = torch.cat([self.data[k].to(device) for k in keys]) if keys else torch.zeros(0, device=device)
        if reduce is not None:
            flat = reduce(flat)
        sizes = [self.data[k].numel() for k in keys]
        for k, part in zip(keys, torch.split(flat.detach().float().cpu(), sizes)):
            self.data[k] = part


# --------------------------------------------------------------------------------------------------------
# The collector: hooks and passes
# --------------------------------------------------------------------------------------------------------
class _Collector:
    GLOBAL = "<global>"

    def __init__(self, model: nn.Module, layers: Dict[str, SnipLinear], precisions: Sequence[str],
                 precond: Precond, fallback: str, estimator: str, propagated: bool, seed: int,
                 bwd_rounding: str = "recipe", forward_drift: bool = False) -> None:
        self.model, self.layers, self.precisions = model, layers, tuple(precisions)
        self.forward_drift = forward_drift
        self.fwd_x: Dict[str, torch.Tensor] = {}  # this batch's layer inputs (forward_drift: E at the weights)
        self.fwd_p: Dict[str, torch.Tensor] = {}  # preconditioners
        self.fwd_w_sq: Dict[str, float] = {}  # ‖W‖², sizes the finite difference
        self.fwd_v: Dict[str, torch.Tensor] = {}  # one probe's preconditioned weight gradient P ⊙ g_rᵀX
        self.fwd_dot: Dict[str, Dict[str, float]] = {}  # Σ_sign sign·⟨G_Y(W + sign·ε·v), E(p)⟩
        self.fwd_shift = 0.0
        self.bwd_rounding = bwd_rounding
        self.precond, self.fallback, self.estimator, self.propagated = precond, fallback, estimator, propagated
        self.backend = get_backend()
        self.stats = _Stats()
        self.phase = "off"
        self.n_local = 1.0
        self.x: Dict[str, torch.Tensor] = {}
        self.xp: Dict[str, torch.Tensor] = {}  # layer inputs as autograd saved them, for the probe hooks
        self.order: Dict[str, int] = {}
        self.group: Dict[str, str] = {}  # layer -> its input group, named by the group's first layer
        self._group_ids: Dict[int, str] = {}  # id(input tensor) -> group, for the current forward only
        self._group_inputs: List[torch.Tensor] = []  # keeps those ids unique: no input is freed mid-forward
        self.emb: Optional[torch.Tensor] = None
        self.z: Optional[torch.Tensor] = None
        self.z_shift: Optional[torch.Tensor] = None
        self.sources: set = set()
        device = _device_of(model)
        self.gen = torch.Generator(device=device).manual_seed(seed)  # probe labels / isotropic noise
        self.had_gen = torch.Generator(device=device).manual_seed(seed + 1)  # Hadamard signs (if enabled)
        self.price_gen = torch.Generator(device=device).manual_seed(seed + 2)  # tokens pricing rounding noise

    # ---------------- hooks ----------------
    @contextmanager
    def hooks(self) -> Iterator[None]:
        handles = [self.model.get_input_embeddings().register_forward_hook(self._on_embedding)]
        for fqn, mod in self.layers.items():
            # prepend: run while ZeRO-3 still holds the gathered weight (its post-forward hook releases it),
            # and hook the raw output, whose gradient arrives after ZeRO-3's pre-backward re-gather.
            handles.append(mod.register_forward_hook(self._forward_hook(fqn), prepend=True))
        if self.estimator == "isotropic":
            handles.append(self._last_block().register_forward_hook(self._on_last_block))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _last_block(self) -> nn.Module:
        from snip_ds.swap import block_index
        last = max(self.layers, key=block_index)
        prefix = last[: last.index(f"layers.{block_index(last)}") + len(f"layers.{block_index(last)}")]
        return self.model.get_submodule(prefix)

    def _on_embedding(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        if self.phase not in ("forward", "probe_forward", "fwd_pass"):
            return output
        self.emb = output.detach().requires_grad_(True)  # our own leaf: no gradient reaches parameters
        return self.emb

    def _on_last_block(self, module: nn.Module, inputs: Any, output: Any) -> Any:
        z = output[0] if isinstance(output, tuple) else output
        if self.phase in ("forward", "probe_forward"):
            self.z = z
        elif self.phase == "alpha" and self.z_shift is not None:
            z = z + self.z_shift
            return (z, *output[1:]) if isinstance(output, tuple) else z
        return output

    def _forward_hook(self, fqn: str):
        def hook(module: SnipLinear, inputs: Any, output: torch.Tensor) -> Optional[torch.Tensor]:
            if self.phase == "fwd_pass":
                return self._on_fwd_forward(fqn, module, inputs[0], output)
            if self.phase == "probe_forward":  # a fresh forward for a probe: only its output gradient counts
                self.xp[fqn] = inputs[0].detach()
                if output.requires_grad:
                    output.register_hook(lambda g: self._on_output_grad(fqn, module, g))
                return
            if self.phase != "forward":
                return
            self._on_forward(fqn, module, inputs[0], output)
        return hook

    def _quant_cfg(self, module: SnipLinear):
        return replace(module.quant_config, stochastic_rounding=False)  # RNE: deterministic, no RNG

    def _on_forward(self, fqn: str, module: SnipLinear, x: torch.Tensor, y: torch.Tensor) -> None:
        x2 = x.detach().reshape(-1, x.shape[-1]).float()  # [T, k]
        self.x[fqn] = x2
        if self.forward_drift:
            self.fwd_x[fqn] = x2
        if self.estimator != "empirical":
            self.xp[fqn] = x.detach()  # the tensor autograd keeps anyway: no copy
        if fqn not in self.order:
            self.order[fqn] = len(self.order)
        if self.propagated and x.requires_grad:
            key = id(x)
            if key not in self._group_ids:  # ids are unique only while the tensors live: reset every forward
                self._group_ids[key] = fqn
                self._group_inputs.append(x)
                gid = self._group_ids[key]
                x.register_hook(lambda g, gid=gid: self._on_input_grad(gid, g))
            self.group[fqn] = self._group_ids[key]
        if y.requires_grad:
            y.register_hook(lambda g: self._on_output_grad(fqn, module, g))
        else:  # no training gradient will arrive: the fprop statistics now (no first-order term)
            self._fprop_stats(fqn, module, self.x.pop(fqn), None)

    def _fprop_errors(self, module: SnipLinear, x2: torch.Tensor) -> Iterator[Tuple[str, torch.Tensor,
                                                                                   torch.Tensor, torch.Tensor]]:
        """Per precision ``(p, E, Q_p(X), Q_p(W))`` with ``E = Q_p(X)Q_p(W)ᵀ - XWᵀ`` (RNE), one at a time."""
        cfg = self._quant_cfg(module)
        w = module.weight.detach().float()  # [n, k]
        y_ref = x2 @ w.t()  # [T, n]
        for p in self.precisions:
            x_lp = self.backend.quantize(x2, p, "x", -1, cfg)
            w_lp = self.backend.quantize(w, p, "w", -1, cfg)
            yield p, x_lp @ w_lp.t() - y_ref, x_lp, w_lp

    def _fprop_stats(self, fqn: str, module: SnipLinear, x2: torch.Tensor, g2: Optional[torch.Tensor],
                     rows: int = 1) -> None:
        """Per precision: ``Σ_t E_tj²`` with ``E = Q_p(X)Q_p(W)ᵀ - XWᵀ``, the operand errors of X and W, and
        (given the training ``G_Y``) the first-order term ``⟨G_Y, E⟩`` from the same E (and, for the empirical
        estimator, its per-sequence square: the sequence-form FLD with ``G_Y`` as the probe)."""
        st = self.stats
        w = module.weight.detach().float()  # [n, k]
        for p, e, x_lp, w_lp in self._fprop_errors(module, x2):
            st.add(fqn, f"err_sq.{p}", dv.channel_sq_sum(e))
            if g2 is not None:
                st.add(fqn, f"first.{p}", (g2 * e).sum() * self.n_local)
                if self.estimator == "empirical":
                    st.add(fqn, f"fld_seq.{p}", dv.sequence_sq_sum(g2 * self.n_local, e, rows))
            st.add(fqn, f"qerr_x.{p}", ((x_lp - x2) ** 2).sum())
            st.add(fqn, f"qerr_w.{p}", ((w_lp - w) ** 2).sum())
            del e, x_lp, w_lp
        st.add(fqn, "qnorm_x", (x2 * x2).sum())
        w_sq = (w * w).sum()
        st.add(fqn, "qnorm_w", w_sq)
        if self.forward_drift:
            self.fwd_w_sq[fqn] = float(w_sq)

    def _on_input_grad(self, gid: str, g: torch.Tensor) -> None:
        if self.phase == "train":
            self.stats.add(self.GLOBAL, f"gx_sq.{gid}", (g.float() ** 2).sum())

    def _on_output_grad(self, fqn: str, module: SnipLinear, g: torch.Tensor) -> None:
        g2 = g.detach().reshape(-1, g.shape[-1]).float()  # [T, n]
        rows = g.shape[0] if g.dim() >= 3 else 1  # sequences: [B, L, n]
        if self.phase in ("probe", "iso"):
            self.stats.add(fqn, "probe_sq", dv.channel_sq_sum(g2))
            self._probe_fld(fqn, module, g2, rows)
            if self.forward_drift and fqn in self.xp:
                x = self.xp[fqn]
                self.fwd_v[fqn] = (g2.t() @ x.reshape(-1, x.shape[-1]).float()).mul_(self.fwd_p[fqn])
        elif self.phase == "train":
            self._on_train_grad(fqn, module, g2, rows)

    def _probe_fld(self, fqn: str, module: SnipLinear, g2: torch.Tensor, rows: int) -> None:
        """Sequence-form FLD: ``Σ_rows (Σ_t g_t·E_t)²`` per precision, E recomputed from the saved input.

        With probe labels drawn from the model's softmax, ``E_ŷ[(g·E)²] = Eᵀ(Σ_s J_sᵀF_sJ_s)E``: the exact
        Gauss-Newton quadratic form of the perturbation, cross-token and cross-channel terms included
        (sequences are independent, so their cross terms vanish in expectation and are left out).
        """
        x = self.xp.get(fqn)
        if x is None:
            return
        x2 = x.reshape(-1, x.shape[-1]).float()
        for p, e, _, _ in self._fprop_errors(module, x2):
            self.stats.add(fqn, f"fld_seq.{p}", dv.sequence_sq_sum(g2, e, rows))
            del e

    def _precond_of(self, fqn: str, gw: torch.Tensor) -> Tuple[Optional[torch.Tensor], Optional[PrecondFn]]:
        pc = self.precond
        if pc is None:
            p, source = dv.fallback_preconditioner(gw, gw.shape, self.fallback)
            self.sources.add(source)
            return p.to(gw.device), None
        entry = pc if callable(pc) and not isinstance(pc, Mapping) else pc[fqn]
        if isinstance(entry, torch.Tensor):
            self.sources.add("tensor")
            return entry.to(gw.device, torch.float32), None
        self.sources.add("callable")
        return None, entry

    def _on_train_grad(self, fqn: str, module: SnipLinear, g2: torch.Tensor, rows: int) -> None:
        st, cfg, be = self.stats, self._quant_cfg(module), self.backend
        x2 = self.x.pop(fqn)
        self._fprop_stats(fqn, module, x2, g2, rows)
        w = module.weight.detach().float() if self.propagated else None
        gw = g2.t() @ x2  # [n, k], BF16-pass weight gradient (mean loss)
        pmat, pfn = self._precond_of(fqn, gw)
        if self.forward_drift:
            self.fwd_p[fqn] = pmat
        sr = {p: self._expects_sr(module, p) for p in self.precisions}
        uses = len(self.precisions) + int(self.propagated)  # projections of X below
        gram = x2.t() @ x2 if dv.gram_pays(x2.shape[0], x2.shape[1], gw.shape[0], uses) else None
        for p in self.precisions:
            if sr[p]:  # training rounds G_Y stochastically: the exact expectation over that rounding
                sample = self._price_sample(x2.shape[0], gw.shape[0])
                mom = be.wgrad_moments(g2, x2, p, module.quant_config, self.had_gen, sample)
                dgw, var, projected = mom.mean.sub_(gw), mom.var, mom.projected
                del mom
            else:
                dgw, var, projected = be.wgrad(g2, x2, p, cfg, self.had_gen) - gw, None, None
            self._drift_stats(fqn, p, dgw, var, projected, x2, pmat, pfn, gram)
            del dgw, var, projected
            g_lp = be.quantize(g2, p, "g", -1, cfg)
            st.add(fqn, f"qerr_g.{p}", ((g_lp - g2) ** 2).sum())
            if self.propagated:
                if sr[p]:
                    mom = be.dgrad_moments(g2, w, p, module.quant_config)
                    e = mom.mean - g2 @ w
                    st.add(fqn, f"dgrad_sq.{p}", (e * e).sum() + mom.var.sum())
                else:
                    e = be.dgrad(g2, w, p, cfg, self.had_gen) - g2 @ w
                    st.add(fqn, f"dgrad_sq.{p}", (e * e).sum())
                del e
        st.add(fqn, "qnorm_g", (g2 * g2).sum())
        if self.estimator == "empirical":
            st.add(fqn, "probe_sq", dv.channel_sq_sum(g2 * self.n_local))
        if self.propagated:
            if pfn is None:
                up = gw * pmat
                st.add(fqn, "up_sq", (up * up).sum())
            else:
                up = gw
                st.add(fqn, "up_sq", torch.as_tensor(pfn(fqn, gw), dtype=torch.float32))
                st.add(fqn, "gw_sq", (gw * gw).sum())
            st.add(fqn, "up_ch", dv.projected_sq_sum(x2, up, gram))

    def _price_sample(self, tokens: int, n: int) -> torch.Tensor:
        """Tokens whose inputs price the rounding noise (:meth:`EmulatedBackend.wgrad_moments`): all of them
        up to PRICE_TOKENS_MIN, else ``n / 4`` of them (which keeps that price near a quarter of the wgrad
        GEMM's cost), drawn from a generator of their own."""
        m = min(tokens, max(PRICE_TOKENS_MIN, n // 4))
        if m == tokens:
            return torch.arange(tokens)
        return torch.randperm(tokens, generator=self.price_gen, device=self.price_gen.device)[:m]

    def _expects_sr(self, module: SnipLinear, p: str) -> bool:
        return self.bwd_rounding == "recipe" and self.backend.rounds_g_stochastically(p, module.quant_config)

    def _drift_stats(self, fqn: str, p: str, dgw: torch.Tensor, var: Optional[torch.Tensor],
                     projected: Optional[torch.Tensor], x2: torch.Tensor, pmat: Optional[torch.Tensor],
                     pfn: Optional[PrecondFn], gram: Optional[torch.Tensor]) -> None:
        """The weight-gradient error's drift statistics: its systematic part ``dgw`` (the whole error under
        round-to-nearest; its expectation under stochastic rounding) under ``*_bias`` keys, and with the
        rounding noise of element-wise variance ``var`` added (its expectation) under the plain keys.

        The noise's loss-unit price per output channel j is ``projected_j`` (estimated from a sample of the
        tokens, :meth:`_price_sample`) times ``P²`` averaged over the row j with weights ``var`` (exact when P
        is constant within a row)."""
        st = self.stats
        if pfn is None:
            drift = dgw.mul_(pmat)  # dgw is ours to overwrite
            bias_sq, bias_ch = (drift * drift).sum(), dv.projected_sq_sum(x2, drift, gram)
            noise_sq = None
            if var is not None:
                row_var = var.sum(dim=1)
                weighted = var.mul_(pmat).mul_(pmat)  # P²·Var, in place
                noise_sq = weighted.sum()
                noise_ch = weighted.sum(dim=1).div_(torch.where(row_var > 0, row_var, 1.0)).mul_(projected)
        else:
            bias_sq = torch.as_tensor(pfn(fqn, dgw), dtype=torch.float32)
            bias_ch = dv.projected_sq_sum(x2, dgw, gram)
            dg_sq = (dgw * dgw).sum()
            st.add(fqn, f"dg_sq_bias.{p}", dg_sq)
            st.add(fqn, f"dg_sq.{p}", dg_sq + var.sum() if var is not None else dg_sq)
            noise_sq = torch.as_tensor(pfn(fqn, var.sqrt()), dtype=torch.float32) if var is not None else None
            noise_ch = projected
        st.add(fqn, f"drift_sq_bias.{p}", bias_sq)
        st.add(fqn, f"drift_ch_bias.{p}", bias_ch)
        st.add(fqn, f"drift_sq.{p}", bias_sq + noise_sq if noise_sq is not None else bias_sq)
        st.add(fqn, f"drift_ch.{p}", bias_ch + noise_ch if noise_sq is not None else bias_ch)

    # ---------------- forward drift (forward_drift=True) ----------------
    def _on_fwd_forward(self, fqn: str, module: SnipLinear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Layer output at the weights ``W + shift·v``: ``y + shift·X vᵀ`` (differentiable in X, as a
        weight change would be; no parameter is touched). Its output gradient meets the layer's fprop errors."""
        v = self.fwd_v.get(fqn)
        if v is not None and self.fwd_shift != 0.0:
            y = y + (self.fwd_shift * (x.float() @ v.t())).to(y.dtype)
        if y.requires_grad:
            y.register_hook(lambda g: self._on_fwd_grad(fqn, module, g))
        return y

    def _on_fwd_grad(self, fqn: str, module: SnipLinear, g: torch.Tensor) -> None:
        x2 = self.fwd_x.get(fqn)
        if x2 is None:
            return
        g2 = g.detach().reshape(-1, g.shape[-1]).double()  # FP64 sums: the two passes' dots nearly cancel
        dots = self.fwd_dot.setdefault(fqn, {})
        sign = 1.0 if self.fwd_shift > 0 else -1.0
        for p, e, _, _ in self._fprop_errors(module, x2):
            dots[p] = dots.get(p, 0.0) + sign * float((g2 * e.double()).sum())
            del e

    def _forward_drift_passes(self, ids, mask, labels) -> None:
        """Prices the update drift that each layer's fprop error causes, for one probe r (SNIP.md section 4's
        loss-unit price applied to the forward): ``(1/2N)·⟨G^probe_r, η·c·ΔG ⊙ P⟩²``, where ΔG is the change of
        the planned weights' training gradient when layer ℓ's output carries its error E_ℓ(p).

        ``⟨v, ΔG⟩`` with ``v = P ⊙ G^probe_r`` is, to first order in E, ``⟨∂G_Y,ℓ(W + εv)/∂ε, E_ℓ⟩`` (the mixed
        second derivative read the other way round), so two passes at ``W ± εv`` give it for every layer at
        once: a central difference of the output gradients, contracted with the errors at ``W``.
        """
        if not self.fwd_v:
            return
        v_sq = sum(float((v * v).sum()) for v in self.fwd_v.values())
        w_sq = sum(self.fwd_w_sq.values())
        if v_sq <= 0 or w_sq <= 0:
            self.fwd_v.clear()
            return
        eps = FWD_STEP * math.sqrt(w_sq / v_sq)
        self.fwd_dot = {}
        for sign in (1.0, -1.0):
            self.fwd_shift = sign * eps
            self.phase = "fwd_pass"
            lg, tg = _targets(self.model(input_ids=ids, attention_mask=mask).logits, labels)
            self.phase = "fwd_backward"
            torch.autograd.grad(F.cross_entropy(lg, tg), self.emb)
        self.fwd_shift = 0.0
        for fqn, dots in self.fwd_dot.items():
            for p, d in dots.items():
                a = d / (2.0 * eps)
                self.stats.add(fqn, f"fwd_sq.{p}", torch.tensor(a * a))
        self.fwd_v.clear()
        self.fwd_dot = {}

    # ---------------- one batch ----------------
    def _probe_root(self, ids, mask, labels, retain: bool, last: bool):
        """The logits to back-propagate a probe from: the retained graph's, or a fresh forward's."""
        if retain:
            return self._lg, not last
        self.phase = "probe_forward"
        lg = _targets(self.model(input_ids=ids, attention_mask=mask).logits, labels)[0]
        return lg, False

    def run_batch(self, batch: Any, num_probes: int, retain_graph: bool = True) -> int:
        ids, mask, labels = _unpack(batch)
        device = _device_of(self.model)
        ids = ids.to(device)
        mask = mask.to(device) if mask is not None else None
        with torch.enable_grad():
            self._group_ids.clear()
            self._group_inputs.clear()
            self.phase = "forward"
            logits = self.model(input_ids=ids, attention_mask=mask).logits
            self.phase = "off"
            lg, tg = _targets(logits, labels)
            n = int(tg.numel())
            if n == 0:
                raise ValueError("batches: a batch has no target tokens (all labels are -100)")
            self.n_local = float(n)
            loss = F.cross_entropy(lg, tg)
            st = self.stats
            st.add(self.GLOBAL, "n_tokens", torch.tensor(float(n)))
            st.add(self.GLOBAL, "n_rows", torch.tensor(float(ids.numel())))
            st.add(self.GLOBAL, "loss_sum", loss.detach() * n)
            extra = self.estimator == "mc_fisher" or self.estimator == "isotropic"
            self.phase = "train"
            torch.autograd.grad(loss, self.emb, retain_graph=extra and retain_graph)
            self.x.clear()
            if not retain_graph:
                self.xp.clear()  # the probes' fresh forwards record their own inputs
            self._lg = lg
            if self.estimator == "mc_fisher":
                probs = torch.softmax(lg.detach(), dim=-1)
                # A row with NaN/Inf logits (an overflowing model) is sampled uniformly so that every rank reaches
                # the statistics' all-reduce; its statistics come out non-finite and the layers are flagged.
                probs = torch.where(torch.isfinite(probs).all(dim=-1, keepdim=True), probs, torch.ones_like(probs))
                for r in range(num_probes):
                    y_hat = torch.multinomial(probs, 1, generator=self.gen).squeeze(1)
                    root, keep = self._probe_root(ids, mask, labels, retain_graph, r == num_probes - 1)
                    self.phase = "probe"
                    torch.autograd.grad(F.cross_entropy(root, y_hat, reduction="sum"), self.emb,
                                        retain_graph=keep)
                    if self.forward_drift:
                        emb = self.emb
                        self._forward_drift_passes(ids, mask, labels)
                        self.emb = emb
            elif self.estimator == "isotropic":
                for r in range(num_probes):
                    _, keep = self._probe_root(ids, mask, labels, retain_graph, r == num_probes - 1)
                    self.phase = "iso"
                    u = torch.randn(self.z.shape, generator=self.gen, device=self.z.device, dtype=self.z.dtype)
                    torch.autograd.grad((u * self.z).sum(), self.emb, retain_graph=keep)
            self._lg = None
            self.xp.clear()
            self.fwd_x.clear()
            self.fwd_p.clear()
            self._fold(int(ids.numel()), num_probes)
            self.phase = "off"
        if self.estimator == "isotropic":
            self._alpha(ids, mask, labels, float(loss.detach()))
        self.emb = self.z = None
        return int(ids.numel())

    def _fold(self, rows: int, num_probes: int) -> None:
        """Turns this batch's per-channel vectors into per-layer scalars, priced with its own probes.

        ``Σ_j v_j · m_j`` with ``m = Σ_t g²/(rows·probes)`` replaces keeping ``v`` and ``m`` until the end, so
        only scalars are all-reduced (a few per layer, whatever the model's width). With one batch per rank
        this is exactly the per-channel formula; across batches and ranks it sums per-batch products, which
        equals it when every batch sees the same sensitivities.
        """
        div = float(rows * (1 if self.estimator == "empirical" else num_probes))
        st = self.stats
        for fqn in self.layers:
            probe = st.pop(fqn, "probe_sq")
            m = probe / div if probe is not None else None
            for vec, out in ((f"err_sq.{p}", f"fld_prod.{p}") for p in self.precisions):
                self._fold_one(fqn, vec, out, m)
            for vec, out in ((f"drift_ch.{p}", f"drift_prod.{p}") for p in self.precisions):
                self._fold_one(fqn, vec, out, m)
            for vec, out in ((f"drift_ch_bias.{p}", f"drift_prod_bias.{p}") for p in self.precisions):
                self._fold_one(fqn, vec, out, m)
            self._fold_one(fqn, "up_ch", "up_prod", m)

    def _fold_one(self, fqn: str, vec: str, out: str, m: Optional[torch.Tensor]) -> None:
        v = self.stats.pop(fqn, vec)
        if v is not None:
            self.stats.add(fqn, out, (v * m).sum() if m is not None else torch.zeros(()))

    @torch.no_grad()
    def _alpha(self, ids, mask, labels, loss_0: float) -> None:
        z = self.z.detach()
        delta = ISO_DELTA * float(z.float().pow(2).mean().sqrt())
        v = torch.randn(z.shape, generator=self.gen, device=z.device, dtype=z.dtype)
        losses = {}
        self.phase = "alpha"
        try:
            for name, s in (("0", 0.0), ("+", 1.0), ("-", -1.0), ("2+", 2.0)):
                self.z_shift = (s * delta) * v
                lg, tg = _targets(self.model(input_ids=ids, attention_mask=mask).logits, labels)
                losses[name] = float(F.cross_entropy(lg, tg))
        finally:
            self.phase, self.z_shift = "off", None
        alpha = dv.isotropic_alpha(losses["0"], losses["+"], losses["-"], delta, float((v.float() ** 2).sum()))
        st = self.stats
        st.add(self.GLOBAL, "alpha_tok", torch.tensor(alpha * self.n_local))  # per-token-scale curvature
        st.add(self.GLOBAL, "quad_ratio", torch.tensor(dv.quadratic_ratio(losses["0"], losses["+"], losses["2+"],
                                                                           losses["-"])))
        st.add(self.GLOBAL, "alpha_count", torch.tensor(1.0))


# --------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------
@contextmanager
def _preserved(model: nn.Module, layers: Dict[str, SnipLinear]) -> Iterator[None]:
    """bf16 layers that back-propagate to their input only; restores the layers' precision, the model's
    mode and the global RNG states (CPU and CUDA)."""
    saved_precision = {fqn: m.gemm_precision for fqn, m in layers.items()}
    saved_grad_only = {fqn: m.input_grad_only for fqn, m in layers.items()}
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        try:
            for m in layers.values():
                m.precision = "bf16"
                m.input_grad_only = True  # every pass back-propagates to the embedding output only
            yield
        finally:
            for fqn, m in layers.items():
                m.precision = saved_precision[fqn]
                m.input_grad_only = saved_grad_only[fqn]


def collect_statistics(model: nn.Module, batches: Iterable[Any], *, layers: Optional[Iterable[str]] = None,
                       lr: float, precond: Precond = None, estimator: str = "mc_fisher", num_probes: int = 1,
                       precisions: Sequence[str] = QUANTIZED, bwd_propagated: bool = False, seed: int = 0,
                       reduce: Optional[Reduce] = None, step: int = 0, world_size: int = 1,
                       step_scale: float = 1.0, precond_fallback: str = "grad_sq",
                       lam: Optional[float] = None, retain_graph: bool = True,
                       fld_form: str = "sequence", bwd_rounding: str = "recipe",
                       forward_drift: bool = False) -> Dict[str, Any]:
    """One SNIP statistics collection on the given batches; leaves no trace on the model.

    Args:
        model: a Hugging Face causal LM whose decoder linears are :class:`SnipLinear`.
        batches: LongTensor ``[B, L]`` token ids, or mappings with ``input_ids`` (optional ``attention_mask``,
            ``labels``; ``-100`` ignored). Each batch plays one step's rank-local batch.
        layers: fqns to measure; default every SnipLinear.
        lr: learning rate η of the next steps.
        precond: ``{fqn: P}`` (weight-shaped tensors, e.g. :func:`adam_precond`), or a callable
            ``(fqn, t) -> Σ_owned (t⊙P)²`` for partitioned states (module docstring), or a mapping of such
            callables; None (or an empty mapping: no optimizer state yet) uses ``precond_fallback``
            (``"grad_sq"``: Adam's first-step ``v̂ = G_W²``; ``"ones"``). The artifact's ``"precond"`` says
            which was used.
        estimator: ``"mc_fisher"`` (default; MC Fisher probes), ``"empirical"`` (the training G_Y, no extra
            pass) or ``"isotropic"`` (ablation: ``N(0, I)`` probes at the last block's output times α).
        num_probes: probes per batch (mc_fisher, isotropic).
        precisions: quantized precisions to measure (``fp8``, ``fp4``).
        bwd_propagated: also estimate what each layer's dgrad error does to the upstream weights (SNIP.md
            section 4's ratio estimate): ``bwd_dgrad`` (loss units; what per-GEMM plans with
            ``dgrad_cost: upstream`` price dgrad by), ``bwd_drift_propagated`` (the same drift in parameter units),
            ``bwd_propagated`` (the ablation: direct BWD + that drift priced like the gradient direction) and
            ``dgrad_err``.
        seed: seed of the private generators (probe labels, isotropic noise, Hadamard signs).
        reduce: ``reduce(t) -> t`` summing over data-parallel ranks (called exactly once); None = identity.
        step: the training step, recorded.
        world_size: data-parallel ranks ``W`` behind ``reduce``.
        step_scale: ``c`` in the drift ``lr·c·ΔG⊙P``: 1 = eventual drift (the planner's λ is a horizon in
            steps); :func:`snip_ds.divergence.adam_step_scale` = one step's drift.
        precond_fallback: see ``precond``.
        lam: λ to record in the artifact (the BWD weight the planner uses by default).
        retain_graph: back-propagate every probe through the first forward's retained graph (cheapest).
            False runs one fresh forward per probe instead, so each backward is an ordinary single one:
            needed under ZeRO-3, which releases the gathered weights after each backward.
        fld_form: which FLD the planner gets as ``fld``: ``"sequence"`` (default; ``(1/2N)Σ_rows (Σ_t
            g_t·E_t)²``, the Gauss-Newton form with every token and channel pair of a sequence) or
            ``"channel"`` (ablation; ``(1/2N)Σ_j (Σ_t E_tj²)·mean_t g_tj²``, diagonal and factorised over
            tokens). Both are recorded (``fld_sequence``, ``fld_channel``).
        bwd_rounding: how the backward statistics round G_Y. ``"recipe"`` (default): as training does; where
            the recipe rounds G_Y stochastically (NVFP4/MXFP4 by default) the drift is its exact expectation
            over that rounding, the systematic part plus the rounding noise. ``"nearest"`` (ablation, the
            behaviour before): round to nearest, deterministic, whatever the recipe. Either way the
            systematic part alone is recorded too (``bwd_bias``, ``bwd_drift_bias``).
        forward_drift: also measure ``fwd``, what each layer's fprop error does to the *update*: the drift
            ``η·c·ΔG ⊙ P`` of the planned weights, ΔG the change of their training gradient when layer ℓ's
            output carries E_ℓ(p), priced in loss units as BWD prices its drift (with the same probes, in the
            full Fisher form ``(1/2N)·mean_r ⟨G^probe_r, drift⟩²``). Two more forward and backward passes per
            probe (:meth:`_Collector._forward_drift_passes`) and one weight-sized FP32 tensor per layer while a
            batch runs. Needs ``estimator="mc_fisher"`` and weight-shaped preconditioners (a mapping of
            tensors, or None for the fallback), not the partitioned states' callable.

    Returns:
        The ``snip_ds.stats/1`` artifact (JSON-ready). Per layer: ``flops``; ``fld``, ``bwd`` (loss units,
        the planner's costs), ``bwd_drift`` (``(lr·c)²‖ΔG_W⊙P‖²``, parameter units), ``first_order``,
        ``quant_err``, ``rel_quant_err`` (each ``{precision: number}``; summed over the operands X, W, G_Y) and
        the same per operand (``quant_err_x`` ...  ``rel_quant_err_g``), ``bwd_bias`` and ``bwd_drift_bias``
        (the systematic part of ``bwd`` and ``bwd_drift``: what persists from step to step), ``nonfinite``.
        Non-finite numbers are written as null and flag the layer.
    """
    if fld_form not in FLD_FORMS:
        raise ValueError(f"fld_form: unknown form {fld_form!r}; valid: {', '.join(FLD_FORMS)}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator: unknown estimator {estimator!r}; valid: {', '.join(ESTIMATORS)}")
    if bwd_rounding not in BWD_ROUNDINGS:
        raise ValueError(f"bwd_rounding: unknown {bwd_rounding!r}; valid: {', '.join(BWD_ROUNDINGS)}")
    bad = [p for p in precisions if p not in QUANTIZED]
    if bad or not precisions:
        raise ValueError(f"precisions: {list(precisions)!r}; choose from {', '.join(QUANTIZED)}")
    if not isinstance(num_probes, int) or num_probes < 1:
        raise ValueError(f"num_probes must be a positive integer, got {num_probes!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
    if precond_fallback not in dv.FALLBACKS:
        raise ValueError(f"precond_fallback: unknown {precond_fallback!r}; valid: {', '.join(dv.FALLBACKS)}")
    mods = _select_layers(model, layers)
    if isinstance(precond, Mapping) and not precond:
        precond = None  # no optimizer state yet (adam_precond before the first step): the fallback
    if isinstance(precond, Mapping):
        missing = [f for f in mods if f not in precond]
        if missing:
            raise ValueError(f"precond: no preconditioner for {len(missing)} layer(s), e.g. {missing[:3]}")
        for fqn in mods:
            e = precond[fqn]
            if isinstance(e, torch.Tensor) and tuple(e.shape) != tuple(mods[fqn].weight.shape):
                raise ValueError(f"precond[{fqn!r}] has shape {tuple(e.shape)}, the weight "
                                 f"{tuple(mods[fqn].weight.shape)}")
    elif precond is not None and not callable(precond):
        raise ValueError(f"precond must be None, a mapping fqn -> tensor/callable, or a callable; "
                         f"got {type(precond).__name__}")
    if forward_drift:
        if estimator != "mc_fisher":
            raise ValueError(f"forward_drift needs estimator='mc_fisher' (its probes price the drift), "
                             f"got {estimator!r}")
        if precond is not None and (not isinstance(precond, Mapping) or
                                    not all(isinstance(precond[f], torch.Tensor) for f in mods)):
            raise ValueError("forward_drift needs weight-shaped preconditioners (a mapping fqn -> tensor, or None "
                             "for the fallback); partitioned optimizer states (a callable) are not supported")

    col = _Collector(model, mods, precisions, precond, precond_fallback, estimator, bwd_propagated, seed,
                     bwd_rounding, forward_drift)
    rows_per_batch, n_batches = None, 0
    with _preserved(model, mods), col.hooks():
        for batch in batches:
            rows = col.run_batch(batch, num_probes, retain_graph)
            rows_per_batch = rows_per_batch or rows
            n_batches += 1
    if n_batches == 0:
        raise ValueError("batches is empty: need at least one batch")
    col.stats.reduce(reduce, _device_of(model))
    return _finalize(col, mods, n_batches, rows_per_batch * world_size, lr=float(lr), step=int(step),
                     world_size=world_size, step_scale=float(step_scale), num_probes=num_probes, seed=seed,
                     lam=lam, fld_form=fld_form, bwd_rounding=bwd_rounding)


def _finalize(col: _Collector, mods: Dict[str, SnipLinear], n_batches: int, tokens_per_step: int, *,
              lr: float, step: int, world_size: int, step_scale: float, num_probes: int, seed: int,
              lam: Optional[float], fld_form: str = "sequence", bwd_rounding: str = "recipe") -> Dict[str, Any]:
    st, G, W, B = col.stats, _Collector.GLOBAL, float(world_size), float(n_batches)
    n_tot = float(st.get(G, "n_tokens")[0])
    callable_mode = "callable" in col.sources
    cover = 1.0 if callable_mode else W  # how many times the reduced P-weighted norms cover each element
    eta2 = (lr * step_scale) ** 2
    out: Dict[str, Any] = {"format": STATS_FORMAT, "step": step, "lr": lr, "world_size": world_size,
                           "estimator": col.estimator, "num_probes": num_probes, "fld_form": fld_form,
                           "step_scale": step_scale, "bwd_rounding": bwd_rounding,
                           "precond": ",".join(sorted(col.sources)) or "none", "batches": n_batches,
                           "tokens": int(n_tot), "loss": st.get(G, "loss_sum")[0].item() / n_tot, "seed": seed,
                           "forward_drift": col.forward_drift}
    if lam is not None:
        out["lambda"] = float(lam)
    curvature = 1.0
    if col.estimator == "isotropic":
        count = float(st.get(G, "alpha_count")[0])
        curvature = float(st.get(G, "alpha_tok")[0]) / count
        out["alpha"] = curvature / (n_tot / (B * W))  # α of one rank-local batch's mean loss
        out["quadratic_ratio"] = float(st.get(G, "quad_ratio")[0]) / count

    # upstream sums for the propagated ablation: layers run before the first layer sharing ℓ's input
    upstream: Dict[str, List[str]] = {}
    if col.propagated:
        first_of_group: Dict[str, int] = {}
        for fqn, gid in col.group.items():
            first_of_group[gid] = min(first_of_group.get(gid, 10 ** 9), col.order[fqn])
        for fqn in mods:
            start = first_of_group.get(col.group.get(fqn, ""), col.order.get(fqn, 0))
            upstream[fqn] = [m for m in mods if col.order.get(m, 10 ** 9) < start]

    def iso_factor(fqn: str, num: str, den: str) -> float:
        """‖ΔG⊙P‖²/‖ΔG‖² (callable mode: the loss price assumes P constant within the layer)."""
        d = float(st.get(fqn, den)[0]) / W
        return float(st.get(fqn, num)[0]) / cover / d if d > 0 else 0.0

    layers_out: Dict[str, Any] = {}
    for fqn, mod in mods.items():
        rec: Dict[str, Any] = {"flops": 6.0 * tokens_per_step * mod.in_features * mod.out_features}
        fld, bwd, drift, first, qe, rqe, fld_ch, fld_sq = {}, {}, {}, {}, {}, {}, {}, {}
        bwd_bias, drift_bias = {}, {}
        qe_op, rqe_op = {r: {} for r in OPERANDS}, {r: {} for r in OPERANDS}
        probes = 1.0 if col.estimator == "empirical" else float(num_probes)
        for p in col.precisions:
            fld_ch[p] = curvature * float(st.get(fqn, f"fld_prod.{p}")[0]) / (2.0 * n_tot)
            fld_sq[p] = curvature * float(st.get(fqn, f"fld_seq.{p}")[0]) / probes / (2.0 * n_tot)
            fld[p] = fld_sq[p] if fld_form == "sequence" else fld_ch[p]
            drift[p] = eta2 * float(st.get(fqn, f"drift_sq.{p}")[0]) / cover / B / W
            price = curvature * float(st.get(fqn, f"drift_prod.{p}")[0]) / (2.0 * n_tot) / W
            scale = iso_factor(fqn, f"drift_sq.{p}", f"dg_sq.{p}") if callable_mode else 1.0
            bwd[p] = eta2 * price * scale
            drift_bias[p] = eta2 * float(st.get(fqn, f"drift_sq_bias.{p}")[0]) / cover / B / W
            price = curvature * float(st.get(fqn, f"drift_prod_bias.{p}")[0]) / (2.0 * n_tot) / W
            scale = iso_factor(fqn, f"drift_sq_bias.{p}", f"dg_sq_bias.{p}") if callable_mode else 1.0
            bwd_bias[p] = eta2 * price * scale
            first[p] = float(st.get(fqn, f"first.{p}")[0]) / n_tot
            for r in OPERANDS:
                e, nrm = float(st.get(fqn, f"qerr_{r}.{p}")[0]), float(st.get(fqn, f"qnorm_{r}")[0])
                qe_op[r][p] = e / (B * W)
                rqe_op[r][p] = e / nrm if nrm > 0 else 0.0
            qe[p] = sum(qe_op[r][p] for r in OPERANDS)
            rqe[p] = sum(rqe_op[r][p] for r in OPERANDS)
        rec.update(fld=fld, fld_sequence=fld_sq, fld_channel=fld_ch, bwd=bwd, bwd_drift=drift, first_order=first,
                   quant_err=qe, rel_quant_err=rqe, bwd_bias=bwd_bias, bwd_drift_bias=drift_bias)
        if col.forward_drift:
            rec["fwd"] = {p: eta2 * float(st.get(fqn, f"fwd_sq.{p}")[0]) / float(num_probes) / (2.0 * n_tot) / W
                          for p in col.precisions}
        for r in OPERANDS:  # per operand, for per-GEMM quant_err plans (each GEMM quantizes two of them)
            rec[f"quant_err_{r}"], rec[f"rel_quant_err_{r}"] = qe_op[r], rqe_op[r]
        if col.propagated:
            gx = float(st.get(G, f"gx_sq.{col.group.get(fqn, '')}")[0])
            up_sq = sum(float(st.get(u, "up_sq")[0]) for u in upstream[fqn]) * W / cover
            up_price = 0.0
            for u in upstream[fqn]:
                pr = curvature * float(st.get(u, "up_prod")[0]) / (2.0 * n_tot) * B * W  # Σ of local prices
                up_price += pr * (iso_factor(u, "up_sq", "gw_sq") if callable_mode else 1.0)
            prop, prop_drift, derr = {}, {}, {}
            for p in col.precisions:
                e_sq = float(st.get(fqn, f"dgrad_sq.{p}")[0])
                derr[p] = e_sq / (B * W)
                e_glob = eta2 * derr[p] / W
                prop_drift[p] = e_glob * up_sq / gx if gx > 0 else 0.0
                prop[p] = bwd[p] + (e_glob * up_price / gx if gx > 0 else 0.0)
            rec.update(bwd_propagated=prop, bwd_drift_propagated=prop_drift, dgrad_err=derr)
        layers_out[fqn] = rec
    if col.propagated:
        _dgrad_cost(col, layers_out, upstream, eta2, B, W, cover)
    out["layers"] = {fqn: _clean(rec) for fqn, rec in layers_out.items()}
    return out


def _dgrad_cost(col: _Collector, layers_out: Dict[str, Dict[str, Any]], upstream: Dict[str, List[str]],
                eta2: float, B: float, W: float, cover: float) -> None:
    """``bwd_dgrad``: the upstream drift that ℓ's dgrad error causes (``bwd_drift_propagated``, split over the
    upstream layers u as the ratio estimate splits it, ∝ ‖G_W,u⊙P_u‖²), each part priced in loss units at
    u's own rate for a noise-like drift, ``bwd_u / bwd_drift_u``. (``bwd_propagated`` prices the same drift as
    if it pointed along the gradient, whose Fisher price per unit is far higher: in a one-off check on the
    4-block compare model, not a committed benchmark, it made dgrad ~23× wgrad in loss units where the drifts
    are ~3×.)"""
    st, G = col.stats, _Collector.GLOBAL
    for fqn, rec in layers_out.items():
        gx = float(st.get(G, f"gx_sq.{col.group.get(fqn, '')}")[0])
        cost = {}
        for p in col.precisions:
            e_glob = eta2 * float(st.get(fqn, f"dgrad_sq.{p}")[0]) / (B * W * W)  # as in _finalize
            total = 0.0
            for u in upstream[fqn]:
                own_loss, own_drift = layers_out[u]["bwd"][p], layers_out[u]["bwd_drift"][p]
                if gx > 0 and own_drift > 0 and math.isfinite(own_loss / own_drift):
                    total += e_glob * float(st.get(u, "up_sq")[0]) * W / cover / gx * (own_loss / own_drift)
            cost[p] = total
        rec["bwd_dgrad"] = cost


def _clean(rec: Dict[str, Any]) -> Dict[str, Any]:
    """Non-finite numbers -> None, and the ``nonfinite`` flag."""
    nonfinite = False
    for key, val in rec.items():
        if isinstance(val, dict):
            for p, v in val.items():
                if not math.isfinite(v):
                    nonfinite = True
                    val[p] = None
    rec["nonfinite"] = nonfinite
    return rec


def save_stats(stats: Mapping[str, Any], path: str) -> None:
    """Writes the artifact as JSON atomically (temporary file in the same directory, then rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write_text(path, json.dumps(stats, indent=1, allow_nan=False))
