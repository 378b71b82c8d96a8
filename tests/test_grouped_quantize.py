"""One launch for two quantizations (``grouped._grouped_quantize_kernel``: X's and W's in forward, W's for dgrad and
G_Y's in backward).

Each program of the grouped launch runs the single quantization kernel's code on its own tensor's tile, so each
quantization must equal its own launch bit for bit: values in every layout, tensor scale, amax, stochastic draws.
The second tensor's products of tensor scales take the first tensor's scale computed in-program from its amax
(the first's own program writes it in the same launch): they must equal the products of the single launch that
reads the written scale. Interpreted on CPU tensors here (compiled on a CUDA GPU, as tests/triton_mode.py
decides); a subprocess compiles the kernel for a Hopper GPU without one.
"""
import math

import pytest
import torch

from quant_inputs import wide_sample
from snip_ds.quant import get_recipe
from triton_mode import DEVICE, SKIP_REASON, compile_check, interpreter_on, kg, kq  # noqa: F401 (a fixture)

if SKIP_REASON:
    pytest.skip(SKIP_REASON, allow_module_level=True)

VALUES = torch.bfloat16


def _cfg(t, recipe, axis=1, transpose=False, **kw):
    return kq.launch_config(*t.shape, recipe, axis, VALUES, transpose, t.dtype == torch.bfloat16, **kw)


def _seed(value):
    return kq.seed_tensor(value, torch.device(DEVICE))


def _assert_same(grouped, alone):
    """``(values, values2, scale, amax)`` of the grouped launch and of the single one: the same bits."""
    for got, want in zip(grouped, alone):
        assert (got is None) == (want is None)
        if got is not None:
            assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
            assert torch.equal(got.cpu().reshape(-1).view(torch.uint8), want.cpu().reshape(-1).view(torch.uint8))


def _as_int(t):
    return t.cpu().view(torch.int32)


# (X's recipe and shape, W's recipe and shape): per tensor, MX, NVFP4 1-D and 16 x 16; odd shapes, a tensor of
# one tile beside one of several, mixed dtypes
FORWARD = [("fp8_e4m3", (33, 70), torch.bfloat16, "fp8_e4m3", (48, 70), torch.float32),
           ("mxfp8", (70, 96), torch.float32, "mxfp8", (17, 96), torch.bfloat16),
           ("nvfp4", (70, 96), torch.bfloat16, "nvfp4", (48, 96), torch.bfloat16),
           ("mxfp4", (1, 32), torch.float32, "mxfp4", (130, 32), torch.float32),
           ("nvfp4_2d", (40, 50), torch.float32, "nvfp4", (20, 50), torch.bfloat16),
           ("mxfp8", (40, 64), torch.bfloat16, "nvfp4", (24, 64), torch.float32)]


@pytest.mark.parametrize("amax", ["grouped", "own", "given"])
@pytest.mark.parametrize("case", FORWARD, ids=lambda c: f"{c[0]}-{c[3]}")
def test_x_and_w_in_one_launch_equal_their_own_launches(case, amax):
    """Forward: X in both layouts (each blocked along its own axis; per-tensor: the same codes transposed) and W,
    its amax written and, for a tensor-scaled W, fprop's product ``S_W * S_X`` -- from the grouped amax pass's
    partials, from each tensor's own amax pass inside the launch, or from given amaxes."""
    x_recipe, x_shape, x_dtype, w_recipe, w_shape, w_dtype = case
    x = wide_sample(x_shape, seed=1).to(DEVICE, x_dtype)
    w = wide_sample(w_shape, seed=2).to(DEVICE, w_dtype)
    given = amax == "given"
    x_amax = x.float().abs().amax() if given and get_recipe(x_recipe).scale != "e8m0" else None
    w_amax = w.float().abs().amax() if given and get_recipe(w_recipe).scale != "e8m0" else None
    x_cfg = _cfg(x, x_recipe, both=True, amax_given=x_amax is not None)
    unit = get_recipe(w_recipe).scale == "e8m0"
    w_cfg = _cfg(w, w_recipe, amax_given=w_amax is not None, write_amax=True, products=0 if unit else 1)
    x_partials = w_partials = None
    if amax == "grouped" and kq.takes_amax_pass(x_cfg) and kq.takes_amax_pass(w_cfg):
        x_partials, w_partials = kg.grouped_amax_partials(kg.grouped_amax_config(x_cfg, w_cfg), x, w)
    product = None if unit else torch.full((1,), -1.0, device=DEVICE)
    x_out, w_out = kg.launch_pair(kg.quantize_pair_config(x_cfg, w_cfg), x, x_amax, w, w_amax,
                                  a_partials=x_partials, b_partials=w_partials, products=product)

    x_alone = kq.launch(x_cfg, x, x_amax, None)
    alone_product = None if unit else torch.full((1,), -2.0, device=DEVICE)
    w_alone = kq.launch(w_cfg, w, w_amax, None, **({} if unit else dict(partners=(x_alone[2],),
                                                                          products=alone_product)))
    _assert_same(x_out, x_alone)
    _assert_same(w_out, w_alone)
    if not unit:
        assert torch.equal(_as_int(product), _as_int(alone_product))
        assert torch.equal(product.cpu(), (w_out[2] * x_out[2]).reshape(1).cpu())


@pytest.mark.parametrize("need_w", [True, False])
@pytest.mark.parametrize("recipes", [("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"), ("fp8_e4m3", "fp8_e5m2"),
                                     ("mxfp8", "nvfp4")])
def test_w_for_dgrad_and_g_in_one_launch_equal_their_own_launches(recipes, need_w):
    """Backward: W for dgrad, transposed, from its kept amax, and G_Y (dgrad's layout and, where wgrad runs,
    wgrad's transposed), rounded stochastically from two seeds where its recipe has blocks, writing dgrad's
    product with W's scale (computed in-program) and wgrad's with X's kept scale."""
    w_recipe, g_recipe = recipes
    w = wide_sample((40, 64), seed=3).to(DEVICE, torch.bfloat16)
    g = (wide_sample((64, 40), seed=4) * 1e-3).to(DEVICE, torch.bfloat16)
    w_mx = get_recipe(w_recipe).scale == "e8m0"
    w_amax = w.float().abs().amax().to(DEVICE)
    x_scale = torch.tensor(0.0078125, device=DEVICE)
    w_cfg = _cfg(w, w_recipe, axis=0, transpose=True, amax_given=True)
    per_tensor = get_recipe(g_recipe).block_size == 0
    n_products = 0 if per_tensor else 1 + need_w
    g_cfg = _cfg(g, g_recipe, both=need_w, products=n_products)
    stochastic = not per_tensor
    seeds = (_seed(11), _seed(12) if need_w else None) if stochastic else (None, None)
    products = torch.full((n_products,), -1.0, device=DEVICE) if n_products else None
    partner2 = x_scale if n_products == 2 else None
    w_out, g_out = kg.launch_pair(kg.quantize_pair_config(w_cfg, g_cfg), w, None if w_mx else w_amax, g, None,
                                  b_seed=seeds[0], b_seed2=seeds[1], partner2=partner2, products=products)

    w_alone = kq.launch(w_cfg, w, None if w_mx else w_amax, None)
    alone_products = torch.full((n_products,), -2.0, device=DEVICE) if n_products else None
    partners = (w_alone[2], x_scale)[:n_products]
    g_alone = kq.launch(g_cfg, g, None, seeds[0], seed2=seeds[1],
                        **(dict(partners=partners, products=alone_products) if n_products else {}))
    _assert_same(w_out, w_alone)
    _assert_same(g_out, g_alone)
    if n_products:
        assert torch.equal(_as_int(products), _as_int(alone_products))
    if w_mx and n_products:
        assert torch.equal(products[0].cpu(), g_out[2].cpu())  # an MX W's scale is 1


@pytest.mark.parametrize("special", ["nan", "inf", "zero", "tiny"])
def test_the_partner_scale_computed_in_program_follows_the_scale_rules(special):
    """The first tensor's scale computed in the second's program is the one its own program writes in every
    case of the scale rule: a NaN amax (scale NaN), an Inf amax (NaN), an all-zero tensor (1), a subnormal amax
    (at least 2**-149); the product is the single launch's, bit for bit."""
    x = wide_sample((20, 32), seed=5).to(DEVICE)
    if special == "zero":
        x = torch.zeros_like(x)
    elif special == "tiny":
        x = torch.full_like(x, 2.0 ** -140)
    else:
        x[3, 7] = math.nan if special == "nan" else -math.inf
    w = wide_sample((24, 32), seed=6).to(DEVICE)
    x_cfg = _cfg(x, "nvfp4", both=True)
    w_cfg = _cfg(w, "nvfp4", write_amax=True, products=1)
    partials = kg.grouped_amax_partials(kg.grouped_amax_config(x_cfg, w_cfg), x, w)
    product = torch.empty(1, device=DEVICE)
    x_out, w_out = kg.launch_pair(kg.quantize_pair_config(x_cfg, w_cfg), x, None, w, None, a_partials=partials[0],
                                  b_partials=partials[1], products=product)
    alone = kq.launch(x_cfg, x, None, None)
    alone_product = torch.empty(1, device=DEVICE)
    kq.launch(w_cfg, w, None, None, partners=(alone[2],), products=alone_product)
    _assert_same(x_out, alone)
    assert torch.equal(_as_int(product), _as_int(alone_product))
    expected = {"nan": math.nan, "inf": math.nan, "zero": 1.0}.get(special)
    if expected is not None:
        assert (math.isnan(x_out[2].item()) if math.isnan(expected) else x_out[2].item() == expected)


def test_many_tiles_strided_operands():
    """More tiles than one program's worth in both tensors (several programs each side of the boundary), read
    through strides (a transposed view, a column slice)."""
    base = wide_sample((160, 200), seed=7)
    x = base.t().to(DEVICE)  # [200, 160], not contiguous
    w = base.to(torch.bfloat16)[3:150, 5:165].to(DEVICE)
    assert not x.is_contiguous() and not w.is_contiguous()
    x_cfg = _cfg(x, "nvfp4", both=True)
    w_cfg = _cfg(w, "nvfp4", write_amax=True, products=1)
    pair = kg.quantize_pair_config(x_cfg, w_cfg)
    assert pair.programs == x_cfg.grid[0] > 1 and pair.grid == (x_cfg.grid[0] + w_cfg.grid[0],)
    product, alone_product = torch.empty(1, device=DEVICE), torch.empty(1, device=DEVICE)
    x_out, w_out = kg.launch_pair(pair, x, None, w, None, products=product)
    x_alone = kq.launch(x_cfg, x, None, None)
    _assert_same(x_out, x_alone)
    _assert_same(w_out, kq.launch(w_cfg, w, None, None, partners=(x_alone[2],), products=alone_product))
    assert torch.equal(_as_int(product), _as_int(alone_product))


def test_the_configuration_is_worked_out_once_per_pair_and_checked():
    """One configuration object per pair of launch configurations (equal ones too); the first may write no
    products; a launch's products tensor and second partner must match the configuration."""
    a, b = torch.zeros(33, 64), torch.zeros(16, 64, dtype=torch.bfloat16)
    first, second = _cfg(a, "nvfp4", both=True), _cfg(b, "nvfp4", products=2)
    pair = kg.quantize_pair_config(first, second)
    assert kg.quantize_pair_config(first, second) is pair
    assert kg.quantize_pair_config(_cfg(a, "nvfp4", both=True), _cfg(b, "nvfp4", products=2)) is pair
    assert pair.first is first and pair.second is second
    assert "PRODUCTS_A" not in pair.constants and pair.constants["PRODUCTS_B"] == 2
    assert not {"STOCHASTIC_A", "DEQUANT_A", "DEQUANT_B", "STOCHASTIC_B"} & set(pair.constants)  # (fixed, per call)
    with pytest.raises(ValueError, match="first"):
        kg.quantize_pair_config(second, first)
    dequantizing = kq.cached_launch_config(16, 64, "nvfp4", 1, torch.float32, False, True, True)
    with pytest.raises(ValueError, match="second: dequantizes"):
        kg.quantize_pair_config(first, dequantizing)
    a, b = a.to(DEVICE), b.to(DEVICE)
    with pytest.raises(ValueError, match="products"):
        kg.launch_pair(pair, a, None, b, None, products=torch.empty(2, device=DEVICE))  # no second partner
    with pytest.raises(ValueError, match="products"):
        kg.launch_pair(pair, a, None, b, None, partner2=torch.ones((), device=DEVICE))  # no products tensor
    mx = kg.quantize_pair_config(_cfg(a, "mxfp8"), _cfg(b, "mxfp8"))
    with pytest.raises(ValueError, match="partials"):
        kg.launch_pair(mx, a, None, b, None, a_partials=torch.zeros(1, dtype=torch.int32, device=DEVICE))


COMPILE_CHECK = r"""
import re
import sys
try:
    from triton.backends.compiler import GPUTarget
    import triton.backends.nvidia  # noqa: F401
except ImportError as err:
    print("skip:", err)
    sys.exit(0)
import torch
import triton
from triton.compiler import ASTSource
from snip_ds.backend.kernels import grouped as kg, quantize as kq
ptr = {torch.bfloat16: "*i16", torch.float32: "*i32"}
out_ptr = {torch.bfloat16: "*i16", torch.float8_e4m3fn: "*u8"}
def side(in_dtype, out_dtype):  # one quantization's tensor, outputs, amax, shape and strides
    return [ptr[in_dtype], out_ptr[out_dtype], out_ptr[out_dtype], "*i32", "i32", "*fp32", "*fp32", "i32", "i32",
            "i32", "i32"]
pairs = [  # (first, second, their input dtypes, values dtype, STOCHASTIC_B)
    (kq.launch_config(64, 64, "fp8_e4m3", 1, torch.float8_e4m3fn, False, True, both=True),
     kq.launch_config(48, 64, "fp8_e4m3", 1, torch.float8_e4m3fn, False, False, write_amax=True),
     torch.bfloat16, torch.float32, torch.float8_e4m3fn, False),
    (kq.launch_config(64, 96, "nvfp4", 1, torch.bfloat16, False, True, both=True),
     kq.launch_config(48, 96, "nvfp4", 1, torch.bfloat16, False, True, write_amax=True, products=1),
     torch.bfloat16, torch.bfloat16, torch.bfloat16, False),
    (kq.launch_config(40, 64, "nvfp4", 0, torch.bfloat16, True, True, amax_given=True),
     kq.launch_config(64, 40, "nvfp4", 1, torch.bfloat16, False, True, both=True, products=2),
     torch.bfloat16, torch.bfloat16, torch.bfloat16, True),
    (kq.launch_config(40, 64, "mxfp8", 0, torch.bfloat16, True, False, amax_given=True),
     kq.launch_config(64, 40, "mxfp8", 1, torch.bfloat16, False, False, both=True),
     torch.float32, torch.float32, torch.bfloat16, False),
]
for first, second, a_dtype, b_dtype, out_dtype, stochastic in pairs:
    pair = kg.quantize_pair_config(first, second)
    const = dict(pair.constants, STOCHASTIC_B=stochastic)
    runtime = [name for name in kg._grouped_quantize_kernel.arg_names if name not in const]
    types = side(a_dtype, out_dtype) + side(b_dtype, out_dtype) + ["*i64", "*i64", "*fp32", "*fp32", "i32"]
    sig = dict(zip(runtime, types), **{name: "constexpr" for name in const})
    assert len(sig) == len(kg._grouped_quantize_kernel.arg_names)
    compiled = triton.compile(ASTSource(kg._grouped_quantize_kernel, sig, constexprs=const),
                              target=GPUTarget("cuda", 90, 32))
    assert not re.search(r"div\.(full|approx)|\.ftz", compiled.asm["ptx"]), out_dtype  # IEEE division, subnormals
print("ok")
"""


@pytest.mark.slow
def test_the_grouped_kernel_compiles_for_cuda_without_a_gpu():
    """Triton's compiler (to a Hopper cubin, no GPU needed) accepts the grouped quantization kernel: per-tensor
    FP8 codes, NVFP4 with one and two products (stochastic), MX; its PTX divides with IEEE division and flushes
    no subnormals (what bit-exactness on a GPU needs). In a subprocess, where Triton is not in interpreter
    mode."""
    compile_check(COMPILE_CHECK, timeout=900)
