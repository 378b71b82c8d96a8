"""Triton device functions: rounding FP32 magnitudes onto an element grid, and the recipes' scales.

Everything is integer manipulation of the FP32 bit pattern plus correctly rounded FP32 arithmetic
(``tl.div_rn``; products of a grid value and a power of two or an E4M3 scale, which are exact), so the
results equal :mod:`snip_ds.formats` and :mod:`snip_ds.quant` bit for bit:

* ``round_rne``: an FP32 magnitude ``a = m * 2**(e - 23)`` (``m`` the 24-bit significand, hidden bit
  included) has the quantum ``2**(max(e, emin) - mbits)`` on the format's grid, so the grid point is the
  integer ``m / 2**shift`` rounded to nearest-even, times the quantum, with
  ``shift = 23 - mbits + max(emin - e, 0)``: the dropped bits decide the rounding, no float trick involved.
* ``round_stochastic``: the same integer split; the dropped bits ``low`` over ``2**shift`` are the
  fraction ``f`` of a quantum, and the magnitude rounds up when a uniform 32-bit draw ``u`` has
  ``u < f * 2**32`` -- probability exactly ``f`` whenever ``shift <= 32``, i.e. for every magnitude above
  ``2**-9`` of its quantum (smaller ones round up with a probability off by less than ``2**-32``).

Inputs are non-negative magnitudes; NaN is returned as NaN and anything above ``max_normal`` (Inf
included) saturates to it, as in :func:`snip_ds.formats.round_magnitude_`.

``rounded`` puts them together for a tile of a quantization (:mod:`.quantize`): block amaxes (``block_amax_bits``),
scales, the draws of stochastic rounding (``draw``), rounding, the block scale multiplied back, the encoding.
"""
from __future__ import annotations

import triton
import triton.language as tl

from snip_ds.backend.kernels.config import MX, NVFP4_2D, OUT_BF16, OUT_FP8, PER_TENSOR
from snip_ds.formats import E4M3

F32_MIN_SUBNORMAL_BITS = tl.constexpr(1)  # bit pattern of 2**-149
E4M3_MBITS = tl.constexpr(E4M3.mbits)  # NVFP4's block scales are E4M3
E4M3_EMIN = tl.constexpr(E4M3.emin)
E4M3_MAX = tl.constexpr(E4M3.max_normal)


@triton.jit
def is_nan(a):
    return a != a


@triton.jit
def is_finite(a):
    return (a.to(tl.int32, bitcast=True) & 0x7F800000) != 0x7F800000


@triton.jit
def pow2(exp):
    """``2**exp`` in FP32 for an int32 tensor ``exp`` in [-127, 127] (2**-127 is an FP32 subnormal)."""
    normal = ((tl.maximum(exp, -126) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(exp < -126, tl.full(exp.shape, 0x00400000, tl.int32).to(tl.float32, bitcast=True), normal)


@triton.jit
def _split(a, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """(significand m, shift, quantum) of non-negative finite FP32 magnitudes ``a`` on the format's grid."""
    bits = a.to(tl.int32, bitcast=True)
    field = bits >> 23
    m = bits & 0x7FFFFF
    m = tl.where(field > 0, m | 0x800000, m)
    e = tl.maximum(field, 1) - 127  # FP32 subnormals share the exponent of the smallest normal
    shift = (23 - MBITS) + tl.maximum(EMIN - e, 0)
    quantum = ((tl.maximum(e, EMIN) - MBITS + 127) << 23).to(tl.float32, bitcast=True)  # a normal FP32
    return m, shift, quantum


@triton.jit
def round_rne(a, MBITS: tl.constexpr, EMIN: tl.constexpr, MAXN: tl.constexpr):
    """Non-negative FP32 magnitudes rounded to nearest-even on the grid, saturating at ``MAXN``."""
    sat = tl.minimum(a, MAXN)  # max_normal lies on the grid, so rounding never goes above it
    m, shift, quantum = _split(sat, MBITS, EMIN)
    shift = tl.minimum(shift, 26)  # m < 2**24: any shift >= 25 rounds to 0 already
    r = m >> shift
    one = tl.full(m.shape, 1, tl.int32)
    low = m & ((one << shift) - 1)
    half = one << (shift - 1)
    up = (low > half) | ((low == half) & ((r & 1) == 1))
    out = (r + up.to(tl.int32)).to(tl.float32) * quantum  # an integer of <= mbits + 2 bits times 2**k: exact
    return tl.where(is_nan(a), a, out)


@triton.jit
def round_stochastic(a, rand, MBITS: tl.constexpr, EMIN: tl.constexpr, MAXN: tl.constexpr):
    """Non-negative FP32 magnitudes rounded stochastically on the grid: up with probability equal to the
    fraction of a quantum above the grid point below; ``rand`` holds uniform 32-bit draws (``tl.randint``)."""
    sat = tl.minimum(a, MAXN)
    m32, shift32, quantum = _split(sat, MBITS, EMIN)
    m = m32.to(tl.int64)
    shift = tl.minimum(shift32, 56).to(tl.int64)  # shift > 56: a < 2**-32 quanta, rounds up with P <= 2**-32
    one = tl.full(m.shape, 1, tl.int64)
    r = m >> shift
    low = m & ((one << shift) - 1)
    u = rand.to(tl.uint32, bitcast=True).to(tl.int64)  # zero-extended: uniform on [0, 2**32)
    # up iff u / 2**32 < low / 2**shift, compared as integers without overflow (u << 24 < 2**56)
    up = (u << tl.maximum(shift - 32, 0)) < (low << tl.maximum(32 - shift, 0))
    out = (r + up.to(tl.int64)).to(tl.float32) * quantum
    return tl.where(is_nan(a), a, out)


@triton.jit
def with_sign(magnitude, sign_bits):
    """``magnitude`` (non-negative or NaN) with the sign bit ``sign_bits`` (int32, 0 or the sign bit)."""
    return (magnitude.to(tl.int32, bitcast=True) | sign_bits).to(tl.float32, bitcast=True)


@triton.jit
def load_bits(ptrs, mask, IN_BF16: tl.constexpr):
    """FP32 bit patterns (int32) of the elements at ``ptrs``: int32 views of FP32 data, or int16 views of
    BF16 data widened by bit shifting (exact for every value, subnormals and NaN included -- Triton's
    interpreter mis-converts BF16 subnormals, and this costs the GPU nothing). Masked elements read 0."""
    bits = tl.load(ptrs, mask=mask, other=0)
    if IN_BF16:
        bits = (bits.to(tl.int32) & 0xFFFF) << 16
    return bits


@triton.jit
def bf16_bits(values):
    """FP32 ``values`` rounded to nearest-even BF16, as int16 bit patterns (a NaN stays a quiet NaN)."""
    bits = values.to(tl.int32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    rounded = tl.where(is_nan(values), (bits >> 16) | 0x40, rounded)
    return rounded.to(tl.int16)


@triton.jit
def fp8_code(values, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """FP32 ``values`` on an FP8 grid (E4M3 or E5M2: ``MBITS`` mantissa bits, smallest normal exponent
    ``EMIN``; signed, saturated, NaN allowed) as the format's 8-bit codes, int32: the sign, then the biased
    exponent ``e - EMIN + 1`` and the top ``MBITS`` mantissa bits of a normal, or the significand of a
    subnormal (``|v| / 2**(EMIN - MBITS)``, an integer). NaN is 0x7F (with its sign), a NaN in both formats."""
    bits = values.to(tl.int32, bitcast=True)
    mag_bits = bits & 0x7FFFFFFF
    e = (mag_bits >> 23) - 127
    normal = ((e - EMIN + 1) << MBITS) | ((mag_bits >> (23 - MBITS)) & ((1 << MBITS) - 1))
    # a subnormal |v| = k * 2**(EMIN - MBITS), k < 2**MBITS: its FP32 significand shifted down to k (exact)
    shift = tl.minimum(tl.maximum(23 - MBITS + EMIN - e, 0), 31)  # in range for the normals too (not used)
    sub = tl.where(mag_bits == 0, 0, ((mag_bits & 0x7FFFFF) | 0x800000) >> shift)
    code = tl.where(e >= EMIN, normal, sub)
    code = tl.where(is_nan(values), 0x7F, code)
    return code | ((bits >> 24) & 0x80)


@triton.jit
def tensor_scale(amax, MAXN: tl.constexpr):
    """Per-tensor scale from the tensor amax (FP32 scalar): ``amax / MAXN`` correctly rounded, 1 for amax 0,
    at least 2**-149, NaN for a non-finite amax (:func:`snip_ds.quant._per_tensor`, NVFP4's ``S``)."""
    tiny = tl.full([], F32_MIN_SUBNORMAL_BITS, tl.int32).to(tl.float32, bitcast=True)
    s = tl.where(amax > 0, tl.div_rn(amax, tl.full([], MAXN, tl.float32)), 1.0)
    s = tl.maximum(s, tiny)
    return tl.where(is_finite(amax), s, float("nan"))


@triton.jit
def mx_exponent(amax_bits, EMAX: tl.constexpr):
    """E8M0 exponent ``clamp(floor(log2 amax) - EMAX, -127, 127)`` (0 for amax 0) from the int32 bits of
    non-negative block amaxes. A subnormal amax has floor(log2) <= -127, clamped to -127 whatever it is."""
    field = amax_bits >> 23
    exp = tl.where(field > 0, field - 127, -127) - EMAX
    exp = tl.minimum(tl.maximum(exp, -127), 127)
    return tl.where(amax_bits > 0, exp, 0)


@triton.jit
def e4m3_rne(t):
    """Round non-negative FP32 values (NaN, Inf allowed) to E4M3, saturating: NVFP4's block scales."""
    return round_rne(t, E4M3_MBITS, E4M3_EMIN, E4M3_MAX)


@triton.jit
def reduce_amax(amax_ptr, n_amax, AMAX_BLOCK: tl.constexpr):
    """Stage 2: the tensor amax (FP32) from the ``n_amax`` int32 bit patterns at ``amax_ptr`` (the partial
    maxima of :func:`snip_ds.backend.kernels.quantize._amax_kernel`, or one given amax's bits)."""
    offs = tl.arange(0, AMAX_BLOCK)
    bits = tl.load(amax_ptr + offs, mask=offs < n_amax, other=0) & 0x7FFFFFFF  # a given -0 or -NaN: its magnitude
    return tl.max(bits, axis=0).to(tl.float32, bitcast=True)


@triton.jit
def amax_and_scale(amax_ptr, n_amax, KIND: tl.constexpr, TENSOR_DIVISOR: tl.constexpr,
                   AMAX_BLOCK: tl.constexpr):
    """The tensor amax (stage 2, :func:`reduce_amax`; 0 for MX, which reads none) and the tensor scale made from
    it (1 for MX): what a quantization's first program writes out, and what a grouped launch's other tensor
    computes in-program where it multiplies this scale into a product (:mod:`snip_ds.backend.kernels.grouped`)."""
    amax = tl.zeros([], tl.float32)
    if KIND != MX:
        amax = reduce_amax(amax_ptr, n_amax, AMAX_BLOCK)
    if KIND == MX:
        scale = tl.full([], 1.0, tl.float32)
    else:
        scale = tensor_scale(amax, TENSOR_DIVISOR)  # (MAXN for per-tensor recipes)
    return amax, scale


# ------------------------------------------------------------------------------------------------------
# a tile's values: block amaxes, scales, draws and rounding together (the quantization kernels' arithmetic)
# ------------------------------------------------------------------------------------------------------


@triton.jit
def draw(seed, idx):
    """Uniform 32-bit draws (int32 bit patterns) for the int64 element indices ``idx``: Philox-4x32-10 with
    key ``seed`` (uint64) and counter (low word of idx, high word of idx, 0, 0), its first output word --
    ``tl.randint``'s stream for int64 offsets from Triton 3.4 on, independent of the Triton release."""
    lo = (idx & 0xFFFFFFFF).to(tl.uint32)
    hi = ((idx >> 32) & 0xFFFFFFFF).to(tl.uint32)
    zero = lo * 0
    r, _, _, _ = tl.philox(seed.to(tl.uint64), lo, hi, zero, zero)
    return r.to(tl.int32, bitcast=True)


@triton.jit
def block_amax_bits(mag_bits, KIND: tl.constexpr, AXIS: tl.constexpr, BS: tl.constexpr,
                    BR: tl.constexpr, BC: tl.constexpr):
    """Each element's block amax, as int32 bits, broadcast back to the tile's shape [BR, BC]."""
    if KIND == NVFP4_2D:
        t = tl.reshape(mag_bits, [BR // BS, BS, BC // BS, BS])
        m = tl.max(tl.max(t, axis=3), axis=1)  # [BR // BS, BC // BS]
        full = tl.broadcast_to(m[:, None, :, None], [BR // BS, BS, BC // BS, BS])
    elif AXIS == 1:
        m = tl.max(tl.reshape(mag_bits, [BR, BC // BS, BS]), axis=2)
        full = tl.broadcast_to(m[:, :, None], [BR, BC // BS, BS])
    else:
        m = tl.max(tl.reshape(mag_bits, [BR // BS, BS, BC]), axis=1)
        full = tl.broadcast_to(m[:, None, :], [BR // BS, BS, BC])
    return tl.reshape(full, [BR, BC])


@triton.jit
def rounded(mag, mag_bits, sign_bits, scale, rows, cols, C, seed_ptr, offset, KIND: tl.constexpr,
            AXIS: tl.constexpr, BS: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
            MAXN: tl.constexpr, STOCHASTIC: tl.constexpr, OUT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
            DEQUANT: tl.constexpr):
    """A tile's values in blocks along ``AXIS`` (``scale``: the tensor scale), encoded as ``OUT``: the magnitudes
    ``mag`` (their int32 bits ``mag_bits``; signs ``sign_bits``) of the tile at ``rows`` x ``cols`` of a tensor
    of ``C`` columns, scaled, rounded (stochastically from the seed at ``seed_ptr``, drawn at element index
    ``offset + row * C + col``), times their block scale, signed."""
    if KIND == PER_TENSOR:
        scaled = tl.div_rn(mag, tl.broadcast_to(scale, mag.shape))
        value_mul = tl.full(mag.shape, 1.0, tl.float32)
    elif KIND == MX:
        amax_bits = block_amax_bits(mag_bits, KIND, AXIS, BS, BR, BC)
        exp = mx_exponent(amax_bits, EMAX)
        finite = (amax_bits >> 23) < 255  # a NaN or Inf in the block poisons its scale
        value_mul = tl.where(finite, pow2(exp), float("nan"))
        scaled = mag * pow2(-exp)  # times an exact power of two: the correctly rounded quotient
        scaled = tl.where(finite, scaled, float("nan"))
    else:  # NVFP4, NVFP4_2D
        amax_b = block_amax_bits(mag_bits, KIND, AXIS, BS, BR, BC).to(tl.float32, bitcast=True)
        value_mul = e4m3_rne(tl.div_rn(amax_b, tl.broadcast_to(scale * MAXN, amax_b.shape)))  # s_b; MAXN = 6
        d = value_mul * scale
        if DEQUANT:  # fake_quantize's order: fl(q * fl(s_b * S)), 0 where s_b * S is 0
            value_mul = d
        d = tl.where(d == 0, float("inf"), d)  # s_b rounded to 0: the block dequantizes to zeros
        scaled = tl.div_rn(mag, d)

    if STOCHASTIC:
        idx = rows[:, None] * C + cols[None, :] + offset
        q = round_stochastic(scaled, draw(tl.load(seed_ptr), idx), MBITS, EMIN, MAXN)
    else:
        q = round_rne(scaled, MBITS, EMIN, MAXN)
    if KIND != PER_TENSOR:
        q = q * value_mul  # a grid value times a power of two or an E4M3 scale: exact (DEQUANT NVFP4: rounded)
    elif DEQUANT:
        q = q * tl.broadcast_to(scale, q.shape)  # fake_quantize: fl(q * s)
    values = with_sign(q, sign_bits)
    if OUT == OUT_BF16:
        values = bf16_bits(values)
    elif OUT == OUT_FP8:  # per-tensor recipes only: q is the element's grid value itself
        values = fp8_code(values, MBITS, EMIN).to(tl.uint8)
    return values
