// Fused CPU quantization of 2-D GEMM operands: snip_ds.quant.quantize_parts in two passes over memory.
//
// Pass 1 (recipes with a tensor-level scale, when no tensor amax is given): the tensor amax, a max over the
// bit patterns of |x| (for non-negative floats the integer order is the float order, and a NaN's pattern is
// above +Inf's, so NaN propagates as in torch.amax).
// Pass 2: per row (blocks along axis 1) or per strip of block-size rows (blocks along axis 0, 2-D tiles):
// block amaxes, scales, rounding and the values, written once. The arithmetic is the reference's FP32
// operations in the reference's order (compiled without contraction or fast-math), and rounding to nearest
// even is the reference's own (a + K) - K, so the results equal snip_ds.quant bit for bit. Stochastic
// rounding draws Philox-4x32-10 (Triton's tl.randint: the same (seed, element index) gives the same draw)
// and rounds up when the 32-bit draw is below the dropped fraction of a quantum (Triton kernels' grid.py).
//
// The element loops are compiled three times (AVX-512, AVX2, baseline) and the caller picks one (torch's
// own CPU capability, so ATEN_CPU_CAPABILITY limits it as it limits torch's kernels).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

enum Kind : int64_t { PER_TENSOR = 0, MX = 1, NVFP4 = 2, NVFP4_2D = 3 };

#define INLINE inline __attribute__((always_inline))

INLINE uint32_t f2u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
INLINE float u2f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

struct Grid {
  int32_t mbits;
  int32_t emin;
  float maxn;
};

// snip_ds.formats.round_magnitude_ (RNE) on one non-negative magnitude (NaN stays NaN): saturate, then
// (a + K) - K with K = quantum * 2**23 taken from a's exponent floored at the subnormal binade.
INLINE float round_rne(float a, Grid g) {
  float sat = a > g.maxn ? g.maxn : a;
  uint32_t e = f2u(sat) & 0x7F800000u;
  uint32_t lo = uint32_t(g.emin + 127) << 23;
  e = e < lo ? lo : e;
  float magic = u2f(e + (uint32_t(23 - g.mbits) << 23));
  return (sat + magic) - magic;
}

// Philox-4x32-10 of counter (idx lo, idx hi, 0, 0) and key (seed lo, seed hi): the first output word, as
// Triton's tl.randint(seed, idx) returns it.
INLINE uint32_t philox(uint64_t seed, uint64_t idx) {
  uint32_t c0 = uint32_t(idx), c1 = uint32_t(idx >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
  for (int i = 0; i < 10; ++i) {
    uint64_t p0 = uint64_t(0xD2511F53u) * c0;
    uint64_t p1 = uint64_t(0xCD9E8D57u) * c2;
    uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0;
    uint32_t n2 = uint32_t(p0 >> 32) ^ c3 ^ k1;
    c1 = uint32_t(p1);
    c3 = uint32_t(p0);
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c0;
}

// Stochastic rounding of one non-negative magnitude with the uniform 32-bit draw u (grid.py's
// round_stochastic): up with probability low / 2**shift, the dropped fraction of a quantum, i.e. when
// u * 2**shift < low * 2**32, decided in 32-bit integers: u < low << (32 - shift) for shift <= 32, else
// u <= (low - 1) >> (shift - 32) (low >= 1).
// Integer selects only (a >= 0 or NaN): a select between floating-point results would keep the loop from
// vectorizing (the compiler may not speculate a multiply that could trap).
INLINE float round_sr(float a, Grid g, uint32_t u) {
  uint32_t abits = f2u(a) & 0x7FFFFFFFu;
  uint32_t maxb = f2u(g.maxn);
  uint32_t bits = abits > maxb ? maxb : abits;  // saturated (Inf too); a NaN is returned at the end
  int32_t field = int32_t(bits >> 23);
  uint32_t m = bits & 0x7FFFFFu;
  m = field > 0 ? (m | 0x800000u) : m;
  int32_t e = std::max(field, 1) - 127;
  int32_t shift = (23 - g.mbits) + std::max(g.emin - e, 0);
  shift = std::min(shift, 56);
  uint32_t quantum_bits = uint32_t(std::max(e, g.emin) - g.mbits + 127) << 23;
  float quantum = u2f(abits > 0x7F800000u ? 0x7FC00000u : quantum_bits);  // NaN in, NaN out
  int32_t s31 = std::min(shift, 31);  // m < 2**24: the same r and low as the exact shift
  uint32_t r = m >> s31;
  uint32_t low = m & ((1u << s31) - 1u);
  uint32_t below = low << std::max(32 - shift, 0);  // < 2**32: low < 2**shift
  uint32_t tiny = (low - 1u) >> std::max(shift - 32, 0);
  uint32_t near = shift <= 32 ? uint32_t(u < below) : 0u;  // branch-free, so the loop vectorizes
  uint32_t far = shift > 32 ? (uint32_t(low != 0u) & uint32_t(u <= tiny)) : 0u;
  float out = float(int32_t(r + (near | far))) * quantum;
  return out;
}

// u[j] = philox(seed, idx0 + j) for j < m: the draws of a span, in vectors of 16 (AVX-512) or 8 (AVX2)
// counters. A round's 32 x 32 -> 64-bit products: _mul_epu32 on the even lanes and on the odd lanes shifted
// down, the high and low words blended back.
__attribute__((noinline)) void philox_fill_base(uint64_t seed, uint64_t idx0, int64_t m, uint32_t* u) {
  for (int64_t j = 0; j < m; ++j) u[j] = philox(seed, idx0 + uint64_t(j));
}

#define PHILOX_VECTOR_BODY(V, W, SET1, LOAD, STORE, MUL, SRLI, SLLI, XOR, BLEND_ODD)                      \
  const V A = SET1(int32_t(0xD2511F53u)), B = SET1(int32_t(0xCD9E8D57u));                               \
  int64_t j = 0;                                                                                         \
  for (; j + W <= m; j += W) {                                                                           \
    alignas(64) uint32_t lo[W], hi[W];                                                                   \
    for (int l = 0; l < W; ++l) {                                                                        \
      uint64_t i = idx0 + uint64_t(j + l);                                                               \
      lo[l] = uint32_t(i);                                                                               \
      hi[l] = uint32_t(i >> 32);                                                                         \
    }                                                                                                    \
    V c0 = LOAD(lo), c1 = LOAD(hi), c2 = SET1(0), c3 = SET1(0);                                          \
    uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);                                             \
    for (int r = 0; r < 10; ++r) {                                                                       \
      V pe0 = MUL(c0, A), po0 = MUL(SRLI(c0, 32), A);                                                    \
      V pe1 = MUL(c2, B), po1 = MUL(SRLI(c2, 32), B);                                                    \
      V hi0 = BLEND_ODD(SRLI(pe0, 32), po0), lo0 = BLEND_ODD(pe0, SLLI(po0, 32));                        \
      V hi1 = BLEND_ODD(SRLI(pe1, 32), po1), lo1 = BLEND_ODD(pe1, SLLI(po1, 32));                        \
      V n0 = XOR(XOR(hi1, c1), SET1(int32_t(k0)));                                                       \
      V n2 = XOR(XOR(hi0, c3), SET1(int32_t(k1)));                                                       \
      c1 = lo1;                                                                                          \
      c3 = lo0;                                                                                          \
      c0 = n0;                                                                                           \
      c2 = n2;                                                                                           \
      k0 += 0x9E3779B9u;                                                                                 \
      k1 += 0xBB67AE85u;                                                                                 \
    }                                                                                                    \
    STORE(u + j, c0);                                                                                    \
  }                                                                                                      \
  for (; j < m; ++j) u[j] = philox(seed, idx0 + uint64_t(j));

__attribute__((noinline, target("avx2,fma,bmi,bmi2,f16c")))
void philox_fill_avx2(uint64_t seed, uint64_t idx0, int64_t m, uint32_t* u) {
#define LOAD256(p) _mm256_load_si256(reinterpret_cast<const __m256i*>(p))
#define STORE256(p, v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v)
#define BLEND256(a, b) _mm256_blend_epi32(a, b, 0xAA)
  PHILOX_VECTOR_BODY(__m256i, 8, _mm256_set1_epi32, LOAD256, STORE256, _mm256_mul_epu32, _mm256_srli_epi64,
                     _mm256_slli_epi64, _mm256_xor_si256, BLEND256)
}

__attribute__((noinline, target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,bmi,bmi2,f16c")))
void philox_fill_avx512(uint64_t seed, uint64_t idx0, int64_t m, uint32_t* u) {
#define LOAD512(p) _mm512_load_si512(reinterpret_cast<const void*>(p))
#define STORE512(p, v) _mm512_storeu_si512(reinterpret_cast<void*>(p), v)
#define BLEND512(a, b) _mm512_mask_blend_epi32(__mmask16(0xAAAA), a, b)
  PHILOX_VECTOR_BODY(__m512i, 16, _mm512_set1_epi32, LOAD512, STORE512, _mm512_mul_epu32, _mm512_srli_epi64,
                     _mm512_slli_epi64, _mm512_xor_si512, BLEND512)
}

// Per-tensor scale from the tensor amax: amax / divisor, 1 for amax 0, at least 2**-149, NaN when the
// amax is not finite (snip_ds.quant._per_tensor_scale and NVFP4's S).
float tensor_scale(float amax, float divisor) {
  float s = amax > 0.0f ? amax / divisor : 1.0f;
  float tiny = u2f(1u);
  s = s < tiny ? tiny : s;
  return (f2u(amax) & 0x7F800000u) == 0x7F800000u ? std::numeric_limits<float>::quiet_NaN() : s;
}

INLINE float pow2(int32_t exp) {  // 2**exp for exp in [-127, 127]
  return exp < -126 ? u2f(0x00400000u) : u2f(uint32_t(exp + 127) << 23);
}

struct Params {
  int64_t kind, axis, block;
  Grid grid;
  Grid e4m3;  // NVFP4 block scales
  int32_t emax;
  float six;  // the element format's max_normal (NVFP4: s_b = E4M3(amax_b / (S * 6)))
  float scale;  // per-tensor scale, or NVFP4's S
  bool dequantize;  // values times the tensor scale, in snip_ds.quant.fake_quantize's order
  bool stochastic;
  uint64_t seed;
  int64_t offset;
};

// (divisor, value multiplier) of a block from the bits of its amax.
INLINE void block_scales(uint32_t amax_bits, const Params& p, float& d, float& vm) {
  if (p.kind == MX) {
    int32_t field = int32_t(amax_bits >> 23);
    int32_t exp = (field > 0 ? field - 127 : -127) - p.emax;
    exp = std::min(std::max(exp, -127), 127);
    exp = amax_bits > 0 ? exp : 0;
    float x = field < 255 ? pow2(exp) : std::numeric_limits<float>::quiet_NaN();
    d = x;
    vm = x;
  } else {  // NVFP4: s_b = E4M3_RNE(amax_b / (S * 6)), d = s_b * S (+Inf where s_b * S is 0)
    float sb = round_rne(u2f(amax_bits) / (p.scale * p.six), p.e4m3);
    float mul = sb * p.scale;
    d = mul == 0.0f ? std::numeric_limits<float>::infinity() : mul;
    vm = p.dequantize ? mul : sb;  // fake_quantize: fl(q * fl(s_b * S)); the split: q * s_b (exact)
  }
}

template <typename In>
INLINE uint32_t load_bits(const In* x, int64_t i) {
  if constexpr (std::is_same_v<In, float>) {
    return f2u(x[i]);
  } else {
    return uint32_t(x[i].x) << 16;
  }
}

template <typename Out>
INLINE void store(Out* out, int64_t i, float v) {
  if constexpr (std::is_same_v<Out, float>) {
    out[i] = v;
  } else {
    out[i] = c10::BFloat16(v);
  }
}

// One span of n elements: value = round(|x| / D[j]) * VM[j] with x's sign; idx0: the stochastic draw index
// of the first element.
template <int ISA, typename In, typename Out>
INLINE void quantize_span(const In* x, Out* out, const float* D, const float* VM, int64_t n, const Params& p,
                          uint64_t idx0) {
  const Grid g = p.grid;
  if (p.stochastic) {
    const uint64_t seed = p.seed;
    constexpr int64_t STEP = 256;
    uint32_t u[STEP];
    for (int64_t j0 = 0; j0 < n; j0 += STEP) {
      const int64_t m = std::min(STEP, n - j0);
      if constexpr (ISA == 2) philox_fill_avx512(seed, idx0 + uint64_t(j0), m, u);
      else if constexpr (ISA == 1) philox_fill_avx2(seed, idx0 + uint64_t(j0), m, u);
      else philox_fill_base(seed, idx0 + uint64_t(j0), m, u);
      for (int64_t j = 0; j < m; ++j) {
        uint32_t b = load_bits(x, j0 + j);
        uint32_t mb = b & 0x7FFFFFFFu;
        float q = round_sr(u2f(mb) / D[j0 + j], g, u[j]) * VM[j0 + j];
        store(out, j0 + j, u2f(f2u(q) | (b ^ mb)));
      }
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      uint32_t b = load_bits(x, j);
      uint32_t mb = b & 0x7FFFFFFFu;
      float q = round_rne(u2f(mb) / D[j], g) * VM[j];
      store(out, j, u2f(f2u(q) | (b ^ mb)));
    }
  }
}

INLINE uint32_t max_mag_bits(uint32_t acc, uint32_t b) {
  uint32_t m = b & 0x7FFFFFFFu;
  return m > acc ? m : acc;
}

// Rows [r0, r1) of an R x C tensor, columns [c0, c1): the task unit. Blocks along axis 1 (and per-tensor):
// rows one by one; along axis 0 / 2-D tiles: [r0, r1) is one strip of block rows.
template <int ISA, typename In, typename Out>
INLINE void run_task(const In* x, Out* out, int64_t C, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                     const Params& p, float* D, float* VM, uint32_t* colmax) {
  const int64_t w = c1 - c0;
  const int64_t bs = p.block;
  if (p.kind == PER_TENSOR) {
    const float vm = p.dequantize ? p.scale : 1.0f;  // fake_quantize: fl(q * s)
    for (int64_t j = 0; j < w; ++j) { D[j] = p.scale; VM[j] = vm; }
    for (int64_t r = r0; r < r1; ++r)
      quantize_span<ISA>(x + r * C + c0, out + r * C + c0, D, VM, w, p, uint64_t(p.offset + r * C + c0));
    return;
  }
  if (p.kind != NVFP4_2D && p.axis == 1) {  // blocks along the row (c0 = 0, c1 = C)
    for (int64_t r = r0; r < r1; ++r) {
      const In* xr = x + r * C;
      for (int64_t b0 = 0; b0 < C; b0 += bs) {
        int64_t b1 = std::min(b0 + bs, C);
        uint32_t amax = 0;
        for (int64_t j = b0; j < b1; ++j) amax = max_mag_bits(amax, load_bits(xr, j));
        float d, vm;
        block_scales(amax, p, d, vm);
        for (int64_t j = b0; j < b1; ++j) { D[j] = d; VM[j] = vm; }
      }
      quantize_span<ISA>(xr, out + r * C, D, VM, C, p, uint64_t(p.offset + r * C));
    }
    return;
  }
  // blocks along axis 0 or 16x16 tiles: column amaxes over the strip
  for (int64_t j = 0; j < w; ++j) colmax[j] = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const In* xr = x + r * C + c0;
    for (int64_t j = 0; j < w; ++j) colmax[j] = max_mag_bits(colmax[j], load_bits(xr, j));
  }
  if (p.kind == NVFP4_2D) {  // c0 is a multiple of bs: tiles of bs columns
    for (int64_t b0 = 0; b0 < w; b0 += bs) {
      int64_t b1 = std::min(b0 + bs, w);
      uint32_t amax = 0;
      for (int64_t j = b0; j < b1; ++j) amax = colmax[j] > amax ? colmax[j] : amax;
      float d, vm;
      block_scales(amax, p, d, vm);
      for (int64_t j = b0; j < b1; ++j) { D[j] = d; VM[j] = vm; }
    }
  } else {
    for (int64_t j = 0; j < w; ++j) block_scales(colmax[j], p, D[j], VM[j]);
  }
  for (int64_t r = r0; r < r1; ++r)
    quantize_span<ISA>(x + r * C + c0, out + r * C + c0, D, VM, w, p, uint64_t(p.offset + r * C + c0));
}

template <typename In, typename Out>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,bmi,bmi2,f16c")))
void run_task_avx512(const In* x, Out* out, int64_t C, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                     const Params& p, float* D, float* VM, uint32_t* colmax) {
  run_task<2>(x, out, C, r0, r1, c0, c1, p, D, VM, colmax);
}

template <typename In, typename Out>
__attribute__((target("avx2,fma,bmi,bmi2,f16c")))
void run_task_avx2(const In* x, Out* out, int64_t C, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                   const Params& p, float* D, float* VM, uint32_t* colmax) {
  run_task<1>(x, out, C, r0, r1, c0, c1, p, D, VM, colmax);
}

template <typename In, typename Out>
void run_task_base(const In* x, Out* out, int64_t C, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                   const Params& p, float* D, float* VM, uint32_t* colmax) {
  run_task<0>(x, out, C, r0, r1, c0, c1, p, D, VM, colmax);
}

constexpr int64_t COL_CHUNK = 1024;  // strip tasks span this many columns (a strip of 32 x 1024 FP32: 128 KiB)

// Threads: torch's (at::get_num_threads()), tasks handed out dynamically, so that a thread slowed down by other
// processes on its core takes fewer of them (a static split would wait for its half).
INLINE int threads_for(int64_t n_tasks) {
  return (n_tasks > 1 && !omp_in_parallel()) ? int(std::min<int64_t>(at::get_num_threads(), n_tasks)) : 1;
}

template <typename In, typename Out>
void run(const In* x, Out* out, int64_t R, int64_t C, const Params& p, int64_t isa) {
  auto task = isa >= 2 ? run_task_avx512<In, Out> : isa == 1 ? run_task_avx2<In, Out> : run_task_base<In, Out>;
  const bool strips = p.kind == NVFP4_2D || (p.kind != PER_TENSOR && p.axis == 0);
  if (!strips) {  // tasks: groups of rows, about 32 Ki elements each
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(C, 1));
    const int64_t n_tasks = (R + grain - 1) / grain;
#pragma omp parallel num_threads(threads_for(n_tasks))
    {
      std::vector<float> D(C), VM(C);
#pragma omp for schedule(dynamic, 1)
      for (int64_t t = 0; t < n_tasks; ++t)
        task(x, out, C, t * grain, std::min(R, (t + 1) * grain), 0, C, p, D.data(), VM.data(), nullptr);
    }
    return;
  }
  const int64_t bs = p.block;
  const int64_t n_strips = (R + bs - 1) / bs;
  const int64_t n_chunks = (C + COL_CHUNK - 1) / COL_CHUNK;  // COL_CHUNK is a multiple of every tile edge
  const int64_t n_tasks = n_strips * n_chunks;
#pragma omp parallel num_threads(threads_for(n_tasks))
  {
    const int64_t w = std::min(C, COL_CHUNK);
    std::vector<float> D(w), VM(w);
    std::vector<uint32_t> colmax(w);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < n_tasks; ++t) {
      int64_t s = t / n_chunks, c = t % n_chunks;
      task(x, out, C, s * bs, std::min(R, (s + 1) * bs), c * COL_CHUNK, std::min(C, (c + 1) * COL_CHUNK), p,
           D.data(), VM.data(), colmax.data());
    }
  }
}

template <typename In>
INLINE uint32_t amax_span(const In* x, int64_t begin, int64_t end, uint32_t acc) {
  for (int64_t i = begin; i < end; ++i) acc = max_mag_bits(acc, load_bits(x, i));
  return acc;
}

template <typename In>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,bmi,bmi2,f16c")))
uint32_t amax_span_avx512(const In* x, int64_t begin, int64_t end, uint32_t acc) {
  return amax_span(x, begin, end, acc);
}

template <typename In>
__attribute__((target("avx2,fma,bmi,bmi2,f16c")))
uint32_t amax_span_avx2(const In* x, int64_t begin, int64_t end, uint32_t acc) {
  return amax_span(x, begin, end, acc);
}

template <typename In>
uint32_t amax_span_base(const In* x, int64_t begin, int64_t end, uint32_t acc) {
  return amax_span(x, begin, end, acc);
}

template <typename In>
uint32_t amax_bits(const In* x, int64_t n, int64_t isa) {
  auto span = isa >= 2 ? amax_span_avx512<In> : isa == 1 ? amax_span_avx2<In> : amax_span_base<In>;
  constexpr int64_t GRAIN = 65536;
  const int64_t n_tasks = (n + GRAIN - 1) / GRAIN;
  uint32_t result = 0;
#pragma omp parallel num_threads(threads_for(n_tasks))
  {
    uint32_t acc = 0;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t t = 0; t < n_tasks; ++t) acc = span(x, t * GRAIN, std::min(n, (t + 1) * GRAIN), acc);
#pragma omp critical
    result = acc > result ? acc : result;
  }
  return result;
}

void check_input(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "x: the CPU quantizer needs a CPU tensor, got device ", x.device());
  TORCH_CHECK(x.dim() == 2, "x: the CPU quantizer takes a 2-D tensor, got ", x.dim(), " dimensions");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x: the CPU quantizer takes float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), "x: the CPU quantizer takes a contiguous tensor");
}

at::Tensor tensor_amax(const at::Tensor& x, int64_t isa) {
  check_input(x);
  uint32_t bits = x.scalar_type() == at::kFloat ? amax_bits(x.data_ptr<float>(), x.numel(), isa)
                                                 : amax_bits(x.data_ptr<c10::BFloat16>(), x.numel(), isa);
  return at::full({}, u2f(bits), x.options().dtype(at::kFloat));
}

// values (R x C, out_dtype) and the 0-d FP32 tensor scale; with dequantize, the values already carry the tensor
// scale (snip_ds.quant.fake_quantize's result, its multiplications in its order). amax: the tensor amax (FP32 0-d), needed by the
// per-tensor and NVFP4 kinds. grid = (mbits, emin, max_normal, emax) of the element format.
std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& x, const at::Tensor& amax, int64_t kind, int64_t axis,
                                            int64_t block, int64_t mbits, int64_t emin, int64_t emax,
                                            double max_normal, double divisor, bool stochastic,
                                            const at::Tensor& seed, int64_t offset, bool out_bf16, bool dequantize,
                                            int64_t isa) {
  check_input(x);
  TORCH_CHECK(kind >= PER_TENSOR && kind <= NVFP4_2D, "kind: expected 0..3, got ", kind);
  TORCH_CHECK(axis == 0 || axis == 1, "axis: expected 0 or 1, got ", axis);
  TORCH_CHECK(kind == PER_TENSOR || (block > 0 && COL_CHUNK % block == 0), "block: unsupported block size ",
              block);
  const int64_t R = x.size(0), C = x.size(1);
  Params p;
  p.kind = kind;
  p.axis = axis;
  p.block = block;
  p.grid = Grid{int32_t(mbits), int32_t(emin), float(max_normal)};
  p.e4m3 = Grid{3, -6, 448.0f};
  p.emax = int32_t(emax);
  p.six = float(max_normal);
  p.stochastic = stochastic;
  p.dequantize = dequantize;
  // the seed and the amax are read here, in the kernel, as a GPU kernel reads them from device memory: the caller
  // never reads a tensor's value on the host
  TORCH_CHECK(seed.numel() == 1 && seed.scalar_type() == at::kLong && seed.device().is_cpu(),
              "seed: expected a one-element int64 CPU tensor");
  p.seed = uint64_t(*seed.contiguous().data_ptr<int64_t>());
  p.offset = offset;
  p.scale = 1.0f;
  if (kind != MX) {
    TORCH_CHECK(amax.numel() == 1 && amax.scalar_type() == at::kFloat && amax.device().is_cpu(),
                "tensor_amax: expected a one-element float32 CPU tensor");
    p.scale = tensor_scale(*amax.contiguous().data_ptr<float>(), float(divisor));
  }
  at::Tensor values = at::empty({R, C}, x.options().dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
  at::Tensor scale = at::full({}, p.scale, x.options().dtype(at::kFloat));
  if (x.numel() == 0) return {values, scale};
  if (x.scalar_type() == at::kFloat) {
    if (out_bf16) run(x.data_ptr<float>(), values.data_ptr<c10::BFloat16>(), R, C, p, isa);
    else run(x.data_ptr<float>(), values.data_ptr<float>(), R, C, p, isa);
  } else {
    if (out_bf16) run(x.data_ptr<c10::BFloat16>(), values.data_ptr<c10::BFloat16>(), R, C, p, isa);
    else run(x.data_ptr<c10::BFloat16>(), values.data_ptr<float>(), R, C, p, isa);
  }
  return {values, scale};
}

// The draws of stochastic rounding for indices [offset, offset + n), as int64 (checks the generator).
at::Tensor philox_draws(int64_t seed, int64_t offset, int64_t n) {
  at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) o[i] = int64_t(philox(uint64_t(seed), uint64_t(offset + i)));
  return out;
}

int64_t supported_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx2") &&
      __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2"))
    return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2")) return 1;
  return 0;
}

}  // namespace

// The two quantization ops are CPU kernels (not catch-all ones), so that the package can give them shape functions
// (torch.library.register_fake) and torch.compile traces calls of them.
TORCH_LIBRARY(snip_ds_cpu, m) {
  m.def("tensor_amax(Tensor x, int isa) -> Tensor");
  m.def("quantize(Tensor x, Tensor amax, int kind, int axis, int block, int mbits, int emin, int emax, "
        "float max_normal, float divisor, bool stochastic, Tensor seed, int offset, bool out_bf16, bool dequantize, "
        "int isa) "
        "-> (Tensor, Tensor)");
  m.def("philox_draws(int seed, int offset, int n) -> Tensor", &philox_draws);
  m.def("supported_isa() -> int", &supported_isa);
}

TORCH_LIBRARY_IMPL(snip_ds_cpu, CPU, m) {
  m.impl("tensor_amax", &tensor_amax);
  m.impl("quantize", &quantize);
}
