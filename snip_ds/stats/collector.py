"""One SNIP statistics collection: hooks on every :class:`~snip_ds.linear.SnipLinear` and every MoE (expert,
projection) pair's :class:`~snip_ds.experts.points.ExpertPoint` (docs/method.md; what differs for experts:
:mod:`snip_ds.stats.experts`).

For each batch the model runs one BF16 (unquantized) forward with a graph, one backward of the training loss
and, for the Monte-Carlo Fisher estimator, one backward per probe of ``Σ_t CE(logits_t, ŷ_t)`` with labels
``ŷ`` sampled from the model's own softmax. Every backward is ``torch.autograd.grad`` with respect to the
embedding output only (made a fresh leaf by a hook), so no parameter ``.grad`` is touched and no
gradient-accumulation hook (DeepSpeed's included) fires. Hooks on each layer's output see ``G_Y`` (training)
and ``g`` (probe) and reduce everything at once to per-channel vectors or scalars (at the end of each batch the
per-channel vectors are priced with that batch's probes and folded into per-layer scalars, so only a few
scalars per layer are all-reduced, whatever the model's width):

* forward hook: keeps the layer's input X for its training-gradient and probe hooks, and tells BWD which layers
  share an input (q/k/v, gate/up), so that they share its Gram matrix XᵀX;
* training-gradient hook (``G_Y``): the BWD terms, :class:`~snip_ds.stats.bwd.BwdEstimator` (``ΔG_W =
  Q_p(G_Y)ᵀQ_p(X) - G_YᵀX`` with G_Y rounded as training rounds it, preconditioned and priced per channel;
  the dgrad error with ``bwd_propagated``), and the FLD terms that need ``G_Y`` or the channel form,
  :meth:`~snip_ds.stats.fld.FldEstimator.on_output` (only where :class:`CollectSettings` asks for them);
* probe hook (g): ``Σ_t g_tj²``, which prices the per-channel terms; then, in the layer's own backward (its
  ``input_grad_observer``, which sees g and the layer's input gradient ``gW``), the sequence-form FLD
  ``Σ_rows (Σ_t g_t·E_t)²``, :meth:`~snip_ds.stats.fld.FldEstimator.on_probe`, whose reference term
  ``Σ_t g_t·(XWᵀ)_t = Σ_t (g_t W)·x_t`` comes from that gradient instead of a product XWᵀ;
* ``forward_drift=True``: after each probe, two more forward and backward passes of the training loss
  (:meth:`~snip_ds.stats.fwd.ForwardDrift.passes`) give how each layer's fprop error changes the update;
* ``estimator="isotropic"``: probes from the last block's output and four forward passes for the curvature α
  (:mod:`snip_ds.stats.isotropic`).

Each estimator is its own module, which names the sums it adds to one :class:`~snip_ds.stats.common.Sums`
(:class:`~snip_ds.stats.common.SumField`: which of them are folded at the end of each batch) and prices them.
The passes run in the :class:`~snip_ds.stats.common.Phase` each hook checks. The sums of all batches are packed
into one flat tensor and summed across data-parallel ranks with a single call of ``reduce``; then
:func:`snip_ds.stats.fields.finalize` composes the estimators' prices into the artifact that
:func:`snip_ds.stats_file.load_stats` reads. Preconditioners (Adam state, the partitioned states of ZeRO,
the fallback) and how they combine across data-parallel ranks: :mod:`snip_ds.stats.precond`.

A layer may run more than once per forward (a block applied twice, a layer shared by several blocks): every call
is observed, and a layer's statistics are those of all its calls, as its weight gradient is the sum of theirs.
The training gradient's terms are formed once all its calls' output gradients have arrived, from their inputs and
gradients stacked along the tokens (one GEMM over all of them: its quantization scales are taken over all the
calls' rows, where training scales each call on its own); the sequence-form FLD sums each sequence's
``g_t·E_t`` over all calls before squaring (the calls' errors meet in the same loss). Each layer's calls and rows
per batch are counted (``rows``, all-reduced): its FLOPs follow them (``6·rows·k·n`` per step), and a layer that
no call reached in the whole collection is flagged ``no_calls`` (FLOPs 0; its estimators ran on one all-zero token
per batch, so every rank all-reduces the same sums). ``forward_drift`` and ``bwd_propagated`` measure layers that
run once per forward only (a ValueError names the first that does not).

Limits: gradient checkpointing must be off during a collection (recomputation would re-run the forward hooks).
Under ZeRO-3 no gathering is needed: the layer hooks run before ZeRO-3 releases a weight after forward and
after it re-gathers it for backward.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Dict, Iterable, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from snip_ds import divergence as dv
from snip_ds.backend import statistics_backend
from snip_ds.backend.operands import shared_amax
from snip_ds.linear import SnipLinear
from snip_ds.stats import bwd, fld
from snip_ds.stats.bwd import BwdEstimator
from snip_ds.experts.points import ExpertPoint
from snip_ds.stats import experts as moe
from snip_ds.stats.common import (CALL_ROWS, GLOBAL, LOSS_SUM, N_ROWS, N_TOKENS, PROBE_SQ, Layer, Phase, Reduce,
                                  Rows, Shared, Sums, device_of, flat, fp32_matmuls, select_layers, targets,
                                  unpack)
from snip_ds.stats.fields import finalize
from snip_ds.stats.fld import FldEstimator
from snip_ds.stats.fwd import ForwardDrift
from snip_ds.stats.idle import add_zero_token
from snip_ds.stats.isotropic import IsotropicProbe
from snip_ds.stats.precond import Precond, check_precond
from snip_ds.stats.preserve import preserved
from snip_ds.stats.settings import CollectSettings


class Collector:
    """One collection's hooks, passes and sums (the module docstring). It runs the passes and routes what each
    hook sees to the estimators it composes, which share one :class:`~snip_ds.stats.common.Shared`:
    ``fld`` (:class:`~snip_ds.stats.fld.FldEstimator`), ``bwd`` (:class:`~snip_ds.stats.bwd.BwdEstimator`,
    with ``groups`` for ``bwd_propagated``), ``fwd`` (:class:`~snip_ds.stats.fwd.ForwardDrift`, with
    ``forward_drift``) and ``iso`` (:class:`~snip_ds.stats.isotropic.IsotropicProbe`, the isotropic ablation)."""

    def __init__(self, model: nn.Module, layers: Dict[str, Layer], settings: CollectSettings,
                 precond: Precond) -> None:
        self.model, self.layers, self.precisions = model, layers, tuple(settings.precisions)
        # MoE experts' (expert, projection) pairs (snip_ds.stats.experts): their tokens' sequences and counts
        self.points = moe.Points({f: m for f, m in layers.items() if isinstance(m, ExpertPoint)})
        self.estimator, self.propagated = settings.estimator, settings.bwd_propagated
        self.forward_drift = settings.forward_drift
        self.shared = Shared(Sums(), statistics_backend(), self.precisions,
                             tp_first=all(getattr(m, "tp_index", 0) == 0 for m in layers.values()))
        self.stats = self.shared.stats
        device = device_of(model)
        self.gen = torch.Generator(device=device).manual_seed(settings.seed)  # probe labels / isotropic noise
        self.fld = FldEstimator(self.shared, settings)
        self.bwd = BwdEstimator(self.shared, settings, precond, device)
        self.groups = self.bwd.inputs if self.propagated else None
        self.fwd = ForwardDrift(self.shared, self.fld) if self.forward_drift else None
        self.iso = IsotropicProbe(self.shared, self.gen) if self.estimator == "isotropic" else None
        self.phase = Phase.OFF
        # per layer and call of the running forward (call c: the layer's c-th run in it)
        self.calls: Dict[str, int] = {}  # calls so far
        self.x: Dict[str, Dict[int, torch.Tensor]] = {}  # inputs ([T, k] FP32) until their training gradient
        self.g: Dict[str, Dict[int, torch.Tensor]] = {}  # training gradients until every call's has arrived
        self.xp: Dict[str, Dict[int, torch.Tensor]] = {}  # inputs as autograd saved them, for the probe hooks
        self.rows: Dict[str, Dict[int, Rows]] = {}  # each call's sequences (Collector._rows_of)
        self.current: Dict[str, int] = {}  # the call whose backward runs (set by its output-gradient hook)
        self.seen: Dict[str, int] = {}  # rows the layer saw in the batch's forward, over all its calls
        self.emb: Optional[torch.Tensor] = None
        self._lg: Optional[torch.Tensor] = None

    @contextmanager
    def hooks(self) -> Iterator[None]:
        handles = [self.model.get_input_embeddings().register_forward_hook(self._on_embedding)]
        for fqn, mod in self.layers.items():
            # prepend: run while ZeRO-3 still holds the gathered weight (its post-forward hook releases it),
            # and hook the raw output, whose gradient arrives after ZeRO-3's pre-backward re-gather.
            handles.append(mod.register_forward_hook(self._forward_hook(fqn), prepend=True))
        if self.iso is not None:
            block = self.iso.last_block(self.model, self.layers)
            handles.append(block.register_forward_hook(self.iso.on_block_output))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _on_embedding(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        if self.phase not in (Phase.FORWARD, Phase.PROBE_FORWARD, Phase.FWD_PASS):
            return output
        self.emb = output.detach().requires_grad_(True)  # our own leaf: no gradient reaches parameters
        return self.emb.clone()  # what the model gets: a tensor it may scale in place (CTRL, BLT do)

    def new_forward(self) -> None:
        """A forward of the model starts: its layers' calls are counted from 0."""
        self.calls.clear()
        self.xp.clear()
        self.rows.clear()
        self.current.clear()

    def _forward_hook(self, fqn: str):
        def hook(module: SnipLinear, inputs: Any, output: torch.Tensor) -> Optional[torch.Tensor]:
            if self.phase is Phase.FWD_PASS:
                return self.fwd.shifted_output(fqn, module, inputs[0], output)
            if self.phase not in (Phase.FORWARD, Phase.PROBE_FORWARD):
                return
            x = inputs[0]
            call = self.calls.get(fqn, 0)
            self.calls[fqn] = call + 1
            counted = self.phase is Phase.FORWARD
            self.points.on_forward(fqn, module, x, counted=counted)
            self.rows.setdefault(fqn, {})[call] = self._rows_of(fqn, x)
            if not counted:  # a fresh forward for a probe: only its output gradient counts
                self.xp.setdefault(fqn, {})[call] = x.detach()
                if output.requires_grad:
                    output.register_hook(lambda g: self._on_output_grad(fqn, module, g, call))
                return
            if call == 1 and (self.fwd is not None or self.groups is not None):
                raise ValueError(f"layer {fqn!r} runs more than once per forward: forward_drift and "
                                 f"bwd_propagated measure layers that run once; collect without them")
            self.seen[fqn] = self.seen.get(fqn, 0) + x.numel() // x.shape[-1]
            self._on_forward(fqn, module, x, output, call)
        return hook

    def _rows_of(self, fqn: str, x: torch.Tensor) -> Rows:
        """The sequences of a layer's input (and so of its output's gradient): ``[B, L, k]``'s B, or an expert's
        tokens' sequences."""
        if fqn in self.points:
            return self.points.rows(fqn)
        return x.shape[0] if x.dim() >= 3 else 1

    def _on_forward(self, fqn: str, module: SnipLinear, x: torch.Tensor, y: torch.Tensor, call: int) -> None:
        x2 = flat(x)  # [T, k]
        gid = self.bwd.on_forward(fqn, module, x)
        if self.fwd is not None:
            self.fwd.on_forward(fqn, x2)
        if self.estimator != "empirical":
            self.xp.setdefault(fqn, {})[call] = x.detach()  # the tensor autograd keeps anyway: no copy
        if self.groups is not None and gid is not None and x.requires_grad:
            x.register_hook(lambda g, gid=gid: self._on_input_grad(gid, g))
        if y.requires_grad:
            self.x.setdefault(fqn, {})[call] = x2
            y.register_hook(lambda g: self._on_output_grad(fqn, module, g, call))
        else:  # no training gradient will arrive: the fprop statistics now (no first-order term)
            self.fld.on_output(fqn, module, x2, None)
            if self.fwd is not None:
                self.fwd.on_weights(fqn, module, None)

    def _on_input_grad(self, gid: str, g: torch.Tensor) -> None:
        if self.phase is Phase.TRAIN:
            self.bwd.on_input_grad(gid, g)

    def _on_output_grad(self, fqn: str, module: SnipLinear, g: torch.Tensor, call: int) -> None:
        # a tensor-parallel shard: scales from the whole tensor's amax
        with shared_amax(getattr(module, "amax_reduce", None)):
            self._output_grad(fqn, module, g, call)

    def _stacked(self, fqn: str) -> Optional[Tuple[torch.Tensor, torch.Tensor, Rows]]:
        """The layer's inputs, training gradients and sequences over all its calls once every call's gradient
        has arrived (one call: as they are; several: stacked along the tokens in call order), else None."""
        xs, gs = self.x[fqn], self.g[fqn]
        if len(gs) < len(xs):
            return None
        del self.x[fqn], self.g[fqn]
        calls = sorted(xs)
        if len(calls) == 1:
            return xs[calls[0]], gs[calls[0]], self.rows[fqn][calls[0]]
        seqs = [dv.sequence_index(self.rows[fqn][c], xs[c].shape[0], xs[c].device) for c in calls]
        return torch.cat([xs[c] for c in calls]), torch.cat([gs[c] for c in calls]), torch.cat(seqs)

    def _output_grad(self, fqn: str, module: SnipLinear, g: torch.Tensor, call: int) -> None:
        g2 = flat(g)  # [T, n]
        if self.phase in (Phase.PROBE, Phase.ISO):  # the FLD follows in the layer's backward (_on_layer_backward)
            self.current[fqn] = call
            self.stats.add(fqn, PROBE_SQ.key(), dv.channel_sq_sum(g2))
            if self.fwd is not None and call in self.xp.get(fqn, {}):
                self.fwd.on_probe(fqn, self.xp[fqn][call], g2)
        elif self.phase is Phase.TRAIN:
            self.g.setdefault(fqn, {})[call] = g2
            stacked = self._stacked(fqn)
            if stacked is None:  # more calls' gradients to come
                return
            x2, g2, rows = stacked
            self.fld.on_output(fqn, module, x2, g2, rows)
            pmat = self.bwd.on_train_grad(fqn, module, x2, g2)
            if self.fwd is not None:
                self.fwd.on_weights(fqn, module, pmat)
            if self.estimator == "empirical":  # the training gradient is this estimator's probe
                self.stats.add(fqn, PROBE_SQ.key(), dv.channel_sq_sum(g2 * self.shared.n_local))

    def on_layer_backward(self, fqn: str, module: SnipLinear, g: torch.Tensor, gx: Optional[torch.Tensor]) -> None:
        """A probe's backward through layer ``fqn``: its output gradient g and its own input gradient ``gW``
        (None where the input needs none), for the sequence-form FLD (the call is the one whose output gradient
        hook ran last: a layer's backward follows its output's gradient at once)."""
        if self.phase in (Phase.PROBE, Phase.ISO):
            call = self.current.get(fqn, 0)
            rows = self.rows.get(fqn, {}).get(call, 1)
            several = self.calls.get(fqn, 0) > 1
            with shared_amax(getattr(module, "amax_reduce", None)):
                self.fld.on_probe(fqn, module, self.xp.get(fqn, {}).get(call), flat(g), rows,
                                  flat(gx) if gx is not None else None, several=several)

    def _probe_root(self, ids, mask, labels, retain: bool, last: bool):
        """The logits to back-propagate a probe from: the retained graph's, or a fresh forward's."""
        if retain:
            return self._lg, not last
        self.phase = Phase.PROBE_FORWARD
        self.new_forward()
        lg = targets(self.model(input_ids=ids, attention_mask=mask).logits, labels)[0]
        return lg, False

    def _drift_pass(self, ids, mask, labels) -> None:
        """One forward_drift pass: a forward whose layers are shifted, and the training loss's backward."""
        self.phase = Phase.FWD_PASS
        lg, tg = targets(self.model(input_ids=ids, attention_mask=mask).logits, labels)
        self.phase = Phase.FWD_BACKWARD
        torch.autograd.grad(F.cross_entropy(lg, tg), self.emb)

    def _mean_loss(self, ids, mask, labels) -> float:
        lg, tg = targets(self.model(input_ids=ids, attention_mask=mask).logits, labels)
        return float(F.cross_entropy(lg, tg))

    def _set_alpha_phase(self, running: bool) -> None:
        self.phase = Phase.ALPHA if running else Phase.OFF

    def run_batch(self, batch: Any, num_probes: int, retain_graph: bool = True) -> int:
        ids, mask, labels = unpack(batch)
        device = device_of(self.model)
        ids = ids.to(device)
        mask = mask.to(device) if mask is not None else None
        self.points.begin_batch(ids.shape[1])
        self.seen.clear()
        self.new_forward()
        with torch.enable_grad():
            self.phase = Phase.FORWARD
            self.bwd.begin_forward()
            logits = self.model(input_ids=ids, attention_mask=mask).logits
            self.bwd.end_forward()
            self.phase = Phase.OFF
            lg, tg = targets(logits, labels)
            n = int(tg.numel())
            if n == 0:
                raise ValueError("batches: a batch has no target tokens (all labels are -100)")
            self.shared.n_local = float(n)
            loss = F.cross_entropy(lg, tg)
            st = self.stats
            once = self.shared.once  # a tensor-parallel group's ranks share the batch: count it once
            st.add(GLOBAL, N_TOKENS.key(), once(torch.tensor(float(n))))
            st.add(GLOBAL, N_ROWS.key(), once(torch.tensor(float(ids.numel()))))
            st.add(GLOBAL, LOSS_SUM.key(), once(loss.detach() * n))
            self.points.add_routed(st)
            extra = self.estimator == "mc_fisher" or self.estimator == "isotropic"
            self.phase = Phase.TRAIN
            torch.autograd.grad(loss, self.emb, retain_graph=extra and retain_graph)
            self.x.clear()
            self.g.clear()
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
                    self.phase = Phase.PROBE
                    torch.autograd.grad(F.cross_entropy(root, y_hat, reduction="sum"), self.emb,
                                        retain_graph=keep)
                    self.fld.end_probe()
                    if self.fwd is not None:
                        emb = self.emb
                        self.fwd.passes(lambda: self._drift_pass(ids, mask, labels))
                        self.emb = emb
            elif self.iso is not None:
                for r in range(num_probes):
                    _, keep = self._probe_root(ids, mask, labels, retain_graph, r == num_probes - 1)
                    self.phase = Phase.ISO
                    torch.autograd.grad(self.iso.probe_loss(), self.emb, retain_graph=keep)
                    self.fld.end_probe()
            self._lg = None
            self.xp.clear()
            if self.fwd is not None:
                self.fwd.end_batch()
            self._uncalled(device)
            self._fold(int(ids.numel()), num_probes)
            self.phase = Phase.OFF
        if self.iso is not None:
            self.iso.alpha(lambda: self._mean_loss(ids, mask, labels), self._set_alpha_phase)
            self.iso.end_batch()
        self.emb = None
        return int(ids.numel())

    def _uncalled(self, device: torch.device) -> None:
        """Each layer's rows this batch (``rows``, the tokens of all its calls); and the layers that saw none
        (an expert no token was routed to, a layer the forward never called) measured on one all-zero token
        (:mod:`snip_ds.stats.idle`)."""
        probe = self.estimator != "empirical"
        idle = list(self.points.unrouted())
        for fqn, module in self.layers.items():
            if fqn in self.points:
                continue
            self.stats.add(fqn, CALL_ROWS.key(), self.shared.once(torch.tensor(float(self.seen.get(fqn, 0)))))
            if fqn not in self.seen:
                idle.append((fqn, module))
        for fqn, point in idle:
            add_zero_token(fqn, point, device, self.fld, self.bwd, self.stats, probe)

    def _fold(self, rows: int, num_probes: int) -> None:
        """Turns this batch's per-channel vectors into per-layer scalars, priced with its own probes.

        ``Σ_j v_j · m_j`` with ``m = Σ_t g²/(rows·probes)`` replaces keeping ``v`` and ``m`` until the end, so
        only scalars are all-reduced (a few per layer, whatever the model's width). With one batch per rank
        this is exactly the per-channel formula; across batches and ranks it sums per-batch products, which
        equals it when every batch sees the same sensitivities.
        """
        probes = 1 if self.estimator == "empirical" else num_probes
        st = self.stats
        folds = [(f, p) for f in fld.FOLDS + bwd.FOLDS for p in self.precisions]
        folds += [(f, None) for f in bwd.LAYER_FOLDS]
        for fqn in self.layers:
            probe = st.pop(fqn, PROBE_SQ.key())
            # mean_t g_tj² over the tokens the layer saw: the batch's, or an expert's routed tokens
            seen = self.points.tokens(fqn) if fqn in self.points else self.seen.get(fqn, rows)
            m = probe / float(seen * probes) if probe is not None and seen else None
            for vec, suffix in folds:
                v = st.pop(fqn, vec.key(suffix))
                if v is not None:
                    st.add(fqn, vec.folded_into.key(suffix), (v * m).sum() if m is not None else torch.zeros(()))


def collect_statistics(model: nn.Module, batches: Iterable[Any], settings: Optional[CollectSettings] = None, *,
                       lr: float, precond: Precond = None, step_scale: float = 1.0, step: int = 0,
                       world_size: int = 1, reduce: Optional[Reduce] = None,
                       layers: Optional[Iterable[str]] = None) -> Dict[str, Any]:
    """One SNIP statistics collection on the given batches; leaves no trace on the model.

    Args:
        model: a Hugging Face causal LM whose decoder linears are :class:`SnipLinear`.
        batches: LongTensor ``[B, L]`` token ids, or mappings with ``input_ids`` (optional ``attention_mask``,
            ``labels``; ``-100`` ignored). Each batch plays one step's rank-local batch.
        settings: how the statistics are estimated (:class:`CollectSettings`); default its defaults.
        lr: learning rate η of the next steps.
        precond: ``{fqn: P}`` (weight-shaped tensors, e.g. :func:`adam_precond`), or a callable
            ``(fqn, t) -> Σ_owned (t⊙P)²`` for partitioned states (module docstring), or a mapping of such
            callables; None (or an empty mapping: no optimizer state yet) uses ``settings.precond_fallback``
            (default ``"factored"``: a rank-1 estimate of Adam's first-step ``v̂ = G_W²``; ``"grad_sq"``;
            ``"ones"``). The artifact's ``"precond"`` says
            which was used.
        step_scale: ``c`` in the drift ``lr·c·ΔG⊙P``: 1 = eventual drift (the planner's λ is a horizon in
            steps); :func:`snip_ds.divergence.adam_step_scale` = one step's drift.
        step: the training step, recorded.
        world_size: data-parallel ranks ``W`` behind ``reduce``.
        reduce: ``reduce(t) -> t`` summing over data-parallel ranks (called exactly once); None = identity.
        layers: fqns to measure; default every SnipLinear and every (expert, projection) pair of the model's
            :class:`~snip_ds.experts.module.SnipExperts` (``<experts path>.<expert>.<projection>``).

    Returns:
        The ``snip_ds.stats/1`` artifact (JSON-ready). Per layer: ``flops``; ``fld``, ``bwd`` (loss units,
        the planner's costs; each ``{precision: number}``), ``nonfinite``; with ``forward_drift`` ``fwd``,
        with ``bwd_propagated`` ``bwd_propagated``, ``bwd_drift_propagated``, ``bwd_dgrad``, ``dgrad_err``;
        and the groups of ``settings.study_fields``: ``fld_sequence``, ``fld_channel``; ``first_order``;
        ``quant_err``, ``rel_quant_err`` (summed over the operands X, W, G_Y) and the same per operand
        (``quant_err_x`` ...  ``rel_quant_err_g``); ``bwd_bias`` and ``bwd_drift_bias`` (the systematic part
        of ``bwd`` and ``bwd_drift``: what persists from step to step); ``bwd_drift``
        (``(lr·c)²‖ΔG_W⊙P‖²``, parameter units). Non-finite numbers are written as null and flag the layer.
        An expert pair's record also has ``routed_tokens`` (per step, all ranks; its ``flops`` follow them) and
        ``no_tokens`` (no token reached it: its ``fld`` and ``bwd`` are 0, :mod:`snip_ds.stats.experts`).
    """
    if settings is None:
        settings = CollectSettings()
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
    mods = select_layers(model, layers)
    moe.check_settings(mods, settings)
    precond = check_precond(precond, mods, settings.forward_drift, settings.estimator)

    col = Collector(model, mods, settings, precond)
    rows_per_batch, n_batches = None, 0
    with preserved(model, mods, col.on_layer_backward), col.hooks(), fp32_matmuls(device_of(model), settings.collect_tf32):
        for batch in batches:
            rows = col.run_batch(batch, settings.num_probes, settings.retain_graph)
            rows_per_batch = rows_per_batch or rows
            n_batches += 1
    if n_batches == 0:
        raise ValueError("batches is empty: need at least one batch")
    col.fld.flush()  # tensor-parallel shards' per-sequence sums: reduced over their group, then squared
    col.stats.reduce(reduce, device_of(model))
    return finalize(col.stats, mods, settings, sources=col.bwd.sources, groups=col.bwd.inputs, n_batches=n_batches,
                    tokens_per_step=rows_per_batch * world_size, lr=float(lr), step=int(step),
                    world_size=world_size, step_scale=float(step_scale))
