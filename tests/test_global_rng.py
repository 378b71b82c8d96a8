"""snip_ds.runtime.global_rng: Python's, NumPy's and torch's global generators through a safetensors file and back, exactly."""
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from snip_ds.runtime.global_rng import (NUMPY_KEYS, PYTHON_KEYS, TORCH_KEY, global_rng_tensors, restore_global_rngs,
                                seed_global_rngs)


def _draws() -> tuple:
    """What code drawing from the three generators gets next (Gaussians included: each generator caches one)."""
    return ([random.random() for _ in range(5)], random.gauss(0.0, 1.0), np.random.rand(5).tolist(),
            float(np.random.standard_normal()), torch.rand(5).tolist())


@pytest.fixture
def kept_global_state():
    """The test changes the process-wide generators: put them back for the tests after it."""
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.set_rng_state(saved[2])


@pytest.mark.parametrize("cached_gaussian", [False, True])
def test_states_saved_to_safetensors_and_restored_repeat_the_draws(tmp_path, kept_global_state, cached_gaussian):
    seed_global_rngs(1234)
    _draws()  # one Gaussian each: both generators draw a pair and keep the second
    if not cached_gaussian:  # the kept one drawn too
        random.gauss(0.0, 1.0)
        np.random.standard_normal()
    assert (random.getstate()[2] is not None) == cached_gaussian
    assert bool(np.random.get_state()[3]) == cached_gaussian
    path = tmp_path / "rng.safetensors"
    save_file(global_rng_tensors(), str(path))  # plain tensors: no pickle anywhere
    expected = _draws()
    seed_global_rngs(99)  # anything else in between
    _draws()
    restore_global_rngs(load_file(str(path)))
    assert _draws() == expected


def test_the_keys_and_dtypes_are_plain_integers_and_floats(kept_global_state):
    tensors = global_rng_tensors()
    assert set(tensors) == {TORCH_KEY, *PYTHON_KEYS, *NUMPY_KEYS}
    assert tensors["python_rng/state"].dtype == torch.int64 and tensors["python_rng/state"].shape == (625,)
    assert tensors["numpy_rng/keys"].dtype == torch.int64 and tensors["numpy_rng/keys"].shape == (624,)
    assert tensors["numpy_rng/cached_gaussian"].dtype == torch.float64


def test_an_older_file_with_torch_s_state_alone_leaves_python_and_numpy_as_they_are(kept_global_state):
    seed_global_rngs(5)
    torch_only = {TORCH_KEY: torch.get_rng_state().clone()}
    expected_torch = torch.rand(3).tolist()
    random.random(), np.random.rand()
    python, numpy = random.getstate(), np.random.get_state()
    restore_global_rngs(torch_only)
    assert torch.rand(3).tolist() == expected_torch
    assert random.getstate() == python
    assert np.array_equal(np.random.get_state()[1], numpy[1]) and np.random.get_state()[2] == numpy[2]


def test_a_damaged_state_is_a_value_error_naming_the_generator(kept_global_state):
    bad = global_rng_tensors()
    bad["numpy_rng/keys"] = bad["numpy_rng/keys"][:10]
    with pytest.raises(ValueError, match=r"^numpy_rng/keys: expected 624 unsigned 32-bit words"):
        restore_global_rngs(bad)
    bad = global_rng_tensors()
    bad["python_rng/state"] = bad["python_rng/state"][:7]
    with pytest.raises(ValueError, match=r"^python_rng: not a state of Python's random"):
        restore_global_rngs(bad)
