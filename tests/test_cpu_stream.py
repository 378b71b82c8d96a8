"""The torch backend's GEMM epilogue (:func:`snip_ds.backend.cpu_stream.scaled`) and its CPU GEMM of grid values
(``TorchBackend._mm``): what each takes and writes, bit for bit against the path it replaced.

A BF16 GEMM's result on the CPU is its FP32 sum rounded once to BF16; the layer's BF16 result is that value
(MX: nothing multiplied) or that value times the FP32 product of tensor scales, rounded once (NVFP4). Taking
the BF16 result as it is, instead of widening it to FP32 and narrowing the result back, changes no bit; these
tests hold the code to that, on every CPU (no Triton needed)."""
import math

import pytest
import torch

from snip_ds.backend import TorchBackend

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _mm_as_before(a, b, scale_a, scale_b, bias, out_dtype, unit_scales, scale, fast_bf16):
    """The CPU's BF16-exact GEMM and epilogue as they were written before the GEMM's BF16 result was taken
    without a widening: the BF16 GEMM's result widened to FP32, then scaled in FP32 and narrowed."""
    if fast_bf16 and out_dtype == torch.bfloat16:
        y = torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16)).float()
    else:
        y = torch.mm(a.float(), b.float())
    if not unit_scales:
        scale = scale_a * scale_b if scale is None else scale
        if bias is None and out_dtype != torch.float32:
            return torch.mul(y, scale, out=torch.empty(y.shape, dtype=out_dtype))
        y = y.mul_(scale)
    return (y if bias is None else y + bias.float()).to(out_dtype)


@pytest.mark.parametrize("fast_bf16", [False, True], ids=["fp32_gemm", "bf16_gemm"])
def test_a_bf16_gemm_result_is_taken_as_it_is_bit_for_bit(fast_bf16, monkeypatch):
    """On a CPU the BF16 GEMM's result (its FP32 sum rounded once to BF16) is the layer's BF16 result for MX
    and the operand of NVFP4's one ``mul`` that writes BF16 (no widening to FP32 and narrowing back): every
    result, in every output dtype, with and without a bias, a kernel-written product of scales or none, is
    bit for bit the result of the widened path (``_mm_as_before``), with and without a native BF16 GEMM."""
    from snip_ds.backend import cpu_stream

    monkeypatch.setattr(cpu_stream, "_fast_bf16", fast_bf16)
    gen = torch.Generator().manual_seed(23)
    rows = torch.exp2(torch.randint(-6, 7, (33, 1), generator=gen).float())
    a = (torch.randn(33, 70, generator=gen) * rows).bfloat16()
    b = torch.randn(70, 45, generator=gen).bfloat16()
    scale_a, scale_b = torch.tensor(0.3713), torch.tensor(1.9e-3)
    backend = TorchBackend()
    for out_dtype in DTYPES:
        for bias in (None, torch.linspace(-1, 1, 45).to(out_dtype)):
            for unit, scale in ((True, None), (False, None), (False, torch.empty(2).fill_(7.1e-4)[1])):
                got = backend._mm("fprop", a, b, scale_a, scale_b, None, bias, out_dtype, unit, scale)
                ref = _mm_as_before(a, b, scale_a, scale_b, bias, out_dtype, unit, scale, fast_bf16)
                assert got.dtype == out_dtype and torch.equal(got, ref), (out_dtype, bias is None, unit, scale)


def test_a_bf16_product_scaled_in_one_operator_is_bit_for_bit():
    """NVFP4's tensor scale applied to a BF16 GEMM result in one operator that writes BF16 (the FP32 product
    rounded once as it is written: ``cpu_stream._mul_into``) equals widening to FP32, multiplying and narrowing,
    for every BF16 value (NaN as NaN) and scales that round every way: subnormal, overflowing, zero, infinite,
    given 0-d (a CPU scalar, multiplied in FP32 by the BF16 kernel: the CPU's path) or 1-d (promoted: the
    product computed in FP32 and narrowed as it is stored, the path of a scale on a GPU)."""
    from snip_ds.backend import cpu_stream

    every = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    gen = torch.Generator().manual_seed(29)
    scales = [1.0, 0.5, 3.0, 1 / 3, 7.77e-3, 2.0 ** -130, 2.0 ** -149, 1e30, 0.0, math.inf]
    scales += (torch.exp2(torch.randn(24, generator=gen) * 20) * (1 + torch.rand(24, generator=gen))).tolist()
    for value in scales:
        scale = torch.tensor(value, dtype=torch.float32)
        ref = every.float().mul(scale).to(torch.bfloat16)
        for given in (scale, scale.reshape(1)):
            for cols in (slice(None), slice(3, 253)):  # (rows whose length leaves a tail after the vectors)
                got = cpu_stream._mul_into(every[:, cols], given, torch.bfloat16)
                want = ref[:, cols]
                same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
                assert got.dtype == torch.bfloat16 and same.all(), value
