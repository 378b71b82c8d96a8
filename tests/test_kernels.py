"""The fused Triton quantization kernels (snip_ds/backend/kernels) against snip_ds.quant.quantize_parts.

Where there is a CUDA GPU (and ``TRITON_INTERPRET`` is not set to 1), the kernels are compiled and every test
runs on CUDA tensors: the module checks that they really are compiled. Elsewhere they run on CPU tensors
through Triton's interpreter: ``TRITON_INTERPRET=1`` is set while triton and the kernels are imported and
while these tests run, so no other test sees it. Deterministic results must equal the reference bit for bit
(NaN compared by position: its sign and payload are not part of the contract). Stochastic rounding is held
to independent facts instead: every output is one of the two grid points around the input, the mean over
many draws is the input, and the draws are a function of (seed, offset, element index) only -- the same
under the interpreter and compiled (a subprocess runs the other mode), under every supported Triton, and in
the fused CPU kernels.
"""
import math
import os
import subprocess
import sys

import pytest
import torch

from reference_quant import GRIDS
from quant_inputs import assert_stochastic_rounding_unbiased, known_scale_input, neighbours, wide_sample
from snip_ds import quant
from snip_ds.backend import kernels
from triton_mode import (DEVICE, SKIP_REASON, amax, compile_check, interpreter_on, kq, on_cuda,  # noqa: F401
                         q)  # (interpreter_on: a fixture)

if SKIP_REASON:
    pytest.skip(SKIP_REASON, allow_module_level=True)


RECIPES = list(quant.RECIPES)
AXES = [0, 1]
# awkward shapes: single rows and columns, not multiples of 16 or 32, a tile edge crossed (64)
SHAPES = [(1, 45), (37, 1), (33, 70), (16, 32), (70, 17)]


def assert_same_bits(actual, expected):
    """Bit-for-bit equality; NaNs must sit at the same positions (any sign and payload)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan), "NaN positions differ"
    view = torch.int16 if actual.dtype == torch.bfloat16 else torch.int32
    a = actual.masked_fill(nan, 0).view(view)
    e = expected.masked_fill(nan, 0).view(view)
    bad = (a != e).nonzero()
    assert bad.numel() == 0, (f"{len(bad)} elements differ, first at {bad[0].tolist()}: "
                              f"{actual[tuple(bad[0])].item()!r} vs {expected[tuple(bad[0])].item()!r}")


def assert_matches_reference(x, recipe, axis, tensor_amax=None, **kw):
    parts = q(x, recipe, axis, tensor_amax=tensor_amax, **kw)
    ref = quant.quantize_parts(x.cpu(), recipe, axis, tensor_amax=tensor_amax)
    expected = ref.values.to(kw.get("out_dtype", torch.float32))
    assert_same_bits(parts.values, expected.t().contiguous() if kw.get("transpose") else expected)
    assert parts.tensor_scale.shape == () and parts.tensor_scale.dtype == torch.float32
    assert_same_bits(parts.tensor_scale, ref.tensor_scale)
    return parts


# ----------------------------------------------------------------------------------------------------------
# round to nearest even: bit for bit against the reference
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_inputs_match_reference(recipe, axis, dtype):
    for i, shape in enumerate(SHAPES):
        assert_matches_reference(wide_sample(shape, seed=100 + i, dtype=dtype), recipe, axis)


def special_inputs():
    """Named 2-D inputs built around the conventions of snip_ds.quant: signed zeros, FP32 subnormals,
    values near the FP32 maximum, NaN and Inf, all-zero blocks, huge dynamic range inside one block."""
    base = wide_sample((40, 50), seed=7)
    cases = {}
    x = base.clone()
    x[0] = 0.0
    x[1] = -0.0
    x[2, :20] = -0.0
    x[3, ::3] = 1e-40  # FP32 subnormals among normals
    x[4, 1::4] = -1.4e-45  # the smallest FP32 subnormal
    x[5, 5] = 3.4e38  # near FLT_MAX: tensor amax, NVFP4 tensor scale near its top
    x[6, 6] = -3.0e38
    x[7:9, :] = 1e-38  # a block of tiny normals next to the huge ones
    x[:, 10] = 0.0  # an all-zero column: blocks along axis 0 that are all zero
    cases["finite_specials"] = x
    cases["all_zero"] = torch.zeros(20, 33)
    cases["all_negative_zero"] = torch.full((20, 33), -0.0)
    cases["all_subnormal"] = torch.full((19, 35), 1e-42) * torch.sign(base[:19, :35])  # amax subnormal
    cases["smallest_subnormal"] = torch.full((3, 40), 1.4e-45)
    cases["range_in_one_block"] = torch.tensor([[3e38, 1e-30, -2.0, 1e-45] * 10] * 4)
    for name, value in (("nan", math.nan), ("inf", math.inf), ("neg_inf", -math.inf)):
        y = base.clone()
        y[13, 17] = value
        cases[name] = y
    y = base.clone()
    y[2, 3], y[30, 40] = math.nan, math.inf
    cases["nan_and_inf"] = y
    return cases


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("axis", AXES)
def test_special_values_match_reference(recipe, axis):
    for name, x in special_inputs().items():
        try:
            assert_matches_reference(x, recipe, axis)
            assert_matches_reference(x.to(torch.bfloat16), recipe, axis)
        except AssertionError as err:
            raise AssertionError(f"case {name}: {err}") from None


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("axis", AXES)
def test_fake_quantize_matches_reference(recipe, axis):
    """``fake_quantize`` (what the statistics quantize with on a GPU) is :func:`snip_ds.quant.fake_quantize`
    bit for bit, the tensor-level scale multiplied in the reference's order (NVFP4: ``fl(q * fl(s_b * S))``,
    which can differ from the split's ``fl(fl(q * s_b) * S)``): random, special and given-amax inputs, FP32
    and BF16 in, FP32 out."""
    cases = {**special_inputs(), **{f"random {s}": wide_sample(s, seed=200 + i) for i, s in enumerate(SHAPES)}}
    for name, x in cases.items():
        for xd in (x, x.to(torch.bfloat16)):
            try:
                got = kq.fake_quantize(xd.to(DEVICE), recipe, axis)
                assert_same_bits(got.cpu(), quant.fake_quantize(xd.float(), recipe, axis))
            except AssertionError as err:
                raise AssertionError(f"case {name}, {xd.dtype}: {err}") from None
    x = wide_sample((35, 48), seed=21)
    amax_given = x.abs().max() * 7
    assert_same_bits(kq.fake_quantize(x.to(DEVICE), recipe, axis, tensor_amax=amax_given.to(DEVICE)).cpu(),
                     quant.fake_quantize(x, recipe, axis, tensor_amax=amax_given))


@pytest.mark.parametrize("recipe", ["fp8_e4m3", "fp8_e5m2", "nvfp4", "nvfp4_2d", "mxfp4"])
@pytest.mark.parametrize("axis", AXES)
def test_given_tensor_amax(recipe, axis):
    """A finite tensor amax from outside (the whole tensor x is a slice of): no amax pass, and non-finite
    elements saturate instead of poisoning (NVFP4: a block with an Inf gets the largest block scale)."""
    x = wide_sample((35, 48), seed=8)
    assert_matches_reference(x, recipe, axis, tensor_amax=x.abs().max() * 7)
    x[3, 4], x[20, 33], x[9, 9] = math.inf, -math.inf, math.nan
    assert_matches_reference(x, recipe, axis, tensor_amax=torch.tensor(1e3))
    assert_matches_reference(x, recipe, axis, tensor_amax=torch.tensor(0.0))  # scale 1 by convention
    assert_matches_reference(x, recipe, axis, tensor_amax=torch.tensor(math.nan))


@pytest.mark.parametrize("recipe", RECIPES)
def test_bf16_output_transposed_output_and_strided_input(recipe):
    x = wide_sample((45, 70), seed=9)
    assert_matches_reference(x, recipe, 1, out_dtype=torch.bfloat16)
    assert_matches_reference(x, recipe, 0, transpose=True)
    assert_matches_reference(x, recipe, 1, out_dtype=torch.bfloat16, transpose=True)
    strided = wide_sample((70, 45), seed=10).to(DEVICE).t()  # a transposed view: column-major
    assert not strided.is_contiguous()
    assert_matches_reference(strided, recipe, 0)
    sliced = wide_sample((45, 140), seed=11).to(DEVICE)[:, ::2]  # column stride 2
    assert_matches_reference(sliced, recipe, 1)


@pytest.mark.parametrize("recipe", ["fp8_e4m3", "mxfp8", "nvfp4_2d"])
def test_result_does_not_depend_on_the_tiling(recipe, monkeypatch):
    """Large tiles (one program) and the smallest ones (many programs, partial amaxes across them) agree."""
    from snip_ds.backend.kernels import config

    def tiles(edge):  # the tile edge for the configurations worked out from here on
        config.cached_launch_config.cache_clear()
        monkeypatch.setattr(config, "MAX_TILE", edge)
        return config.cached_launch_config(70, 50, recipe, 1, torch.float32, False, False, False).grid

    x = wide_sample((70, 50), seed=12)
    grid_big = tiles(64)
    big = q(x, recipe, 1)
    grid_small = tiles(16)
    small = q(x, recipe, 1)
    assert grid_small[0] > grid_big[0]  # more programs: the tiling really changed
    assert_same_bits(small.values, big.values)
    assert_same_bits(small.tensor_scale, big.tensor_scale)
    monkeypatch.setattr(config, "MAX_AMAX_PROGRAMS", 4)  # the amax pass's programs loop over several tiles
    tiles(16)
    looped = q(x, recipe, 1)
    assert_same_bits(looped.values, big.values)
    assert_same_bits(looped.tensor_scale, big.tensor_scale)
    assert_same_bits(amax(x), x.abs().amax())
    monkeypatch.setattr(config, "MAX_AMAX_PROGRAMS", 512)
    draws = [q(x, recipe, 1, stochastic=True, seed=5).values]
    tiles(64)
    draws.append(q(x, recipe, 1, stochastic=True, seed=5).values)
    assert_same_bits(draws[0], draws[1])
    config.cached_launch_config.cache_clear()


def test_tensor_amax_pass():
    """The amax kernel alone: torch's amax of |x| in FP32, NaN propagating past Inf, BF16 read exactly."""
    x = wide_sample((70, 45), seed=17)
    x[3, 4] = -1e-45  # a subnormal never wins, but must not break the integer max
    for t in (x, x.to(torch.bfloat16), x.t(), x[:1], x[:, :1]):
        assert_same_bits(amax(t), t.float().abs().amax())
    x[10, 20] = -math.inf
    assert amax(x).item() == math.inf
    x[60, 1] = math.nan
    assert amax(x).isnan()
    assert amax(torch.empty(0, 5)).item() == 0.0
    assert kernels.tensor_amax(torch.full((2, 3), -0.0, device=DEVICE)).item() == 0.0


def test_empty_tensor():
    for recipe in ("fp8_e4m3", "nvfp4"):
        parts = q(torch.empty(0, 32), recipe, 1, transpose=True)
        assert parts.values.shape == (32, 0) and parts.tensor_scale.item() == 1.0


# ----------------------------------------------------------------------------------------------------------
# stochastic rounding: on the two neighbouring grid points, unbiased, reproducible
# ----------------------------------------------------------------------------------------------------------


STOCHASTIC_RECIPES = ["fp8_e4m3", "fp8_e5m2", "mxfp8", "mxfp4", "nvfp4", "nvfp4_2d"]


@pytest.mark.parametrize("recipe", STOCHASTIC_RECIPES)
def test_stochastic_outputs_are_neighbouring_grid_points(recipe):
    x, amax, d = known_scale_input(recipe, 32, 64, seed=13)
    fmt = quant.get_recipe(recipe).element.name
    lo, hi = neighbours(x, d, fmt)
    for seed in range(3):
        parts = q(x, recipe, 1, tensor_amax=amax, stochastic=True, seed=seed)
        # the same blocks along axis 0 of the transposed input, written back transposed
        across = q(x.t().contiguous(), recipe, 0, tensor_amax=amax, stochastic=True,
                                   seed=seed, transpose=True)
        # per-tensor values are unscaled grid values and d = 1; block recipes' values carry the block scale
        for out in (parts.values.double(), across.values.double()):
            assert ((out.abs() == lo) | (out.abs() == hi)).all()
            assert (torch.signbit(out) == torch.signbit(x)).all()
    rne = q(x, recipe, 1, tensor_amax=amax).values.double().abs()
    assert ((rne == lo) | (rne == hi)).all()  # the construction gives the scales it claims


@pytest.mark.parametrize("recipe", ["fp8_e4m3", "mxfp4", pytest.param("nvfp4", marks=pytest.mark.slow),
                                    pytest.param("nvfp4_2d", marks=pytest.mark.slow)])
def test_stochastic_rounding_is_unbiased(recipe):
    """The mean of 64 copies x 8 seeds = 512 draws is x (tests/quant_inputs.py has the bounds)."""
    assert_stochastic_rounding_unbiased(q, recipe, seeds=8)


@pytest.mark.parametrize("recipe", ["fp8_e5m2", "mxfp4", "nvfp4"])
def test_stochastic_rounding_is_reproducible(recipe):
    """Same (seed, offset): the same draws; another seed: other draws; a slice of rows quantized with the
    offset of its first element (and the whole tensor's amax) gets the draws of the whole."""
    x = wide_sample((48, 64), seed=15)
    amax = x.abs().max()
    first = q(x, recipe, 1, stochastic=True, seed=3)
    assert_same_bits(q(x, recipe, 1, stochastic=True, seed=3).values, first.values)
    assert not torch.equal(q(x, recipe, 1, stochastic=True, seed=4).values, first.values)
    assert not torch.equal(q(x, recipe, 1, stochastic=True, seed=3, offset=1).values,
                           first.values)
    rows = 17
    tail = q(x[rows:], recipe, 1, tensor_amax=amax, stochastic=True, seed=3,
                             offset=rows * x.shape[1])
    assert_same_bits(tail.values, first.values[rows:])
    # the draws follow the element, not the layout written or the dtype read
    transposed = q(x, recipe, 1, stochastic=True, seed=3, transpose=True)
    assert_same_bits(transposed.values, first.values.t().contiguous())
    x16 = x.to(torch.bfloat16)
    assert_same_bits(q(x16, recipe, 1, stochastic=True, seed=3, out_dtype=torch.bfloat16).values,
                     q(x16.float(), recipe, 1, stochastic=True, seed=3).values.to(torch.bfloat16))


def test_cpu_kernels_round_as_these_kernels():
    """snip_ds.backend.cpu (the fused C++ CPU quantizer) draws the same Philox stream from (seed, offset,
    element index): with stochastic rounding on too, both give the same bits, so a run rounds alike on CPU
    and GPU."""
    from snip_ds.backend import cpu
    if not cpu.available():
        pytest.skip(f"the CPU quantization kernels are unavailable here: {cpu.unavailable_reason()}")
    x = wide_sample((40, 70), seed=16)
    for recipe in ["fp8_e5m2", "mxfp8", "mxfp4", "nvfp4", "nvfp4_2d"]:
        for axis in AXES:
            for stochastic, offset in ((False, 0), (True, 123), (True, 2 ** 33 + 123)):  # past 2**32 too
                kw = dict(stochastic=stochastic, seed=2 ** 40 + 7, offset=offset)
                assert_same_bits(cpu.quantize_parts(x, recipe, axis, **kw).values,
                                 q(x, recipe, axis, **kw).values)


@pytest.mark.parametrize("recipe", ["fp8_e4m3", "mxfp8", "nvfp4_2d"])
def test_stochastic_special_values(recipe):
    """Scales are round-to-nearest-even, so poisoning is the reference's: NaN exactly where it has NaN; and
    zeros stay zeros with their sign."""
    for name, x in special_inputs().items():
        ref = quant.quantize_parts(x, recipe, 1).values
        out = q(x, recipe, 1, stochastic=True, seed=9).values
        assert torch.equal(out.isnan(), ref.isnan()), name
        zero = x == 0
        assert (out[zero] == 0).all() and torch.equal(out[zero].signbit(), x[zero].signbit()), name


def test_stochastic_exact_values_stay():
    """Values already on the grid have nothing to round: every draw returns them."""
    grid = torch.tensor([v for v, _ in GRIDS["e4m3"]])
    x = torch.cat([grid, -grid]).reshape(2, -1)
    for seed in range(4):
        values = q(x, "fp8_e4m3", 1, tensor_amax=torch.tensor(448.0), stochastic=True,
                                   seed=seed).values
        assert_same_bits(values, x)


@pytest.mark.parametrize("recipe, dtype", [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
@pytest.mark.parametrize("axis", AXES)
def test_fp8_codes_are_the_reference_values_cast(recipe, dtype, axis):
    """A per-tensor FP8 recipe written as its own codes: the reference's grid values cast to that dtype,
    byte for byte (NaN by position), subnormals, zeros of both signs and saturated values included; FP32 and
    BF16 in, transposed or not; the tensor scale as with any other output."""
    cases = {**special_inputs(), **{f"random {s}": wide_sample(s, seed=300 + i) for i, s in enumerate(SHAPES)}}
    for name, x in cases.items():
        for xd in (x, x.to(torch.bfloat16)):
            for transpose in (False, True):
                parts = q(xd, recipe, axis, out_dtype=dtype, transpose=transpose)
                ref = quant.quantize_parts(xd.float(), recipe, axis)
                want = ref.values.to(dtype)
                got = parts.values.t() if transpose else parts.values
                assert got.dtype == dtype and parts.values.is_contiguous(), name
                nan = want.float().isnan()
                assert torch.equal(got.float().isnan(), nan), f"case {name}: NaN positions differ"
                same = got.view(torch.uint8) == want.view(torch.uint8)
                assert (same | nan).all(), f"case {name}, {xd.dtype}, transpose {transpose}: codes differ"
                assert_same_bits(parts.tensor_scale, ref.tensor_scale)


# ----------------------------------------------------------------------------------------------------------
# arguments
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    (dict(x=torch.zeros(4, 4, dtype=torch.float16)), TypeError, "^x: .*float32 or bfloat16"),
    (dict(x=torch.zeros(4, 4, dtype=torch.int32)), TypeError, "^x: "),
    (dict(x=torch.zeros(2, 4, 4)), ValueError, "^x: .*2-D"),
    (dict(x=[[1.0]]), TypeError, "^x: expected a torch.Tensor"),
    (dict(axis=2), ValueError, "^axis: "),
    (dict(axis=True), ValueError, "^axis: "),
    (dict(recipe="fp6"), ValueError, "^recipe: unknown recipe 'fp6'"),
    (dict(tensor_amax=torch.ones(2)), ValueError, "^tensor_amax: "),
    (dict(tensor_amax=1.0), ValueError, "^tensor_amax: "),
    (dict(seed=-1), ValueError, "^seed: "),
    (dict(offset=1.5), ValueError, "^offset: "),
    (dict(out_dtype=torch.float16), ValueError, "^out_dtype: "),
    (dict(out_dtype=torch.float8_e4m3fn), ValueError, "^out_dtype: .*per-tensor recipe"),  # nvfp4
    (dict(recipe="fp8_e5m2", out_dtype=torch.float8_e4m3fn), ValueError, "^out_dtype: .*not of 'fp8_e5m2'"),
    (dict(transpose=1), ValueError, "^transpose: "),
])
def test_bad_arguments_name_the_field(kwargs, error, match):
    args = dict(x=torch.zeros(4, 4), recipe="nvfp4", axis=1)
    args.update(kwargs)
    x, recipe, axis = args.pop("x"), args.pop("recipe"), args.pop("axis")
    with pytest.raises(error, match=match):
        q(x, recipe, axis, **args)


def test_available_and_package_entry_point():
    assert kernels.available()  # triton imports, and there is a GPU or the kernels are interpreted
    assert kernels.interpreting() == (DEVICE == "cpu") == kq.INTERPRETED
    x = wide_sample((5, 40), seed=16)
    assert_same_bits(kernels.quantize_parts(x.to(DEVICE), "mxfp8", 1).values.cpu(),
                     quant.quantize_parts(x, "mxfp8", 1).values)


def test_without_triton_a_clear_error(monkeypatch):
    monkeypatch.setattr(kernels, "_triton_installed", lambda: False)
    assert not kernels.available()
    with pytest.raises(RuntimeError, match="^triton kernels: need the triton package"):
        kernels.quantize_parts(torch.zeros(2, 32), "mxfp4", 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the benchmark's answer on a machine without CUDA")
def test_benchmark_without_cuda_says_so(capsys, tmp_path):
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                        "bench_quant_kernels.py")
    spec = importlib.util.spec_from_file_location("bench_quant_kernels", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--output_dir", str(tmp_path)]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())  # nothing written


# ----------------------------------------------------------------------------------------------------------
# compiled for a CUDA GPU, without one: the compiler is stricter than the interpreter
# ----------------------------------------------------------------------------------------------------------

COMPILE_CHECK = r"""
import re, sys
try:
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
except ImportError as err:
    print("skip:", err)
    sys.exit(0)
import triton
from triton.compiler import ASTSource
from snip_ds import quant
from snip_ds.backend.kernels import quantize as kq
target = GPUTarget("cuda", 90, 32)
ptr_bits = {True: "*i16", False: "*i32"}
for name in ("fp8_e4m3", "fp8_e5m2", "mxfp8", "mxfp4", "nvfp4", "nvfp4_2d"):
    r = quant.get_recipe(name)
    kind = kq.kind(r)
    # (stochastic, BF16 in, axis, dequantize, OUT: 0 FP32, 1 BF16, 2 the FP8 codes of a per-tensor recipe)
    # (both layouts written: 1 the same values (per-tensor recipes), 2 blocks along the other axis (block
    # recipes, from axis 1); the amax given (2 slots read) or from up to 512 partials; products of scales)
    variants = [(False, False, 1, False, 0, 0, 512, 0), (True, True, 0, False, 1, 0, 2, 1),
                (False, True, 0, True, 0, 0, 512, 0)]
    for stochastic, bf16, axis, dequant, out, both, amax_block, products in variants + (
            [(False, True, 0, False, 2, 1, 512, 0), (False, False, 1, False, 2, 1, 2, 0)] if kind == 0 else
            [(True, True, 1, False, 1, 2, 512, 2), (False, False, 1, False, 1, 2, 2, 1)]):
        const = dict(KIND=kind, AXIS=axis, BS=max(r.block_size, 1), MBITS=r.element.mbits, EMIN=r.element.emin,
                     EMAX=r.element.emax, MAXN=r.element.max_normal, TENSOR_DIVISOR=2688.0, STOCHASTIC=stochastic,
                     TRANSPOSE=bf16 and not dequant and both != 2, IN_BF16=bf16, OUT=out, BR=64, BC=64,
                     DEQUANT=dequant, BOTH=both, AMAX_BLOCK=amax_block, WRITE_AMAX=both == 1, PRODUCTS=products)
        out_ptr = ("*fp32", "*i16", "*u8")[out]
        sig = {"x_ptr": ptr_bits[bf16], "out_ptr": out_ptr, "out2_ptr": out_ptr, "amax_ptr": "*i32",
               "n_amax": "i32", "scale_out_ptr": "*fp32", "amax_out_ptr": "*fp32", "R": "i32", "C": "i32",
               "stride_r": "i32", "stride_c": "i32", "seed_ptr": "*i64", "seed2_ptr": "*i64", "offset": "i64",
               "partner_ptr": "*fp32", "partner2_ptr": "*fp32", "products_ptr": "*fp32",
               **{k: "constexpr" for k in const}}
        ptx = triton.compile(ASTSource(kq._quantize_kernel, sig, constexprs=const), target=target).asm["ptx"]
        where = (name, stochastic, bf16, axis, dequant)
        assert not re.search(r"div\.(full|approx)|\.ftz", ptx), where  # IEEE division, subnormals kept
        assert ("div.rn.f32" in ptx) == (r.scale != "e8m0"), where
for bf16 in (False, True):
    sig = {"x_ptr": ptr_bits[bf16], "partials_ptr": "*i32", "R": "i32", "C": "i32", "stride_r": "i32",
           "stride_c": "i32", "IN_BF16": "constexpr", "BR": "constexpr", "BC": "constexpr"}
    for per_program in (1, 16):
        const = dict(IN_BF16=bf16, BR=64, BC=64, TILES_PER_PROGRAM=per_program)
        triton.compile(ASTSource(kq._amax_kernel, {**sig, "TILES_PER_PROGRAM": "constexpr"}, constexprs=const),
                       target=target)
print("ok")
"""


@pytest.mark.slow
def test_kernels_compile_for_cuda_without_a_gpu():
    """Triton's compiler (to PTX and a Hopper cubin, no GPU needed) accepts every kernel variant the
    interpreter runs, and the PTX divides with IEEE division (div.rn) and flushes no subnormals (no .ftz):
    what bit-exactness on a GPU needs. In a subprocess, where Triton is not in interpreter mode."""
    compile_check(COMPILE_CHECK, timeout=1800)


# ----------------------------------------------------------------------------------------------------------
# the same draws interpreted and compiled; beyond 2**31 elements and 65535 column tiles (CUDA GPU)
# ----------------------------------------------------------------------------------------------------------

DRAWS = r"""
import sys, torch
from snip_ds import quant
from snip_ds.backend.kernels import quantize as kq
device = "cpu" if kq.INTERPRETED else "cuda"
x = torch.load(sys.argv[1], weights_only=True).to(device)
draws = {r: kq.quantize_parts(x, r, 1, stochastic=True, seed=11, offset=2 ** 32 + 7).values.cpu()
         for r in quant.RECIPES}
torch.save({"interpreted": kq.INTERPRETED, "draws": draws}, sys.argv[2])
print("ok")
"""


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_interpreted_and_compiled_kernels_draw_alike(tmp_path):
    """Stochastic rounding draws the same bits compiled on a GPU and under the interpreter for the same
    (seed, offset), offsets past 2**32 included (the counter's high word): a subprocess runs the mode this
    process does not."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if DEVICE == "cuda":
        env["TRITON_INTERPRET"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    x = wide_sample((40, 64), seed=18)
    torch.save(x, tmp_path / "x.pt")
    result = subprocess.run([sys.executable, "-c", DRAWS, str(tmp_path / "x.pt"), str(tmp_path / "draws.pt")],
                            env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
    other = torch.load(tmp_path / "draws.pt", weights_only=True)
    assert other["interpreted"] == (DEVICE == "cuda")
    for recipe, values in other["draws"].items():
        assert_same_bits(values, q(x, recipe, 1, stochastic=True, seed=11, offset=2 ** 32 + 7).values)


@pytest.mark.gpu
@on_cuda
@pytest.mark.parametrize("shape", [(333, 270), (1024, 4096), (4096, 1024)])
def test_compiled_kernels_large_shapes_and_specials(shape):
    """Compiled kernels on shapes with many tiles of each kind, specials included: bit for bit, every recipe,
    both axes, FP32 and BF16 in and out, transposed or not."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randn(shape, generator=gen) * 4)
    x.view(-1)[::97] = 0.0
    x.view(-1)[5::101] = 1e-40
    for special in (None, math.nan, math.inf):
        if special is not None:
            x.view(-1)[x.numel() // 2] = special
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            got_amax, want_amax = amax(xd), xd.float().abs().amax()
            assert (got_amax.isnan() and want_amax.isnan()) or torch.equal(got_amax, want_amax)
            for recipe in quant.RECIPES:
                for axis in (0, 1):
                    for transpose in (False, True):
                        try:
                            assert_matches_reference(xd, recipe, axis, out_dtype=dtype, transpose=transpose)
                        except AssertionError as err:
                            raise AssertionError(f"{(special, dtype, recipe, axis, transpose)}: {err}") from None


@pytest.mark.gpu
@on_cuda
def test_more_than_2_31_elements_and_65535_column_tiles():
    """One BF16 operand of 512 x (2**22 + 64) elements (2**31 + 2**15): its last columns lie past element
    2**31, and its 65537 column tiles of 64 pass the 65535 a CUDA grid allows in its second dimension.
    Checked against the reference on slices (per-row blocks, the whole tensor's amax), and its stochastic
    draws past 2**31 against the same rows quantized alone at their offset."""
    rows, cols = 512, 2 ** 22 + 64
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, generator=gen)
    x[-1, -1] = 7.5  # the amax sits in the very last element
    whole_amax = kq.tensor_amax(x)
    assert whole_amax.item() == 7.5
    for recipe in ("nvfp4", "mxfp8", "fp8_e4m3"):
        parts = kq.quantize_parts(x, recipe, 1, out_dtype=torch.bfloat16)
        for sl in (slice(0, 4096), slice(cols - 4096, cols)):
            ref = quant.quantize_parts(x[:, sl].cpu(), recipe, 1, tensor_amax=whole_amax.cpu())
            assert_same_bits(parts.values[:, sl].cpu(), ref.values.to(torch.bfloat16))
            assert_same_bits(parts.tensor_scale.cpu(), ref.tensor_scale)
        del parts
    whole = kq.quantize_parts(x, "nvfp4", 1, stochastic=True, seed=5, out_dtype=torch.bfloat16).values[-1:, :]
    alone = kq.quantize_parts(x[-1:], "nvfp4", 1, tensor_amax=whole_amax, stochastic=True, seed=5,
                              offset=(rows - 1) * cols, out_dtype=torch.bfloat16).values
    assert_same_bits(whole.cpu(), alone.cpu())


def test_seed_as_a_device_tensor():
    """A seed given as a one-element int64 tensor on the kernels' device draws what the same int draws."""
    x = wide_sample((24, 48), seed=19)
    for recipe in ("fp8_e5m2", "nvfp4"):
        as_int = q(x, recipe, 1, stochastic=True, seed=2 ** 40 + 3, offset=5).values
        assert_same_bits(q(x, recipe, 1, stochastic=True, seed=torch.tensor(2 ** 40 + 3), offset=5).values, as_int)
    with pytest.raises(ValueError, match="^seed: expected an int or a one-element int64 tensor"):
        q(x, "nvfp4", 1, stochastic=True, seed=torch.tensor([1, 2]))
