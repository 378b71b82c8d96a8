"""The ``te`` backend (snip_ds/backend/te.py): its errors, its wiring, and on a GPU its numerics.

Three groups:

* errors, on any machine: Transformer Engine that does not import, a version outside the supported range, a
  device that is not CUDA and a recipe TE cannot express (``launch/train.py`` stopping with one error line is
  tests/test_train_errors.py's ``snip_quant_backend_te`` case);
* wiring, on any machine: the backend driven by a stand-in for Transformer Engine whose quantizers are the
  reference's (snip_ds.quant) and whose GEMM follows ``general_gemm``'s documented layout convention (A, B,
  "TN"/"NN"/"NT", column-major; transformer_engine/pytorch/cpp_extensions/gemm.py and module/linear.py,
  v2.9). It checks what this machine can: which operand gets which quantizer, usage and axis, the GEMM
  layouts and operand order, the padding and cropping, the bias, the Hadamard transform, the quantizer
  cache across recipe changes, and which quantizations are seeded from the layer's generator. TE's own
  numerics are not in it;
* numerics, on a CUDA GPU with Transformer Engine (skipped elsewhere, as here): the real quantizers and
  GEMMs against the emulated backend (module docstring of te.py for where TE's recipes differ, and the
  floors derived from that).
"""
import contextlib
import dataclasses
import math
import sys
import types

import pytest
import torch

from snip_ds.backend import BackendError, get_backend, resolve
from snip_ds.backend import te as te_mod
from snip_ds.backend.emulated import EmulatedBackend, reference_operands
from snip_ds.formats import E4M3, round_to_format
from snip_ds.linear import SnipLinear
from snip_ds.quant import fake_quantize
from snip_ds.quant_config import QuantConfig

pytestmark = pytest.mark.te

EMULATED = EmulatedBackend()
GEMMS = ("fprop", "dgrad", "wgrad")


def _te_imports() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


# ----------------------------------------------------------------------------------------------------------
# errors (any machine)
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", ["2.8.0", "2.8.99", "2.20.0", "2.21.1", "3.0.0"])
def test_versions_outside_the_range_are_refused_naming_version_and_range(version):
    problem = te_mod.version_problem(version)
    assert problem is not None and f"version {version}" in problem and ">=2.9,<2.20" in problem


@pytest.mark.parametrize("version", ["2.9.0", "2.9.0+cu12", "2.12.1", "2.19.0", "2.20.0.dev0"])
def test_versions_inside_the_range_are_accepted(version):
    assert te_mod.version_problem(version) is None  # (2.20.0.dev0, a development version of 2.20, sorts below)


def test_a_version_that_is_not_a_number_is_refused():
    assert "'unknown'" in te_mod.version_problem("unknown")
    assert "no version number" in te_mod.version_problem(None)


@pytest.mark.skipif(_te_imports(), reason="Transformer Engine imports here")
def test_without_transformer_engine_the_import_failure_is_named(monkeypatch):
    monkeypatch.setattr(te_mod, "_backend", None)
    with pytest.raises(BackendError, match=r"^backend 'te': Transformer Engine does not import \(ModuleNotFound"
                                           r"Error: No module named 'transformer_engine'\); install it"):
        get_backend("te")
    with pytest.raises(BackendError, match=r"^backend 'te' cannot run fp8_hybrid on cuda: Transformer Engine "
                                           r"does not import"):
        resolve("te", "fp8", QuantConfig(backend="te"), "cuda")


def test_a_version_outside_the_range_is_an_error_when_the_backend_loads(monkeypatch):
    monkeypatch.setattr(te_mod, "_backend", None)
    monkeypatch.setitem(sys.modules, "transformer_engine", types.SimpleNamespace(__version__="2.8.1"))
    with pytest.raises(BackendError, match=r"^backend 'te': the installed Transformer Engine is version 2.8.1; "
                                           r"this backend supports Transformer Engine >=2.9,<2.20"):
        get_backend("te")


def test_a_supported_version_whose_pytorch_part_does_not_import_is_an_error(monkeypatch):
    monkeypatch.setattr(te_mod, "_backend", None)
    monkeypatch.setitem(sys.modules, "transformer_engine", types.SimpleNamespace(__version__="2.9.0"))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)  # import raises ImportError
    with pytest.raises(BackendError, match=r"^backend 'te': Transformer Engine 2.9.0 does not import "
                                           r"\((ModuleNotFound|Import)Error: import of transformer_engine"):
        get_backend("te")


def test_te_on_the_cpu_names_the_device():
    with pytest.raises(BackendError, match=r"^backend 'te' cannot run fp8_hybrid on cpu: Transformer Engine "
                                           r"runs on CUDA devices only"):
        resolve("te", "fp8", QuantConfig(backend="te"), "cpu")
    layer = SnipLinear.from_linear(torch.nn.Linear(32, 16), "fp4", QuantConfig(backend="te"))
    with pytest.raises(BackendError, match=r"cannot run nvfp4 \(2-D weight blocks\) on cpu"):
        layer(torch.randn(4, 32))
    with pytest.raises(BackendError, match="cannot run mxfp8 on cpu: Transformer Engine runs on CUDA"):
        te_mod.TEBackend(None, "2.9.0").check("fp8", QuantConfig(fp8_recipe="mxfp8"), torch.device("cpu"))


def test_mxfp4_is_refused_naming_backend_recipe_and_device():
    with pytest.raises(BackendError, match=r"^backend 'te' cannot run mxfp4 on cuda:0: Transformer Engine 2.9.0 "
                                           r"has no MXFP4 quantizer"):
        te_mod.TEBackend(None, "2.9.0").check("fp4", QuantConfig(fp4_recipe="mxfp4"), torch.device("cuda:0"))


def test_a_recipe_the_gpu_lacks_is_refused_with_te_s_reason(monkeypatch):
    _no_cuda_context(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    fake = FakeTE()
    fake.available["nvfp4"] = lambda return_reason: (False, "Device compute capability 10.0 or higher required "
                                                            "for NVFP4 execution.")
    backend = te_mod.TEBackend(fake, "2.9.0")
    with pytest.raises(BackendError, match=r"^backend 'te' cannot run nvfp4 \(2-D weight blocks\) on cuda:0 "
                                           r"\(NVIDIA H100 80GB HBM3\): Transformer Engine 2.9.0 says: Device "
                                           r"compute capability 10.0"):
        backend.check("fp4", QuantConfig(), torch.device("cuda:0"))
    backend.check("fp8", QuantConfig(), torch.device("cuda:0"))  # fp8_hybrid: available


# ----------------------------------------------------------------------------------------------------------
# wiring (any machine): a stand-in for Transformer Engine with the reference's quantizers
# ----------------------------------------------------------------------------------------------------------

class FakeQuantized:
    """What a TE quantizer returns, as this backend uses it: data for the row-wise usage (blocks along the last
    axis) and/or the column-wise usage (blocks along the first axis); None where not quantized."""

    def __init__(self, rowwise, columnwise):
        self.rowwise, self.columnwise = rowwise, columnwise


class FakeQuantizer:
    def __init__(self, recipe: str, log: tuple, rowwise: bool, columnwise: bool, **settings):
        self.recipe, self.rowwise, self.columnwise, self.settings = recipe, rowwise, columnwise, settings
        made, self.used = log
        made.append(self)

    def __call__(self, t):
        assert t.shape[0] % 32 == 0 and t.shape[1] % 32 == 0, t.shape  # TE's quantizers need multiples of 32
        self.used.append(self)
        q = lambda axis: fake_quantize(t.float(), self.recipe, axis=axis)  # noqa: E731
        return FakeQuantized(q(-1) if self.rowwise else None, q(0) if self.columnwise else None)


class FakeTE:
    """Stands in for ``_TEModules``: the quantizer classes, the availability checks, the dtypes, general_gemm."""

    E4M3, E5M2 = "kFloat8E4M3", "kFloat8E5M2"

    def __init__(self, workspace: bool = False):
        self.made: list = []  # every quantizer built, in order
        self.used: list = []  # every quantization, by quantizer
        self.gemms: list = []
        self.available = {r: (lambda return_reason: (True, "")) for r in ("fp8_hybrid", "mxfp8", "nvfp4")}
        self.get_workspace = (lambda: "workspace") if workspace else None
        made = (self.made, self.used)

        def float8_current(fp8_dtype, device, *, rowwise=True, columnwise=True):
            recipe = {self.E4M3: "fp8_e4m3", self.E5M2: "fp8_e5m2"}[fp8_dtype]
            return FakeQuantizer(recipe, made, rowwise, columnwise, kind="fp8_current", device=device)

        def mxfp8(fp8_dtype, *, rowwise=True, columnwise=True):
            assert fp8_dtype == self.E4M3
            return FakeQuantizer("mxfp8", made, rowwise, columnwise, kind="mxfp8")

        def nvfp4(rowwise=True, columnwise=True, with_rht=False, with_post_rht_amax=False,
                  with_2d_quantization=False, stochastic_rounding=False):
            return FakeQuantizer("nvfp4_2d" if with_2d_quantization else "nvfp4", made, rowwise, columnwise,
                                 kind="nvfp4", with_rht=with_rht, with_post_rht_amax=with_post_rht_amax,
                                 with_2d_quantization=with_2d_quantization, stochastic_rounding=stochastic_rounding)

        self.Float8CurrentScalingQuantizer, self.MXFP8Quantizer, self.NVFP4Quantizer = float8_current, mxfp8, nvfp4

    def general_gemm(self, A, B, *args, out_dtype, layout, bias, use_split_accumulator, grad):
        """TE's convention (cpp_extensions/gemm.py, module/linear.py): column-major ``D = op(A) op(B)``; in
        row-major terms ``out = op(B) @ op(A)`` with op(A) = A^T for "T" (A's row-wise data), A for "N"
        (A's column-wise data), op(B) = B^T for "T" (B's column-wise data), B for "N" (B's row-wise data):
        TN ``X W^T``, NN ``G W``, NT ``G^T X``."""
        assert args == ((("workspace",) if self.get_workspace else ()))
        assert use_split_accumulator is True  # FP32 accumulation
        self.gemms.append((layout, grad))
        trans_a, trans_b = layout[0] == "T", layout[1] == "T"
        a = A.rowwise if trans_a else A.columnwise
        b = B.columnwise if trans_b else B.rowwise
        assert a is not None and b is not None, f"{layout}: an operand lacks the usage TE reads"
        out = (b.t() if trans_b else b) @ (a.t() if trans_a else a)
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype), None, None, None


def _no_cuda_context(monkeypatch):
    monkeypatch.setattr(te_mod, "_on", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(te_mod, "_index", lambda device: 0)


@pytest.fixture
def fake(monkeypatch):
    _no_cuda_context(monkeypatch)
    seeded = []

    @contextlib.contextmanager
    def record(device, generator):
        seeded.append(generator)
        yield
    monkeypatch.setattr(te_mod, "_seeded_cuda_rng", record)
    modules = FakeTE()
    return te_mod.TEBackend(modules, "2.9.0"), modules, seeded


def _operands(tokens=40, k=72, n=48, seed=0):
    """Shapes that are not multiples of 32 (the padding is exercised), outlier input channels."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=gen)
    x[:, :3] *= 20
    return x, torch.randn(n, k, generator=gen) * 0.05, torch.randn(tokens, n, generator=gen) * 1e-3


def _run(backend, gemm, x, w, g, precision, cfg, generator=None, **kw):
    if gemm == "fprop":
        return backend.fprop(x, w, precision, cfg, **kw)
    if gemm == "dgrad":
        return backend.dgrad(g, w, precision, cfg, generator, **kw)
    return backend.wgrad(g, x, precision, cfg, generator, **kw)


def _within_accumulation_error(actual, expected, gemm, x, w, g, precision, cfg, generator_state=None, extra=0.0):
    """|actual - expected| within twice the FP32 accumulation bound ``k u sum|a||b|`` of the reference's
    quantized operands (both sides are FP32 GEMMs of the same operands, summed in different orders)."""
    a, b = {"fprop": (x, w), "dgrad": (g, w), "wgrad": (g, x)}[gemm]
    gen = None
    if generator_state is not None:
        gen = torch.Generator()
        gen.set_state(generator_state)
    pa, pb = reference_operands(gemm, a, b, precision, cfg, gen)
    qa, qb = (pa.values * pa.tensor_scale).double().abs(), (pb.values * pb.tensor_scale).double().abs()
    mag = {"fprop": lambda: qa @ qb.t(), "dgrad": lambda: qa @ qb, "wgrad": lambda: qa.t() @ qb}[gemm]()
    depth = {"fprop": x.shape[1], "dgrad": w.shape[0], "wgrad": x.shape[0]}[gemm] + 32  # + zero padding
    bound = 2 * depth * 2.0 ** -24 * mag + extra + 1e-30
    assert actual.shape == expected.shape
    assert bool(((actual.double() - expected.double()).abs() <= bound).all())


CASES = [("fp8", QuantConfig(fp8_recipe="fp8_hybrid")), ("fp8", QuantConfig(fp8_recipe="mxfp8")),
         ("fp4", QuantConfig(stochastic_rounding=False)),
         ("fp4", QuantConfig(stochastic_rounding=False, weight_2d=False)),
         ("fp4", QuantConfig(stochastic_rounding=False, hadamard=True))]


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("precision,cfg", CASES, ids=lambda c: c if isinstance(c, str) else
                         f"{c.fp8_recipe}-{c.fp4_recipe}-2d{int(c.weight_2d)}-h{int(c.hadamard)}")
def test_wiring_gives_the_reference_gemms(fake, gemm, precision, cfg):
    backend, modules, _ = fake
    x, w, g = _operands()
    gen = torch.Generator().manual_seed(3)
    state = gen.get_state()
    actual = _run(backend, gemm, x, w, g, precision, cfg, gen)
    gen.set_state(state)  # the same Hadamard signs for the reference
    expected = _run(EMULATED, gemm, x, w, g, precision, cfg, gen)
    _within_accumulation_error(actual, expected, gemm, x, w, g, precision, cfg, state)
    layout = {"fprop": "TN", "dgrad": "NN", "wgrad": "NT"}[gemm]
    assert modules.gemms == [(layout, gemm != "fprop")]


def test_wiring_quantizers_roles_usages_and_cache(fake):
    backend, modules, seeded = fake
    x, w, g = _operands()
    cfg = QuantConfig(fp8_recipe="fp8_hybrid")
    for gemm in GEMMS:
        _run(backend, gemm, x, w, g, "fp8", cfg)
    # (recipe, row-wise, column-wise) of each quantizer made: fprop X and W row-wise E4M3; dgrad G row-wise
    # E5M2, W column-wise E4M3; wgrad G column-wise E5M2, X column-wise E4M3 (X and W share E4M3 quantizers)
    assert [(q.recipe, q.rowwise, q.columnwise) for q in modules.made] == [
        ("fp8_e4m3", True, False), ("fp8_e5m2", True, False), ("fp8_e4m3", False, True),
        ("fp8_e5m2", False, True)]
    for gemm in GEMMS:  # the same settings again: no new quantizer
        _run(backend, gemm, x, w, g, "fp8", cfg)
    assert len(modules.made) == 4
    nv = QuantConfig(stochastic_rounding=True, weight_2d=True)
    for gemm in GEMMS:
        _run(backend, gemm, x, w, g, "fp4", nv, torch.Generator().manual_seed(0))
    new = modules.made[4:]
    assert all(q.settings["with_rht"] is False and q.settings["with_post_rht_amax"] is False for q in new)
    two_d = {(q.rowwise, q.settings["with_2d_quantization"], q.settings["stochastic_rounding"]) for q in new}
    # X: 1-D, nearest; W: 2-D, nearest; G: 1-D, stochastic; each in the usages the GEMMs read
    assert two_d == {(True, False, False), (True, True, False), (False, True, False), (True, False, True),
                     (False, False, True), (False, False, False)}
    assert len(seeded) == 2  # G_Y in dgrad and in wgrad: seeded from the layer's generator; X and W never
    # a recipe change picks other quantizers (TE's never change recipe): 1-D weights, nearest gradients
    before = len(modules.used)
    _run(backend, "dgrad", x, w, g, "fp4", QuantConfig(stochastic_rounding=False, weight_2d=False))
    used = modules.used[before:]
    assert [(q.recipe, q.rowwise, q.settings["stochastic_rounding"]) for q in used] == [
        ("nvfp4", True, False), ("nvfp4", False, False)]  # G_Y row-wise, W column-wise
    assert len(seeded) == 2


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_wiring_bias_fused_or_added_in_fp32(fake, out_dtype):
    backend, modules, _ = fake
    x, w, _ = _operands()
    bias = torch.randn(w.shape[0]).to(out_dtype)
    cfg = QuantConfig()
    actual = backend.fprop(x, w, "fp8", cfg, bias=bias, out_dtype=out_dtype)
    expected = EMULATED.fprop(x, w, "fp8", cfg, bias=bias, out_dtype=out_dtype)
    assert actual.dtype == out_dtype
    if out_dtype == torch.float32:  # + one FP32 rounding of the bias addition on each side
        _within_accumulation_error(actual, expected, "fprop", x, w, None, "fp8", cfg,
                                   extra=2 * 2.0 ** -24 * expected.double().abs())
    else:  # both round the same FP32 sum to BF16: at most one BF16 ulp apart where the sums differ slightly
        assert bool(((actual.float() - expected.float()).abs() <= expected.float().abs() * 2.0 ** -7 + 1e-6).all())


def test_wiring_passes_the_workspace_that_te_2_9_wants(monkeypatch):
    _no_cuda_context(monkeypatch)
    modules = FakeTE(workspace=True)
    x, w, g = _operands()
    out = te_mod.TEBackend(modules, "2.9.0").fprop(x, w, "fp8", QuantConfig())
    assert out.shape == (x.shape[0], w.shape[0])


def test_bf16_gemms_need_no_quantizer(fake):
    backend, modules, _ = fake
    x, w, g = _operands()
    for gemm in GEMMS:
        out = _run(backend, gemm, x, w, g, "bf16", QuantConfig())
        ref = _run(EMULATED, gemm, x, w, g, "bf16", QuantConfig())
        torch.testing.assert_close(out, ref, rtol=2 ** -20, atol=1e-9)
    assert modules.made == [] and modules.gemms == []


# ----------------------------------------------------------------------------------------------------------
# numerics on a CUDA GPU with Transformer Engine (skipped here)
# ----------------------------------------------------------------------------------------------------------

needs_te_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and _te_imports()),
                                  reason="needs a CUDA GPU and Transformer Engine")
T, K, N = 256, 512, 384


def sqnr_db(ref: torch.Tensor, actual: torch.Tensor) -> float:
    ref, actual = ref.double(), actual.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - actual).pow(2).sum().clamp_min(1e-300)))


@pytest.fixture(scope="module")
def te_backend():
    return get_backend("te")  # a version outside the range fails here, naming it


def _require(backend, precision, cfg):
    try:
        backend.check(precision, cfg, torch.device("cuda"))
    except BackendError as err:
        pytest.skip(str(err))


@pytest.fixture
def cuda_operands():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, K, device="cuda", generator=gen)
    x[:, :8] *= 20  # outlier channels
    x *= torch.exp(torch.randn(1, K, device="cuda", generator=gen))  # block amaxes spread over binades
    w = torch.randn(N, K, device="cuda", generator=gen) * 0.02
    g = torch.randn(T, N, device="cuda", generator=gen) * 1e-3
    return x, w, g


def _exact(gemm, x, w, g):
    x, w, g = x.double(), w.double(), g.double()
    return {"fprop": lambda: x @ w.t(), "dgrad": lambda: g @ w, "wgrad": lambda: g.t() @ x}[gemm]()


# The floor against the emulated backend, where TE's recipe is the reference's up to FP32 roundings
# (fp8_hybrid, nvfp4 with nearest rounding): an operand element differs only when it lies within a few FP32
# roundings of a rounding boundary (probability ~1e-5 per element), each such element costs at most one grid
# step; the rest is FP32 accumulation order (~1e-7 relative). Below 40 dB would take ~1e-4 of the elements
# off by a whole step: 10x more than the boundaries allow.
FLOOR_DB = 40.0


@pytest.mark.gpu
@needs_te_gpu
@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("precision,cfg", [("fp8", QuantConfig()), ("fp4", QuantConfig(stochastic_rounding=False)),
                                           ("fp4", QuantConfig(stochastic_rounding=False, weight_2d=False)),
                                           ("fp4", QuantConfig(stochastic_rounding=False, hadamard=True))])
@pytest.mark.parametrize("shape", [(T, K, N), (100, 200, 72)])  # the second is padded to multiples of 32
def test_gpu_gemms_match_the_emulated_backend(te_backend, cuda_operands, gemm, precision, cfg, shape):
    _require(te_backend, precision, cfg)
    x, w, g = cuda_operands
    tokens, k, n = shape
    x, w, g = x[:tokens, :k].contiguous(), w[:n, :k].contiguous(), g[:tokens, :n].contiguous()
    gen = torch.Generator(device="cuda").manual_seed(1)
    state = gen.get_state()
    actual = _run(te_backend, gemm, x, w, g, precision, cfg, gen)
    gen.set_state(state)  # the same Hadamard signs
    expected = _run(EMULATED, gemm, x, w, g, precision, cfg, gen)
    assert sqnr_db(expected, actual) >= FLOOR_DB


def _te_mxfp8_reference(t: torch.Tensor) -> torch.Tensor:
    """MXFP8 with TE's block scale, along the last axis: ``2**ceil(log2(amax_b * fl(1/448)))`` (``float_to_e8m0``,
    round up, of ``amax * max_norm_rcp``, transformer_engine/common/util/ptx.cuh and cast_kernels.cuh), then the
    elements RNE to E4M3 (exact division by a power of two)."""
    blocks = t.float().reshape(t.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    v = amax * torch.tensor(1.0 / 448.0, dtype=torch.float32, device=t.device)
    mant, exp = torch.frexp(v)  # v = mant * 2**exp, mant in [0.5, 1): log2 v is an integer when mant == 0.5
    exp = torch.where(mant == 0.5, exp - 1, exp).clamp(-127, 127)
    scale = torch.where(amax > 0, torch.ldexp(torch.ones_like(v), exp), torch.full_like(v, 2.0 ** -127))
    return (round_to_format(blocks / scale, E4M3) * scale).reshape(t.shape)


@pytest.mark.gpu
@needs_te_gpu
def test_gpu_mxfp8_operands_are_te_s_rule_and_differ_from_ours_only_where_documented(te_backend, cuda_operands):
    cfg = QuantConfig(fp8_recipe="mxfp8")
    _require(te_backend, "fp8", cfg)
    x, _, _ = cuda_operands
    for t in (x, x.t().contiguous()):  # blocks along k, and along the tokens (the wgrad axis)
        te_values = te_backend.quantize(t, "fp8", cfg, "x", rowwise=True).dequantize(dtype=torch.float32)
        assert torch.equal(te_values, _te_mxfp8_reference(t))  # exact: power-of-two scales
        ours = fake_quantize(t, "mxfp8", axis=-1)
        # the two rules agree in every block whose amax significand is at most 1.75 (448 / 256)
        amax = t.reshape(t.shape[0], -1, 32).abs().amax(dim=-1, keepdim=True)
        mant, _ = torch.frexp(amax)  # amax = mant * 2**e, mant in [0.5, 1): significand 2 * mant
        # (blocks within 2**-20 of the boundary left out: TE scales fl(amax * fl(1/448)), not amax / 448)
        same_rule = (2 * mant <= 1.75 * (1 - 2.0 ** -20)).expand(-1, -1, 32).reshape(t.shape)
        assert torch.equal(te_values[same_rule], ours[same_rule])
        assert not torch.equal(te_values, ours)  # and the data has blocks where they differ


@pytest.mark.gpu
@needs_te_gpu
@pytest.mark.parametrize("gemm", GEMMS)
def test_gpu_mxfp8_gemms(te_backend, cuda_operands, gemm):
    """Against the product of TE-rule operands (exact in FP32 operands, so FLOOR_DB is far below what the FP32
    accumulation gives), and against the unquantized product no worse than the reference's recipe by more than
    3 dB: TE's scale is at most twice the reference's (one binade), in the blocks with an amax significand
    above 1.75 (about a fifth of them for log-uniform amaxes), which doubles their quantum (4x noise) there
    while sparing their saturation: noise <= (1 - f + 4 f) = 1.6x for f = 1/5, 2 dB, + 1 dB for the spread
    of f in these data."""
    cfg = QuantConfig(fp8_recipe="mxfp8")
    _require(te_backend, "fp8", cfg)
    x, w, g = cuda_operands
    actual = _run(te_backend, gemm, x, w, g, "fp8", cfg)
    along = {"fprop": (x, w), "dgrad": (g, w.t().contiguous()), "wgrad": (g.t().contiguous(), x.t().contiguous())}
    a, b = (_te_mxfp8_reference(t) for t in along[gemm])  # both along the contraction axis (the last)
    te_rule = (a.double() @ b.double().t())
    assert sqnr_db(te_rule, actual) >= FLOOR_DB
    exact = _exact(gemm, x, w, g)
    emulated = _run(EMULATED, gemm, x, w, g, "fp8", cfg)
    assert sqnr_db(exact, actual) >= sqnr_db(exact, emulated) - 3.0


@pytest.mark.gpu
@needs_te_gpu
@pytest.mark.parametrize("recipe,role,cfg", [("fp8_e4m3", "x", QuantConfig()), ("fp8_e5m2", "g", QuantConfig()),
                                             ("nvfp4", "x", QuantConfig()), ("nvfp4_2d", "w", QuantConfig()),
                                             ("nvfp4", "w", QuantConfig(weight_2d=False))])
def test_gpu_operands_match_the_reference_up_to_fp32_roundings(te_backend, cuda_operands, recipe, role, cfg):
    """fp8_hybrid and nvfp4 compute the reference's scales with other FP32 roundings (te.py's docstring), so
    the dequantized operands agree to a few FP32 ulps (the scale products), except where an element or a
    block amax lies within a few FP32 roundings of a rounding boundary: ~1e-5 of them; allowed 1e-3."""
    precision = "fp8" if recipe.startswith("fp8") else "fp4"
    cfg = QuantConfig(stochastic_rounding=False, weight_2d=cfg.weight_2d)
    _require(te_backend, precision, cfg)
    x, w, g = cuda_operands
    t = {"x": x, "w": w, "g": g}[role]
    te_values = te_backend.quantize(t, precision, cfg, role, rowwise=True).dequantize(dtype=torch.float32)
    ours = fake_quantize(t, recipe, axis=-1)
    close = (te_values - ours).abs() <= ours.abs() * 2.0 ** -20
    assert float((~close).float().mean()) <= 1e-3


@pytest.mark.gpu
@needs_te_gpu
@pytest.mark.parametrize("gemm", ["dgrad", "wgrad"])
def test_gpu_stochastic_rounding_follows_the_layer_generator(te_backend, cuda_operands, gemm):
    """Same generator state, same rounding; the generator moves on, other rounding; the global CUDA random
    state untouched. TE's draws are not the reference's, but their error is the same in distribution: against
    the unquantized product within 1 dB of the reference's (the measured noise powers of two independent
    draws over ~1e5 outputs agree to far better than that)."""
    cfg = QuantConfig(stochastic_rounding=True)
    _require(te_backend, "fp4", cfg)
    x, w, g = cuda_operands
    gen = torch.Generator(device="cuda").manual_seed(5)
    state = gen.get_state()
    cuda_state = torch.cuda.get_rng_state()
    first = _run(te_backend, gemm, x, w, g, "fp4", cfg, gen)
    assert torch.equal(torch.cuda.get_rng_state(), cuda_state)
    second = _run(te_backend, gemm, x, w, g, "fp4", cfg, gen)
    assert not torch.equal(first, second)
    gen.set_state(state)
    assert torch.equal(_run(te_backend, gemm, x, w, g, "fp4", cfg, gen), first)
    exact = _exact(gemm, x, w, g)
    emulated = _run(EMULATED, gemm, x, w, g, "fp4", cfg, torch.Generator(device="cuda").manual_seed(6))
    assert sqnr_db(exact, first) >= sqnr_db(exact, emulated) - 1.0


@pytest.mark.gpu
@needs_te_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("precision,cfg", [("fp8", QuantConfig()), ("fp4", QuantConfig(stochastic_rounding=False))])
def test_gpu_snip_linear_forward_and_backward_match_the_emulated_backend(te_backend, precision, cfg, dtype):
    """A SnipLinear on the te backend against the same layer on the emulated backend: output, input, weight
    and bias gradients. BF16 outputs add one BF16 rounding on both sides (~59 dB), above FLOOR_DB."""
    te_cfg = dataclasses.replace(cfg, backend="te")
    _require(te_backend, precision, te_cfg)
    base = torch.nn.Linear(K, N, bias=True).to("cuda", dtype)
    layers = {}
    for name, c in (("te", te_cfg), ("emulated", dataclasses.replace(cfg, backend="emulated"))):
        lin = torch.nn.Linear(K, N, bias=True).to("cuda", dtype)
        lin.load_state_dict(base.state_dict())
        layers[name] = SnipLinear.from_linear(lin, precision, c)
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(4, T // 4, K, device="cuda", generator=gen).to(dtype)
    g_y = (torch.randn(4, T // 4, N, device="cuda", generator=gen) * 1e-3).to(dtype)
    got = {}
    for name, layer in layers.items():
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.backward(g_y)
        got[name] = (y.detach(), xi.grad, layer.weight.grad, layer.bias.grad)
    for te_t, em_t in zip(got["te"], got["emulated"]):
        assert te_t.dtype == em_t.dtype and te_t.shape == em_t.shape
        assert sqnr_db(em_t, te_t) >= FLOOR_DB


@pytest.mark.gpu
@needs_te_gpu
def test_gpu_a_recipe_change_switches_te_s_quantizers(te_backend, cuda_operands):
    """One backend, the weight's recipe changed between calls: each call matches its own reference, and the
    two differ (TE would keep a quantizer's recipe; the backend must pick another quantizer)."""
    cfg_2d, cfg_1d = QuantConfig(stochastic_rounding=False), QuantConfig(stochastic_rounding=False, weight_2d=False)
    _require(te_backend, "fp4", cfg_2d)
    x, w, _ = cuda_operands
    out = {}
    for name, cfg in (("2d", cfg_2d), ("1d", cfg_1d), ("2d again", cfg_2d)):
        out[name] = te_backend.fprop(x, w, "fp4", cfg)
        assert sqnr_db(EMULATED.fprop(x, w, "fp4", cfg), out[name]) >= FLOOR_DB
    assert not torch.equal(out["2d"], out["1d"]) and torch.equal(out["2d"], out["2d again"])
    assert math.isfinite(sqnr_db(out["1d"], out["2d"]))
