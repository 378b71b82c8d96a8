"""Tensor parallelism: DeepSpeed AutoTP's sharded decoder linears, run at the plan's precision.

With ``"tensor_parallel": {"autotp_size": N}`` ``deepspeed.initialize`` replaces every decoder linear by one of
its own layers holding this rank's shard: ``LinearLayer`` (column-parallel: q, k, v, gate, up; rows of W, the
input's gradient all-reduced in backward) or ``LinearAllreduce`` (row-parallel: o, down; columns of W, the
partial outputs all-reduced in forward). :func:`quantize_tp_layers` then turns each into
:class:`SnipColumnParallel` or :class:`SnipRowParallel`: the very same module object (its class changed, its
Parameters, ZeRO bookkeeping and DeepSpeed's checkpoint gathering untouched), which keeps DeepSpeed's
communication and runs its local GEMMs through :class:`~snip_ds.linear.SnipLinear`'s quantized path.

Numerics do not depend on N: every per-tensor scale (FP8 current scaling, NVFP4's tensor scale) is formed from
the whole tensor's amax, all-reduced (MAX) over the tensor-parallel group (:func:`snip_ds.backend.operands.
shared_amax`); a shard width that is not a multiple of the recipes' block is refused, so blocks never straddle
shards; the stochastic-rounding generators are seeded per global rank, so ranks never share noise.

The rank layout is DeepSpeed's mesh ``(data parallel, tensor parallel)``: rank ``r`` is shard ``r % N`` of
data-parallel rank ``r // N`` (:func:`data_parallel`; checked against DeepSpeed's groups after start-up).
"""
from __future__ import annotations

import re
from typing import Dict, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from snip_ds.linear import SnipLinear
from snip_ds.backend.operands import operand_recipes
from snip_ds.quant import get_recipe
from snip_ds.quant_config import QuantConfig
from snip_ds.config.settings import ConfigError

SUPPORTED_DEEPSPEED = ((0, 19), (0, 19))  # (oldest, newest) major.minor whose AutoTP layers are known here


def check_deepspeed_version(version: str) -> None:
    """Raises ConfigError unless ``version`` (``deepspeed.__version__``) is in :data:`SUPPORTED_DEEPSPEED`: the
    AutoTP layer classes and their attributes (``mp_group``, ``tp_index``, ``_partition_sizes``) are DeepSpeed's
    internals, known for those versions only."""
    m = re.match(r"(\d+)\.(\d+)", str(version))
    lo, hi = SUPPORTED_DEEPSPEED
    if m is None or not lo <= (int(m.group(1)), int(m.group(2))) <= hi:
        span = f"{lo[0]}.{lo[1]}" if lo == hi else f"{lo[0]}.{lo[1]} - {hi[0]}.{hi[1]}"
        raise ConfigError(f"tensor_parallel.autotp_size: snip_ds runs DeepSpeed AutoTP's layers of DeepSpeed "
                          f"{span}, this is DeepSpeed {version}; install deepspeed=={lo[0]}.{lo[1]}.* or remove "
                          f"'tensor_parallel'")


def data_parallel(rank: int, world_size: int, tp: int) -> Tuple[int, int]:
    """``(data-parallel rank, data-parallel size)`` of global ``rank`` in DeepSpeed's (DP, TP) mesh."""
    return rank // tp, world_size // tp


def block_multiple(cfg: QuantConfig) -> int:
    """The width every shard's split axis must be a multiple of: the largest block of any recipe the layers may
    run (1 when none has blocks), so that no block straddles two shards."""
    sizes = [get_recipe(getattr(operand_recipes(p, cfg), role)).block_size
             for p in ("fp8", "fp4") for role in ("x", "w", "g")]
    return max([s for s in sizes if s] or [1])


class _TpShard:
    """What both tensor-parallel layer classes add to :class:`SnipLinear`: the group's reductions."""

    @property
    def amax_reduce(self):
        return self._amax_max if self.mp_group is not None and self.tp_world_size > 1 else None

    def _amax_max(self, amax: torch.Tensor) -> torch.Tensor:
        out = amax.detach().float().reshape(1).clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.mp_group)
        return out.reshape(())

    def tp_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.mp_group is None or self.tp_world_size == 1:
            return t
        out = t.detach().contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.mp_group)
        return out


def _classes():
    """The two quantized layer classes, built on first use (they subclass DeepSpeed's)."""
    global _COLUMN, _ROW
    if _COLUMN is None:
        from deepspeed.module_inject.layers import ColumnParallel, LinearAllreduce, LinearLayer, RowParallel

        class SnipColumnParallel(_TpShard, LinearLayer, SnipLinear):
            """AutoTP's column-parallel ``LinearLayer`` (rows of W) at the plan's precision: the input passes
            DeepSpeed's ``ColumnParallel`` (identity forward, gradient all-reduced), then this shard's GEMMs."""

            tp_shard = "column"

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                if self.mp_group is not None:
                    x = ColumnParallel.apply(self.mp_group, x)
                return self.local_linear(x, self.bias)

        class SnipRowParallel(_TpShard, LinearAllreduce, SnipLinear):
            """AutoTP's row-parallel ``LinearAllreduce`` (columns of W) at the plan's precision: this shard's GEMMs,
            DeepSpeed's ``RowParallel`` all-reduce of the partial outputs, then the (replicated) bias."""

            tp_shard = "row"

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                y = RowParallel.apply(self.mp_group, self.local_linear(x, None), not self.is_training_mode())
                return y if self.bias is None else y + self.bias

        _COLUMN, _ROW = SnipColumnParallel, SnipRowParallel
    return _COLUMN, _ROW


_COLUMN = _ROW = None


def quantize_tp_layers(module: torch.nn.Module, originals: Mapping[str, SnipLinear],
                       cfg: QuantConfig) -> Dict[str, str]:
    """Turns every AutoTP layer that replaced one of ``originals`` (``{fqn: the SnipLinear before
    deepspeed.initialize}``) into its quantized class, in place, carrying over precision, recipes, generator and
    name. Returns ``{fqn: "column" or "row"}``.

    Raises:
        ConfigError: a layer AutoTP left whole (to be named in ``snip.exclude``), a DeepSpeed layer class other
            than ``LinearLayer``/``LinearAllreduce`` (fused or sub-parameter layers), an output gather, a shard
            width that is not a multiple of the recipes' block (naming the layer and the sizes), or the ``te``
            backend (whose quantizers do not share amaxes across shards here).
    """
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer

    column, row = _classes()
    if cfg.backend == "te":
        raise ConfigError("snip.quant.backend: 'te' does not run tensor-parallel layers in snip_ds (its scales "
                          "would not be shared across shards); choose 'auto', 'torch' or 'emulated'")
    block = block_multiple(cfg)
    kinds: Dict[str, str] = {}
    for fqn, old in originals.items():
        m = module.get_submodule(fqn)
        if m is old or isinstance(m, (column, row)):
            if m is old:
                raise ConfigError(f"layer {fqn}: tensor_parallel.autotp_size: AutoTP left this layer whole "
                                  f"(unsharded), so every rank would compute it; list it in snip.exclude or "
                                  f"shard it")
            kinds[fqn] = m.tp_shard
            continue
        if type(m) is LinearLayer:
            cls, axis = column, 0
            if m.gather_output:
                raise ConfigError(f"layer {fqn}: AutoTP gathers this column-parallel layer's output, which "
                                  f"snip_ds does not quantize; list it in snip.exclude")
        elif type(m) is LinearAllreduce:
            cls, axis = row, 1
        else:
            raise ConfigError(f"layer {fqn}: AutoTP replaced it with {type(m).__module__}.{type(m).__name__}, "
                              f"which snip_ds does not quantize (it runs LinearLayer and LinearAllreduce); list "
                              f"it in snip.exclude")
        if getattr(type(m), "tp_overlap_comm", False):
            raise ConfigError("tensor_parallel.tp_overlap_comm: snip_ds's tensor-parallel layers do not overlap "
                              "their all-reduce with the weight gradient; set it to false")
        sizes = tuple(int(s) for s in getattr(m, "_partition_sizes", None) or (m.weight.shape[axis],))
        bad = [s for s in sizes if s % block]
        if bad:
            what = "output features (rows of W)" if axis == 0 else "input features (columns of W)"
            raise ConfigError(f"layer {fqn}: tensor parallelism splits its {what} into shards of {list(sizes)}, "
                              f"not multiples of {block} (the largest block of snip.quant's recipes): a block "
                              f"would straddle two ranks; choose an autotp_size that splits it into multiples "
                              f"of {block}")
        m.__class__ = cls
        shape = getattr(m.weight, "ds_shape", m.weight.shape)  # ZeRO-3: the shard's shape, not the partition's
        m.out_features, m.in_features = int(shape[0]), int(shape[1])
        m._gemm_precision = old.gemm_precision
        m.quant_config, m.generator, m.fqn = old.quant_config, old.generator, old.fqn
        m.input_grad_only, m.input_grad_observer = old.input_grad_only, old.input_grad_observer
        m.register_op_handle()
        kinds[fqn] = cls.tp_shard
    return kinds


def check_model(infos: Mapping[str, object], settings, model_config=None, tp: int = 1, model=None) -> None:
    """Raises ConfigError for what tensor parallelism does not run with (before ``deepspeed.initialize``): a degree
    ``tp`` that does not divide the model's attention heads, key-value heads or intermediate size (read from
    ``model_config``, a Hugging Face config, where it has them: AutoTP would split them unevenly), a
    Mixture-of-Experts model, a layer whose weight is stored transposed (GPT-2's ``Conv1D``, which AutoTP's
    layers do not shard as snip_ds runs them; ``model`` is where they are looked for), and the research variants of the statistics whose sums are not the shards' sums
    (``estimator`` other than ``mc_fisher``, ``fld_form: channel``, ``dgrad_cost: upstream``, study fields, or a
    ``method`` solved from them)."""
    from snip_ds.experts.points import ExpertLayerInfo

    text = getattr(model_config, "text_config", None) or model_config
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(text, field, None)
        if isinstance(value, int) and value % tp:
            raise ConfigError(f"tensor_parallel.autotp_size: {tp} does not divide the model's {field} ({value}); "
                              f"choose a degree that divides the heads, key-value heads and intermediate size")

    stored = next((name for name, m in (model.named_modules() if model is not None else ())
                   if name in infos and getattr(m, "transposed", False)), None)
    if stored is not None:
        raise ConfigError(f"tensor_parallel.autotp_size: layer {stored} stores its weight [in, out] (a Conv1D), which "
                          f"snip_ds does not run tensor-parallel; remove 'tensor_parallel'")
    moe = next((name for name, info in infos.items() if isinstance(info, ExpertLayerInfo)), None)
    if moe is not None:
        raise ConfigError(f"tensor_parallel.autotp_size: layer {moe.rsplit('.', 2)[0]} is a Mixture-of-Experts "
                          f"experts module, which snip_ds does not run tensor-parallel; remove 'tensor_parallel'")
    research = [("snip.research.estimator", settings.estimator, "mc_fisher"),
                ("snip.research.fld_form", settings.fld_form, "sequence"),
                ("snip.research.dgrad_cost", settings.dgrad_cost, None)]
    for field, value, only in research:
        if (only is not None and value != only) or (field.endswith("dgrad_cost") and value == "upstream"):
            raise ConfigError(f"{field}: {value!r} is not available with tensor parallelism (its statistics are "
                              f"not sums of the shards' parts); use the default")
    if settings.collect_study_fields:
        fields = list(settings.collect_study_fields)
        raise ConfigError(f"snip.research.study_fields / snip.method: the statistics {fields} are not available "
                          f"with tensor parallelism; use the default method without study fields")


def check_groups(tp: int, rank: int, world_size: int) -> None:
    """Raises RuntimeError unless DeepSpeed's tensor- and data-parallel groups are the mesh
    :func:`data_parallel` assumes (the data each rank reads follows from it)."""
    from deepspeed.utils import groups

    got = (groups.get_tensor_model_parallel_world_size(), groups.get_tensor_model_parallel_rank(),
           groups.get_data_parallel_world_size(), groups.get_data_parallel_rank())
    dp_rank, dp_size = data_parallel(rank, world_size, tp)
    want = (tp, rank % tp, dp_size, dp_rank)
    if got != want:
        raise RuntimeError(f"DeepSpeed's tensor-parallel layout is (tp size, tp rank, dp size, dp rank) = {got} on "
                           f"rank {rank}, snip_ds expected {want}: this DeepSpeed lays out its mesh differently")


def shard_of(module: torch.nn.Module) -> Optional[str]:
    """``"column"``, ``"row"`` or None (a whole layer)."""
    return getattr(module, "tp_shard", None)
