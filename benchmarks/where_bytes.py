"""Where a step's bytes are, for ``bench_layer_host.py``: what autograd keeps, by who keeps it; what is live at an
eager step's peak and what made it; and the CPU allocator's peak without the bytes an operator allocates and frees
inside its own call (a CPU kernel's scratch, such as the FP32 copies of the CPU's ``torch._scaled_mm``).

* :func:`saved_by_owner`: the storages autograd keeps between forward and backward (each once, parameters' not),
  split into those only the model's linear layers keep (saved while a linear's forward runs, and by nothing else)
  and the rest. A linear is recognised by structure: a module without children holding a 2-D ``weight``
  Parameter (``nn.Linear``, ``SnipLinear``, torchao's ``Float8Linear``).
* :class:`PeakLive`: :class:`~snip_ds.backend.dispatch_audit.LiveBytes` that also notes, for each live storage,
  the operator that allocated it, its shape and dtype and whether it ran in forward or backward, and keeps that
  list as it stands at the peak, with the operator during which the peak was reached.
* :func:`allocator_peaks`: from a memory profile's event tree, the peak of the CPU allocator's bytes, and the
  peak of the bytes that outlive the operator call that allocated them (an allocation freed before any
  ``aten::`` operator around it returns is that operator's scratch).
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch
import torch.utils._pytree as pytree

from snip_ds.backend.dispatch_audit import LiveBytes


def is_linear(module: torch.nn.Module) -> bool:
    """A linear layer, by structure: no child modules, a 2-D ``weight`` Parameter."""
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.nn.Parameter) and weight.dim() == 2 and next(module.children(), None) is None


def saved_by_owner(step, params: Iterable[torch.Tensor], linears: Iterable[torch.nn.Module] = ()) -> dict:
    """Runs ``step(context)`` (one forward + backward, ``context`` entered around the forward) and returns the
    bytes of the storages autograd kept for backward, each storage once, ``params``' not: ``bytes`` in all,
    ``linear_only_bytes`` of those only ``linears`` kept (saved inside one's forward, and by nothing outside
    them), and ``tensors``: ``[bytes, shape, dtype, "linear" | "other" | "both"]``, largest first. (Hooks on
    ``linears`` tell who saves: pass none for a compiled module, whose graph the hooks would change.)"""
    skip = {p.untyped_storage().data_ptr() for p in params}
    inside = [0]
    owners: Dict[int, set] = {}
    sizes: Dict[int, Tuple[int, tuple, str]] = {}

    def enter(*_):
        inside[0] += 1

    def leave(*_):
        inside[0] -= 1

    def pack(t):
        for leaf in _inner(t):
            ptr = leaf.untyped_storage().data_ptr()
            if ptr in skip or leaf.numel() == 0:
                continue
            owners.setdefault(ptr, set()).add("linear" if inside[0] else "other")
            sizes.setdefault(ptr, (leaf.untyped_storage().nbytes(), tuple(leaf.shape),
                                   str(leaf.dtype).replace("torch.", "")))
        return t

    handles = []
    for module in linears:
        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        step(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
    finally:
        for handle in handles:
            handle.remove()
    tensors = []
    for ptr, (nbytes, shape, dtype) in sizes.items():
        who = owners[ptr]
        tensors.append([nbytes, list(shape), dtype, "both" if len(who) == 2 else next(iter(who))])
    tensors.sort(key=lambda e: -e[0])
    return {"bytes": sum(e[0] for e in tensors),
            "linear_only_bytes": sum(e[0] for e in tensors if e[3] == "linear"), "tensors": tensors}


def _inner(t: torch.Tensor) -> List[torch.Tensor]:
    """The plain tensors a tensor subclass holds (its ``__tensor_flatten__``), or the tensor itself."""
    if type(t).__torch_dispatch__ is torch.Tensor.__torch_dispatch__ or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [leaf for name in names for leaf in _inner(getattr(t, name))]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class PeakLive(LiveBytes):
    """:class:`LiveBytes` that keeps what was live at the peak: ``at_peak``, ``[bytes, phase, operator, shape,
    dtype]`` per live storage (phase: ``backward`` where autograd's engine ran the operator that allocated it,
    else ``forward``), and ``peak_op``, the operator whose outputs brought the peak, with its phase and its
    place among the step's operators."""

    def __init__(self) -> None:
        super().__init__()
        self._made: Dict[int, tuple] = {}
        self.ops = 0
        self.at_peak: List[list] = []
        self.peak_op: Dict[str, object] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = set(self._held)
        peak = self.peak
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is NotImplemented:
            return out
        phase = "backward" if _in_backward() else "forward"
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ptr = t.untyped_storage().data_ptr()
                if ptr in self._held and ptr not in before:
                    self._made[ptr] = (phase, str(func), list(t.shape), str(t.dtype).replace("torch.", ""))
        self.ops += 1
        if self.peak > peak:
            self.at_peak = sorted(([n, *self._made[p]] for p, n in self._held.items()), key=lambda e: -e[0])
            self.peak_op = {"op": str(func), "phase": phase, "index": self.ops}
        return out


def held_difference(held: List[list], reference: List[list]) -> List[list]:
    """What one peak's live list (:attr:`PeakLive.at_peak`) holds beyond another's, and lacks of it: tensors
    matched by phase, shape, dtype and bytes (whatever operator made them: a GEMM's output is one in either);
    ``[bytes (negative: lacking), count, phase, the operators that made that side's tensors of this kind, shape,
    dtype]``, the largest first."""
    def tally(entries):
        made: Dict[tuple, List[str]] = {}
        for nbytes, phase, op, shape, dtype in entries:
            made.setdefault((phase, tuple(shape), dtype, nbytes), []).append(op)
        return made

    mine, theirs = tally(held), tally(reference)
    out = []
    for key in set(mine) | set(theirs):
        count = len(mine.get(key, ())) - len(theirs.get(key, ()))
        if count:
            phase, shape, dtype, nbytes = key
            ops = sorted(set((mine if count > 0 else theirs)[key]))
            out.append([nbytes * count, abs(count), phase, ", ".join(ops), list(shape), dtype])
    out.sort(key=lambda e: (-abs(e[0]), -e[0], e[3]))
    return out


def allocator_peaks(prof) -> dict:
    """From a memory profile (``torch.profiler.profile(profile_memory=True)``), the CPU allocator's allocations
    during it: :func:`peaks` of :func:`allocation_events`."""
    return peaks(allocation_events(prof))


def allocation_events(prof) -> List[tuple]:
    """The CPU allocator's allocations and frees in a memory profile, in time order: ``(time, address, bytes
    (negative: a free), the ids of the aten:: operator calls it happened inside, their names)``, outermost first."""
    events = []

    def walk(node, calls: tuple, names: tuple) -> None:
        fields = node.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation":
            if fields.device.type == "cpu":
                events.append((node.start_time_ns, fields.ptr, fields.alloc_size, calls, names))
            return
        if node.name.startswith("aten::"):
            calls, names = calls + (node.id,), names + (node.name,)
        for child in node.children:
            walk(child, calls, names)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, (), ())
    return sorted(events, key=lambda e: e[0])


def peaks(events: List[tuple]) -> dict:
    """Of :func:`allocation_events`' list: ``peak_bytes``, the peak of the bytes allocated above what was
    allocated when it began; ``outliving_peak_bytes``, the same counting only allocations that outlive the call
    of every ``aten::`` operator they were made in (one freed inside such a call is that operator's scratch);
    ``scratch_at_peak_bytes``: the scratch live at the first peak; and ``peak_in``: the operators (outermost
    first) whose call made the allocation that reached the first peak."""
    scratch = set()  # indexes of the allocations and frees of operators' scratch
    open_allocs: Dict[int, int] = {}
    for i, (_, ptr, nbytes, calls, _) in enumerate(events):
        if nbytes > 0:
            open_allocs[ptr] = i
        elif ptr in open_allocs:
            j = open_allocs.pop(ptr)
            if set(events[j][3]) & set(calls):
                scratch.update((i, j))
    live = peak = outliving = outliving_peak = scratch_live = scratch_at_peak = 0
    peak_in: Tuple[str, ...] = ()
    for i, (_, _, nbytes, _, names) in enumerate(events):
        live += nbytes
        if i in scratch:
            scratch_live += nbytes
        else:
            outliving += nbytes
            outliving_peak = max(outliving_peak, outliving)
        if live > peak:
            peak, scratch_at_peak, peak_in = live, scratch_live, names
    return {"peak_bytes": peak, "outliving_peak_bytes": outliving_peak, "scratch_at_peak_bytes": scratch_at_peak,
            "peak_in": list(peak_in)}


def markdown(rows: List[dict]) -> List[str]:
    """The Markdown section of ``bench_layer_host.md`` on where the rows' bytes are (the rows' fields that
    :func:`saved_by_owner`, :class:`PeakLive` and :func:`allocator_peaks` fill)."""
    rows = [r for r in rows if "error" not in r]
    base = {(r["scope"], r["mode"]): r for r in rows if r["variant"] == "bf16"}
    lines = ["", "## Where the bytes are", "",
             "Kept for backward (eager): the storages only the linears keep (saved inside a linear's forward and by "
             "nothing else; a linear: a module without children holding a 2-D weight) and the rest, which the "
             "linears' recipe does not change; the rest alone against bf16's whole.", "",
             "| scope | variant | saved B | kept only by the linears B | the rest B | the rest × bf16's saved |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "saved_linear_only_bytes" not in r:
            continue
        rest, b = r["saved_bytes"] - r["saved_linear_only_bytes"], base.get((r["scope"], r["mode"]))
        ratio = f"{rest / b['saved_bytes']:.2f}" if b and b.get("saved_bytes") else "-"
        lines.append(f"| {r['scope']} | {r['variant']} | {r['saved_bytes']} | {r['saved_linear_only_bytes']} | "
                     f"{rest} | {ratio} |")
    lines += ["", "The eager peak (live tensors' bytes): the operator whose outputs reached it, and what was live then "
              "beyond bf16's peak of the same scope, and what bf16 had live that the row had not (+ bytes more, - "
              "bytes fewer: count, shape, dtype, made in forward or backward by which operator; tensors matched "
              "by shape, dtype and phase whatever made them).", "",
              "| scope | variant | peak B | reached at | held beyond bf16's peak / lacking of it |", "|---|---|---|---|---|"]
    for r in rows:
        if "peak_op" not in r:
            continue
        op = r["peak_op"]
        b = base.get((r["scope"], r["mode"]))
        diff = held_difference(r["peak_held"], b["peak_held"]) if b and r is not b and "peak_held" in b else []
        cell = "; ".join(f"{'+' if e[0] > 0 else ''}{e[0]} ({e[1]}x {e[4]} {e[5]}, {e[2]} `{e[3]}`)" for e in diff[:8])
        if len(diff) > 8:
            cell += f"; {len(diff) - 8} more"
        lines.append(f"| {r['scope']} | {r['variant']} | {r['peak_bytes']} | {op.get('phase')} `{op.get('op')}` "
                     f"(operator {op.get('index')}) | {cell or '-'} |")
    alloc = [r for r in rows if "peak_alloc_outliving_bytes" in r]
    if alloc:
        lines += ["", "The CPU allocator's peak: all its bytes (a CPU kernel's scratch included), and the peak of the "
                  "bytes that outlive the operator call that allocated them (scratch: allocated and freed inside one "
                  "`aten::` operator's call, as the CPU's `_scaled_mm` emulation's FP32 copies are); the scratch live "
                  "at the peak, and the operators whose call reached it.", "",
                  "| scope | mode | variant | peak B | outliving its operator B | × bf16 | scratch at the peak B | "
                  "reached in |", "|---|---|---|---|---|---|---|---|"]
        for r in alloc:
            ratio = r.get("peak_alloc_outliving_bytes_ratio_vs_bf16")
            where = " > ".join(f"`{n}`" for n in r.get("peak_alloc_in", [])) or "-"
            lines.append(f"| {r['scope']} | {r['mode']} | {r['variant']} | {r['peak_alloc_bytes']} | "
                         f"{r['peak_alloc_outliving_bytes']} | {'-' if ratio is None else f'{ratio:.3f}'} | "
                         f"{r['peak_alloc_scratch_bytes']} | {where} |")
    return lines
