"""The process-wide generators a model's or a user's data code draws from: Python's ``random``, NumPy's global
generator (``numpy.random.seed`` / ``get_state``) and torch's CPU generator. :func:`seed_global_rngs` seeds them
all as the Hugging Face Trainer's ``set_seed`` does; :func:`global_rng_tensors` and :func:`restore_global_rngs`
carry their states through a checkpoint's ``snip_rng_rank<r>.safetensors`` as plain integer and float tensors
(no pickle: a checkpoint is read with safetensors, never unpickled), exactly.

SNIP's own randomness (data order, statistics, measurements, stochastic rounding) has generators of its own.
"""
from __future__ import annotations

import random
from typing import Dict, Mapping

import numpy as np
import torch

TORCH_KEY = "torch_rng"
PYTHON_KEYS = ("python_rng/version", "python_rng/state", "python_rng/gauss_next")
NUMPY_KEYS = ("numpy_rng/keys", "numpy_rng/pos", "numpy_rng/has_gauss", "numpy_rng/cached_gaussian")


def seed_global_rngs(seed: int) -> None:
    """Seeds Python's, NumPy's and torch's global generators (CPU and every GPU) with ``seed``, as the Hugging
    Face Trainer's ``set_seed`` does (NumPy takes it modulo 2**32)."""
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


def global_rng_tensors() -> Dict[str, torch.Tensor]:
    """The three generators' states as tensors (keys :data:`TORCH_KEY`, :data:`PYTHON_KEYS`,
    :data:`NUMPY_KEYS`): integers as int64, Python's cached Gaussian and NumPy's as float64 (an empty
    tensor where Python has none)."""
    version, words, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    if kind != "MT19937":  # numpy.random's global generator has been MT19937 in every NumPy release
        raise ValueError(f"NumPy's global generator is {kind!r}, not MT19937: its state cannot be saved")
    return {
        TORCH_KEY: torch.get_rng_state().clone(),
        "python_rng/version": torch.tensor([version], dtype=torch.int64),
        "python_rng/state": torch.tensor(words, dtype=torch.int64),
        "python_rng/gauss_next": torch.tensor([] if gauss_next is None else [gauss_next], dtype=torch.float64),
        "numpy_rng/keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
        "numpy_rng/pos": torch.tensor([pos], dtype=torch.int64),
        "numpy_rng/has_gauss": torch.tensor([has_gauss], dtype=torch.int64),
        "numpy_rng/cached_gaussian": torch.tensor([cached], dtype=torch.float64),
    }


def restore_global_rngs(tensors: Mapping[str, torch.Tensor]) -> None:
    """Restores what :func:`global_rng_tensors` gave, generator by generator: one whose keys ``tensors`` lacks
    (a checkpoint of an older snip_ds held torch's alone) keeps its state.

    Raises:
        ValueError: a state of the wrong shape or values (a damaged file).
    """
    if TORCH_KEY in tensors:
        torch.set_rng_state(tensors[TORCH_KEY])
    if all(k in tensors for k in PYTHON_KEYS):
        version = int(tensors["python_rng/version"].reshape(-1)[0])
        words = tuple(int(w) for w in tensors["python_rng/state"].tolist())
        gauss = tensors["python_rng/gauss_next"].tolist()
        try:
            random.setstate((version, words, float(gauss[0]) if gauss else None))
        except (TypeError, ValueError, OverflowError) as err:
            raise ValueError(f"python_rng: not a state of Python's random ({err})") from None
    if all(k in tensors for k in NUMPY_KEYS):
        keys = tensors["numpy_rng/keys"].numpy()
        if keys.shape != (624,) or keys.min() < 0 or keys.max() >= 2 ** 32:
            raise ValueError(f"numpy_rng/keys: expected 624 unsigned 32-bit words, got shape {tuple(keys.shape)}")
        np.random.set_state(("MT19937", keys.astype(np.uint32), int(tensors["numpy_rng/pos"].reshape(-1)[0]),
                             int(tensors["numpy_rng/has_gauss"].reshape(-1)[0]),
                             float(tensors["numpy_rng/cached_gaussian"].reshape(-1)[0])))
