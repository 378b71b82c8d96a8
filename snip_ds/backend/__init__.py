"""How each of a linear layer's three GEMMs is computed at a given precision (see :mod:`.base`).

One module per backend: :mod:`.emulated` (the numerical reference; the statistics use its numerics through
:func:`statistics_backend`), :mod:`.torch_native` (``torch``) and :mod:`.te` (``te``, Transformer Engine:
registered as a :class:`LazyBackend`, imported only when chosen); :mod:`.base` holds the interface, the
registry and ``auto``; :mod:`.operands` resolves a precision into each GEMM's operand recipes for all of them.
:mod:`.layer_step` is one quantized layer's forward and backward through them (what the eager autograd function
runs), :mod:`.custom_ops` the same as torch custom operators (what ``torch.compile`` traces), and
:mod:`.dispatch_audit` counts what a step dispatches and finds host reads (tests and benchmarks).

May import: the numerics core below it (types, formats, scales, quant, options, quant_config) and runtime/; never
linear, swap, stats/ or anything above.
"""
from snip_ds.backend.base import (BackendError, GemmBackend, LazyBackend, check_backend, get_backend,
                                  kernel_seed, layer_backends, register, resolve, seed_offset)
from snip_ds.backend.emulated import EmulatedBackend, GemmMoments, reference_operands, statistics_backend
from snip_ds.backend.operands import (CHUNK_ELEMENTS, GemmRecipe, Operand, OperandRecipes, chunks, gemm_recipe,
                                      operand_recipes, tensor_amax)
from snip_ds.backend.torch_native import TorchBackend


def _load_te(prefix: str) -> GemmBackend:
    from snip_ds.backend import te  # imported on first use: it imports Transformer Engine
    return te.load(prefix)


register(EmulatedBackend())
register(TorchBackend())
register(LazyBackend("te", ("cuda",), "Transformer Engine runs on CUDA devices only", _load_te))

__all__ = ["BackendError", "GemmBackend", "LazyBackend", "EmulatedBackend", "TorchBackend", "GemmMoments",
           "GemmRecipe", "Operand", "OperandRecipes", "CHUNK_ELEMENTS", "check_backend", "chunks", "gemm_recipe",
           "get_backend", "kernel_seed", "layer_backends", "operand_recipes", "reference_operands", "register",
           "resolve", "seed_offset", "statistics_backend", "tensor_amax"]
