"""How a causal LM's quantizable GEMMs are found: the one place that knows model layouts.

A decoder block is a module named ``...layers.<i>`` (Hugging Face's Llama, Mistral, Qwen2, Phi-3, GPT-NeoX,
DeepSeek-V3 ... all name them so). Every ``nn.Linear`` inside a block is a quantizable layer, found by walking
the block, not from a table of names, except

* MoE routers: a linear that scores the experts (its output width is the config's expert count, or it is named
  ``gate``/``router`` beside an experts module) is small and precision-sensitive, and stays as it is;
* what the user excludes (``snip.exclude``: globs matched on the fully qualified name).

A layer's *kind* is its path inside the block (``self_attn.q_proj``, ``self_attn.qkv_proj``,
``mlp.dense_h_to_4h``); kinds keep the block's module order, so Llama's are q, k, v, o, gate, up, down as before.
Which layers read one input tensor (q/k/v, gate/up; nothing for fused projections) is measured by
:func:`input_groups` with one tiny forward.

Mixture-of-Experts experts modules (transformers' ``<Family>Experts`` with 3-D Parameters) hold no ``nn.Linear``;
:mod:`snip_ds.experts` makes each of their (expert, projection) pairs a layer of its own. An experts module it
does not know, or a list of expert MLPs, is refused by :func:`decoder_linears`, naming the module, before
anything trains.
"""
from __future__ import annotations

import fnmatch
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from snip_ds.types import BLOCK_NAME_RE, block_index

ROUTER_NAMES = ("gate", "router")  # the usual names of an MoE block's scoring linear
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_BLOCKS_HINT = "modules named '...layers.<i>' as in Hugging Face's Llama, Phi-3, GPT-NeoX or DeepSeek-V3 models"


class UnsupportedModelError(ValueError):
    """The model has no quantizable layers, or modules snip_ds cannot quantize (MoE experts it does not know)."""


def decoder_blocks(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The decoder blocks as ``(fqn, module)`` in block order: the outermost modules named ``...layers.<i>``."""
    found = [(name, m) for name, m in model.named_modules() if BLOCK_NAME_RE.match(name)]
    names = {name for name, _ in found}
    outer = [(name, m) for name, m in found
             if not any(name.startswith(other + ".") for other in names if other != name)]
    return sorted(outer, key=lambda item: block_index(item[0]))


def expert_count(model: nn.Module) -> Optional[int]:
    """The number of experts the model's config declares (``num_experts``, ``num_local_experts``,
    ``n_routed_experts``, ``moe_num_experts``), or None."""
    config = getattr(model, "config", None)
    for key in EXPERT_COUNT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return value
    return None


def _is_experts(name: str, module: nn.Module) -> bool:
    """An MoE experts module: transformers' ``<Family>Experts`` (3-D Parameters: one matrix per expert; a
    convolution's 3-D kernel is no such thing) or a list of expert MLPs named ``experts``."""
    if not isinstance(module, nn.modules.conv._ConvNd) and any(
            len(getattr(p, "ds_shape", p.shape)) == 3 for p in module.parameters(recurse=False)):  # ds_shape: ZeRO-3
        return True
    if type(module).__name__.endswith("Experts"):
        return True
    return name.rsplit(".", 1)[-1] == "experts" and isinstance(module, (nn.ModuleList, nn.ModuleDict))


def find_experts(model: nn.Module) -> List[Tuple[str, str]]:
    """``(fqn, class name)`` of every MoE experts module of the model (the outermost ones)."""
    found: List[Tuple[str, str]] = []
    for name, module in model.named_modules():
        if any(name.startswith(f + ".") for f, _ in found):
            continue
        if _is_experts(name, module):
            found.append((name, type(module).__name__))
    return found


def is_router(fqn: str, linear: nn.Linear, parent: Optional[nn.Module], n_experts: Optional[int]) -> bool:
    """Whether ``linear`` scores an MoE block's experts (and so stays unquantized): its output width is the
    config's expert count and it is named like a router or sits beside an experts module; or it is named like a
    router beside an experts module (a scalar gate of a shared expert included)."""
    leaf = fqn.rsplit(".", 1)[-1]
    named = leaf in ROUTER_NAMES or leaf.endswith(tuple(f"_{n}" for n in ROUTER_NAMES))
    beside_experts = parent is not None and any(_is_experts(n, m) for n, m in parent.named_children())
    if n_experts is not None and linear.out_features == n_experts and (named or beside_experts):
        return True
    return named and beside_experts


def _check_patterns(exclude: Iterable[str]) -> Tuple[str, ...]:
    patterns = tuple(exclude)
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise ValueError(f"snip.exclude: expected non-empty glob strings, got {p!r}")
    return patterns


def decoder_linears(model: nn.Module, exclude: Sequence[str] = ()) -> List[str]:
    """Fully qualified names of the model's quantizable linears: every ``nn.Linear`` (subclasses included) inside
    a decoder block, block by block and in each block's module order, less MoE routers (:func:`is_router`) and
    the names matching a glob of ``exclude``. Pure: only reads the model.

    Raises:
        UnsupportedModelError: the model has MoE experts in a layout :mod:`snip_ds.experts` does not know
            (named with their class), or no quantizable linear (named by the model's class).
        ValueError: a pattern of ``exclude`` matches no decoder linear.
    """
    patterns = _check_patterns(exclude)
    from snip_ds.experts import LAYOUTS, SnipExperts

    unknown = [(name, cls) for name, cls in find_experts(model)
               if cls not in LAYOUTS and not isinstance(model.get_submodule(name), SnipExperts)]
    if unknown:
        name, cls = unknown[0]
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise UnsupportedModelError(
            f"{type(model).__name__}: module {name!r} ({cls}){more} holds Mixture-of-Experts weights in a layout "
            f"snip_ds does not know (it knows {', '.join(sorted(LAYOUTS))}); it refuses to train them unquantized "
            f"under a plan that says otherwise")
    blocks = decoder_blocks(model)
    n_experts = expert_count(model)
    names: List[str] = []
    for prefix, block in blocks:
        modules = dict(block.named_modules())
        for sub, module in block.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            parent = modules.get(sub.rsplit(".", 1)[0]) if "." in sub else block
            fqn = f"{prefix}.{sub}"
            if not is_router(fqn, module, parent, n_experts):
                names.append(fqn)
    for p in patterns:
        if not any(fnmatch.fnmatchcase(n, p) for n in names):
            raise ValueError(f"snip.exclude: pattern {p!r} matches no decoder linear of {type(model).__name__} "
                             f"(e.g. {names[0] if names else 'none'})")
    kept = [n for n in names if not any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    if not kept:
        why = ("every one is excluded by snip.exclude" if names else
               "its decoder blocks hold no nn.Linear" if blocks else f"it has no decoder blocks ({_BLOCKS_HINT})")
        raise UnsupportedModelError(f"{type(model).__name__}: no quantizable linears found: snip_ds quantizes the "
                                    f"nn.Linear layers of decoder blocks, and {why}")
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
