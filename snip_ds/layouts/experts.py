"""Mixture-of-Experts experts modules: which modules hold experts, how they store and apply them, and the proof.

In transformers 5 the routed experts of an MoE block are one module holding each projection of all ``E``
experts as one 3-D Parameter (``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``, or stored transposed),
called as ``experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K])``. Most such classes carry
transformers' experts interface (``use_experts_implementation``): flags that say whether the weights are stored
transposed, have biases, a gate (``gate_up_proj``, combined by the class's ``_apply_gate``) or not (``up_proj``
then the activation) and a norm after each expert. :class:`ExpertsLayout` is that description as data.

* **Candidates** (:func:`experts_candidates`): a module carrying the interface's flags, or one whose Parameters
  of three or more dimensions share a leading ``E`` that its MoE block scores (a linear GEMM with ``E`` outputs
  or a router's ``[E, hidden]`` weight beside it) or that the config declares as its expert count, or one called
  as routed experts (``forward(hidden_states, <indices>, <weights>)``) beside a router that scores the
  config's expert count, whatever its weights' shapes (which then decide whether any layout fits). A 3-D Parameter alone (a
  convolution's kernel, RWKV's time mixing, Zamba's per-head projections) makes no experts module.
* **Layout** (:func:`hypotheses`): from the interface's flags where the class has them, else every layout
  consistent with the Parameters' shapes.
* **Proof** (:func:`recognize`): a layout is accepted only when snip_ds's replacement, every pair unquantized,
  reproduces the module's own forward and backward (output, and the gradients of the input, the routing
  weights and every Parameter) on a random routing of random tokens, within the round-off of summing the same
  products in another order. The probe runs once per class and layout on the module's device in FP64 (FP32
  where a kernel lacks FP64), on random weights of the module's hidden width but a narrow expert width and at
  most three experts, swapped in with ``torch.func.functional_call``: the model's own Parameters are neither read
  nor changed (ZeRO-3 partitioned ones included) and it costs well under a second. Anything else is refused
  naming the module, its class and what did not match.
"""
from __future__ import annotations

import inspect
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from torch import nn
from torch.func import functional_call

from snip_ds.layouts.linears import gemm_shape, linear_form
from snip_ds.types import full_shape

INTERFACE_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm")
ROUTED = "routed"  # forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K])
BATCHED = "batched"  # forward(hidden_states [E·T, H]): expert e runs on rows e·T .. (e+1)·T (Llama 4)
_ARITY = {ROUTED: 3, BATCHED: 1}

# The probe's sizes: enough to cover uneven routing and every projection, small enough to cost nothing.
PROBE_EXPERTS, PROBE_WIDTH, PROBE_TOKENS, PROBE_TOP_K = 3, 8, 8, 2


class ExpertsLayoutError(ValueError):
    """An experts module snip_ds cannot replace: the message names the module, its class and what did not match."""


@dataclass(frozen=True)
class ExpertsLayout:
    """How one experts module stores its experts and applies one of them.

    Attributes:
        projections: the 3-D weight Parameters' names, in the order an expert applies them: the input
            projection (gate and up fused into one GEMM when ``gated``), then the output projection.
        transposed: weights stored ``[E, in, out]`` and applied as ``x @ W[e]``; else ``[E, out, in]``.
        bias: each projection has an ``[E, out]`` Parameter named ``<projection>_bias``.
        gated: the first projection computes gate and up; the class's ``_apply_gate`` combines them (without
            one: ``act_fn(first half) * second half``). Else the first projection is an up projection and
            ``act_fn`` follows it.
        post_norm: the module's ``post_expert_norm`` is applied to each expert's output.
        convention: how the module is called: :data:`ROUTED` (each token's top-k experts and routing weights),
            or :data:`BATCHED` (one input of ``E`` equal parts, expert ``e`` on part ``e``: every expert runs
            on every token, the routing weights already applied by the MoE block).
    """

    projections: Tuple[str, str]
    transposed: bool
    bias: bool
    gated: bool
    post_norm: bool = False
    convention: str = ROUTED

    def between(self, module: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """What the experts do between the two projections, with ``module``'s attributes (``act_fn`` ...) and its
        family class's ``_apply_gate`` (``module.family_class``: the class of the module it replaces)."""
        if not self.gated:
            return module.act_fn(h)
        apply_gate = getattr(getattr(module, "family_class", type(module)), "_apply_gate", None)
        if apply_gate is not None:
            return apply_gate(module, h)
        gate, up = h.chunk(2, dim=-1)
        return module.act_fn(gate) * up

    def describe(self) -> str:
        parts = [f"{'gated' if self.gated else 'ungated'} {'/'.join(self.projections)}",
                 "stored [E, in, out]" if self.transposed else "stored [E, out, in]"]
        if self.bias:
            parts.append("with biases")
        if self.post_norm:
            parts.append("post-expert norm")
        return ", ".join(parts)


# ------------------------------------------------------------------------------------------------------
# candidates
# ------------------------------------------------------------------------------------------------------

def has_interface(module: nn.Module) -> bool:
    """Whether ``module`` carries transformers' experts interface (the flags its decorator sets)."""
    return all(hasattr(module, f) for f in INTERFACE_FLAGS)


def _stacked(module: nn.Module) -> Dict[str, Tuple[int, ...]]:
    """The module's own Parameters of three or more dimensions, by name, with their full shapes."""
    return {n: full_shape(p) for n, p in module.named_parameters(recurse=False) if len(full_shape(p)) >= 3}


def expert_count(module: nn.Module) -> Optional[int]:
    """The number of experts a candidate holds: the shared leading dimension of its stacked Parameters."""
    leading = {s[0] for s in _stacked(module).values()}
    return leading.pop() if len(leading) == 1 else None


def _declared_counts(config: Any) -> set:
    """Positive integers a config (and its sub-configs) declares under a name that counts experts."""
    out, seen = set(), set()

    def walk(cfg, depth):
        if cfg is None or id(cfg) in seen or depth > 3:
            return
        seen.add(id(cfg))
        for key, value in vars(cfg).items():
            if "expert" in key and isinstance(value, int) and not isinstance(value, bool) and value > 1:
                out.add(value)
            elif hasattr(value, "to_dict") and hasattr(value, "model_type"):
                walk(value, depth + 1)
    walk(config, 0)
    return out


def _weights(module: nn.Module) -> Dict[str, Tuple[int, ...]]:
    """The Parameters of two or more dimensions in ``module``'s subtree, by name, with their full shapes."""
    return {n: full_shape(p) for n, p in module.named_parameters() if len(full_shape(p)) >= 2}


def _scores(parent: nn.Module, skip: nn.Module, count: int) -> bool:
    """Whether something under ``parent`` (``skip``'s subtree aside) scores ``count`` experts from an input of a
    width ``skip``'s experts read or write: a linear GEMM ``[hidden -> count]``, or a router's own
    ``[count, hidden]`` weight."""
    widths = {d for s in (_stacked(skip) or _weights(skip)).values() for d in s[1:]}
    skipped = {id(m) for m in skip.modules()}
    for m in parent.modules():
        if id(m) in skipped:
            continue
        form = linear_form(m)
        if form is not None and gemm_shape(m, form) in {(w, count) for w in widths}:
            return True
        if any(full_shape(p) in {(count, w) for w in widths} for p in m.parameters(recurse=False)):
            return True
    return False


def experts_candidates(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``(fqn, module)`` of the modules that hold MoE experts (module docstring), outermost first, model order."""
    declared = _declared_counts(getattr(model, "config", None))
    modules = dict(model.named_modules())
    found: List[Tuple[str, nn.Module]] = []
    for fqn, module in modules.items():
        if any(fqn.startswith(f + ".") for f, _ in found):
            continue
        if has_interface(module) or isinstance(getattr(module, "layout", None), ExpertsLayout):
            found.append((fqn, module))  # the interface's flags, or snip_ds's own replacement
            continue
        if isinstance(module, nn.modules.conv._ConvNd) or not _weights(module):  # a kernel, or no weights
            continue
        parent = modules.get(fqn.rsplit(".", 1)[0] if "." in fqn else "", model)
        count = expert_count(module)
        if count is not None and count >= 2 and (count in declared or _scores(parent, module, count)):
            found.append((fqn, module))
        elif _routed_signature(module) and parent is not module and any(
                _scores(parent, module, c) for c in declared | {s[0] for s in _stacked(module).values()}):
            found.append((fqn, module))  # called as routed experts, beside their router
    return found


# ------------------------------------------------------------------------------------------------------
# layouts
# ------------------------------------------------------------------------------------------------------

def _interface_layout(module: nn.Module) -> ExpertsLayout:
    gated = bool(module.has_gate)
    return ExpertsLayout(("gate_up_proj" if gated else "up_proj", "down_proj"), transposed=bool(module.is_transposed),
                         bias=bool(module.has_bias), gated=gated, post_norm=bool(module.has_post_expert_norm))


def hypotheses(module: nn.Module) -> List[ExpertsLayout]:
    """The layouts to try for an experts candidate: the interface's, or those its 3-D Parameters' shapes allow
    (two projections chained through the hidden width; gated where the first has twice the second's input),
    called as its forward's inputs say (three: routed; one: batched)."""
    if has_interface(module):
        return [_interface_layout(module)]
    convention = {arity: name for name, arity in _ARITY.items()}.get(_positional_arity(module))
    if convention is None:
        return []
    stacked = _stacked(module)
    if len(stacked) != 2 or any(len(s) != 3 for s in stacked.values()):
        return []
    (p1, s1), (p2, s2) = stacked.items()
    if s1[0] != s2[0]:  # every expert needs both projections
        return []
    params = dict(module.named_parameters(recurse=False))
    out = []
    for transposed in (False, True):
        (o1, i1), (o2, i2) = ((s1[2], s1[1]), (s2[2], s2[1])) if transposed else ((s1[1], s1[2]), (s2[1], s2[2]))
        if i1 != o2:  # the second projection must give back the hidden width the first one read
            continue
        bias = all(f"{p}_bias" in params and full_shape(params[f"{p}_bias"]) == (s1[0], o) for p, o in
                   ((p1, o1), (p2, o2)))
        for gated in (True, False):
            if (o1 == 2 * i2) if gated else (o1 == i2):
                out.append(ExpertsLayout((p1, p2), transposed=transposed, bias=bias, gated=gated,
                                         convention=convention))
    return out


# ------------------------------------------------------------------------------------------------------
# the proof
# ------------------------------------------------------------------------------------------------------

Wrap = Callable[[nn.Module, str, ExpertsLayout], nn.Module]  # (family module, fqn, layout) -> unquantized replacement


def _routed_signature(module: nn.Module) -> bool:
    """Whether ``forward`` is called as routed experts are: three inputs, the second the tokens' expert indices
    and the third their routing weights (transformers' ``top_k_index, top_k_weights`` or ``router_indices,
    routing_weights``)."""
    try:
        params = list(inspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        return False
    return (_positional_arity(module) == 3 and "ind" in params[1].lower() and "weight" in params[2].lower())


def _positional_arity(module: nn.Module) -> int:
    try:
        sig = inspect.signature(type(module).forward)
    except (TypeError, ValueError):
        return -1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in sig.parameters.values()) - 1  # self


def _probe_shapes(module: nn.Module, layout: ExpertsLayout, experts: int) -> Dict[str, Tuple[int, ...]]:
    """Shapes of the probe's experts Parameters: the module's hidden width, a narrow expert width."""
    s1 = full_shape(getattr(module, layout.projections[0]))
    hidden = s1[1] if layout.transposed else s1[2]
    mid = PROBE_WIDTH * (2 if layout.gated else 1)
    shapes = {layout.projections[0]: (experts, hidden, mid) if layout.transposed else (experts, mid, hidden),
              layout.projections[1]: (experts, PROBE_WIDTH, hidden) if layout.transposed else
              (experts, hidden, PROBE_WIDTH)}
    if layout.bias:
        shapes[f"{layout.projections[0]}_bias"] = (experts, mid)
        shapes[f"{layout.projections[1]}_bias"] = (experts, hidden)
    return shapes


def _probe_params(module: nn.Module, layout: ExpertsLayout, experts: int, device, dtype,
                  gen: torch.Generator) -> Dict[str, torch.Tensor]:
    shapes = _probe_shapes(module, layout, experts)
    params = {}
    for name, p in module.named_parameters():
        shape = shapes.get(name, full_shape(p))
        if name in shapes:
            scale = 1.0 / math.sqrt(shape[1] if layout.transposed and name in layout.projections else shape[-1])
            t = torch.randn(shape, generator=gen, dtype=torch.float64) * (scale if len(shape) == 3 else 0.5)
        elif len(shape) == 1:  # a norm's weight, a bias: around 1
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float64)
        else:
            t = torch.randn(shape, generator=gen, dtype=torch.float64) / math.sqrt(shape[-1])
        params[name] = t.to(device=device, dtype=dtype).requires_grad_(True)
    unexplained = [n for n in shapes if n not in params]
    if unexplained:
        raise ExpertsLayoutError(f"no Parameter {unexplained[0]!r}")
    return params


def _run(module: nn.Module, params: Dict[str, torch.Tensor], inputs, g: torch.Tensor):
    x, idx, w = inputs
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True) if w is not None else None
    out = functional_call(module, params, (x, idx, w) if idx is not None else (x,))
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        raise ExpertsLayoutError(f"forward returned {type(out).__name__} "
                                 f"{tuple(out.shape) if isinstance(out, torch.Tensor) else ''}, not [tokens, hidden]")
    leaves = [x] + ([w] if w is not None else []) + list(params.values())
    grads = torch.autograd.grad(out, leaves, g, allow_unused=True)
    return [out.detach()] + [None if t is None else t.detach() for t in grads]


def _compare(names: List[str], ref: List, got: List, dtype: torch.dtype, reduction: int) -> Optional[str]:
    """The first tensor that differs beyond the round-off bound, described; None if all agree.

    Both sides compute the same products; only the order of their sums may differ (the GEMMs' reductions, a
    token's sum over its experts, a weight gradient's over tokens). The round-off of such a sum grows like
    ``√n·u`` (random signs), its worst case like ``n·u``; the bound ``64·√n·u·max|ref|`` with ``n`` the longest
    reduction sits far above the first and, in FP64, some 10⁹ below any difference a wrong layout makes."""
    u = torch.finfo(dtype).eps / 2
    for name, a, b in zip(names, ref, got):
        if a is None and b is None:
            continue
        if a is None or b is None:
            which = "the module's own" if a is None else "snip_ds's replacement"
            if (b if a is None else a).abs().max() == 0:
                continue
            return f"{name}: {which} backward gives no gradient where the other does"
        if a.shape != b.shape:
            return f"{name}: shape {tuple(b.shape)}, the module's own {tuple(a.shape)}"
        scale = float(a.abs().max())
        bound = 64 * math.sqrt(reduction) * u * scale
        diff = float((a.double() - b.double()).abs().max())
        if not diff <= bound:
            return f"{name} differs by {diff:.3g} (allowed {bound:.3g}, largest value {scale:.3g})"
    return None


@contextmanager
def _ieee_fp32(device: torch.device) -> Iterator[None]:
    """FP32 products in IEEE FP32 on a CUDA device (not TF32) while the probe runs; the setting restored after."""
    if device.type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    attr, value = ("fp32_precision", "ieee") if hasattr(matmul, "fp32_precision") else ("allow_tf32", False)
    saved = getattr(matmul, attr)
    setattr(matmul, attr, value)
    try:
        yield
    finally:
        setattr(matmul, attr, saved)


def prove(module: nn.Module, fqn: str, layout: ExpertsLayout, wrap: Wrap) -> None:
    """Raises :class:`ExpertsLayoutError` unless ``wrap(module, fqn, layout)`` (snip_ds's replacement, every pair
    unquantized) computes what ``module`` does (module docstring)."""
    arity = _positional_arity(module)
    if arity != _ARITY[layout.convention]:
        raise ExpertsLayoutError(f"its forward takes {arity} positional input(s), not (hidden_states, top_k_index, "
                                 f"top_k_weights)")
    batched = layout.convention == BATCHED
    total = expert_count(module) or full_shape(getattr(module, layout.projections[0]))[0]
    experts = min(total, PROBE_EXPERTS)
    top_k = min(PROBE_TOP_K, experts)
    ref_param = next(iter(module.parameters()))
    device = ref_param.device if ref_param.device.type != "meta" else torch.device("cpu")
    replacement = wrap(module, fqn, layout)
    gen = torch.Generator().manual_seed(0)
    hidden = _probe_shapes(module, layout, experts)[layout.projections[1]][1 if not layout.transposed else 2]
    last_error = None
    for dtype in (torch.float64, torch.float32):
        params = _probe_params(module, layout, experts, device, dtype, gen)
        rows = PROBE_TOKENS * (experts if batched else 1)
        x = torch.randn(rows, hidden, generator=gen, dtype=torch.float64).to(device, dtype)
        idx = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(PROBE_TOKENS)]).to(device)
        w = (0.1 + torch.rand(PROBE_TOKENS, top_k, generator=gen, dtype=torch.float64)).to(device, dtype)
        g = torch.randn(rows, hidden, generator=gen, dtype=torch.float64).to(device, dtype)
        if batched:
            idx = w = None
        saved = [(m, m.num_experts) for m in (module, replacement) if hasattr(m, "num_experts")]
        try:
            for m, _ in saved:
                m.num_experts = experts
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), _ieee_fp32(device):
                try:
                    ref = _run(module, params, (x, idx, w), g)
                except ExpertsLayoutError:
                    raise
                except Exception as err:  # noqa: BLE001 - its own forward fails on the probe: try FP32, then refuse
                    last_error = f"its own forward failed on a probe: {type(err).__name__}: {err}"
                    continue
                try:
                    got = _run(replacement, params, (x, idx, w), g)
                except Exception as err:  # noqa: BLE001 - the layout does not fit what the module holds
                    raise ExpertsLayoutError(f"snip_ds's replacement failed on the probe: {type(err).__name__}: "
                                             f"{err}") from None
        finally:
            for m, n in saved:
                m.num_experts = n
        names = ["output", "input gradient"] + ([] if batched else ["routing weights' gradient"]) + [
            f"{n}'s gradient" for n in params]
        mismatch = _compare(names, ref, got, dtype, reduction=hidden + PROBE_TOKENS * top_k)
        if mismatch is not None:
            raise ExpertsLayoutError(f"its forward and snip_ds's ({layout.describe()}) differ on a random routing: "
                                     f"{mismatch}")
        return
    raise ExpertsLayoutError(last_error or "no probe ran")


_proved: Dict[Tuple[Any, ...], ExpertsLayout] = {}


def recognize(module: nn.Module, fqn: str, wrap: Wrap) -> ExpertsLayout:
    """The proved layout of the experts module ``module`` at ``fqn`` (once per class and configuration).

    Raises:
        ExpertsLayoutError: no layout fits; the message names the module, its class and what did not match.
    """
    cls = type(module)
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
    key = (cls, implementation, type(getattr(module, "act_fn", None)),
           tuple(getattr(module, f, None) for f in INTERFACE_FLAGS),
           tuple(sorted((n, len(s)) for n, s in _stacked(module).items())))
    if key in _proved:
        return _proved[key]
    name = f"experts module {fqn!r} ({cls.__module__}.{cls.__qualname__})"
    options = hypotheses(module)
    if not options:
        stacked = ", ".join(f"{n} {list(s)}" for n, s in (_stacked(module) or _weights(module)).items())
        raise ExpertsLayoutError(f"{name}: its experts' weights ({stacked}) fit no layout snip_ds knows (two "
                                 f"projections [E, out, in] or [E, in, out] through the hidden width)")
    reasons = []
    for layout in options:
        try:
            prove(module, fqn, layout, wrap)
        except ExpertsLayoutError as err:
            reasons.append(str(err))
            continue
        _proved[key] = layout
        return layout
    raise ExpertsLayoutError(f"{name} is not one snip_ds can quantize per expert: {'; '.join(dict.fromkeys(reasons))}")


def counts_around(model: nn.Module, candidates: Iterable[Tuple[str, nn.Module]]) -> Dict[str, set]:
    """``{MoE block path: {expert counts}}``: the module holding each experts candidate, and the counts of the
    experts it holds (for the routers of :mod:`snip_ds.decoder`)."""
    out: Dict[str, set] = {}
    for fqn, module in candidates:
        count = expert_count(module) or (len(module) if isinstance(module, (nn.ModuleList, nn.ModuleDict)) else None)
        if count:
            out.setdefault(fqn.rsplit(".", 1)[0] if "." in fqn else "", set()).add(count)
    return out
