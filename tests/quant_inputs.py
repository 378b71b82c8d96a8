"""Inputs and exact bounds shared by the quantizer tests (the CPU kernels' and the Triton kernels'): samples
over a wide range of magnitudes, inputs whose per-element scale is known by construction, and the grid points
either side of a value; and the recipe cases the backend tests run."""
import math

import torch

from reference_quant import GRIDS
from snip_ds import quant
from snip_ds.quant_config import QuantConfig

# (precision, QuantConfig) for each quantized recipe; stochastic rounding off unless a test turns it on
RECIPE_CASES = {
    "fp8_hybrid": ("fp8", QuantConfig(fp8_recipe="fp8_hybrid")),
    "mxfp8": ("fp8", QuantConfig(fp8_recipe="mxfp8")),
    "nvfp4_2d": ("fp4", QuantConfig(fp4_recipe="nvfp4", weight_2d=True, stochastic_rounding=False)),
    "nvfp4": ("fp4", QuantConfig(fp4_recipe="nvfp4", weight_2d=False, stochastic_rounding=False)),
    "mxfp4": ("fp4", QuantConfig(fp4_recipe="mxfp4", stochastic_rounding=False)),
}


def wide_sample(shape, seed, dtype=torch.float32):
    """Normal values spread over ~25 binades: elements land in every part of the grids (subnormal ranges,
    flushes to zero, saturation under the block scales)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randn(shape, generator=gen) * 4)
    return x.to(dtype)


def known_scale_input(recipe_name, rows, cols, seed):
    """(x, tensor_amax, d): an input whose dequantization multiplier ``d`` per element is known by
    construction (per-tensor: amax = max_normal gives s = 1; MX: each block holds 2**emax * X; NVFP4: amax
    2688 gives S = 1 and each block holds 6 * s_b), the others uniform in magnitude below the block amax."""
    recipe = quant.get_recipe(recipe_name)
    gen = torch.Generator().manual_seed(seed)
    element = recipe.element
    if recipe.block_size == 0:
        d = torch.ones(rows, cols)
        top, amax = element.max_normal, torch.tensor(element.max_normal)
    elif recipe.scale == "e8m0":
        choices = torch.tensor([2.0 ** -3, 0.5, 1.0, 4.0])
        d = choices[torch.randint(0, 4, (rows, cols // 32), generator=gen)].repeat_interleave(32, 1)
        top, amax = 2.0 ** element.emax, None
    else:
        choices = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.5])  # E4M3 values
        tiles = torch.randint(0, 5, (rows // 16 if recipe.block_2d else rows, cols // 16), generator=gen)
        d = choices[tiles].repeat_interleave(16, 1)
        if recipe.block_2d:
            d = d.repeat_interleave(16, 0)
        top, amax = element.max_normal, torch.tensor(448.0 * 6.0)
    signs = torch.where(torch.rand(rows, cols, generator=gen) < 0.5, -1.0, 1.0)
    x = torch.rand(rows, cols, generator=gen) * top * d * signs
    if recipe.block_size:
        step = 16 if recipe.block_2d else 1
        x[::step, ::recipe.block_size] = top * d[::step, ::recipe.block_size]
    return x, amax, d


def neighbours(x, d, fmt):
    """(lo, hi): the grid points of ``fmt`` times ``d`` just below and above |x| (float64, exact)."""
    grid = torch.tensor([v for v, _ in GRIDS[fmt]], dtype=torch.float64)
    scaled = grid[None, :] * d.double().reshape(-1, 1)
    mag = x.double().abs().reshape(-1, 1)
    lo = torch.where(scaled <= mag, scaled, -1.0).amax(1)
    hi = torch.where(scaled >= mag, scaled, math.inf).amin(1)
    return lo.reshape(x.shape), hi.reshape(x.shape)


def assert_stochastic_rounding_unbiased(quantize_parts, recipe_name, seeds, copies=64):
    """The mean of N = copies x seeds stochastic draws is x. ``quantize_parts`` is a fused quantizer's
    function (``x, recipe, axis, tensor_amax=, stochastic=, seed=``); the copies of x are stacked along the
    rows, so they draw at other offsets. Each draw of an element is lo or hi with P(hi) = f,
    f = (|x| - lo) / (hi - lo), so its mean over N draws has variance (hi - |x|)(|x| - lo) / N. Checked two
    ways: every element within the Hoeffding bound (hi - lo) * sqrt(ln(2 n / delta) / (2 N)), delta = 1e-6
    over all n elements; and the sum of all errors within 5 standard deviations of the sum (a normal tail of
    6e-7). The kernels round fl(|x| / d), which differs from |x| / d by 2**-24 relative: far below either
    bound."""
    x, amax, d = known_scale_input(recipe_name, 16, 32, seed=14)
    lo, hi = neighbours(x, d, quant.get_recipe(recipe_name).element.name)
    total = torch.zeros(x.shape, dtype=torch.float64)
    for seed in range(seeds):
        values = quantize_parts(x.repeat(copies, 1), recipe_name, 1, tensor_amax=amax, stochastic=True,
                                seed=seed).values
        total += values.double().abs().view(copies, *x.shape).sum(0)
    n_draws = copies * seeds
    error = total / n_draws - x.double().abs()
    var = (hi - x.double().abs()) * (x.double().abs() - lo) / n_draws
    bound = (hi - lo) * math.sqrt(math.log(2 * x.numel() / 1e-6) / (2 * n_draws))
    assert (error.abs() <= bound).all()
    assert abs(error.sum().item()) <= 5 * math.sqrt(var.sum().item())
    assert var.sum() > 0  # the test exercised rounding between grid points


def skip_without_cpu_scaled_mm() -> None:
    """Skips the calling test where this CPU's ``torch._scaled_mm`` has no FP8 kernel (oneDNN builds one for AMX
    CPUs; limited to AVX2 or AVX-512 it cannot create the primitive). The product never calls it on a CPU; tests
    use it to check the FP8 GEMM plumbing."""
    import pytest

    one = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(one, one.t(), scale_a=torch.tensor(1.0), scale_b=torch.tensor(1.0))
    except RuntimeError as err:
        pytest.skip(f"this CPU's torch._scaled_mm does not run: {str(err).splitlines()[0]}")
