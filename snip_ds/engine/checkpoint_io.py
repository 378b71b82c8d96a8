"""DeepSpeed's checkpoint files read without unpickling, and written so that a failed write stops every rank
the same way.

* :class:`SafeTorchCheckpointEngine` (put in place by :func:`install_safe_loader`): DeepSpeed's torch
  checkpoint engine, loading with ``torch.load(weights_only=True)`` and the classes
  :func:`deepspeed_safe_globals` allows, and recording a failed write (:func:`write_error`) instead of raising
  in the middle of DeepSpeed's collective save;
* :func:`safe_torch_load`: every ``torch.load`` within it (DeepSpeed's own, outside its engine) with
  ``weights_only=True``.

A file that needs more than ``weights_only`` allows raises :class:`~snip_ds.engine.checkpoint_layout.
CheckpointError` naming it: checkpoints are never unpickled.
"""
from __future__ import annotations

import contextlib
import os

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from snip_ds.engine.checkpoint_layout import CheckpointError


def write_error(path: str | os.PathLike, err: BaseException) -> str:
    """``"<path>: cannot be written (<cause>)"``, the cause taken from the first OSError in ``err``'s chain
    (torch's zip writer wraps the OSError of a failed write in a RuntimeError that does not name it)."""
    seen, e = set(), err
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            cause = f"{e.strerror or e} [errno {e.errno}]" if e.errno else str(e)
            break
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    else:
        cause = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return f"{path}: cannot be written ({cause})"


def deepspeed_safe_globals() -> list:
    """Classes DeepSpeed pickles into its checkpoints that ``weights_only`` loading must accept."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler, DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    import argparse
    import collections
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address, argparse.Namespace,
            collections.OrderedDict, set]


class SafeTorchCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, loading with ``weights_only=True`` (no arbitrary unpickling).

    Saving records the first failed write in :attr:`failure` instead of raising: DeepSpeed's
    ``save_checkpoint`` runs collectives after its writes (ZeRO-3's parameter all-gather, a barrier), so a
    rank that raised there would leave the others waiting. :func:`snip_ds.engine.checkpoint.save` lets DeepSpeed
    finish, then the ranks agree on the first failure. Once a write failed, later writes of the same save are
    skipped.
    """

    failure: str | None = None

    def save(self, state_dict, path: str):
        if self.failure is not None:
            return
        try:
            with open(path, "wb") as f:  # a Python file: the OSError of a failed write stays in the chain
                torch.save(state_dict, f, _use_new_zipfile_serialization=self.zipfile_serialization)
        except Exception as err:  # noqa: BLE001 -- recorded and reported by every rank after the save
            self.failure = write_error(path, err)

    def makedirs(self, path, exist_ok=False):
        try:
            os.makedirs(path, exist_ok=exist_ok)
        except OSError as err:
            if self.failure is None:
                self.failure = write_error(path, err)

    def load(self, path: str, map_location=None):
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            try:
                return torch.load(path, map_location=map_location, weights_only=True)
            except Exception as err:  # a corrupt or foreign file: name it
                raise CheckpointError(f"{path}: cannot be read as a DeepSpeed checkpoint file with "
                                      f"weights_only=True ({err})") from None


@contextlib.contextmanager
def safe_torch_load():
    """Within it, every ``torch.load`` (DeepSpeed's own calls included: its universal-checkpoint reader and
    ``ds_to_universal`` pass ``weights_only=False`` themselves, outside its checkpoint engine) loads with
    ``weights_only=True`` and :func:`deepspeed_safe_globals`; a file that needs more raises :class:`CheckpointError`
    naming it. Restores ``torch.load`` on exit. Not thread-safe (nothing else loads meanwhile)."""
    original = torch.load

    def load(f, map_location=None, *args, **kwargs):
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            try:
                return original(f, map_location, *args, **kwargs)
            except Exception as err:  # noqa: BLE001 -- a corrupt or foreign file: name it
                raise CheckpointError(f"{f}: cannot be read as a DeepSpeed checkpoint file with "
                                      f"weights_only=True ({str(err).splitlines()[0] if str(err) else err})"
                                      ) from None
    torch.load = load
    try:
        yield
    finally:
        torch.load = original


def install_safe_loader(ds_engine) -> None:
    """Makes ``ds_engine`` (and its optimizer) read checkpoints through :class:`SafeTorchCheckpointEngine`."""
    if type(ds_engine.checkpoint_engine) is TorchCheckpointEngine:
        ds_engine.checkpoint_engine = SafeTorchCheckpointEngine(ds_engine._config)
        opt = getattr(ds_engine, "optimizer", None)
        if opt is not None and hasattr(opt, "checkpoint_engine"):
            opt.checkpoint_engine = ds_engine.checkpoint_engine
        copy_scripts = ds_engine._copy_recovery_script  # rank 0 copies zero_to_fp32.py into each checkpoint
        engine = ds_engine.checkpoint_engine

        def guarded_copy(save_path):  # its failure is recorded like a failed shard write (see save)
            if engine.failure is None:
                try:
                    copy_scripts(save_path)
                except OSError as err:
                    engine.failure = write_error(err.filename or save_path, err)
        ds_engine._copy_recovery_script = guarded_copy
