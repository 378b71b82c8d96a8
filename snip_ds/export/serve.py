"""``snip-ds export --format``: which format an export writes, and for ``compressed-tensors`` the steps between the
loaded FP32 masters and the saved model (:func:`finish_model`): the plan and recipes read from the checkpoint, each
planned layer's scheme (:mod:`snip_ds.export.ct`), the NVFP4 activation scales calibrated on the run's data
(:mod:`snip_ds.export.calib`), the compression and its check.

``hf`` (the default) writes the plain model at ``--dtype``, as before.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch
from torch import nn

from snip_ds.export.ct import CT_RANGE, FALLBACKS, FORMATS
from snip_ds.export.files import ExportError

from snip_ds.export.cli import DEFAULT_CALIBRATION_BATCHES  # noqa: E402 (one default for both)


@dataclass(frozen=True)
class ServeOptions:
    """How to export: ``format`` (:data:`~snip_ds.export.ct.FORMATS`), for ``compressed-tensors`` the ``fallback``
    of layers it cannot express (None: refuse them) and how many batches of the run's training data calibrate the
    NVFP4 activation global scales."""

    format: str = "hf"
    fallback: Optional[str] = None
    calibration_batches: int = DEFAULT_CALIBRATION_BATCHES
    vllm_fused: bool = False  # one scheme per q/k/v and gate/up group, the most precise of theirs
    calibration_data: Optional[str] = None  # other data than the run's (snip_ds.export.calib.calibration_batches)


def serve_options(args) -> ServeOptions:
    """The :class:`ServeOptions` of ``snip-ds export``'s parsed flags (:mod:`snip_ds.export.cli`)."""
    return ServeOptions(format=args.format, fallback=args.fallback, calibration_batches=args.calibration_batches,
                        vllm_fused=args.vllm_fused, calibration_data=args.calibration_data)


def check_options(options: ServeOptions) -> None:
    """Refuses an unknown format or fallback, a calibration count below 1, calibration data that is not there,
    options that need ``--format compressed-tensors`` without it, and a missing or unsupported compressed-tensors.

    Raises:
        ExportError: naming the flag.
    """
    if options.format not in FORMATS:
        raise ExportError(f"--format {options.format!r}: expected one of {', '.join(FORMATS)}")
    if options.fallback is not None and options.fallback not in FALLBACKS:
        raise ExportError(f"--fallback {options.fallback!r}: expected one of {', '.join(FALLBACKS)}")
    n = options.calibration_batches
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ExportError(f"--calibration-batches {n!r}: expected a positive integer")
    if options.format == "hf":
        if options.fallback is not None:
            raise ExportError("--fallback: only with --format compressed-tensors")
        if n != DEFAULT_CALIBRATION_BATCHES:
            raise ExportError("--calibration-batches: only with --format compressed-tensors")
        if options.vllm_fused:
            raise ExportError("--vllm-fused: only with --format compressed-tensors")
        if options.calibration_data is not None:
            raise ExportError("--calibration-data: only with --format compressed-tensors")
        return
    if options.calibration_data is not None and not Path(options.calibration_data).exists():
        raise ExportError(f"--calibration-data {options.calibration_data}: no such file or directory")
    try:
        import compressed_tensors
        from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    except ImportError:
        raise ExportError(f"--format compressed-tensors: needs the compressed-tensors package "
                          f"({','.join(CT_RANGE)}): pip install -e \".[serve]\"") from None
    from packaging.version import Version

    version = Version(compressed_tensors.__version__)
    low, high = (Version(v.lstrip("<>=")) for v in CT_RANGE)
    if not low <= version < high:
        raise ExportError(f"--format compressed-tensors: compressed-tensors {version} is installed; snip_ds writes "
                          f"its checkpoints for versions {','.join(CT_RANGE)} (pip install -e \".[serve]\")")
    missing = [p for p in ("NVFP4", "FP8") if p not in PRESET_SCHEMES]
    if missing:
        raise ExportError(f"--format compressed-tensors: the installed compressed-tensors {version} lacks the "
                          f"scheme(s) {', '.join(missing)}")


def plan_and_settings(meta: Mapping[str, Any], source: Path) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The checkpoint's plan assignment and ``"snip"`` settings (both as JSON).

    Raises:
        ExportError: the checkpoint holds no plan (naming ``source``).
    """
    plan = meta.get("plan")
    assignment = plan.get("assignment") if isinstance(plan, Mapping) else None
    if not isinstance(assignment, Mapping) or not assignment:
        raise ExportError(f"{source}: holds no plan (snip_state.json 'plan'), so there are no precisions to export "
                          f"with --format compressed-tensors; export it with --format hf")
    settings = meta.get("settings")
    return dict(assignment), dict(settings) if isinstance(settings, Mapping) else {}


def plan_note(options: ServeOptions, dtype: str) -> str:
    """What the export record says of the plan."""
    if options.format == "hf":
        return f"not applied by this model, which runs in plain {dtype}"
    return "its forward precisions are this model's quantization_config (config.json)"


def _quant_config(settings: Mapping[str, Any], source: Path):
    from snip_ds.quant_config import QuantConfig

    quant = dict(settings.get("quant") or {})
    quant["backend"] = "emulated"  # the numerical reference: what every backend computes
    try:
        return QuantConfig(**{k: v for k, v in quant.items() if k in QuantConfig.__dataclass_fields__})
    except (TypeError, ValueError) as err:
        raise ExportError(f"{source}: settings.quant: {err}") from None


def finish_model(model: nn.Module, meta: Mapping[str, Any], source: Path, options: ServeOptions,
                 dtype: torch.dtype, warn: Callable[[str], None]
                 ) -> Tuple[Dict[str, Any], Optional[Callable[[Path], None]]]:
    """Brings the loaded FP32 ``model`` to what the export saves: ``hf``: cast to ``dtype``; ``compressed-tensors``:
    the unquantized parameters cast to ``dtype``, each quantized layer compressed from its FP32 master. Returns
    what the export records of it and the step to run on the saved directory (writing ``quantization_config``
    into its ``config.json``), or None."""
    if options.format == "hf":
        model.to(dtype)
        return {"format_written": "hf"}, None
    from snip_ds.export.calib import calibration_batches, input_amax, planned_forward_model
    from snip_ds.export.ct import compress, layer_schemes, split_fusions, unify_fusions
    from snip_ds.types import expert_pair

    assignment, settings = plan_and_settings(meta, source)
    quant = _quant_config(settings, source)
    modules = dict(model.named_modules())
    widths, not_linear = {}, set()
    for fqn in assignment:
        module = modules.get(fqn)
        if isinstance(module, nn.Linear):
            widths[fqn] = module.in_features
        else:
            not_linear.add(fqn)
    experts = {f for f in not_linear if expert_pair(f) is not None}
    others = sorted(not_linear - experts)
    if others:  # GPT-2's Conv1D: its weight is stored [in, out]
        raise ExportError(f"layer {others[0]}: is a {type(modules.get(others[0])).__name__}, not an nn.Linear; "
                          f"compressed-tensors quantizes nn.Linear layers only; export with --format hf")
    schemes = layer_schemes(assignment, quant, widths, experts, options.fallback, warn)
    moved = unify_fusions(schemes, warn) if options.vllm_fused else {}
    split = split_fusions(schemes)
    if split:
        warn(f"{len(split)} q/k/v or gate/up group(s) at different schemes ({next(iter(split))}, ...): transformers "
             f"loads them; vLLM fuses each group into one module and wants one scheme for it (--vllm-fused gives "
             f"each group its most precise member's scheme)")
    if experts and not any(s.scheme == "fp8" for s in schemes.values()):
        warn("MoE experts exported unquantized with no FP8 layer: transformers 5.24 loads such a checkpoint's "
             "experts through the NVFP4 group, which drops them, and fails (vLLM reads the checkpoint itself)")
    fp4 = sorted(f for f, s in schemes.items() if s.scheme == "nvfp4")
    amax: Dict[str, torch.Tensor] = {}
    calibration: Dict[str, Any] = {"batches": 0}
    if fp4:
        batches, data = calibration_batches(settings, options.calibration_batches, str(source),
                                            options.calibration_data, model.get_input_embeddings().num_embeddings)
        planned = planned_forward_model(model, assignment, quant)
        amax = input_amax(planned, fp4, batches)
        del planned
        calibration = {"batches": len(batches), "blocks_per_batch": batches[0]["input_ids"].shape[0],
                       "block_size": batches[0]["input_ids"].shape[1], "data": data,
                       "input_amax": {f: float(a) for f, a in amax.items()}}
    masters = {f: model.get_submodule(f).weight.detach().float().clone()
               for f, s in schemes.items() if s.scheme != "bf16"}
    model.to(dtype)
    compressor, layers = compress(model, schemes, quant, amax, masters)
    counts: Dict[str, int] = {}
    for s in schemes.values():
        counts[s.scheme] = counts.get(s.scheme, 0) + 1
    record = {"format_written": "compressed-tensors", "schemes": counts, "layers": layers,
              "fallback": {f: s.reason for f, s in schemes.items() if s.reason and f not in moved},
              "vllm_fused": {"raised": moved, "split_groups": sorted(split)},
              "calibration": calibration, "recipes": {"fp8": quant.fp8_recipe, "fp4": quant.fp4_recipe,
                                                      "weight_2d": quant.weight_2d}}
    return record, lambda tmp: compressor.update_config(str(tmp))
