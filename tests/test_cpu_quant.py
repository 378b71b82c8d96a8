"""The fused CPU quantization kernels (snip_ds/backend/cpu) against snip_ds.quant.quantize_parts.

Round to nearest even must equal the reference bit for bit (values and tensor scale; NaN compared by position),
for every recipe, both axes, odd shapes, FP32 and BF16 inputs and outputs, and every instruction-set variant
this CPU runs (AVX-512, AVX2, baseline: each is compiled from the same source and picked at run time, so all of
them are checked here whatever ``ATEN_CPU_CAPABILITY`` says). Stochastic rounding is held to independent facts:
every output is one of the two grid points around the input, the mean over many draws is the input, the draws
are Philox-4x32-10 of (seed, element index) and so reproducible and slice-independent. Without a C++ compiler
the kernel tests skip; the fallback tests run anyway.
"""
import json
import logging
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from snip_ds import quant
from snip_ds.backend import TorchBackend, reference_operands
from snip_ds.backend import cpu
from snip_ds.quant_config import QuantConfig
from tests.reference_quant import GRIDS, assert_bitwise_equal
from tests.quant_inputs import assert_stochastic_rounding_unbiased, known_scale_input, neighbours, wide_sample

REPO = Path(__file__).resolve().parents[1]
RECIPES = list(quant.RECIPES)
# awkward shapes: single rows and columns, not multiples of 16 or 32; 70 x 2100 spans several column chunks
# (1024) and threads, with partial blocks along both axes
SHAPES = [(1, 45), (37, 1), (33, 70), (16, 32), (70, 17), (70, 2100)]
ISAS = [0, 1, 2]  # baseline, AVX2, AVX-512


@pytest.fixture(scope="module")
def kernels():
    if not cpu.available():
        pytest.skip(f"the CPU quantization kernels are unavailable here: {cpu.unavailable_reason()}")
    return cpu


@pytest.fixture(params=ISAS, ids=["baseline", "avx2", "avx512"])
def isa(request, kernels, monkeypatch):
    """Each instruction-set variant this CPU supports (the others skip)."""
    if request.param > int(cpu._ops.supported_isa()):
        pytest.skip("this CPU lacks the instructions of that variant")
    monkeypatch.setattr(cpu, "isa_level", lambda: request.param)
    return request.param


def assert_matches_reference(x, recipe, axis, tensor_amax=None, out_dtype=torch.float32):
    parts = cpu.quantize_parts(x, recipe, axis, tensor_amax=tensor_amax, out_dtype=out_dtype)
    ref = quant.quantize_parts(x, recipe, axis, tensor_amax=tensor_amax)
    assert_bitwise_equal(parts.values, ref.values.to(out_dtype))
    assert parts.tensor_scale.shape == () and parts.tensor_scale.dtype == torch.float32
    assert_bitwise_equal(parts.tensor_scale, ref.tensor_scale)


# ----------------------------------------------------------------------------------------------------------
# round to nearest even: bit for bit against the reference
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_inputs_match_reference(recipe, axis, dtype, isa):
    for i, shape in enumerate(SHAPES):
        x = wide_sample(shape, seed=100 + i, dtype=dtype)
        assert_matches_reference(x, recipe, axis)
        assert_matches_reference(x, recipe, axis, out_dtype=torch.bfloat16)


def special_inputs():
    """Named 2-D inputs around the conventions of snip_ds.quant: signed zeros, FP32 subnormals, values near
    the FP32 maximum, NaN and Inf, all-zero blocks, a huge dynamic range inside one block, and ties."""
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
    x[7:9, :] = 1e-38  # tiny normals next to the huge ones
    x[:, 10] = 0.0  # an all-zero column: blocks along axis 0 that are all zero
    cases["finite_specials"] = x
    cases["all_zero"] = torch.zeros(20, 33)
    cases["all_negative_zero"] = torch.full((20, 33), -0.0)
    cases["all_subnormal"] = torch.full((19, 35), 1e-42) * torch.sign(base[:19, :35])  # amax subnormal
    cases["smallest_subnormal"] = torch.full((3, 40), 1.4e-45)
    cases["range_in_one_block"] = torch.tensor([[3e38, 1e-30, -2.0, 1e-45] * 10] * 4)
    cases["huge"] = base * 1e30
    cases["tiny"] = base * 1e-30
    for name, value in (("nan", math.nan), ("inf", math.inf), ("neg_inf", -math.inf)):
        y = base.clone()
        y[13, 17] = value
        cases[name] = y
    y = base.clone()
    y[2, 3], y[30, 40] = math.nan, math.inf
    cases["nan_and_inf"] = y
    for fmt, top in (("e4m3", 448.0), ("e5m2", 57344.0), ("e2m1", 6.0)):
        # every midpoint between neighbouring grid values (ties), with +-top in every row and column, so the
        # per-tensor, MX (block amax top: X = 1) and, for E2M1 with 2688 = 448 * 6 present, NVFP4 scales are 1
        grid = [v for v, _ in GRIDS[fmt]]
        mids = torch.tensor([(a + b) / 2 for a, b in zip(grid, grid[1:])])
        n = mids.numel()
        t = torch.zeros(32, 32 * ((n + 29) // 30))
        t.view(-1)[: n * 32].copy_(mids.repeat(32) * torch.where(torch.arange(n * 32) % 3 == 0, -1.0, 1.0))
        t[:, ::16] = top
        t[::16, :] = -top
        if fmt == "e2m1":
            t[0, 1] = 2688.0
        cases[f"ties_{fmt}"] = t
    return cases


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("axis", [0, 1])
def test_special_values_match_reference(recipe, axis, isa):
    for name, x in special_inputs().items():
        try:
            assert_matches_reference(x, recipe, axis)
            assert_matches_reference(x.to(torch.bfloat16), recipe, axis)
        except AssertionError as err:
            raise AssertionError(f"case {name}: {err}") from None


@pytest.mark.parametrize("recipe", ["fp8_e4m3", "fp8_e5m2", "nvfp4", "nvfp4_2d", "mxfp4"])
@pytest.mark.parametrize("axis", [0, 1])
def test_given_tensor_amax(recipe, axis, kernels):
    """An amax from outside (the whole tensor x is a slice of): non-finite elements saturate instead of
    poisoning; amax 0 gives scale 1; a NaN amax poisons."""
    x = wide_sample((35, 48), seed=8)
    assert_matches_reference(x, recipe, axis, tensor_amax=x.abs().max() * 7)
    x[3, 4], x[20, 33], x[9, 9] = math.inf, -math.inf, math.nan
    assert_matches_reference(x, recipe, axis, tensor_amax=torch.tensor(1e3))
    assert_matches_reference(x, recipe, axis, tensor_amax=torch.tensor(0.0))
    assert_matches_reference(x, recipe, axis, tensor_amax=torch.tensor(math.nan))


def test_slices_with_the_whole_amax_give_the_whole_result(kernels):
    x = wide_sample((96, 80), seed=9)
    for recipe in RECIPES:
        for axis in (0, 1):
            whole = cpu.quantize_parts(x, recipe, axis)
            amax = cpu.tensor_amax(x)
            parts = [cpu.quantize_parts(x[r:r + 32], recipe, axis, tensor_amax=amax) for r in (0, 32, 64)]
            assert_bitwise_equal(torch.cat([p.values for p in parts]), whole.values)


def test_tensor_amax_pass(isa):
    x = wide_sample((70, 2100), seed=10)
    assert_bitwise_equal(cpu.tensor_amax(x), x.abs().amax())
    assert_bitwise_equal(cpu.tensor_amax(x.to(torch.bfloat16)), x.to(torch.bfloat16).abs().amax().float())
    x[3, 4] = -math.inf
    assert cpu.tensor_amax(x).item() == math.inf
    x[5, 6] = math.nan
    assert math.isnan(cpu.tensor_amax(x).item())
    assert cpu.tensor_amax(torch.empty(0, 5)).item() == 0.0


def test_empty_and_strided_inputs(kernels):
    for recipe in ("fp8_e4m3", "nvfp4"):
        parts = cpu.quantize_parts(torch.empty(0, 32), recipe, 1)
        assert parts.values.shape == (0, 32) and parts.tensor_scale.item() == 1.0
    x = wide_sample((48, 64), seed=11)
    assert_matches_reference(x.t(), "mxfp8", 0)  # a transposed view is copied to rows first
    assert_matches_reference(x[:, ::2], "nvfp4", 1)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"x": torch.zeros(4)}, ValueError, "^x: the CPU quantizer takes a 2-D tensor"),
    ({"x": torch.zeros(4, 4, dtype=torch.float64)}, TypeError, "^x: the CPU quantizer takes float32 or bfloat16"),
    ({"axis": 2}, ValueError, "^axis: expected 0 or 1"),
    ({"recipe": "fp6"}, ValueError, "^recipe: unknown recipe 'fp6'"),
    ({"tensor_amax": 3.0}, ValueError, "^tensor_amax: expected a one-element"),
    ({"seed": -1}, ValueError, r"^seed: expected an int in \[0, 2\*\*63\)"),
    ({"offset": 1.5}, ValueError, "^offset: expected an int"),
    ({"out_dtype": torch.float16}, ValueError, "^out_dtype: expected torch.float32 or torch.bfloat16"),
])
def test_bad_arguments_name_the_field(kwargs, error, match, kernels):
    args = {"x": torch.zeros(4, 32), "recipe": "nvfp4", "axis": 1, **kwargs}
    with pytest.raises(error, match=match):
        cpu.quantize_parts(args.pop("x"), args.pop("recipe"), args.pop("axis"), **args)


# ----------------------------------------------------------------------------------------------------------
# stochastic rounding: Philox draws, neighbouring grid points, unbiased, reproducible
# ----------------------------------------------------------------------------------------------------------

def philox_reference(seed: int, index: int) -> int:
    """Philox-4x32-10 (Salmon et al. 2011) of counter (index lo, index hi, 0, 0), key (seed lo, seed hi):
    the first output word, as Triton's tl.randint returns it. Plain Python integers."""
    mask = 0xFFFFFFFF
    c = [index & mask, index >> 32 & mask, 0, 0]
    k = [seed & mask, seed >> 32 & mask]
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & mask, (p0 >> 32) ^ c[3] ^ k[1], p0 & mask]
        k = [(k[0] + 0x9E3779B9) & mask, (k[1] + 0xBB67AE85) & mask]
    return c[0]


def test_philox_draws(kernels):
    # Random123's known-answer vector for counter 0, key 0 (first word)
    assert philox_reference(0, 0) == 0x6627E8D5
    for seed, offset in ((0, 0), (12345, 7), (2 ** 61 + 3, 2 ** 32 - 3), (2 ** 40, 2 ** 45)):
        got = cpu.philox_draws(seed, offset, 6).tolist()
        assert got == [philox_reference(seed, offset + i) for i in range(6)]


STOCHASTIC_RECIPES = ["fp8_e4m3", "fp8_e5m2", "mxfp8", "mxfp4", "nvfp4", "nvfp4_2d"]


@pytest.mark.parametrize("recipe", STOCHASTIC_RECIPES)
def test_stochastic_outputs_are_neighbouring_grid_points(recipe, isa):
    x, amax, d = known_scale_input(recipe, 32, 64, seed=13)
    fmt = quant.get_recipe(recipe).element.name
    lo, hi = neighbours(x, d, fmt)
    for seed in range(3):
        for out in (cpu.quantize_parts(x, recipe, 1, tensor_amax=amax, stochastic=True, seed=seed).values,
                    cpu.quantize_parts(x.t().contiguous(), recipe, 0, tensor_amax=amax, stochastic=True,
                                       seed=seed).values.t()):
            out = out.double()
            assert ((out.abs() == lo) | (out.abs() == hi)).all()
            assert (torch.signbit(out) == torch.signbit(x)).all()
    rne = cpu.quantize_parts(x, recipe, 1, tensor_amax=amax).values.double().abs()
    assert ((rne == lo) | (rne == hi)).all()  # the construction gives the scales it claims


@pytest.mark.parametrize("recipe", ["fp8_e5m2", "mxfp4", "nvfp4", "nvfp4_2d"])
def test_stochastic_rounding_is_unbiased(recipe, kernels):
    """The mean of 64 copies x 32 seeds = 2048 draws is x (tests/quant_inputs.py has the bounds)."""
    assert_stochastic_rounding_unbiased(cpu.quantize_parts, recipe, seeds=32)


@pytest.mark.parametrize("recipe", ["fp8_e5m2", "mxfp4", "nvfp4", "nvfp4_2d"])
def test_stochastic_rounding_is_reproducible(recipe, isa):
    """Same (seed, offset): the same draws; another seed or offset: others; a slice of rows quantized with
    the offset of its first element (and the whole tensor's amax) gets the draws of the whole; BF16 input and
    output round as the FP32 values do; every instruction-set variant draws the same."""
    x = wide_sample((48, 64), seed=15)
    amax = x.abs().max()
    first = cpu.quantize_parts(x, recipe, 1, stochastic=True, seed=3)
    assert_bitwise_equal(cpu.quantize_parts(x, recipe, 1, stochastic=True, seed=3).values, first.values)
    assert not torch.equal(cpu.quantize_parts(x, recipe, 1, stochastic=True, seed=4).values, first.values)
    assert not torch.equal(cpu.quantize_parts(x, recipe, 1, stochastic=True, seed=3, offset=1).values,
                           first.values)
    rows = 16
    tail = cpu.quantize_parts(x[rows:], recipe, 1, tensor_amax=amax, stochastic=True, seed=3,
                              offset=rows * x.shape[1])
    assert_bitwise_equal(tail.values, first.values[rows:])
    x16 = x.to(torch.bfloat16)
    assert_bitwise_equal(cpu.quantize_parts(x16, recipe, 1, stochastic=True, seed=3,
                                            out_dtype=torch.bfloat16).values,
                         cpu.quantize_parts(x16.float(), recipe, 1, stochastic=True, seed=3).values.to(torch.bfloat16))


def test_stochastic_draws_do_not_depend_on_the_variant(kernels, monkeypatch):
    x = wide_sample((40, 2100), seed=16)
    results = []
    for level in range(int(cpu._ops.supported_isa()) + 1):
        monkeypatch.setattr(cpu, "isa_level", lambda level=level: level)
        results.append(cpu.quantize_parts(x, "nvfp4", 0, stochastic=True, seed=2 ** 40 + 1, offset=5).values)
    for other in results[1:]:
        assert_bitwise_equal(other, results[0])


def test_stochastic_special_values(kernels):
    """Scales are round-to-nearest-even, so poisoning is the reference's: NaN exactly where it has NaN; and
    zeros stay zeros with their sign."""
    for recipe in ("fp8_e4m3", "mxfp8", "nvfp4_2d"):
        for name, x in special_inputs().items():
            ref = quant.quantize_parts(x, recipe, 1).values
            out = cpu.quantize_parts(x, recipe, 1, stochastic=True, seed=9).values
            assert torch.equal(out.isnan(), ref.isnan()), name
            zero = x == 0
            assert (out[zero] == 0).all() and torch.equal(out[zero].signbit(), x[zero].signbit()), name


# ----------------------------------------------------------------------------------------------------------
# the torch backend with and without the kernels
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture
def no_kernels(monkeypatch):
    """The state after a failed build: no ops, a reason."""
    monkeypatch.setattr(cpu, "_ops", None)
    monkeypatch.setattr(cpu, "_error", "RuntimeError: no compiler (simulated)")
    assert not cpu.available()


def test_failed_build_warns_once_and_falls_back(monkeypatch, caplog):
    from torch.utils import cpp_extension

    def broken(*args, **kwargs):
        raise RuntimeError("Error building extension 'snip_ds_cpu_quant'\nthe compiler's output")

    monkeypatch.setattr(cpu, "_ops", None)
    monkeypatch.setattr(cpu, "_error", None)
    monkeypatch.setattr(cpp_extension, "load", broken)
    with caplog.at_level(logging.WARNING, logger="snip_ds.backend"):
        assert not cpu.available() and not cpu.available()
    lines = [r.getMessage() for r in caplog.records if r.name == "snip_ds.backend"]
    assert lines == ["snip_ds CPU quantization kernels are unavailable (RuntimeError: Error building extension "
                     "'snip_ds_cpu_quant'); the torch backend quantizes with plain torch ops on CPU (same values, "
                     "slower)"]
    with pytest.raises(RuntimeError, match="CPU quantization kernels: unavailable"):
        cpu.quantize_parts(torch.zeros(2, 32), "nvfp4", 1)


def test_a_load_removes_this_checkouts_earlier_builds_and_says_so(kernels, tmp_path, monkeypatch, caplog):
    """In a temporary extensions folder: this checkout's build of an earlier source (recorded), and one written
    before builds recorded who built them (its build.ninja compiles this source against this torch), go when the
    kernels load, in one warning line; another checkout's build and this build's own folder stay."""
    from torch.utils import cpp_extension

    from snip_ds.runtime import jit_builds

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    own = Path(cpu.build_directory())
    parent = own.parent
    include = os.path.join(os.path.dirname(torch.__file__), "include")

    def build(key, ninja_source=None, identity=None):
        folder = parent / f"{cpu.EXTENSION_NAME}-{key}"
        folder.mkdir(parents=True)
        (folder / f"{cpu.EXTENSION_NAME}.so").write_bytes(b"\0" * 1024)
        if ninja_source is not None:
            (folder / "build.ninja").write_text(f"cflags = -isystem {include} -O3\n\n"
                                                f"build quantize.o: compile {ninja_source}\n")
        if identity is not None:
            jit_builds.record_build(folder, identity)
        return folder

    earlier = build("0000000000000001", identity=cpu.build_identity())
    legacy = build("0000000000000002", ninja_source=cpu.SOURCE)
    other = build("0000000000000003", ninja_source="/elsewhere/snip_ds/backend/cpu/quantize.cpp")
    monkeypatch.setattr(cpu, "_ops", None)
    monkeypatch.setattr(cpu, "_error", None)
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: None)  # the library is loaded in this process
    with caplog.at_level(logging.WARNING, logger="snip_ds"):
        assert cpu.load()
    lines = [r.getMessage() for r in caplog.records if "build folder" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("snip_ds: removed 2 build folder(s) of earlier versions of "
                                                   "snip_ds's CPU kernels that this version never loads")
    assert earlier.name in lines[0] and legacy.name in lines[0] and other.name not in lines[0]
    assert not earlier.exists() and not legacy.exists() and other.exists()
    assert json.loads((own / jit_builds.BUILD_RECORD).read_text()) == {"identity": cpu.build_identity()}


@pytest.mark.parametrize("recipe", ["fp8_hybrid", "mxfp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("fallback", [False, True])
def test_torch_backend_operands_with_and_without_the_kernels(recipe, fallback, request):
    """The torch backend's CPU operands are the reference's bit for bit either way (stochastic rounding off),
    and its GEMMs give the same results with the kernels as without them."""
    if fallback:
        request.getfixturevalue("no_kernels")
    elif not cpu.available():
        pytest.skip(f"the CPU quantization kernels are unavailable here: {cpu.unavailable_reason()}")
    precision = "fp8" if "fp8" in recipe else "fp4"
    cfg = QuantConfig(**({"fp8_recipe": recipe} if precision == "fp8" else {"fp4_recipe": recipe}),
                      stochastic_rounding=False)
    gen = torch.Generator().manual_seed(17)
    x, w, g = torch.randn(70, 40, generator=gen), torch.randn(24, 40, generator=gen), torch.randn(70, 24,
                                                                                                  generator=gen)
    be = TorchBackend()
    for gemm, (a, b) in {"fprop": (x, w), "dgrad": (g, w), "wgrad": (g, x)}.items():
        for got, ref in zip(be.quantized_operands(gemm, a, b, precision, cfg),
                            reference_operands(gemm, a, b, precision, cfg)):
            assert_bitwise_equal(got.values, ref.values)
            assert_bitwise_equal(got.tensor_scale, ref.tensor_scale)


def test_results_do_not_depend_on_the_thread_count(kernels):
    """Tasks are handed out dynamically to torch's threads; every element is computed on its own (and the amax
    is a max), so one thread and two give the same bits, stochastic draws included."""
    x = wide_sample((100, 2100), seed=18)
    previous = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append([cpu.quantize_parts(x, recipe, axis, stochastic=sr, seed=7).values
                            for recipe in ("fp8_e4m3", "mxfp4", "nvfp4_2d") for axis in (0, 1) for sr in (False, True)]
                           + [cpu.tensor_amax(x)])
    finally:
        torch.set_num_threads(previous)
    for a, b in zip(*results):
        assert_bitwise_equal(a, b)


@pytest.mark.parametrize("fast_bf16", [False, True])
def test_bf16_results_with_and_without_a_native_bf16_gemm(fast_bf16, monkeypatch):
    """A BF16 result on the CPU comes from a BF16 GEMM only where oneDNN has native BF16, else from the FP32
    GEMM of the same exact values; either way the product of the operands within FP32 accumulation (at most
    40 terms) plus two BF16 roundings (the BF16 GEMM's result, then the output after the tensor scales)."""
    from snip_ds.backend import cpu_stream

    monkeypatch.setattr(cpu_stream, "_fast_bf16", fast_bf16)
    dtypes = set()
    real_mm, real_addmm = torch.mm, torch.Tensor.addmm_
    monkeypatch.setattr(torch, "mm", lambda a, b, **kw: dtypes.add(a.dtype) or real_mm(a, b, **kw))
    monkeypatch.setattr(torch.Tensor, "addmm_",
                        lambda self, a, b, **kw: dtypes.add(a.dtype) or real_addmm(self, a, b, **kw))
    cfg = QuantConfig(fp4_recipe="nvfp4", stochastic_rounding=False)
    gen = torch.Generator().manual_seed(19)
    x, w = torch.randn(70, 40, generator=gen), torch.randn(24, 40, generator=gen)
    g = torch.randn(70, 24, generator=gen)
    be = TorchBackend()
    for gemm, (a, b) in {"fprop": (x, w), "dgrad": (g, w), "wgrad": (g, x)}.items():
        pa, pb = be.quantized_operands(gemm, a, b, "fp4", cfg)
        da, db = pa.values.double() * pa.tensor_scale.double(), pb.values.double() * pb.tensor_scale.double()
        prod = {"fprop": lambda u, v: u @ v.t(), "dgrad": lambda u, v: u @ v, "wgrad": lambda u, v: u.t() @ v}[gemm]
        ref, mag = prod(da, db), prod(da.abs(), db.abs())
        got = getattr(be, gemm)(a, b, "fp4", cfg, out_dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16
        rel = 100 * 2.0 ** -24 + 2 * 2.0 ** -8
        assert ((got.double() - ref).abs() <= mag * rel + ref.abs() * rel).all(), gemm
    assert dtypes == ({torch.bfloat16} if fast_bf16 else {torch.float32})


# ----------------------------------------------------------------------------------------------------------
# the build folder: one per environment, reused by later processes
# ----------------------------------------------------------------------------------------------------------

def test_build_key_changes_with_the_source_and_the_flags(tmp_path, monkeypatch):
    """A changed source, the source in another place or changed flags give another key (another folder); the
    same inputs the same."""
    source = tmp_path / "quantize.cpp"
    source.write_bytes(open(cpu.SOURCE, "rb").read())
    key = cpu.build_key(str(source))
    assert key == cpu.build_key(str(source)) and len(key) == 16
    assert key != cpu.build_key()  # the same bytes in another checkout: its own folder
    source.write_bytes(source.read_bytes() + b"\n// changed\n")
    assert cpu.build_key(str(source)) != key
    source.write_bytes(open(cpu.SOURCE, "rb").read())
    monkeypatch.setattr(cpu, "CFLAGS", cpu.CFLAGS + ["-march=native"])
    assert cpu.build_key(str(source)) != key
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert cpu.build_directory().startswith(str(tmp_path / "ext") + "/")
    assert os.path.basename(cpu.build_directory()) == f"snip_ds_cpu_quant-{cpu.build_key()}"


_LOAD = ("import json, os, sys\n"
         "from snip_ds.backend import cpu\n"
         "ok = cpu.load(verbose=True)\n"
         "print('RESULT', json.dumps({'ok': ok, 'dir': cpu.build_directory(), 'prefix': sys.prefix,\n"
         "                            'error': cpu.unavailable_reason()}), flush=True)\n")


def _load_in(python: str, ext_dir, pythonpath: str) -> dict:
    e = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext_dir), PYTHONPATH=pythonpath, OMP_NUM_THREADS="1")
    proc = subprocess.run([python, "-c", _LOAD], env=e, capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result["ok"], result["error"]
    result["log"] = proc.stdout + proc.stderr
    return result


def _stamps(folder: str) -> dict:
    return {name: (os.stat(os.path.join(folder, name)).st_mtime_ns, os.stat(os.path.join(folder, name)).st_ino)
            for name in ("quantize.o", "snip_ds_cpu_quant.so")}


@pytest.mark.slow
def test_two_environments_build_into_their_own_folders_and_reuse_them(tmp_path):
    """Two virtual environments (this one, and a second made with ``python -m venv`` that imports the same
    packages) sharing one TORCH_EXTENSIONS_DIR build into two folders; a later process of either reuses its
    build without compiling (the object file and library untouched, ninja reports no work), also after the
    other environment has built."""
    if shutil.which(os.environ.get("CXX") or "c++") is None:
        pytest.skip("no C++ compiler")
    ext = tmp_path / "extensions"
    site = os.path.dirname(os.path.dirname(torch.__file__))  # this environment's site-packages
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip",
                    str(tmp_path / "env_b")], check=True, timeout=120)
    envs = {"a": (sys.executable, str(REPO)), "b": (str(tmp_path / "env_b" / "bin" / "python"), f"{REPO}:{site}")}

    first = {name: _load_in(python, ext, path) for name, (python, path) in envs.items()}
    linked = "-o snip_ds_cpu_quant.so"  # ninja's link command, printed by the verbose loader
    assert all(linked in r["log"] for r in first.values())  # each environment compiled once
    assert first["a"]["prefix"] != first["b"]["prefix"]
    assert first["a"]["dir"] != first["b"]["dir"]
    assert sorted(os.listdir(os.path.dirname(first["a"]["dir"]))) == sorted(
        os.path.basename(r["dir"]) for r in first.values())
    built = {name: _stamps(r["dir"]) for name, r in first.items()}
    for name in ("a", "b", "a"):  # alternate: neither evicts the other
        python, path = envs[name]
        again = _load_in(python, ext, path)
        assert again["dir"] == first[name]["dir"]
        assert _stamps(again["dir"]) == built[name], f"environment {name} rebuilt"
        assert "ninja: no work to do." in again["log"] and linked not in again["log"]
