"""Slow, obviously correct reference quantizers, kept apart from production code.

Everything here works on Python floats and NumPy float32 scalars, one element at a time: a format's grid
is enumerated from its bit fields, rounding picks the nearest grid point by comparing distances (ties go to
the code with an even mantissa), and blocks are cut with explicit slices. Production code in
:mod:`snip_ds.quant` must match these bit for bit wherever both are deterministic.
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import numpy as np
import torch

F32 = np.float32


def grid(ebits: int, mbits: int, bias: int, max_normal: float) -> List[Tuple[float, int]]:
    """Every finite non-negative magnitude of a format with its code, from the bit fields."""
    points = []
    for e in range(2 ** ebits):
        for m in range(2 ** mbits):
            if e == 0:
                value = (m / 2 ** mbits) * 2.0 ** (1 - bias)
            else:
                value = (1 + m / 2 ** mbits) * 2.0 ** (e - bias)
            if value <= max_normal:  # drops E4M3's NaN code and E5M2's Inf/NaN codes
                points.append((value, (e << mbits) | m))
    return sorted(points)


GRIDS = {
    "e4m3": grid(4, 3, 7, 448.0),
    "e5m2": grid(5, 2, 15, 57344.0),
    "e2m1": grid(2, 1, 1, 6.0),
}


def round_rne(value: float, fmt: str) -> float:
    """Nearest grid value of ``fmt`` to ``value``, ties to the even code, saturating; NaN stays NaN."""
    if math.isnan(value):
        return math.nan
    points = GRIDS[fmt]
    mag = min(abs(value), points[-1][0])
    best_value, best_code = points[0]
    for point, code in points[1:]:
        d_new, d_best = abs(mag - point), abs(mag - best_value)
        if d_new < d_best or (d_new == d_best and code % 2 == 0 and best_code % 2 == 1):
            best_value, best_code = point, code
    return math.copysign(best_value, value)


def neighbours(value: float, fmt: str) -> Tuple[float, float]:
    """The grid values just below and just above ``|value|`` (equal when ``|value|`` is on the grid)."""
    mag = abs(value)
    values = [p for p, _ in GRIDS[fmt]]
    lower = max(v for v in values if v <= mag)
    upper = min((v for v in values if v >= mag), default=values[-1])
    return lower, upper


def floor_log2(value: float) -> int:
    """``floor(log2(value))`` for a positive finite float, by exact comparisons with powers of two."""
    k = 0
    while 2.0 ** k <= value:
        k += 1
    while 2.0 ** k > value:
        k -= 1
    return k


def _blocks(n: int, size: int) -> List[slice]:
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def _quantize_block(values: Sequence[float], divisor: float, multiplier: float, fmt: str) -> List[float]:
    """``RNE(v / divisor) * multiplier`` in float32 per element; a zero divisor gives (signed) zeros."""
    out = []
    for v in values:
        if divisor == 0:
            out.append(math.copysign(0.0, v))
            continue
        q = round_rne(float(F32(v) / F32(divisor)), fmt)
        out.append(float(F32(q) * F32(multiplier)))
    return out


def ref_per_tensor(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Per-tensor current scaling: ``s = amax / max`` (1 when amax is 0), ``RNE(x / s) * s``."""
    flat = x.double().flatten().tolist()  # float32 values, held exactly
    amax = max(abs(v) for v in flat)
    scale = float(F32(amax) / F32(GRIDS[fmt][-1][0])) if amax > 0 else 1.0
    return torch.tensor(_quantize_block(flat, scale, scale, fmt), dtype=torch.float32).view(x.shape)


def ref_mx_rows(x: torch.Tensor, fmt: str, emax: int, block: int = 32) -> torch.Tensor:
    """MX along the last axis of a 2-D tensor: ``X = 2**(floor(log2 amax) - emax)`` per block."""
    rows = []
    for row in x.double().tolist():
        out = []
        for sl in _blocks(len(row), block):
            amax = max(abs(v) for v in row[sl])
            scale = 2.0 ** (floor_log2(amax) - emax) if amax > 0 else 1.0
            out += _quantize_block(row[sl], scale, scale, fmt)
        rows.append(out)
    return torch.tensor(rows, dtype=torch.float32)


def _nvfp4_tensor_scale(amax_tensor: float) -> float:
    return float(F32(amax_tensor) / F32(448.0 * 6.0)) if amax_tensor > 0 else 1.0


def _nvfp4_block_scale(amax_block: float, tensor_scale: float) -> float:
    """``d = E4M3_RNE(amax_block / (6 S)) * S`` in float32."""
    s_b = round_rne(float(F32(amax_block) / (F32(tensor_scale) * F32(6.0))), "e4m3")
    return float(F32(s_b) * F32(tensor_scale))


def ref_nvfp4_rows(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """NVFP4 (RNE) along the last axis of a 2-D tensor."""
    data = x.double().tolist()
    tensor_scale = _nvfp4_tensor_scale(max(abs(v) for row in data for v in row))
    rows = []
    for row in data:
        out = []
        for sl in _blocks(len(row), block):
            d = _nvfp4_block_scale(max(abs(v) for v in row[sl]), tensor_scale)
            out += _quantize_block(row[sl], d, d, "e2m1")
        rows.append(out)
    return torch.tensor(rows, dtype=torch.float32)


def ref_nvfp4_2d(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """NVFP4 (RNE) with ``block x block`` tiles of a 2-D tensor (partial tiles at the edges)."""
    data = x.double().tolist()
    n_rows, n_cols = len(data), len(data[0])
    tensor_scale = _nvfp4_tensor_scale(max(abs(v) for row in data for v in row))
    out = [[0.0] * n_cols for _ in range(n_rows)]
    for rs in _blocks(n_rows, block):
        for cs in _blocks(n_cols, block):
            tile = [data[r][c] for r in range(rs.start, rs.stop) for c in range(cs.start, cs.stop)]
            d = _nvfp4_block_scale(max(abs(v) for v in tile), tensor_scale)
            q = iter(_quantize_block(tile, d, d, "e2m1"))
            for r in range(rs.start, rs.stop):
                for c in range(cs.start, cs.stop):
                    out[r][c] = next(q)
    return torch.tensor(out, dtype=torch.float32)


def block_diagonal_hadamard(signs: Sequence[float], size: int = 16) -> torch.Tensor:
    """The full ``n x n`` matrix ``blockdiag(H, ..., H, I_tail) @ diag(signs)`` in float64."""
    n = len(signs)
    h = torch.tensor([[(-1.0) ** bin(i & j).count("1") for j in range(size)] for i in range(size)],
                     dtype=torch.float64) / math.sqrt(size)
    m = torch.eye(n, dtype=torch.float64)
    for start in range(0, n - n % size, size):
        m[start:start + size, start:start + size] = h
    return m @ torch.diag(torch.tensor(list(signs), dtype=torch.float64))


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same shape, dtype, NaN positions and exact bits elsewhere (so +0.0 and -0.0 differ)."""
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.float().flatten(), expected.float().flatten()
    nan_a, nan_e = a.isnan(), e.isnan()
    assert torch.equal(nan_a, nan_e), f"NaN at {nan_a.nonzero().flatten()[:8].tolist()} vs " \
                                      f"{nan_e.nonzero().flatten()[:8].tolist()}"
    bits_a, bits_e = a[~nan_a].view(torch.int32), e[~nan_e].view(torch.int32)
    bad = (bits_a != bits_e).nonzero().flatten()
    assert bad.numel() == 0, (f"{bad.numel()} of {bits_a.numel()} values differ, e.g. "
                              f"{a[~nan_a][bad[:6]].tolist()} vs {e[~nan_e][bad[:6]].tolist()}")


def _sr_moments_block(values: Sequence[float], divisor: float, multiplier: float,
                      fmt: str) -> Tuple[List[float], List[float]]:
    """Mean and variance of stochastic rounding of ``v / divisor`` onto ``fmt``'s grid, times ``multiplier``:
    the value goes to the grid neighbour below (``l``) or above (``u``) with probabilities making it unbiased
    inside the range; beyond max_normal it saturates (no variance)."""
    means, variances = [], []
    for v in values:
        if divisor == 0:
            means.append(0.0)
            variances.append(0.0)
            continue
        a = min(abs(float(F32(v) / F32(divisor))), GRIDS[fmt][-1][0])
        lower, upper = neighbours(a, fmt)
        p_up = 0.0 if upper == lower else (a - lower) / (upper - lower)
        mean = lower + p_up * (upper - lower)
        var = p_up * (upper - mean) ** 2 + (1 - p_up) * (lower - mean) ** 2
        means.append(math.copysign(mean * multiplier, v))
        variances.append(var * multiplier ** 2)
    return means, variances


def ref_sr_moments_rows(x: torch.Tensor, recipe: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-element mean and variance of stochastic rounding along the last axis of a 2-D tensor, for
    ``"nvfp4"`` (blocks of 16) or ``"mxfp4"`` (blocks of 32), from the grid's neighbours of each value."""
    data = x.double().tolist()
    tensor_scale = _nvfp4_tensor_scale(max(abs(v) for row in data for v in row))
    means, variances = [], []
    for row in data:
        m_row, v_row = [], []
        for sl in _blocks(len(row), 16 if recipe == "nvfp4" else 32):
            amax = max(abs(v) for v in row[sl])
            if recipe == "nvfp4":
                d = _nvfp4_block_scale(amax, tensor_scale)
            else:
                d = 2.0 ** (floor_log2(amax) - 2) if amax > 0 else 1.0
            m, v = _sr_moments_block(row[sl], d, d, "e2m1")
            m_row += m
            v_row += v
        means.append(m_row)
        variances.append(v_row)
    return torch.tensor(means, dtype=torch.float64), torch.tensor(variances, dtype=torch.float64)


def ref_nvfp4_parts_rows(x: torch.Tensor, block: int = 16) -> Tuple[torch.Tensor, float]:
    """NVFP4 (RNE) along the last axis of a 2-D tensor, split as ``quantize_parts`` splits it: each element's
    E2M1 grid value times its block's E4M3 scale ``s_b`` (``q`` found by dividing by ``d = fl(s_b * S)``),
    and the FP32 tensor scale ``S``."""
    data = x.double().tolist()
    tensor_scale = _nvfp4_tensor_scale(max(abs(v) for row in data for v in row))
    rows = []
    for row in data:
        out = []
        for sl in _blocks(len(row), block):
            amax = max(abs(v) for v in row[sl])
            s_b = round_rne(float(F32(amax) / (F32(tensor_scale) * F32(6.0))), "e4m3")
            d = float(F32(s_b) * F32(tensor_scale))
            out += _quantize_block(row[sl], d, s_b, "e2m1")
        rows.append(out)
    return torch.tensor(rows, dtype=torch.float32), tensor_scale
