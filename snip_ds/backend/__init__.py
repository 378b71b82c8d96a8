"""How each of a linear layer's three GEMMs is computed at a given precision (see :mod:`.base`).

One module per backend: :mod:`.emulated` (the numerical reference; the statistics use its numerics through
:func:`statistics_backend`), :mod:`.torch_native` (``torch``) and :mod:`.te` (``te``, Transformer Engine:
imported only when chosen, through :func:`get_backend` / :func:`resolve`); :mod:`.base` holds the interface,
the registry and ``auto``.
"""
from snip_ds.backend.base import (BackendError, GemmBackend, check_backend, get_backend, layer_backends,
                                  register, resolve, seed_offset)
from snip_ds.backend.emulated import (CHUNK_ELEMENTS, EmulatedBackend, GemmMoments, OperandRecipes,  # noqa: F401
                                      _chunks, operand_recipes, reference_operands, statistics_backend,
                                      tensor_amax)
from snip_ds.backend.torch_native import TorchBackend
from snip_ds.quant import hadamard_transform, random_signs  # noqa: F401  (as before the split)

register(EmulatedBackend())
register(TorchBackend())

__all__ = ["BackendError", "GemmBackend", "EmulatedBackend", "TorchBackend", "GemmMoments", "OperandRecipes",
           "CHUNK_ELEMENTS", "check_backend", "get_backend", "layer_backends", "operand_recipes",
           "reference_operands", "register", "resolve", "seed_offset", "statistics_backend", "tensor_amax"]
