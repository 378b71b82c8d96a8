"""The inventory of a causal LM's quantizable GEMMs: which linears and experts modules snip_ds plans.

The decoder blocks are the numbered entries of the model's block list (:mod:`snip_ds.layouts.blocks`): Llama's
``model.layers.<i>``, GPT-2's ``transformer.h.<i>``, OPT's ``model.decoder.layers.<i>``. Every linear GEMM inside a
block (:func:`snip_ds.layouts.linears.linear_form`: ``nn.Linear``, a weight stored transposed as GPT-2's
``Conv1D``, any class proved to compute one of the two) is a quantizable layer, found by walking the block, not
from a table of names, except

* MoE routers: a linear of an MoE block whose output width is the experts' count and whose output, ranked,
  chooses the experts' tokens (:mod:`snip_ds.layouts.routers`), or of width 1 (a shared expert's scalar gate),
  is small and precision-sensitive, and stays as it is;
* what the user excludes (``snip.exclude``: globs matched on the fully qualified name).

A layer's *kind* is its path inside the block (``self_attn.q_proj``, ``attn.c_attn``, ``mlp.dense_h_to_4h``);
kinds keep the block's module order, so Llama's are q, k, v, o, gate, up, down as before. Which layers read one
input tensor (q/k/v, gate/up; nothing for fused projections) is measured by :func:`input_groups` with one tiny
forward.

Mixture-of-Experts experts modules hold no linear per expert: :mod:`snip_ds.experts` makes each of their
(expert, projection) pairs a layer of its own once :mod:`snip_ds.layouts.experts` has proved their layout; an
experts module whose layout is not proved is refused by :func:`decoder_linears`, naming the module, its class and
what did not match, before anything trains. A linear that a block holds but the model never calls (Mamba's
``dt_proj``, whose weight the mixer multiplies itself) is planned here and left out of the plan once a step shows
it receives no call (:mod:`snip_ds.engine.state`).
"""
from __future__ import annotations

import fnmatch
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from snip_ds.experts.model import find_experts_modules
from snip_ds.layouts.blocks import decoder_blocks as _blocks
from snip_ds.layouts.experts import ExpertsLayoutError, counts_around, experts_candidates
from snip_ds.layouts.linears import gemm_shape, linear_form
from snip_ds.layouts.routers import proved_routers


class UnsupportedModelError(ValueError):
    """The model has no quantizable layers, or modules snip_ds cannot quantize (MoE experts it cannot prove)."""


def _holds_gemm(module: nn.Module) -> bool:
    return any(linear_form(m) is not None for m in module.modules()) or bool(experts_candidates(module))


def decoder_blocks(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The decoder blocks as ``(fqn, module)`` in model order (:mod:`snip_ds.layouts.blocks`)."""
    return _blocks(model, _holds_gemm)


def _check_patterns(exclude: Iterable[str]) -> Tuple[str, ...]:
    patterns = tuple(exclude)
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise ValueError(f"snip.exclude: expected non-empty glob strings, got {p!r}")
    return patterns


def decoder_experts(model: nn.Module) -> Dict[str, nn.Module]:
    """``{path: module}`` of the experts modules inside the decoder blocks, each layout proved.

    Raises:
        UnsupportedModelError: an experts module whose layout is not proved (the first such, named, and how
            many more there are).
    """
    try:
        return find_experts_modules(model)
    except ExpertsLayoutError as err:
        raise UnsupportedModelError(f"{type(model).__name__}: {err}; it refuses to train them unquantized under "
                                    f"a plan that says otherwise") from None


def _expert_lists(block: nn.Module, prefix: str) -> Dict[str, List[nn.Module]]:
    """``{path of the module holding it: [its expert MLPs]}`` for the lists of expert MLPs inside a block: a
    container of two or more entries of one class, each holding a linear GEMM (older MoE layouts keep experts so)."""
    out: Dict[str, List[nn.Module]] = {}
    for sub, module in block.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) or len(module) < 2:
            continue
        entries = list(module.children())
        if len({type(e) for e in entries}) == 1 and next(entries[0].children(), None) is not None and \
                all(any(linear_form(m) is not None for m in e.modules()) for e in entries):
            holder = f"{prefix}.{sub.rsplit('.', 1)[0]}" if "." in sub else prefix
            out.setdefault(holder, []).append(entries)
    return out


def _moe_blocks(model: nn.Module, blocks) -> Dict[str, Tuple[set, List[nn.Module]]]:
    """``{MoE block path: ({expert counts}, [the modules it calls as experts])}``: the module holding each
    experts module (its count from its Parameters) or list of expert MLPs (each entry an expert)."""
    out: Dict[str, Tuple[set, List[nn.Module]]] = {}
    candidates = experts_candidates(model)
    for path, counts in counts_around(model, candidates).items():
        out[path] = (set(counts), [m for f, m in candidates if (f.rsplit(".", 1)[0] if "." in f else "") == path])
    for prefix, block in blocks:
        for holder, lists in _expert_lists(block, prefix).items():
            counts, experts = out.setdefault(holder, (set(), []))
            for entries in lists:
                counts.add(len(entries))
                experts.extend(entries)
    return out


def _routers(model: nn.Module, moe: Dict[str, Tuple[set, List[nn.Module]]], experts: Dict[str, nn.Module]) -> set:
    """Names of the linears left out as MoE routers: in an MoE block, of output width 1 (a shared expert's scalar
    gate), or of the experts' count and proved to route (:func:`snip_ds.layouts.routers.proved_routers`; where
    the block's forward cannot run alone, every such linear)."""
    out = set()
    for path, (counts, called) in moe.items():
        block = model.get_submodule(path) if path else model
        skip = {id(m) for e in [*experts.values(), *called] for m in e.modules()}  # the experts' own linears
        candidates: Dict[str, nn.Module] = {}
        for sub, module in block.named_modules():
            fqn = f"{path}.{sub}" if path else sub
            form = linear_form(module) if sub and id(module) not in skip else None
            if form is None:
                continue
            width = gemm_shape(module, form)[1]
            if width == 1:
                out.add(fqn)
            elif width in counts:
                candidates[sub] = module
        proved = proved_routers(block, candidates, called,
                                [gemm_shape(m, linear_form(m))[0] for m in candidates.values()]) if path else None
        out.update(f"{path}.{sub}" if path else sub for sub in candidates if proved is None or sub in proved)
    return out


def decoder_linears(model: nn.Module, exclude: Sequence[str] = ()) -> List[str]:
    """Fully qualified names of the model's quantizable linears: every linear GEMM inside a decoder block, block
    by block and in each block's module order, less MoE routers and the names matching a glob of ``exclude``.
    Pure: only reads the model (a linear class other than ``nn.Linear`` is proved once on a random probe).

    Raises:
        UnsupportedModelError: the model has MoE experts whose layout is not proved (named with their class),
            or no quantizable linear (named by the model's class).
        ValueError: a pattern of ``exclude`` matches no decoder linear.
    """
    patterns = _check_patterns(exclude)
    experts = decoder_experts(model)
    blocks = decoder_blocks(model)
    routers = _routers(model, _moe_blocks(model, blocks), experts)
    names: List[str] = []
    for prefix, block in blocks:
        for sub, module in block.named_modules():
            fqn = f"{prefix}.{sub}" if sub else prefix
            if any(fqn.startswith(e + ".") for e in experts):
                continue  # the experts' own Parameters are planned per pair
            if linear_form(module) is not None and fqn not in routers:
                names.append(fqn)
    for p in patterns:
        if not any(fnmatch.fnmatchcase(n, p) for n in names):
            raise ValueError(f"snip.exclude: pattern {p!r} matches no decoder linear of {type(model).__name__} "
                             f"(e.g. {names[0] if names else 'none'})")
    kept = [n for n in names if not any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    if not kept and not experts:
        why = ("every one is excluded by snip.exclude" if names else
               "its decoder blocks hold no linear GEMM (x·Wᵀ + b)" if blocks else
               "it has no decoder blocks (numbered entries of a block list, such as model.layers.<i>, that hold "
               "a linear GEMM)")
        raise UnsupportedModelError(f"{type(model).__name__}: no quantizable linears found: snip_ds quantizes the "
                                    f"linear GEMMs of decoder blocks, and {why}")
    return kept


def input_groups(model: nn.Module, fqns: Optional[Sequence[str]] = None,
                 seq_len: int = 4) -> List[Tuple[str, ...]]:
    """The layers that read one and the same input tensor (q/k/v, gate/up; each fused projection alone), found
    with one tiny no-grad forward whose hooks record the identity of each layer's input.

    The model must hold its full weights (not ZeRO-3 partitioned); its RNG state and weights are left as they
    were. Returns the groups in the order their first layer runs, each in running order.
    """
    fqns = list(decoder_linears(model) if fqns is None else fqns)
    first: Dict[str, str] = {}  # layer -> the first layer that read its input
    owner: Dict[int, str] = {}
    inputs: List[torch.Tensor] = []  # keeps the ids unique while the forward runs

    def hook(fqn):
        def record(module, args):
            x = args[0]
            if id(x) not in owner:
                owner[id(x)] = fqn
                inputs.append(x)
            first.setdefault(fqn, owner[id(x)])
        return record

    handles = [model.get_submodule(f).register_forward_pre_hook(hook(f)) for f in fqns]
    param = next(model.parameters())
    device = param.device if param.device.type != "meta" else torch.device("cpu")
    ids = torch.zeros((1, seq_len), dtype=torch.long, device=device)
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(input_ids=ids)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    groups: Dict[str, List[str]] = {}
    for fqn in first:  # in running order
        groups.setdefault(first[fqn], []).append(fqn)
    return [tuple(g) for g in groups.values()]
