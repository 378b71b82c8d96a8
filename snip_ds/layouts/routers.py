"""Which linears of an MoE block are its routers, proved by what consumes their output.

A linear in an MoE block (the module holding an experts module or a list of expert MLPs) whose output width is
the number of experts is only a *candidate*: a shared expert's or an expert's own projection may have that width
too. The MoE block's forward runs once on random tokens with every candidate's output traced: the output, through
any ops but a GEMM (softmax, sigmoid, a bias, a reshape), must be ranked (``topk``, ``argmax``, ``sort`` ...), and
the ranks (through any ops: ``one_hot``, ``where``, indexing) must reach the inputs of the experts. Such a linear
decides where tokens go and is a router; one whose output is only values is an ordinary layer.

The probe runs on random FP32 weights of the block's full shapes swapped in with ``torch.func.functional_call``
(the model's own Parameters are neither read nor changed, ZeRO-3 partitioned ones included), with the experts
themselves stubbed (they return zeros and record what they receive, so their weights cost nothing) and the
block's own hooks set aside; once per block class and shapes. A block whose forward does not run on hidden
states alone (a decoder block that also holds attention), or that calls none of its experts modules, proves
nothing: :func:`proved_routers` then returns None and the caller keeps every candidate out, as a router would be.
"""
from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import Dict, FrozenSet, Iterator, List, Optional, Sequence

import torch
from torch import nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

from snip_ds.types import full_shape

_RANKING = {"topk", "argmax", "argmin", "sort", "argsort", "max", "min", "kthvalue", "multinomial", "mode"}
_MIXING = {"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "einsum", "mv",
           "addmv", "bilinear", "conv1d", "conv2d", "tensordot"}
_PROBE_TOKENS = 16

_proved: Dict[tuple, Optional[FrozenSet[str]]] = {}  # once per block class and shapes


def _tensors(obj) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


class _Trace(TorchFunctionMode):
    """Follows two labels per tensor: ``scores`` (derived from a candidate's output by ops other than GEMMs) and
    ``ranks`` (derived from the indices a ranking op returned for such scores, through any ops)."""

    def __init__(self):
        super().__init__()
        self.scores: Dict[int, set] = {}
        self.ranks: Dict[int, set] = {}
        self.alive: List[torch.Tensor] = []  # keeps the ids unique while the trace runs

    def mark(self, table: Dict[int, set], tensors, labels) -> None:
        for t in tensors:
            table.setdefault(id(t), set()).update(labels)
            self.alive.append(t)

    def labels(self, table: Dict[int, set], tensors) -> set:
        return set().union(*(table.get(id(t), ()) for t in tensors))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        inputs = list(_tensors((args, kwargs)))
        scores, ranks = self.labels(self.scores, inputs), self.labels(self.ranks, inputs)
        outputs = list(_tensors(out))
        if (name.endswith("_") or name == "__setitem__") and args and isinstance(args[0], torch.Tensor):
            outputs.append(args[0])  # in place: the target holds what went in
        if scores and name in _RANKING:
            ranks |= scores if any(not t.is_floating_point() for t in outputs) else set()
        if scores and name not in _MIXING:
            self.mark(self.scores, [t for t in outputs if t.is_floating_point()], scores)
        if ranks:
            self.mark(self.ranks, outputs, ranks)
        return out


@contextmanager
def _bare(block: nn.Module):
    """``block`` in eval mode with its modules' own forward hooks set aside (ZeRO-3's gathering ones included),
    restored on exit."""
    modules = list(block.modules())
    saved = [(m, m.training, m._forward_pre_hooks, m._forward_hooks) for m in modules]
    try:
        for m in modules:
            m._forward_pre_hooks, m._forward_hooks = OrderedDict(), OrderedDict()
        block.eval()
        yield
    finally:
        for m, training, pre, post in saved:
            m.training, m._forward_pre_hooks, m._forward_hooks = training, pre, post


def _probe(block: nn.Module, candidates: Dict[str, nn.Module], experts: Sequence[nn.Module],
           width: int) -> FrozenSet[str]:
    trace, dispatched, calls = _Trace(), set(), []
    inside = {id(p) for e in experts for p in e.parameters()}
    param = next(block.parameters(), None)
    device = param.device if param is not None and param.device.type != "meta" else torch.device("cpu")
    gen = torch.Generator(device=device).manual_seed(0)

    def random(t):
        return torch.randn(full_shape(t), generator=gen, device=device, dtype=torch.float32)
    values = {n: random(p) for n, p in block.named_parameters() if id(p) not in inside}
    values.update({n: random(b) for n, b in block.named_buffers() if b.is_floating_point()})

    def stub(*args, **kwargs):
        calls.append(1)
        dispatched.update(trace.labels(trace.ranks, list(_tensors((args, kwargs)))))
        first = next(_tensors((args, kwargs)))
        return torch.zeros_like(first)

    def label(name):
        return lambda module, args, out: trace.mark(trace.scores, list(_tensors(out)), {name})

    x = torch.randn(1, _PROBE_TOKENS, width, generator=gen, device=device, dtype=torch.float32)
    with _bare(block):
        for name, module in candidates.items():
            module.register_forward_hook(label(name))
        own = [e.__dict__.get("forward") for e in experts]  # a wrapper's own forward, if any
        for e in experts:
            e.forward = stub
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]), trace:  # the global RNG left as it was
                functional_call(block, values, (x,), strict=False)
        finally:
            for e, forward in zip(experts, own):
                del e.forward
                if forward is not None:
                    e.forward = forward
    if not calls:  # the experts run some other way (their weights read directly): nothing seen, nothing proved
        raise LookupError("the MoE block called none of its experts")
    return frozenset(dispatched)


def proved_routers(block: nn.Module, candidates: Dict[str, nn.Module], experts: Sequence[nn.Module],
                   widths: Sequence[int]) -> Optional[FrozenSet[str]]:
    """The names (keys of ``candidates``: linears inside ``block``, the experts' own aside) whose output decides
    which experts get which tokens, by the probe of the module docstring; ``experts`` are the modules ``block``
    calls as its experts (an experts module, or each expert MLP of a list), ``widths`` the input widths to try
    (the candidates'). None when ``block``'s forward does not run on ``[1, tokens, width]`` hidden states."""
    if not candidates or not experts:
        return None
    inside = {id(p) for e in experts for p in e.parameters()}
    key = (type(block), tuple(sorted(candidates)), tuple(type(e) for e in experts),
           tuple((n, full_shape(p)) for n, p in block.named_parameters() if id(p) not in inside))
    if key not in _proved:
        found = None
        for width in dict.fromkeys(widths):
            try:
                found = _probe(block, candidates, experts, width)
                break
            except Exception:  # noqa: BLE001 - the block needs more than hidden states: nothing proved
                continue
        _proved[key] = found
    return _proved[key]
