"""Fake quantization recipes against the slow references in tests/reference_quant.py and docs/method.md's recipe table."""
import math

import numpy as np
import pytest
import torch

from snip_ds.formats import E2M1, E4M3, E5M2
from snip_ds.quant import (RECIPES, Recipe, cast_to_format, fake_quantize, get_recipe, hadamard_matrix,
                           hadamard_transform, quantize_parts, random_signs, stochastic_moments)
from snip_ds.scales import mx_scale
from tests.reference_quant import (GRIDS, assert_bitwise_equal, block_diagonal_hadamard, floor_log2, ref_mx_rows,
                                   ref_nvfp4_2d, ref_nvfp4_parts_rows, ref_nvfp4_rows, ref_per_tensor,
                                   ref_sr_moments_rows, round_rne)

BLOCK_RECIPES = ["mxfp8", "mxfp8_e5m2", "mxfp4", "nvfp4"]
ALL_RECIPES = list(RECIPES)


def sample(shape, seed=0, spread=True):
    """Gaussian data; with ``spread`` each row gets its own magnitude so blocks see different scales."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    if spread:
        x = x * torch.exp2(torch.randint(-6, 7, shape[:-1] + (1,), generator=gen).float())
    return x


def rel_sq_err(q, x):
    return ((q.double() - x.double()).pow(2).sum() / x.double().pow(2).sum()).item()


# ----------------------------------------------------------------------------------------------------------
# recipes and argument checks
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, element, block, scale, block_2d", [
    ("fp8_e4m3", E4M3, 0, "fp32", False), ("fp8_e5m2", E5M2, 0, "fp32", False),
    ("mxfp8", E4M3, 32, "e8m0", False), ("mxfp8_e5m2", E5M2, 32, "e8m0", False),
    ("mxfp4", E2M1, 32, "e8m0", False), ("nvfp4", E2M1, 16, "nvfp4", False),
    ("nvfp4_2d", E2M1, 16, "nvfp4", True),
])
def test_presets(name, element, block, scale, block_2d):
    r = get_recipe(name)
    assert (r.name, r.element, r.block_size, r.scale, r.block_2d) == (name, element, block, scale, block_2d)


@pytest.mark.parametrize("kwargs, field", [
    (dict(name="", element=E4M3), "name"),
    (dict(name="r", element="e4m3"), "element"),
    (dict(name="r", element=E4M3, block_size=-1), "block_size"),
    (dict(name="r", element=E4M3, block_size=32), "block_size"),  # fp32 scale is per-tensor only
    (dict(name="r", element=E4M3, block_size=0, scale="e8m0"), "block_size"),
    (dict(name="r", element=E4M3, block_size=32, scale="e9m0"), "scale"),
    (dict(name="r", element=E2M1, block_size=16, scale="nvfp4", block_2d=1), "block_2d"),
])
def test_recipe_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        Recipe(**kwargs)


def test_unknown_names_list_valid_choices():
    with pytest.raises(ValueError, match="recipe: unknown recipe 'fp6'.*mxfp8.*nvfp4_2d"):
        fake_quantize(torch.ones(4), "fp6")
    with pytest.raises(ValueError, match="format: unknown element format 'e3m2'.*e2m1"):
        cast_to_format(torch.ones(4), "e3m2")


@pytest.mark.parametrize("recipe", ["fp8_e4m3", "mxfp4", "nvfp4_2d"])
@pytest.mark.parametrize("axis", [2, -3, 1.0])
def test_bad_axis(recipe, axis):
    with pytest.raises(ValueError, match="axis"):
        fake_quantize(torch.ones(4, 32), recipe, axis=axis)


@pytest.mark.parametrize("recipe", ["fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_non_float_dtype(recipe, dtype):
    with pytest.raises(TypeError, match="floating-point"):
        fake_quantize(torch.ones(4, 32, dtype=dtype), recipe)


def test_2d_recipe_needs_2d_tensor():
    with pytest.raises(ValueError, match="nvfp4_2d.*2-D tensor.*\\(2, 16, 16\\)"):
        fake_quantize(torch.ones(2, 16, 16), "nvfp4_2d")


# ----------------------------------------------------------------------------------------------------------
# bit-exact against the references
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_per_tensor_matches_reference(name):
    x = sample((6, 40), seed=1)
    assert_bitwise_equal(fake_quantize(x, f"fp8_{name}"), ref_per_tensor(x, name))


@pytest.mark.parametrize("recipe, fmt, emax", [("mxfp8", "e4m3", 8), ("mxfp8_e5m2", "e5m2", 15),
                                                ("mxfp4", "e2m1", 2)])
@pytest.mark.parametrize("cols", [64, 45, 7])  # whole blocks, a partial last block, one short block
def test_mx_matches_reference(recipe, fmt, emax, cols):
    x = sample((5, cols), seed=cols)
    assert_bitwise_equal(fake_quantize(x, recipe), ref_mx_rows(x, fmt, emax))


@pytest.mark.parametrize("cols", [48, 40, 9])
@pytest.mark.parametrize("seed", [0, 1])
def test_nvfp4_matches_reference(cols, seed):
    x = sample((6, cols), seed=seed)
    assert_bitwise_equal(fake_quantize(x, "nvfp4"), ref_nvfp4_rows(x))


@pytest.mark.parametrize("shape", [(32, 48), (20, 40), (7, 16)])
@pytest.mark.parametrize("axis", [0, -1])
def test_nvfp4_2d_matches_reference(shape, axis):
    x = sample(shape, seed=shape[0])
    assert_bitwise_equal(fake_quantize(x, "nvfp4_2d", axis=axis), ref_nvfp4_2d(x))


@pytest.mark.parametrize("amax, emax", [
    (1.0, 8), (2.0 ** 5, 8), (2.0 ** 5 * (1 - 2.0 ** -24), 8), (3.0, 2), (0.75, 2), (6.0, 2),
    (57344.0, 15), (2.0 ** -20, 8), (1.5 * 2.0 ** -100, 2), (2.0 ** -126, 2),
])
def test_mx_scale_exponent(amax, emax):
    scale, _ = mx_scale(torch.tensor([amax]), emax)
    exp = max(floor_log2(amax) - emax, -127)  # E8M0 holds 2**-127 .. 2**127
    assert scale.item() == 2.0 ** exp


def test_mx_scale_clamps_to_e8m0_range():
    # amax = 2**-140 (an FP32 subnormal) wants 2**-148; E8M0 stops at 2**-127
    scale, _ = mx_scale(torch.tensor([2.0 ** -140]), 8)
    assert scale.item() == 2.0 ** -127


@pytest.mark.parametrize("recipe", BLOCK_RECIPES)
def test_block_axis_is_respected(recipe):
    x = sample((48, 24), seed=3).t().contiguous()  # [24, 48]: blocks along dim 0 of x.t()
    assert_bitwise_equal(fake_quantize(x.t(), recipe, axis=0), fake_quantize(x, recipe, axis=-1).t())
    x3 = sample((3, 40, 5), seed=4)
    expected = fake_quantize(x3.transpose(1, 2), recipe, axis=-1).transpose(1, 2)
    assert_bitwise_equal(fake_quantize(x3, recipe, axis=1), expected)


@pytest.mark.parametrize("recipe", ["mxfp4", "nvfp4"])
def test_partial_block_equals_zero_padding(recipe):
    x = sample((4, 37), seed=5)
    padded = torch.cat([x, torch.zeros(4, 27)], dim=1)  # 64 columns
    assert_bitwise_equal(fake_quantize(x, recipe), fake_quantize(padded, recipe)[:, :37])


# ----------------------------------------------------------------------------------------------------------
# error levels (docs/method.md's recipe table, +-40 %)
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe, stochastic, expected", [
    ("fp8_e4m3", False, 7e-4), ("fp8_e5m2", False, 2.8e-3), ("mxfp8", False, 9e-4),
    ("mxfp4", False, 1.3e-2), ("nvfp4", False, 9e-3), ("nvfp4", True, 1.9e-2),
])
def test_gaussian_relative_error(recipe, stochastic, expected):
    x = sample((128, 1024), seed=11, spread=False)
    q = fake_quantize(x, recipe, stochastic=stochastic, generator=torch.Generator().manual_seed(0))
    assert 0.6 * expected < rel_sq_err(q, x) < 1.4 * expected


# ----------------------------------------------------------------------------------------------------------
# stochastic rounding through the scaled recipes
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe, top_spacing", [  # widest grid spacing once scaled: amax 1 per block
    ("nvfp4", 2 / 6), ("mxfp4", 2 * 2.0 ** -2), ("fp8_e4m3", 32 / 448),
])
def test_stochastic_fake_quantize_unbiased(recipe, top_spacing):
    # every block's amax is 1 (column 0 of each block), so all draws share the scales and nothing saturates
    row = torch.rand(64, generator=torch.Generator().manual_seed(2)) * 2 - 1
    row[::16] = 1.0
    draws = 4000
    q = fake_quantize(row.expand(draws, 64).contiguous(), recipe, stochastic=True,
                      generator=torch.Generator().manual_seed(5))
    err = (q.double() - row.double()).mean(0)
    # SR error per draw is within one spacing with variance <= spacing^2 / 4: allow 5 standard errors
    assert err.abs().max() < 5 * top_spacing / (2 * math.sqrt(draws))
    # round-to-nearest is visibly biased per element, so the check above can tell the two apart
    rne_err = (fake_quantize(row[None], recipe)[0].double() - row.double()).abs()
    assert rne_err.max() > 10 * err.abs().max()


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_stochastic_moments_match_grid_neighbours(recipe):
    """Exact mean and variance of stochastic rounding against the reference built from each value's grid
    neighbours; MXFP4 saturates above 6 (a biased mean, no variance), which the reference covers too."""
    x = sample((24, 80), seed=11)  # 80 columns: a partial last block for both block sizes
    x[0, :4] = 0.0
    mean, var = stochastic_moments(x, recipe)
    ref_mean, ref_var = ref_sr_moments_rows(x, recipe)
    torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-6, atol=0)
    torch.testing.assert_close(var.double(), ref_var, rtol=1e-5, atol=0)
    assert (var > 0).float().mean() > 0.8
    if recipe == "nvfp4":  # unbiased inside the range: the mean is x itself (to FP32's x/d·d) unless the
        # E4M3-rounded block scale left the block's top element above 6
        inside = torch.isclose(mean, x, rtol=1e-6, atol=0).float().mean()
        assert inside > 0.97
    else:
        assert (mean != x).any()  # MX's power-of-two scale saturates the top of some blocks


def test_stochastic_moments_match_draws():
    """The moments against many stochastic-rounding draws of fake_quantize (the production path)."""
    x = sample((8, 64), seed=12)
    mean, var = stochastic_moments(x, "nvfp4", axis=0)
    draws = torch.stack([fake_quantize(x, "nvfp4", axis=0, stochastic=True,
                                       generator=torch.Generator().manual_seed(s)) for s in range(3000)])
    torch.testing.assert_close(draws.double().mean(0), mean.double(), atol=5 * var.max().sqrt().item() / 50,
                               rtol=0)
    ratio = draws.double().var(0).sum() / var.double().sum()
    assert 0.95 < ratio < 1.05


def test_stochastic_moments_deterministic_where_nothing_rounds():
    """Values on the grid have no variance; all-zero input gives zeros."""
    x = torch.tensor([[6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0] * 2])
    mean, var = stochastic_moments(x, "mxfp4")
    assert torch.equal(mean, x) and torch.equal(var, torch.zeros_like(x))
    mean, var = stochastic_moments(torch.zeros(3, 32), "nvfp4")
    assert not mean.any() and not var.any()


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp8", "nvfp4_2d"])
def test_stochastic_reproducible_with_seed(recipe):
    x = sample((32, 64), seed=6)
    run = lambda seed: fake_quantize(x, recipe, stochastic=True, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(run(1), run(1)) and not torch.equal(run(1), run(2))


# ----------------------------------------------------------------------------------------------------------
# zeros, non-finite values, dtypes
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", ALL_RECIPES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_all_zero_and_zero_blocks(recipe, stochastic):
    zeros = torch.zeros(16, 64)
    zeros[3, 5] = -0.0
    assert_bitwise_equal(fake_quantize(zeros, recipe, stochastic=stochastic), zeros)
    x = sample((16, 64), seed=7)
    x[:, :32] = 0.0  # zero blocks next to non-zero ones (also whole 16x16 tiles)
    assert torch.equal(fake_quantize(x, recipe, stochastic=stochastic)[:, :32], torch.zeros(16, 32))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4"])
def test_non_finite_poisons_its_mx_block_only(bad, recipe):
    x = sample((2, 64), seed=8)
    y = x.clone()
    y[0, 40] = bad
    out = fake_quantize(y, recipe)
    assert out[0, 32:].isnan().all()
    assert_bitwise_equal(out[0, :32], fake_quantize(x, recipe)[0, :32])
    assert_bitwise_equal(out[1], fake_quantize(x, recipe)[1])


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("recipe", ["fp8_e4m3", "fp8_e5m2", "nvfp4", "nvfp4_2d"])
def test_non_finite_poisons_tensor_scaled_recipes(bad, recipe):
    x = sample((16, 32), seed=9)
    x[2, 3] = bad
    assert fake_quantize(x, recipe).isnan().all()


@pytest.mark.parametrize("recipe", ALL_RECIPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_and_shape_preserved(recipe, dtype):
    x = sample((16, 48), seed=10).to(dtype)
    out = fake_quantize(x, recipe)
    assert out.dtype == dtype and out.shape == x.shape
    assert_bitwise_equal(out, fake_quantize(x.float(), recipe).to(dtype))


@pytest.mark.parametrize("recipe", ALL_RECIPES)
def test_empty_tensor(recipe):
    out = fake_quantize(torch.empty(0, 32, dtype=torch.bfloat16), recipe)
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16


def test_no_autograd_history():
    x = sample((4, 32), seed=14).requires_grad_()
    assert not fake_quantize(x * 2, "nvfp4").requires_grad and not cast_to_format(x, "e4m3").requires_grad


def test_input_not_modified():
    x = sample((16, 48), seed=12)
    before = x.clone()
    for recipe in ALL_RECIPES:
        fake_quantize(x, recipe, stochastic=True)
    assert torch.equal(x, before)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cast_to_format(fmt, dtype):
    x = (sample((8, 32), seed=13) * 4).to(dtype)
    x[0, :3] = torch.tensor([math.inf, -math.inf, math.nan])
    out = cast_to_format(x, fmt)
    expected = torch.tensor([round_rne(v, fmt) for v in x.float().flatten().tolist()]).view(x.shape).to(dtype)
    assert_bitwise_equal(out, expected)


# ----------------------------------------------------------------------------------------------------------
# Hadamard transform
# ----------------------------------------------------------------------------------------------------------

def test_hadamard_matrix_orthonormal():
    h = hadamard_matrix(16)
    assert torch.equal(h @ h.t(), torch.eye(16)) and torch.equal(h, h.t())
    assert set(h.abs().unique().tolist()) == {0.25}


@pytest.mark.rounding
@pytest.mark.parametrize("n_tokens", [48, 40, 7])  # whole blocks, a tail of 8, tail only
@pytest.mark.parametrize("axis", [0, -1])
def test_hadamard_matches_block_diagonal_reference(n_tokens, axis):
    gen = torch.Generator().manual_seed(n_tokens)
    signs = random_signs(n_tokens, gen)
    a = torch.randn(n_tokens, 24, generator=gen)
    x = a if axis == 0 else a.t().contiguous()
    out = hadamard_transform(x, axis=axis, signs=signs)
    out = out if axis == 0 else out.t()
    expected = block_diagonal_hadamard(signs.tolist()) @ a.double()
    # FP32 vs FP64: 16-term sums of ±0.25·a, |terms| summing to ≤ 16·0.25·3 = 12, so ≤ 16·2^-24·12 = 1.1e-5
    # worst case and ~sqrt(16)·2^-24·12 = 3e-6 typical; measured 4.2e-7 (AVX-512 and AVX2 alike)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)


@pytest.mark.rounding
@pytest.mark.parametrize("n_tokens", [64, 50])
def test_hadamard_preserves_wgrad_product(n_tokens):
    gen = torch.Generator().manual_seed(0)
    g, x = torch.randn(n_tokens, 24, generator=gen), torch.randn(n_tokens, 40, generator=gen)
    signs = random_signs(n_tokens, gen)
    hg, hx = hadamard_transform(g, 0, signs), hadamard_transform(x, 0, signs)
    assert not torch.allclose(hg, g)  # it does mix
    # HᵀH = I exactly, so only FP32 round-off: the transform's (~2^-24 relative per element) and two GEMMs of
    # depth n ≤ 64, ~sqrt(n)·2^-24·|value| ≤ 8·6e-8·31 = 1.5e-5 per source; atol 1e-4 + 1e-5·31 = 4e-4 is
    # ~25σ; measured 1.1e-5
    torch.testing.assert_close(hg.t() @ hx, g.t() @ x, rtol=1e-5, atol=1e-4)


def test_hadamard_dtype_and_argument_checks():
    x = torch.randn(32, 8, dtype=torch.bfloat16)
    assert hadamard_transform(x, 0, random_signs(32)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="signs"):
        hadamard_transform(x, 0, random_signs(31))
    with pytest.raises(ValueError, match="axis"):
        hadamard_transform(x, 2, random_signs(32))


def test_random_signs():
    s = random_signs(1000, torch.Generator().manual_seed(4))
    assert s.dtype == torch.float32 and set(s.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(s, random_signs(1000, torch.Generator().manual_seed(4)))
    with pytest.raises(ValueError, match="n:"):
        random_signs(-1)


@pytest.mark.parametrize("recipe", ["fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp4", "mxfp8"])
def test_slices_with_the_tensor_amax_equal_the_whole_tensor(recipe):
    """Row slices quantized along the last axis with the whole tensor's amax give the whole-tensor result."""
    from snip_ds.backend import tensor_amax

    x = torch.randn(96, 80, generator=torch.Generator().manual_seed(5)) * 3
    whole = fake_quantize(x, recipe, axis=-1)
    amax = tensor_amax(x)
    assert amax == x.abs().max()
    parts = torch.cat([fake_quantize(x[i:i + 32], recipe, axis=-1, tensor_amax=amax) for i in (0, 32, 64)])
    assert torch.equal(parts, whole)
    if recipe in ("fp8_e4m3", "nvfp4"):  # a slice's own amax would give another scale
        assert not torch.equal(fake_quantize(x[:32] * 0.1, recipe), fake_quantize(x[:32] * 0.1, recipe,
                                                                                   tensor_amax=amax))


# ----------------------------------------------------------------------------------------------------------
# quantize_parts: the quantized operand split into grid values (times block scales) and the tensor scale
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_parts_per_tensor_against_reference(name):
    """Per-tensor FP8: the values are unscaled grid values, the scale is amax / max_normal, and their
    product is the reference's fake quantization bit for bit."""
    x = sample((6, 40), seed=21)
    parts = quantize_parts(x, f"fp8_{name}")
    grid = {v for v, _ in GRIDS[name]}
    assert set(parts.values.abs().unique().tolist()) <= grid
    assert parts.tensor_scale.shape == () and parts.tensor_scale.dtype == torch.float32
    assert parts.tensor_scale.item() == float(np.float32(x.abs().max().item()) / np.float32(grid and max(grid)))
    assert_bitwise_equal(parts.values * parts.tensor_scale, ref_per_tensor(x, name))


@pytest.mark.parametrize("recipe, fmt, emax", [("mxfp8", "e4m3", 8), ("mxfp4", "e2m1", 2)])
@pytest.mark.parametrize("cols", [64, 45])
def test_parts_mx_against_reference(recipe, fmt, emax, cols):
    x = sample((5, cols), seed=cols + 1)
    parts = quantize_parts(x, recipe)
    assert parts.tensor_scale.item() == 1.0 and parts.tensor_scale.shape == ()
    assert_bitwise_equal(parts.values, ref_mx_rows(x, fmt, emax))


@pytest.mark.parametrize("cols", [48, 40])
def test_parts_nvfp4_against_reference(cols):
    """NVFP4: values are q * s_b and the scale is S, as the reference splits them; fake_quantize is
    fl(q * fl(s_b * S)) (checked by the reference too), so values * S may differ from it only by the second
    rounding of fl(q * fl(s_b * S)) from the exact q * s_b * S (two roundings of at most 2**-24 relative each:
    2**-23 plus a 2**-48 cross term, measured against fq instead of the exact product: the factor 1 + 2**-20
    covers both)."""
    x = sample((6, cols), seed=cols)
    parts = quantize_parts(x, "nvfp4")
    ref_values, ref_scale = ref_nvfp4_parts_rows(x)
    assert_bitwise_equal(parts.values, ref_values)
    assert parts.tensor_scale.item() == ref_scale
    fq = fake_quantize(x, "nvfp4")
    diff = (parts.values.double() * ref_scale - fq.double()).abs()
    assert (diff <= fq.double().abs() * 2.0 ** -23 * (1 + 2.0 ** -20)).all()


@pytest.mark.parametrize("recipe", ALL_RECIPES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_parts_times_scale_is_fake_quantize(recipe, stochastic):
    """The same code path as fake_quantize: per-tensor and MX recipes give it back bit for bit, including
    stochastic rounding's draws from a generator in the same state. NVFP4: values * S rounds the exact
    q * s_b * S once (2**-24 relative), fake_quantize twice (2**-23 + 2**-48), so they differ by less than
    3 * 2**-24 (1 + 2**-20) of fq; 2**-22 bounds that."""
    x = sample((32, 64), seed=22)
    gen = lambda: torch.Generator().manual_seed(3)
    parts = quantize_parts(x, recipe, stochastic=stochastic, generator=gen())
    fq = fake_quantize(x, recipe, stochastic=stochastic, generator=gen())
    product = parts.values * parts.tensor_scale
    if get_recipe(recipe).scale == "nvfp4":
        assert ((product.double() - fq.double()).abs() <= fq.double().abs() * 2.0 ** -22).all()
        assert not stochastic or not torch.equal(fq, fake_quantize(x, recipe))  # the draws did matter
    else:
        assert_bitwise_equal(product, fq)


@pytest.mark.parametrize("recipe", ALL_RECIPES)
def test_parts_values_exact_in_bf16(recipe):
    x = sample((32, 64), seed=23) * 1e3
    values = quantize_parts(x, recipe).values
    assert values.dtype == torch.float32
    assert_bitwise_equal(values.to(torch.bfloat16).float(), values)


@pytest.mark.parametrize("recipe", ["fp8_e4m3", "nvfp4", "mxfp4"])
def test_parts_slices_with_tensor_amax_and_edge_cases(recipe):
    x = torch.randn(96, 80, generator=torch.Generator().manual_seed(5)) * 3
    whole = quantize_parts(x, recipe)
    amax = x.abs().max()
    parts = [quantize_parts(x[i:i + 32], recipe, tensor_amax=amax) for i in (0, 32, 64)]
    assert torch.equal(torch.cat([p.values for p in parts]), whole.values)
    assert all(torch.equal(p.tensor_scale, whole.tensor_scale) for p in parts)
    empty = quantize_parts(torch.empty(0, 32, dtype=torch.bfloat16), recipe)
    assert empty.values.shape == (0, 32) and empty.values.dtype == torch.float32
    zeros = quantize_parts(torch.zeros(4, 32), recipe)
    assert not zeros.values.any() and zeros.tensor_scale.item() == 1.0
    x[1, 2] = math.nan  # poisons its scale: the block for MX, the whole tensor otherwise
    poisoned = quantize_parts(x, recipe).values
    assert poisoned[1, :32].isnan().all() and poisoned[0].isnan().all() == (recipe != "mxfp4")
