"""``snip-ds export --format compressed-tensors``: the plan's forward precisions written as a compressed-tensors
checkpoint (``config.json`` ``quantization_config``), which transformers and vLLM load.

What each planned layer gets (:func:`layer_schemes`), from its forward (fprop) precision:

* ``fp4`` with the ``nvfp4`` recipe: compressed-tensors' NVFP4 (``nvfp4-pack-quantized``): E2M1 codes packed two
  per byte, E4M3 scales per 16 weights of a row, an FP32 global scale; activations quantized per 16 with dynamic
  E4M3 block scales and a static FP32 global scale, ``input_global_scale``, calibrated on the run's own data
  (:mod:`snip_ds.export.calib`);
* ``fp8`` with the ``fp8_hybrid`` recipe: FP8 E4M3 weights with one FP32 scale per tensor (``float-quantized``),
  activations E4M3 with a dynamic per-tensor scale, as the training forward quantizes them;
* ``bf16``, layers the plan leaves out, embeddings, the LM head and MoE routers: unquantized (``ignore``).

What the format cannot express: ``mxfp4``/``mxfp8`` recipes, an NVFP4 layer whose input width is not a multiple
of 16, and MoE experts (transformers holds them as fused 3-D parameters, which compressed-tensors cannot target
per (expert, projection)). Each is refused naming the layer, unless ``--fallback bf16`` asks for it unquantized,
which a one-line warning per reason names.

The weights are snip_ds's own quantization of the FP32 masters (:mod:`snip_ds.quant`, the fprop weight recipe:
NVFP4 in 16x16 tiles with ``weight_2d``, each row of a tile carrying the tile's scale), handed to
compressed-tensors' compressors, which pack them; every layer is then decompressed by compressed-tensors' code and
checked (:func:`check_layer`): the E2M1 codes / E4M3 values and the E4M3 block scales bit for bit, and the
dequantized weights within the global-scale rounding rule documented there.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from snip_ds.export.files import ExportError
from snip_ds.quant import fake_quantize, quantize_parts
from snip_ds.quant_config import QuantConfig
from snip_ds.scales import nvfp4_block_and_tensor_scales
from snip_ds.formats import E2M1

FORMATS = ("hf", "compressed-tensors")
FALLBACKS = ("bf16",)
CT_RANGE = (">=0.20", "<0.21")  # setup.cfg's serve extra
NVFP4_GROUP = 16
# The dequantized-weight rule (check_layer): both sides are q * m, q an E2M1 code, m an FP32 multiplier:
# snip_ds m = fl(s_b * S), S = fl(amax / 2688); compressed-tensors m' = fl(s_b / G), G = fl(2688 / amax). Each of
# the four roundings moves by at most u = 2^-24 relative, and the product q * m one more: |W' - W| <= 5u |W|
# (to first order), bounded here by 2^-21 |W|.
NVFP4_DEQUANT_REL_BOUND = 2.0 ** -21


@dataclass(frozen=True)
class LayerScheme:
    """A planned layer's export: ``scheme`` (``nvfp4``, ``fp8`` or ``bf16``) and, when that is a fallback, why."""

    scheme: str
    reason: str = ""


def _reason(fqn: str, precision: str, quant: QuantConfig, in_features: int, experts: bool) -> Tuple[str, str]:
    """(scheme, '') for a layer the format expresses, ('', why not) otherwise."""
    if precision == "bf16":
        return "bf16", ""
    if experts:
        return "", ("an MoE (expert, projection) pair: transformers holds the experts as fused 3-D parameters, "
                    "which compressed-tensors cannot target per pair")
    if precision == "fp8":
        if quant.fp8_recipe != "fp8_hybrid":
            return "", (f"fp8 recipe {quant.fp8_recipe!r}: its activation scales (OCP MX, rounded down to a power "
                        f"of two) are not compressed-tensors' (rounded up past a mantissa threshold)")
        return "fp8", ""
    if quant.fp4_recipe != "nvfp4":
        return "", (f"fp4 recipe {quant.fp4_recipe!r}: its activation scales (OCP MX, rounded down to a power of "
                    f"two) are not compressed-tensors' (rounded up past a mantissa threshold)")
    if in_features % NVFP4_GROUP:
        return "", f"input width {in_features} is not a multiple of NVFP4's group of {NVFP4_GROUP}"
    return "nvfp4", ""


def layer_schemes(plan: Mapping[str, Any], quant: QuantConfig, widths: Mapping[str, int], experts: set,
                  fallback: Optional[str], warn: Callable[[str], None]) -> Dict[str, LayerScheme]:
    """The scheme of every planned layer (``plan``: the assignment, per layer or per GEMM) from its fprop precision.

    Raises:
        ExportError: a layer the format cannot express, without ``fallback`` (the first such layer named, with
            why, and how many there are).
    """
    out: Dict[str, LayerScheme] = {}
    refused: Dict[str, List[str]] = {}
    split = 0
    for fqn, value in plan.items():
        precision = value if isinstance(value, str) else value["fprop"]
        split += not isinstance(value, str) and len(set(value.values())) > 1
        scheme, why = _reason(fqn, precision, quant, widths.get(fqn, 0), fqn in experts)
        if scheme:
            out[fqn] = LayerScheme(scheme)
        else:
            refused.setdefault(why, []).append(fqn)
            out[fqn] = LayerScheme("bf16", why)
    if refused and fallback is None:
        why, names = next(iter(refused.items()))
        more = sum(map(len, refused.values())) - 1
        raise ExportError(f"layer {names[0]}: not expressible in compressed-tensors: {why}"
                          f"{f' (and {more} more layer(s))' if more else ''}; pass --fallback bf16 to export "
                          f"such layers unquantized")
    for why, names in refused.items():
        warn(f"--fallback bf16: {len(names)} layer(s) unquantized ({names[0]}"
             f"{', ...' if len(names) > 1 else ''}): {why}")
    if split:
        warn(f"{split} per-GEMM layer(s) exported at their fprop precision (dgrad and wgrad exist only in training)")
    return out


FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # what vLLM fuses into one module
PRECISION_ORDER = ("nvfp4", "fp8", "bf16")  # least to most precise


def split_fusions(schemes: Mapping[str, LayerScheme]) -> Dict[str, List[str]]:
    """``{parent module: its fused projections}`` for every q/k/v or gate/up group that the schemes split."""
    out: Dict[str, List[str]] = {}
    for fqn in schemes:
        parent, _, leaf = fqn.rpartition(".")
        for group in FUSED:
            members = [f"{parent}.{m}" for m in group if f"{parent}.{m}" in schemes]
            if leaf == group[0] and len({schemes[m].scheme for m in members}) > 1:
                out[f"{parent}.{'/'.join(group)}"] = members
    return out


def unify_fusions(schemes: Dict[str, LayerScheme], warn: Callable[[str], None]) -> Dict[str, str]:
    """Gives each split q/k/v or gate/up group the most precise scheme among its members (in place), as
    ``--vllm-fused`` asks; returns ``{layer: its planned scheme}`` of the layers moved."""
    moved: Dict[str, str] = {}
    for members in split_fusions(schemes).values():
        target = max((schemes[m].scheme for m in members), key=PRECISION_ORDER.index)
        for m in members:
            if schemes[m].scheme != target:
                moved[m] = schemes[m].scheme
                schemes[m] = LayerScheme(target, f"--vllm-fused: planned {schemes[m].scheme}, fused with a "
                                                 f"{target} projection")
    if moved:
        warn(f"--vllm-fused: {len(moved)} layer(s) raised to the most precise scheme of their q/k/v or gate/up "
             f"group ({next(iter(moved))}, ...)")
    return moved


# --------------------------------------------------------------------------------------------------------
# the schemes, as compressed-tensors' objects
# --------------------------------------------------------------------------------------------------------
def ct_scheme(scheme: str, targets: List[str]):
    """compressed-tensors' ``QuantizationScheme`` for ``scheme`` over ``targets`` (module names): its own
    ``NVFP4`` preset, and FP8 as the training forward runs it (per-tensor weight scale, dynamic per-tensor
    activation scale; the library's ``FP8`` preset with the activation scale dynamic)."""
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    if scheme == "nvfp4":
        return preset_name_to_scheme("NVFP4", targets)
    base = preset_name_to_scheme("FP8", targets)
    acts = base.input_activations.model_copy(update={"dynamic": True, "observer": None})
    return QuantizationScheme(targets=targets, weights=base.weights, input_activations=acts)


def nvfp4_weight(w: torch.Tensor, quant: QuantConfig) -> Dict[str, torch.Tensor]:
    """snip_ds's NVFP4 fprop quantization of ``w`` [n, k] (FP32 master) as compressed-tensors' parameters:
    ``weight`` (the fake-quantized values the compressor packs), ``weight_scale`` [n, k/16] (E4M3 values in FP32:
    a 16x16 tile's scale on each of its rows with ``weight_2d``), ``weight_global_scale`` (compressed-tensors'
    ``G = 448 * 6 / amax``, the reciprocal of snip_ds's ``S``), and ``codes`` (the E2M1 values, for the check)."""
    from compressed_tensors.quantization.utils.helpers import generate_gparam

    recipe = "nvfp4_2d" if quant.weight_2d else "nvfp4"
    n, k = w.shape
    mag = w.abs()
    if quant.weight_2d:
        rows = -n % NVFP4_GROUP
        tiles = torch.nn.functional.pad(mag, (0, 0, 0, rows)).reshape(-1, NVFP4_GROUP, k // NVFP4_GROUP, NVFP4_GROUP)
        amax = tiles.amax(dim=(1, 3)).repeat_interleave(NVFP4_GROUP, dim=0)[:n]
    else:
        amax = mag.reshape(n, k // NVFP4_GROUP, NVFP4_GROUP).amax(dim=-1)
    tensor_amax = mag.amax()
    block_scale, _ = nvfp4_block_and_tensor_scales(amax, E2M1, tensor_amax)
    parts = quantize_parts(w, recipe)
    scale_per_value = block_scale.repeat_interleave(NVFP4_GROUP, dim=1)
    codes = torch.where(scale_per_value > 0, parts.values / scale_per_value.clamp_min(2.0 ** -9), parts.values)
    # A block whose scale rounded to zero holds zeros: any positive scale stores them (compressed-tensors would
    # divide by its zero scale).
    stored = torch.where(block_scale > 0, block_scale, torch.full_like(block_scale, 2.0 ** -9))
    return {"weight": fake_quantize(w, recipe), "weight_scale": stored, "codes": codes,
            "weight_global_scale": generate_gparam(-tensor_amax, tensor_amax), "block_scale": block_scale}


def fp8_weight(w: torch.Tensor) -> Dict[str, torch.Tensor]:
    """snip_ds's E4M3 per-tensor fprop quantization of ``w`` as compressed-tensors' parameters: ``weight`` (the
    FP32 master; the compressor divides by the scale and rounds as snip_ds does), ``weight_scale`` (snip_ds's
    ``amax / 448``) and ``codes`` (snip_ds's E4M3 values, for the check)."""
    parts = quantize_parts(w, "fp8_e4m3")
    return {"weight": w, "weight_scale": parts.tensor_scale.reshape(1), "codes": parts.values}


def check_layer(name: str, scheme: str, compressed: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
                ct_scheme_obj, w: torch.Tensor, quant: QuantConfig) -> Dict[str, Any]:
    """Decompresses one compressed layer with compressed-tensors' own code and compares it with snip_ds's
    quantization of the same master weight; returns what the export records of it.

    NVFP4: the unpacked E2M1 codes and the E4M3 block scales equal snip_ds's bit for bit; the dequantized weights
    (FP32) differ from snip_ds's ``fake_quantize`` only by the global-scale rule (compressed-tensors multiplies
    by ``fl(s_b / G)``, snip_ds by ``fl(s_b * S)``): at most :data:`NVFP4_DEQUANT_REL_BOUND` relative.
    FP8: the E4M3 values and the scale bit for bit, and so the dequantized weights.

    Raises:
        ExportError: any other difference (a defect: nothing is written).
    """
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    reference = fake_quantize(w, "nvfp4_2d" if quant.weight_2d else "nvfp4") if scheme == "nvfp4" else \
        fake_quantize(w, "fp8_e4m3")
    if scheme == "nvfp4":
        packed = compressed["weight_packed"]
        codes = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
        scale = compressed["weight_scale"].float()
        stored = expected["weight_scale"]
        exact = torch.equal(codes, expected["codes"]) and torch.equal(scale, stored)
        deq = dequantize(codes, scale, args=ct_scheme_obj.weights, dtype=torch.float32,
                         global_scale=compressed["weight_global_scale"])
    else:
        q = compressed["weight"]
        exact = torch.equal(q.float(), expected["codes"]) and torch.equal(compressed["weight_scale"].float(),
                                                                          expected["weight_scale"].float())
        deq = dequantize(q, compressed["weight_scale"].float(), args=ct_scheme_obj.weights, dtype=torch.float32)
    diff = (deq - reference).abs()
    rel = float((diff / reference.abs().clamp_min(torch.finfo(torch.float32).tiny)).max()) if diff.numel() else 0.0
    bound = NVFP4_DEQUANT_REL_BOUND if scheme == "nvfp4" else 0.0
    if not exact or rel > bound or not torch.equal(deq == 0, reference == 0):
        raise ExportError(f"layer {name}: compressed-tensors' {scheme} decompression differs from snip_ds's "
                          f"quantization (codes and scales equal: {exact}, largest relative difference "
                          f"{rel:.3g}, allowed {bound:.3g}); nothing written")
    return {"scheme": scheme, "codes_and_scales_bit_exact": True,
            "dequantized_bit_exact": bool(torch.equal(deq, reference)), "max_relative_difference": rel,
            "differing_values": int((deq != reference).sum())}


def _pattern(names: List[str]) -> List[str]:
    return [f"re:^{re.escape(n)}$" for n in names]


def compress(model: nn.Module, schemes: Mapping[str, LayerScheme], quant: QuantConfig,
             input_amax: Mapping[str, torch.Tensor], masters: Mapping[str, torch.Tensor]):
    """Attaches compressed-tensors' schemes to ``model`` (in place; its other parameters keep their dtype), sets
    each quantized layer's weight, scales and calibrated ``input_global_scale`` (FP32) from snip_ds's quantization
    of its FP32 master (``masters``), lets compressed-tensors compress them, and checks every layer
    (:func:`check_layer`). Returns ``(compressor, per-layer record)``; the compressor's ``update_config`` writes
    ``quantization_config`` into a saved ``config.json``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils.helpers import generate_gparam

    by_scheme: Dict[str, List[str]] = {}
    for fqn, s in schemes.items():
        if s.scheme != "bf16":
            by_scheme.setdefault(s.scheme, []).append(fqn)
    # FP8's group first (and again in the compressor's config, _fp8_group_first): transformers 5.24 decompresses
    # every MoE expert with the first group, and FP8's passes the weights of unquantized experts through
    groups = {f"group_{i}": ct_scheme(s, _pattern(names)) for i, (s, names) in enumerate(sorted(by_scheme.items()))}
    quantized = {n for names in by_scheme.values() for n in names}
    ignore = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name not in quantized]
    config = QuantizationConfig(config_groups=groups, ignore=ignore)
    with _quiet():
        apply_quantization_config(model, config)
    expected: Dict[str, Dict[str, torch.Tensor]] = {}
    for fqn in sorted(quantized):
        module = model.get_submodule(fqn)
        w = masters[fqn]
        params = nvfp4_weight(w, quant) if schemes[fqn].scheme == "nvfp4" else fp8_weight(w)
        expected[fqn] = params
        if schemes[fqn].scheme == "nvfp4":
            amax = input_amax[fqn].float()
            params = dict(params, input_global_scale=generate_gparam(-amax, amax))
        for key in ("weight", "weight_scale", "weight_global_scale", "input_global_scale"):
            if key in params:  # FP32: the compressor reads them so; it stores the block scales as E4M3
                old = getattr(module, key)
                setattr(module, key, nn.Parameter(params[key].float().reshape(old.shape).clone(),
                                                  requires_grad=False))
    compressor = ModelCompressor.from_pretrained_model(model)
    _fp8_group_first(compressor.quantization_config)
    with _quiet():
        compressor.compress_model(model)
    compressor.remove_decompression_hook(model)
    record = {}
    for fqn in sorted(quantized):
        module = model.get_submodule(fqn)
        state = {k: v.detach() for k, v in module.named_parameters(recurse=False)}
        record[fqn] = check_layer(fqn, schemes[fqn].scheme, state, expected[fqn], module.quantization_scheme,
                                  masters[fqn], quant)
    return compressor, record


def _fp8_group_first(config) -> None:
    """Puts FP8's config group first (in place). compressed-tensors rebuilds the groups from the schemes the
    model's modules carry, in module order: a block whose first planned layer is NVFP4 would put NVFP4's first,
    and transformers 5.24 would then drop the unquantized MoE experts it decompresses with that group."""
    if config is None:  # no layer quantized
        return
    groups = config.config_groups
    order = sorted(groups, key=lambda name: groups[name].weights.num_bits != 8)  # stable: the rest as they were
    config.config_groups = {f"group_{i}": groups[name] for i, name in enumerate(order)}


class _quiet:
    """compressed-tensors' progress bars (tqdm) off while it works."""

    def __enter__(self):
        import tqdm

        saved = self._saved = tqdm.tqdm.__init__

        def silent(bar, *args, **kwargs):
            kwargs["disable"] = True  # over the caller's own disable=
            saved(bar, *args, **kwargs)
        tqdm.tqdm.__init__ = silent

    def __exit__(self, *exc):
        import tqdm

        tqdm.tqdm.__init__ = self._saved

