"""The optimizer DeepSpeed builds from the config: its fused Adam where that op builds, else torch's, with a warning.

An ``"optimizer": {"type": "Adam" | "AdamW"}`` config makes ``deepspeed.initialize`` build DeepSpeed's
``FusedAdam``, whose op is JIT-compiled on first use (nvcc on a GPU, the C++ compiler on a CPU). When that build
fails (no nvcc, a CUDA toolkit the op does not compile with, no write access to the build folder) DeepSpeed
stops with the compiler's traceback, after minutes of loading the model. :func:`working_adam_config` builds the
op first; if it cannot be built it logs a warning with the reason and returns the config with
``"torch_adam": true``, DeepSpeed's own switch to ``torch.optim.AdamW`` / ``Adam`` (the same update, unfused).
Configs that already choose torch's Adam, another optimizer, or ZeRO's CPU/NVMe optimizer offload (DeepSpeed's
CPU Adam, a different op) are returned unchanged. :func:`prepare_adam_in_place` does the same for the
Hugging Face Trainer, which builds its engine from its own config later.
"""
from __future__ import annotations

import copy
import logging
from typing import Any, Dict, Iterable, Mapping, Optional

from snip_ds.runtime import jit_builds

log = logging.getLogger("snip_ds")

FUSED_TYPES = ("adam", "adamw")


def _uses_fused_adam(config: Mapping[str, Any]) -> bool:
    opt = config.get("optimizer")
    if not isinstance(opt, Mapping) or str(opt.get("type", "")).lower() not in FUSED_TYPES:
        return False
    params = opt.get("params") or {}
    if isinstance(params, Mapping) and params.get("torch_adam"):
        return False
    zero = config.get("zero_optimization") or {}
    offload = zero.get("offload_optimizer") if isinstance(zero, Mapping) else None
    if isinstance(offload, Mapping) and str(offload.get("device", "none")).lower() in ("cpu", "nvme"):
        return False
    return True


def fused_adam_error() -> Optional[str]:
    """None if DeepSpeed's ``FusedAdam`` op loads (building it if needed: DeepSpeed then keeps it loaded for
    ``deepspeed.initialize``), else the reason it cannot, in one line."""
    try:
        from deepspeed.ops.op_builder import FusedAdamBuilder

        from snip_ds.engine.op_builds import announce_unbuilt
        announce_unbuilt("FusedAdamBuilder")  # one line when it compiles now
        with jit_builds.deepspeed_arch_list_set():
            FusedAdamBuilder().load(verbose=False)
    except Exception as err:  # any build or load failure: the compiler's, the loader's, DeepSpeed's own checks
        text = " ".join(str(err).split())
        return f"{type(err).__name__}: {text[:500]}"
    return None


def working_adam_config(config: Mapping[str, Any]) -> Dict[str, Any]:
    """``config`` (a DeepSpeed config), with ``optimizer.params.torch_adam = true`` where it asks for DeepSpeed's
    fused Adam and that op cannot be built here (a warning says why); otherwise ``config`` unchanged. The caller's
    config is never modified."""
    config = dict(config)
    if isinstance(config.get("optimizer"), Mapping):
        config["optimizer"] = dict(copy.deepcopy(config["optimizer"]))
    prepare_adam_in_place([config])
    return config


def prepare_adam_in_place(configs: Iterable[Any]) -> Optional[str]:
    """For a loop that hands its own DeepSpeed config to ``deepspeed.initialize`` later (the Hugging Face
    Trainer, through accelerate): builds the fused Adam now, under the architecture list DeepSpeed can read
    (DeepSpeed keeps the loaded op for the engine), and where it cannot be built sets ``torch_adam`` in each of
    ``configs`` (the live dicts the loop will read; the first decides) with the warning. Returns the reason,
    or None."""
    live = [c for c in configs if isinstance(c, dict)]
    if not live or not _uses_fused_adam(live[0]):
        return None
    reason = fused_adam_error()
    if reason is None:
        return None
    for config in {id(c): c for c in live}.values():
        opt = config.get("optimizer")
        if isinstance(opt, dict):
            params = opt.get("params")
            if not isinstance(params, dict):
                params = opt["params"] = dict(params or {})
            params["torch_adam"] = True
    adamw = str(live[0]["optimizer"].get("type")).lower() == "adamw"
    log.warning("snip_ds: DeepSpeed's FusedAdam could not be built (%s); training with torch.optim.%s instead "
                "(the same update, unfused). Set \"torch_adam\": true in the optimizer's params to choose it "
                "and skip this build.", reason, "AdamW" if adamw else "Adam")
    return reason
