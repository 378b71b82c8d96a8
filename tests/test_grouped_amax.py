"""One launch for two tensors' amax passes (``grouped._grouped_amax_kernel``: a layer's X and W in forward).

Max is exact and order-free, so the grouped launch must write each tensor's partial maxima exactly as that
tensor's own amax pass writes them, and a quantization reducing them must equal one that ran its own pass, bit
for bit. Interpreted on CPU tensors here (compiled on a CUDA GPU, as tests/triton_mode.py decides); a
subprocess compiles the kernel for a Hopper GPU without one.
"""
import math

import pytest
import torch

from quant_inputs import wide_sample
from triton_mode import DEVICE, SKIP_REASON, compile_check, interpreter_on, kg, kq  # noqa: F401 (a fixture)

if SKIP_REASON:
    pytest.skip(SKIP_REASON, allow_module_level=True)


def _cfg(t: torch.Tensor, recipe: str = "nvfp4", amax_given: bool = False):
    """The configuration of ``t``'s quantization along axis 1 (BF16 values)."""
    return kq.launch_config(*t.shape, recipe, 1, torch.bfloat16, False, t.dtype == torch.bfloat16,
                            amax_given=amax_given)


def _grouped(a: torch.Tensor, b: torch.Tensor):
    """The grouped launch's partial maxima of ``a`` and ``b`` (on the kernels' device; ``a``'s the first slots
    of the buffer returned for them), and their configs."""
    a, b = a.to(DEVICE), b.to(DEVICE)
    cfg_a, cfg_b = _cfg(a), _cfg(b)
    buffer, parts_b = kg.grouped_amax_partials(kg.grouped_amax_config(cfg_a, cfg_b), a, b)
    # one buffer, a's slots first (the buffer itself stands for them), b's the rest
    assert buffer.numel() == cfg_a.amax_programs + cfg_b.amax_programs and parts_b.numel() == cfg_b.amax_programs
    assert parts_b.data_ptr() == buffer.data_ptr() + 4 * cfg_a.amax_programs
    return buffer[:cfg_a.amax_programs], parts_b, cfg_a, cfg_b


def _own(t: torch.Tensor, cfg) -> torch.Tensor:
    """The partial maxima of ``t``'s own amax pass (on the kernels' device)."""
    t = t.to(DEVICE)
    return kq._amax_partials(t.view(cfg.in_view), cfg)


def _as_amax(partials: torch.Tensor) -> torch.Tensor:
    """Stage 2 on the host: the FP32 amax from int32 partial maxima."""
    return partials.cpu().view(torch.float32).amax()


def _assert_amax(partials: torch.Tensor, t: torch.Tensor) -> None:
    expected = t.float().abs().amax()
    actual = _as_amax(partials)
    if expected.isnan():
        assert actual.isnan()
    else:
        assert torch.equal(actual, expected), (actual, expected)


# odd shapes: single rows and columns, tile edges crossed, more tiles than the 512 programs (two tiles each)
PAIRS = [((33, 70), (70, 17)), ((1, 45), (37, 1)), ((1, 64 * 600), (130, 200)), ((64, 64), (1, 1))]


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("shapes", PAIRS)
def test_each_tensors_partials_are_its_own_pass(shapes, dtypes):
    """Each tensor's slice of the buffer holds the integers its own amax pass writes (so stage 2 reduces the
    same maximum), whose max is torch's ``x.abs().amax()`` -- for any mix of shapes, tiles and dtypes."""
    a, b = (wide_sample(shape, seed=i).to(dtype) for i, (shape, dtype) in enumerate(zip(shapes, dtypes)))
    parts_a, parts_b, cfg_a, cfg_b = _grouped(a, b)
    assert torch.equal(parts_a.cpu(), _own(a, cfg_a).cpu()) and torch.equal(parts_b.cpu(), _own(b, cfg_b).cpu())
    _assert_amax(parts_a, a)
    _assert_amax(parts_b, b)


def test_a_transposed_and_a_strided_operand():
    """Operands read through their strides: a transposed view and a column slice of a wider tensor."""
    base = wide_sample((90, 140), seed=3)
    a, b = base.t(), base.to(torch.bfloat16)[5:70, 7:120:3]
    assert not a.is_contiguous() and not b.is_contiguous()
    parts_a, parts_b, _, _ = _grouped(a, b)
    _assert_amax(parts_a, a)
    _assert_amax(parts_b, b)


def test_nan_and_inf_propagate_to_their_own_tensor_only():
    """A NaN in one tensor makes its amax NaN (above an Inf), not the other's; an Inf is the amax; a signed
    zero tensor has amax +0."""
    a, b = wide_sample((40, 50), seed=5), wide_sample((20, 30), seed=6).to(torch.bfloat16)
    a[7, 9], a[30, 1] = -math.inf, math.nan
    b[3, 4] = -math.inf
    parts_a, parts_b, _, _ = _grouped(a, b)
    assert _as_amax(parts_a).isnan() and _as_amax(parts_b).item() == math.inf
    parts_a, parts_b, _, _ = _grouped(torch.full((3, 5), -0.0), b)
    assert _as_amax(parts_a).item() == 0.0 and not _as_amax(parts_a).signbit()


@pytest.mark.parametrize("recipe", ["nvfp4", "nvfp4_2d", "fp8_e4m3"])
def test_quantizations_reducing_grouped_partials_equal_their_own_passes(recipe):
    """:func:`kq.launch` with ``partials`` from the grouped launch: the same values, scale and amax bit for bit
    as the launch that runs its own amax pass."""
    x = wide_sample((70, 96), seed=8).to(DEVICE, torch.bfloat16)
    w = wide_sample((48, 96), seed=9).to(DEVICE)
    cfgs = [kq.launch_config(*t.shape, recipe, 1, torch.bfloat16, False, t.dtype == torch.bfloat16,
                             write_amax=True) for t in (x, w)]
    partials = kg.grouped_amax_partials(kg.grouped_amax_config(*cfgs), x, w)
    for t, cfg, parts in zip((x, w), cfgs, partials):
        grouped, _, scale, amax = kq.launch(cfg, t, None, None, partials=parts)
        alone, _, scale_alone, amax_alone = kq.launch(cfg, t, None, None)
        assert torch.equal(grouped.view(torch.int16), alone.view(torch.int16))
        assert torch.equal(scale, scale_alone) and torch.equal(amax, amax_alone)
        assert torch.equal(amax.cpu(), t.float().abs().amax().cpu())


def test_the_configuration_is_worked_out_once_per_pair_and_only_for_amax_passes():
    """One configuration object per pair of quantizations; none where a quantization takes no amax pass (an
    MX recipe, or the tensor amax given); ``partials`` refused where the quantization reduces none."""
    a, b = torch.zeros(33, 70), torch.zeros(70, 17, dtype=torch.bfloat16)
    cfg = kg.grouped_amax_config(_cfg(a), _cfg(b))
    assert kg.grouped_amax_config(_cfg(a), _cfg(b)) is cfg
    assert cfg.grid == (sum(cfg.programs),)
    with pytest.raises(ValueError, match="second"):
        kg.grouped_amax_config(_cfg(a), _cfg(b, "mxfp8"))
    with pytest.raises(ValueError, match="first"):
        kg.grouped_amax_config(_cfg(a, amax_given=True), _cfg(b))
    with pytest.raises(ValueError, match="partials"):
        kq.launch(_cfg(b, "mxfp8"), b.to(DEVICE), None, None, partials=torch.zeros(1, dtype=torch.int32))


COMPILE_CHECK = r"""
import sys
try:
    from triton.backends.compiler import GPUTarget
    import triton.backends.nvidia  # noqa: F401
except ImportError as err:
    print("skip:", err)
    sys.exit(0)
import triton
from triton.compiler import ASTSource
from snip_ds.backend.kernels import grouped as kg
ptr = {True: "*i16", False: "*i32"}
for bf16_a, bf16_b, tiles_a, tiles_b in ((True, False, 1, 1), (False, True, 16, 2), (True, True, 1, 4)):
    const = dict(A_BF16=bf16_a, BRA=64, BCA=64, TILES_A=tiles_a, B_BF16=bf16_b, BRB=16, BCB=64, TILES_B=tiles_b)
    sig = {"a_ptr": ptr[bf16_a], "b_ptr": ptr[bf16_b], "partials_ptr": "*i32",
           **{name: "i32" for name in ("RA", "CA", "stride_ra", "stride_ca", "RB", "CB", "stride_rb",
                                       "stride_cb", "PA", "PB")},
           **{name: "constexpr" for name in const}}
    triton.compile(ASTSource(kg._grouped_amax_kernel, sig, constexprs=const), target=GPUTarget("cuda", 90, 32))
print("ok")
"""


@pytest.mark.slow
def test_the_grouped_kernel_compiles_for_cuda_without_a_gpu():
    """Triton's compiler (to a Hopper cubin, no GPU needed) accepts the grouped kernel: both branches, mixed
    dtypes and tiles per program. In a subprocess, where Triton is not in interpreter mode."""
    compile_check(COMPILE_CHECK, timeout=600)
