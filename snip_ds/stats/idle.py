"""The layers no call reached in a batch (an expert no token was routed to, a layer the forward never called):
each estimator sees one all-zero token for them, whose fprop error, weight-gradient error and probe are exactly 0,
so that they add zeros under the same keys as the layers that ran, and every data-parallel rank all-reduces the
same sums whichever layers its batch reached (:mod:`snip_ds.stats.experts`).
"""
from __future__ import annotations

import torch

from snip_ds.stats.bwd import BwdEstimator
from snip_ds.stats.common import PROBE_SQ, Sums
from snip_ds.stats.fld import FldEstimator


class ZeroWeight:
    """A layer whose weight ZeRO-3 has partitioned, as :func:`add_zero_token` measures it: its own attributes,
    but an all-zero weight. With a zero token every training term is 0 whatever the weight; only the study field
    ``quant_err_w`` (the weight's own operand error) reads 0 instead of the weight's."""

    def __init__(self, point, device: torch.device) -> None:
        self._point = point
        self.weight = self.matrix = torch.zeros(point.out_features, point.in_features, device=device)

    def __getattr__(self, name: str):
        return getattr(self._point, name)


def add_zero_token(fqn: str, point, device: torch.device, fld: FldEstimator, bwd: BwdEstimator, stats: Sums,
                   probe: bool) -> None:
    """Layer ``fqn`` (``point``: its module) measured on one all-zero token by ``fld``, ``bwd`` and, with
    ``probe`` (an estimator with probes), the sequence-form FLD; its probe's square sum is 0."""
    param = point.parameter
    module = point if tuple(param.shape) == tuple(getattr(param, "ds_shape", param.shape)) else \
        ZeroWeight(point, device)  # ZeRO-3: partitioned outside its module's forward
    x2 = torch.zeros(1, module.in_features, device=device)
    g2 = torch.zeros(1, module.out_features, device=device)
    rows = torch.zeros(1, dtype=torch.int64, device=device)
    fld.on_output(fqn, module, x2, g2, rows)
    bwd.on_train_grad(fqn, module, x2, g2)
    stats.add(fqn, PROBE_SQ.key(), torch.zeros(module.out_features, device=device))
    if probe:
        fld.on_probe(fqn, module, x2, g2, rows, torch.zeros_like(x2))
