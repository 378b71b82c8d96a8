"""The FP32 master weights of a checkpoint, read from DeepSpeed's files without unpickling.

* :func:`master_weights`: consolidated from the ZeRO shards (any stage, any world size) by DeepSpeed's own
  ``deepspeed.utils.zero_to_fp32``; without ZeRO and without mixed precision, the module weights DeepSpeed saved
  are the master weights;
* :func:`universal_weights`: a universal checkpoint's whole parameters (``zero/<name>/fp32.pt``);
* :func:`merged_shards`: a tensor-parallel checkpoint's, its shards merged by DeepSpeed's ``ds_to_universal`` in
  a temporary folder.

``zero_to_fp32`` itself unpickles (``weights_only=False``), so while it runs its module-level ``torch`` is
replaced by :class:`_SafeTorch`, which forces ``weights_only=True`` and names the file it cannot read.
"""
from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path
from typing import Callable, Dict, Mapping

import torch

from snip_ds.engine.checkpoint_io import deepspeed_safe_globals
from snip_ds.engine.universal import run_ds_to_universal
from snip_ds.export.files import ExportError, one_line


class _SafeTorch:
    """Stands in for the ``torch`` module inside ``zero_to_fp32``: ``load`` always uses ``weights_only=True``
    (with the DeepSpeed classes :func:`~snip_ds.engine.checkpoint_io.deepspeed_safe_globals` allows); everything
    else is torch's."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def load(f, map_location=None, **kwargs):
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            try:
                return torch.load(f, map_location=map_location, **kwargs)
            except Exception as err:  # a damaged file, or one that needs unpickling: name it
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise ExportError(f"{f}: cannot be read as a DeepSpeed checkpoint file with weights_only=True "
                                  f"({first})") from None


@contextlib.contextmanager
def _safe_zero_to_fp32():
    """``deepspeed.utils.zero_to_fp32`` with :class:`_SafeTorch` as its ``torch``, its prints and progress bars
    silenced."""
    from deepspeed.utils import zero_to_fp32

    saved = zero_to_fp32.torch, zero_to_fp32.tqdm
    zero_to_fp32.torch, zero_to_fp32.tqdm = _SafeTorch(), lambda iterable, **kwargs: iterable
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield zero_to_fp32
    finally:
        zero_to_fp32.torch, zero_to_fp32.tqdm = saved



def master_weights(tag_dir: Path) -> Dict[str, torch.Tensor]:
    """The FP32 master weights of the checkpoint in ``tag_dir``, by parameter name (tied ones under each name).

    Raises:
        ExportError: missing, damaged or unreadable DeepSpeed files (the message names the file).
    """
    with _safe_zero_to_fp32() as z:
        try:
            model_files = z.get_model_state_files(str(tag_dir))
        except FileNotFoundError:
            raise ExportError(f"{tag_dir}: no DeepSpeed '*_model_states.pt' file; the checkpoint is "
                              f"incomplete") from None
        states = z.torch.load(model_files[0], map_location="cpu")
        ds_config = states.get("ds_config") if isinstance(states, dict) else None
        ds_config = ds_config if isinstance(ds_config, dict) else {}
        stage = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
        mixed = any((ds_config.get(k) or {}).get("enabled") is True for k in ("bf16", "fp16"))
        if sorted(tag_dir.glob("*_optim_states.pt")):
            try:
                state = z.get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
            except ExportError:
                raise
            except Exception as err:  # DeepSpeed's own checks (shard count ...) or a foreign file
                raise ExportError(f"{tag_dir}: DeepSpeed could not consolidate the ZeRO shards "
                                  f"({one_line(err)})") from None
            return {k: v.float() for k, v in state.items()}
        if stage > 0 or mixed:
            raise ExportError(f"{tag_dir}: no DeepSpeed '*_optim_states.pt' files, which hold the FP32 master "
                              f"weights of a {'ZeRO' if stage else 'mixed-precision'} run; the checkpoint is "
                              f"incomplete")
        # No ZeRO, no mixed precision: the optimizer steps the module's own FP32 parameters.
        module = states.get("module") if isinstance(states, dict) else None
        if not isinstance(module, Mapping) or not all(isinstance(v, torch.Tensor) for v in module.values()):
            raise ExportError(f"{model_files[0]}: holds no 'module' state dict")
        return {k: v.float() for k, v in module.items()}


def universal_weights(tag_dir: Path, model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The FP32 master weights of a universal checkpoint (``zero/<name>/fp32.pt``, whole parameters: DeepSpeed's
    conversion merged ZeRO partitions and tensor-parallel shards), by the names of ``model``'s state dict (a
    tied parameter, stored once, under each of its names); read with ``weights_only=True``.

    Raises:
        ExportError: an unreadable file, or a parameter of ``model`` that is not there (named).
    """
    weights: Dict[str, torch.Tensor] = {}
    zero = tag_dir / "zero"
    for folder in sorted(zero.iterdir()) if zero.is_dir() else []:
        path = folder / "fp32.pt"
        if not path.is_file():
            continue
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 -- a damaged or foreign file: name it
            raise ExportError(f"{path}: cannot be read as a tensor file ({one_line(err)})") from None
        tensor = state.get("param") if isinstance(state, dict) else None
        if not isinstance(tensor, torch.Tensor):
            raise ExportError(f"{path}: holds no 'param' tensor")
        weights[folder.name] = tensor.float()
    names: Dict[int, list] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for group in names.values():  # a tied parameter: under every name that shares it
        found = next((weights[n] for n in group if n in weights), None)
        for n in group:
            if found is None:
                raise ExportError(f"{zero / n / 'fp32.pt'}: missing; the universal checkpoint does not hold "
                                  f"parameter {n}")
            weights.setdefault(n, found)
    return weights



def merged_shards(tag_dir: Path, model: torch.nn.Module, tp: int, scratch: Path,
                   warn: Callable[[str], None]) -> Dict[str, torch.Tensor]:
    """The FP32 master weights of the tensor-parallel DeepSpeed checkpoint ``tag_dir``, its shards merged by
    DeepSpeed's universal conversion in a temporary folder under ``scratch``."""
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".snip-export-", dir=scratch) as tmp:
        warn(f"{tag_dir}: tensor-parallel shards ({tp} per layer): merged through DeepSpeed's universal "
             f"conversion in a temporary folder")
        quiet = io.StringIO()  # DeepSpeed's converter prints its progress (stdout) and progress bars (stderr)
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            run_ds_to_universal(tag_dir, Path(tmp) / "merged")
        return universal_weights(Path(tmp) / "merged", model)
