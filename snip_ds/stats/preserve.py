"""What a statistics collection leaves on the model: nothing. :func:`preserved` puts the measured layers in the
collection's mode (BF16, back-propagating to their input only, each backward reported to an observer) and
restores afterwards their precision, mode and observer, the global RNG states (CPU and CUDA) and the MoE
experts' routed token counts (:func:`snip_ds.experts.model.routed_tokens_kept`).
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Callable, Dict, Iterator, Optional

import torch
from torch import nn

from snip_ds.experts.model import routed_tokens_kept
from snip_ds.experts.points import ExpertPoint
from snip_ds.stats.common import Layer

# observer(fqn, module, g, gx): a probe's backward through a layer (snip_ds.stats.collector.Collector's)
LayerBackward = Callable[[str, Layer, torch.Tensor, Optional[torch.Tensor]], None]


@contextmanager
def preserved(model: nn.Module, layers: Dict[str, Layer], observer: Optional[LayerBackward] = None) -> Iterator[None]:
    """bf16 layers that back-propagate to their input only (each backward through them reported to ``observer``,
    with the layer's fqn and module first); restores the layers' precision, mode and observer, the global RNG
    states (CPU and CUDA) and the MoE experts' routed token counts."""
    saved_precision = {fqn: m.gemm_precision for fqn, m in layers.items()}
    saved_grad_only = {fqn: m.input_grad_only for fqn, m in layers.items()}
    saved_observer = {fqn: m.input_grad_observer for fqn, m in layers.items()}
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), routed_tokens_kept(model):
        try:
            for m in layers.values():
                m.precision = "bf16"
                m.input_grad_only = True  # every pass back-propagates to the embedding output only
            if observer is not None:
                for fqn, m in layers.items():
                    m.input_grad_observer = partial(observer, fqn, m)
            yield
        finally:
            for fqn, m in layers.items():
                m.precision = saved_precision[fqn]
                m.input_grad_only = saved_grad_only[fqn]
                m.input_grad_observer = saved_observer[fqn]
                if isinstance(m, ExpertPoint):
                    m.token_index = None  # the last batch's routing: not kept past the collection
