"""Non-finite numbers in a training step: :class:`NonFiniteGuard` checks every trainable parameter's gradient and
each micro-batch's loss for NaN/Inf, lets the ranks agree before the update, and then stops the run
(:class:`NonFiniteError`, ``snip.nonfinite: "stop"``) or skips the update (:func:`run_without_update`, ``"skip"``);
:func:`located_forward_hooks` names the first module whose forward output went non-finite. Used by
:class:`snip_ds.engine.state.SnipState` under both loops.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch
from torch import nn

from snip_ds.runtime import distributed as sdist
from snip_ds.runtime.console import say


class NonFiniteError(RuntimeError):
    """A NaN or Inf loss or gradient stopped training (``snip.nonfinite: "stop"``), before the step's update.
    The message, the same on every rank, names the step, the micro-batch (where the loop knows it), the rank
    and the first module whose forward output went non-finite (where the loop can re-run the batch)."""


def floating_tensors(out) -> list:
    """The floating-point tensors of a module's output (a tensor, a tuple/list, or a dict / ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in floating_tensors(o)]
    if isinstance(out, Mapping):
        return [t for o in out.values() for t in floating_tensors(o)]
    return []


def run_without_update(optimizer, step: Callable[[], Any], scheduler: Any = None) -> None:
    """Runs ``step`` (DeepSpeed's ``engine.step``) with the wrapped base optimizer's update and ``scheduler``'s
    step (DeepSpeed's ``engine.lr_scheduler``) suppressed -- what DeepSpeed's own overflow skip does, for any ZeRO
    stage and precision: DeepSpeed still finishes the step (drops the accumulated gradients, advances its step
    counter), but no parameter, optimizer state or learning rate changes."""
    base = getattr(optimizer, "optimizer", optimizer)  # ZeRO / bf16 wrappers hold it there
    held = [obj for obj in (base, scheduler) if obj is not None]
    own = [vars(obj).get("step") for obj in held]  # a scheduler may have wrapped step on the instance
    for obj in held:
        obj.step = lambda *args, **kwargs: None
    try:
        step()
    finally:
        for obj, mine in zip(held, own):
            if mine is None:
                del obj.step
            else:
                obj.step = mine


def max_abs(grad: torch.Tensor) -> torch.Tensor:
    """The largest magnitude in ``grad`` (a 0-dim tensor on its device): finite exactly when every element is,
    NaN and Inf propagating -- one reduction, where ``torch.isfinite(grad).all()`` runs four element-wise
    operators (``isfinite`` decomposes) and a reduction."""
    return torch.linalg.vector_norm(grad, float("inf"))


class NonFiniteGuard:
    """Checks every trainable parameter's gradient for NaN/Inf as it is computed (only while armed: the
    training backward passes, not the statistics' own), notes a micro-batch's non-finite loss, and before the
    update lets the ranks agree (one all-reduced flag per optimizer step) and then stop or skip.

    Nothing is read on the host until :meth:`agree`: each gradient leaves one 0-dim tensor on the device
    (:func:`max_abs`), each micro-batch's loss and these are checked in one reduction at the agreement, and only
    when some rank saw a non-finite value are they read one by one to name the first."""

    def __init__(self, state: "SnipState", module: nn.Module) -> None:
        self.state = state
        self._flags: Optional[list] = None
        self._order: Dict[str, int] = {}
        self._noted: List[tuple] = []  # (micro-batch, loss, flags) of this step, not yet checked
        self.bad: Optional[Dict[str, Any]] = None  # this rank's first non-finite micro-batch this step
        for i, (name, p) in enumerate(module.named_parameters()):
            if p.requires_grad:
                self._order[name] = i
                p.register_hook(self._hook(name))

    def _hook(self, name: str):
        def hook(grad: torch.Tensor):
            if self._flags is not None and grad.numel():  # (an empty gradient is finite)
                self._flags.append((name, max_abs(grad)))
            return None
        return hook

    def arm(self) -> None:
        """Gradients computed from now on are checked (until :meth:`disarm`)."""
        self._flags = []

    def disarm(self) -> list:
        """Stops checking; returns the ``(parameter name, largest magnitude)`` pairs gathered since :meth:`arm`
        (each magnitude a 0-dim tensor on the gradient's device, finite exactly when the gradient is)."""
        flags, self._flags = self._flags or [], None
        return flags

    def begin_step(self) -> None:
        self.bad = None
        self._flags = None
        self._noted = []

    def note(self, index: Optional[int], loss: Optional[torch.Tensor], flags: Sequence) -> None:
        """Notes micro-batch ``index``'s loss and gradients (``flags``, :meth:`disarm`'s), read nowhere yet:
        ``index`` and ``loss`` None where the loop does not say which micro-batch, nor show the loss. At
        :meth:`agree` the step's first non-finite one is what counts: the loss of the first micro-batch whose
        loss or gradients went non-finite, or else the gradient of its first parameter in model order whose
        gradient did."""
        self._noted.append((index, None if loss is None else loss.detach(), list(flags)))

    def _any_nonfinite(self) -> torch.Tensor:
        """1.0 if a noted loss or gradient is non-finite, else 0.0 (float64, on the values' device, not read)."""
        values = [t for _, loss, flags in self._noted for t in ([] if loss is None else [loss.reshape(())])
                  + [f for _, f in flags]]
        if not values:
            return torch.zeros((), dtype=torch.float64)
        device = values[0].device
        largest = max_abs(torch.stack([v if v.device == device else v.to(device) for v in values]))
        return torch.isfinite(largest).logical_not().double()

    def _first_nonfinite(self) -> None:
        """Sets :attr:`bad` from the noted micro-batches, in order (reads each value: after a non-finite step)."""
        for index, loss, flags in self._noted:
            if loss is not None:
                value = float(loss.float().cpu())
                if not math.isfinite(value):
                    self.bad = {"micro_batch": index, "what": f"loss ({value})"}
                    return
            if not flags:
                continue
            device = flags[0][1].device
            finite = torch.isfinite(torch.stack([f.to(device) for _, f in flags])).tolist()
            if not all(finite):
                name = min((n for (n, _), ok in zip(flags, finite) if not ok), key=lambda n: self._order.get(n, 0))
                seen = "the loss was finite" if loss is not None else "the loop does not show SNIP the loss"
                self.bad = {"micro_batch": index, "what": f"gradient (of {name}, the first such parameter in model "
                                                          f"order; {seen})"}
                return

    def agree(self) -> bool:
        """Collective: whether any rank saw a non-finite loss or gradient this step (what :meth:`note` noted):
        the ranks' flags summed on the device, one host read. Where one did, this rank's first (:attr:`bad`)
        is found before this returns."""
        agreed = sdist.dist_sum(self._any_nonfinite()).item() > 0
        if agreed:
            self._first_nonfinite()
        self._noted = []
        return agreed

    def act(self, micro_batches: int, locate: Optional[Callable[[int], Optional[str]]] = None) -> None:
        """Collective, after :meth:`agree` said yes: the same report on every rank; raises
        :class:`NonFiniteError` (``snip.nonfinite: "stop"``) or counts and logs the skip (the caller then skips
        the update).

        Args:
            micro_batches: the step's number of micro-batches.
            locate: ``locate(i)`` re-runs micro-batch ``i``'s forward with hooks and names the first module
                whose output is non-finite (every rank runs it: under ZeRO-3 a forward is collective); None
                where the loop does not hand SNIP its batches (the Trainer).
        """
        st = self.state
        reports = sdist.all_gather_json(self.bad)
        rank = min(r for r, rep in enumerate(reports) if rep)
        rep = reports[rank]
        if locate is not None and rep["micro_batch"] is not None:
            located = sdist.all_gather_json(locate(rep["micro_batch"]))[rank]
            where = (f"first module with a non-finite output: {located}" if located else
                     "every module's forward output was finite: the backward pass went non-finite")
            at = f"micro-batch {rep['micro_batch'] + 1} of {micro_batches}"
        else:
            where = ("the module whose output went non-finite is not located (the training loop does not hand "
                     "SNIP its batches to re-run)")
            at = f"one of its {micro_batches} micro-batch(es)"
        step = st.step
        msg = f"non-finite {rep['what']} at step {step + 1}, {at} on rank {rank}; {where}"
        self.bad = None
        if st.settings.nonfinite != "skip":
            raise NonFiniteError(f"{msg}; the step's update was not applied and no checkpoint was saved after "
                                 f"step {step} (snip.nonfinite \"skip\" skips such steps instead)")
        st.skipped_steps += 1
        st.logger.scalar("train/skipped_steps", st.skipped_steps, step + 1)
        st.logger.text("train/nonfinite", f"step {step + 1}: {msg}; skipped", step + 1)
        if sdist.rank() == 0:
            say(f"snip_ds: warning: {msg}; step skipped ({st.skipped_steps} so far)")


def located_forward_hooks(module: nn.Module, found: List[str]) -> list:
    """Forward hooks on every submodule that record, in ``found``, the first one (in the order modules finish
    their forward) whose output holds a NaN or Inf; returns the handles to remove."""
    def hook(name):
        def check(mod, inputs, output):
            if not found and any(not bool(torch.isfinite(t).all()) for t in floating_tensors(output)):
                found.append(f"{name} ({type(mod).__name__})")
        return check
    return [m.register_forward_hook(hook(n)) for n, m in module.named_modules() if n]
