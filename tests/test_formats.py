"""Element formats and round_to_format against torch's own float8 casts and hand-written tables."""
import math

import pytest
import torch

from snip_ds.formats import E2M1, E4M3, E5M2, FORMATS, get_format, round_signed_, round_to_format
from tests.reference_quant import GRIDS, assert_bitwise_equal, neighbours, round_rne

TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def torch_fp8(x: torch.Tensor, name: str) -> torch.Tensor:
    """Independent reference: torch's RNE cast after saturating (torch's e5m2 cast would give Inf)."""
    fmt = FORMATS[name]
    return x.clamp(-fmt.max_normal, fmt.max_normal).to(TORCH_FP8[name]).float()


def all_finite_fp8(name: str) -> torch.Tensor:
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(TORCH_FP8[name]).float()
    return values[values.isfinite()].unique()  # sorted; +-0 collapse to one


@pytest.mark.parametrize("fmt, ebits, mbits, bias, max_normal, min_normal, min_sub, emax", [
    (E4M3, 4, 3, 7, 448.0, 2.0 ** -6, 2.0 ** -9, 8),
    (E5M2, 5, 2, 15, 57344.0, 2.0 ** -14, 2.0 ** -16, 15),
    (E2M1, 2, 1, 1, 6.0, 1.0, 0.5, 2),
])
def test_format_constants(fmt, ebits, mbits, bias, max_normal, min_normal, min_sub, emax):
    assert (fmt.ebits, fmt.mbits, fmt.bias, fmt.emax) == (ebits, mbits, bias, emax)
    assert (fmt.max_normal, fmt.min_normal, fmt.min_subnormal) == (max_normal, min_normal, min_sub)
    assert fmt.min_normal == 2.0 ** (1 - bias) and fmt.min_subnormal == 2.0 ** (1 - bias - mbits)
    assert get_format(fmt.name) is fmt
    # the bit-field enumeration of the reference agrees on the extremes
    assert GRIDS[fmt.name][-1][0] == max_normal and GRIDS[fmt.name][1][0] == min_sub


@pytest.mark.parametrize("name", ["e3m4", "fp8", "", None])
def test_get_format_unknown_lists_valid(name):
    with pytest.raises(ValueError, match=r"format: unknown .*valid: e4m3, e5m2, e2m1"):
        get_format(name)


# ----------------------------------------------------------------------------------------------------------
# FP8: bit-exact against torch.float8_* casts
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
@pytest.mark.parametrize("kind", ["representable", "midpoints", "near_midpoints", "random"])
def test_fp8_matches_torch_cast(name, kind):
    grid = all_finite_fp8(name)
    if kind == "representable":
        x = grid
    elif kind == "midpoints":  # exact ties between neighbours (fp32 holds them exactly): ties to even
        x = (grid[1:] + grid[:-1]) / 2
    elif kind == "near_midpoints":
        mid = (grid[1:] + grid[:-1]) / 2
        x = torch.cat([torch.nextafter(mid, torch.tensor(math.inf)), torch.nextafter(mid, torch.tensor(-math.inf))])
    else:
        gen = torch.Generator().manual_seed(1)
        fmt = FORMATS[name]
        log_mag = torch.empty(20000).uniform_(math.log2(fmt.min_subnormal) - 3, math.log2(fmt.max_normal) + 3,
                                              generator=gen)
        x = torch.exp2(log_mag) * torch.randn(20000, generator=gen).sign()
    assert_bitwise_equal(round_to_format(x, FORMATS[name]), torch_fp8(x, name))


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e2m1"])
def test_signed_rounding_equals_magnitude_rounding(name):
    """round_signed_ (RNE of signed values with one magic number) against round_to_format, bit for bit:
    the grid, its midpoints and their neighbours of both signs, signed zeros, FP32 subnormals, values past
    the range, Inf, NaN, and random FP32 bit patterns."""
    fmt = FORMATS[name]
    grid = torch.as_tensor(GRIDS[name], dtype=torch.float32)
    grid = torch.cat([grid, -grid]).unique()
    mid = (grid[1:] + grid[:-1]) / 2
    special = torch.tensor([0.0, -0.0, 2.0 ** -149, -(2.0 ** -149), 2.0 ** -126, fmt.max_normal * 1.01,
                            -fmt.max_normal * 3, 1e38, math.inf, -math.inf, math.nan])
    bits = torch.randint(-2 ** 31, 2 ** 31, (1 << 16,), generator=torch.Generator().manual_seed(2))
    x = torch.cat([grid, mid, torch.nextafter(mid, torch.tensor(math.inf)),
                   torch.nextafter(mid, torch.tensor(-math.inf)), special,
                   bits.to(torch.int32).view(torch.float32)])
    assert_bitwise_equal(round_signed_(x.clone(), fmt, x), round_to_format(x, fmt))


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_fp8_ties_go_to_even(name):
    # 1 + half an ulp lies between 1 (even mantissa) and 1 + ulp (odd): it must round down; the next tie up
    # lies between an odd and an even code and must round up
    ulp = 2.0 ** -FORMATS[name].mbits
    x = torch.tensor([1 + ulp / 2, 1 + 1.5 * ulp, -(1 + ulp / 2)])
    assert round_to_format(x, FORMATS[name]).tolist() == [1.0, 1 + 2 * ulp, -1.0]


# ----------------------------------------------------------------------------------------------------------
# E2M1: hand-written table
# ----------------------------------------------------------------------------------------------------------

E2M1_TABLE = [  # (input magnitude, expected RNE magnitude)
    # the 8 codes
    (0.0, 0.0), (0.5, 0.5), (1.0, 1.0), (1.5, 1.5), (2.0, 2.0), (3.0, 3.0), (4.0, 4.0), (6.0, 6.0),
    # every tie: the even code wins (codes 0,2,4,6 = 0, 1, 2, 4)
    (0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),
    # off-tie values and subnormal range
    (0.2499, 0.0), (0.2501, 0.5), (0.7, 0.5), (0.8, 1.0), (1.3, 1.5), (2.6, 3.0), (4.9, 4.0), (5.1, 6.0),
    (1e-30, 0.0), (2.0 ** -130, 0.0),
    # saturation
    (6.5, 6.0), (7.0, 6.0), (8.0, 6.0), (1e30, 6.0), (3e38, 6.0), (math.inf, 6.0),
]


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_e2m1_table(sign):
    x = torch.tensor([sign * v for v, _ in E2M1_TABLE])
    expected = torch.tensor([sign * q for _, q in E2M1_TABLE])
    assert_bitwise_equal(round_to_format(x, E2M1), expected)
    # the bit-field reference agrees with the table
    assert [round_rne(float(v), "e2m1") for v in x] == expected.tolist()


def test_e2m1_all_sixteen_codes_are_fixed_points():
    codes = torch.tensor([s * v for s in (1.0, -1.0) for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)])
    assert_bitwise_equal(round_to_format(codes, E2M1), codes)


# ----------------------------------------------------------------------------------------------------------
# non-finite values, signed zero, argument checks
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1])
def test_nan_inf_and_signed_zero(fmt):
    x = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, -fmt.min_subnormal / 4])
    out = round_to_format(x, fmt)
    assert out[0].isnan()
    assert out[1:3].tolist() == [fmt.max_normal, -fmt.max_normal]
    assert out[3:].tolist() == [0.0, 0.0, 0.0]
    assert out[3:].signbit().tolist() == [False, True, True]


@pytest.mark.parametrize("fmt", [E4M3, E2M1])
@pytest.mark.parametrize("stochastic", [False, True])
def test_input_not_modified_and_shape_kept(fmt, stochastic):
    x = torch.randn(3, 5, 7) * 10
    before = x.clone()
    out = round_to_format(x, fmt, stochastic=stochastic, generator=torch.Generator().manual_seed(0))
    assert out.shape == x.shape and out.dtype == torch.float32
    assert torch.equal(x, before)


def test_rejects_non_fp32():
    with pytest.raises(TypeError, match="float32"):
        round_to_format(torch.ones(3, dtype=torch.bfloat16), E4M3)


# ----------------------------------------------------------------------------------------------------------
# stochastic rounding
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, value", [
    (E2M1, 2.3), (E2M1, -0.3), (E2M1, 4.5), (E2M1, 5.9),  # normal, subnormal, top binade
    (E4M3, 0.3), (E4M3, 2.0 ** -8 + 2.0 ** -11), (E4M3, 300.0), (E5M2, 1000.0), (E5M2, 3e-5),
])
def test_stochastic_rounding_unbiased(fmt, value):
    n = 200_000
    out = round_to_format(torch.full((n,), value), fmt, stochastic=True,
                          generator=torch.Generator().manual_seed(0))
    lo, hi = neighbours(value, fmt.name)
    # only the two neighbours occur, with P(up) = distance from the lower one in quanta
    assert set(out.abs().unique().tolist()) == {lo, hi}
    p_up = (abs(value) - lo) / (hi - lo)
    sigma = (hi - lo) * math.sqrt(p_up * (1 - p_up) / n)
    assert abs(out.double().mean().item() - value) < 5 * sigma


@pytest.mark.parametrize("fmt", [E4M3, E2M1])
def test_stochastic_rounding_exact_and_saturating(fmt):
    values = torch.tensor([p for p, _ in GRIDS[fmt.name]] + [fmt.max_normal * 1.01, math.inf])
    out = round_to_format(values.repeat(100), fmt, stochastic=True, generator=torch.Generator().manual_seed(3))
    expected = values.clamp_max(fmt.max_normal).repeat(100)
    assert_bitwise_equal(out, expected)


def test_stochastic_rounding_reproducible():
    x = torch.randn(4096) * 3
    a = round_to_format(x, E2M1, stochastic=True, generator=torch.Generator().manual_seed(7))
    b = round_to_format(x, E2M1, stochastic=True, generator=torch.Generator().manual_seed(7))
    c = round_to_format(x, E2M1, stochastic=True, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
