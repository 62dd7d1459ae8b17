// The fused optimizer kernels, compiled once per CPU capability (see optimizer_kernels.h and
// CMakeLists.txt: CPU_CAPABILITY is DEFAULT, AVX2 or AVX512, with matching -m flags and
// -ffp-contract=off). One pass over each element: load parameter, gradient and moments, update
// all of them in registers, store. The scalar loop (the DEFAULT capability, and the last few
// elements of every span) performs the same roundings as the vector loop, so results are
// bitwise independent of capability, vector width and where spans were cut.
//
// Why by hand rather than ATen ops: torch::optim::AdamW makes about ten passes over memory per
// step (each op reads and writes whole tensors, two allocate temporaries); AdamW itself needs
// 7 accesses of 4 bytes per parameter. ATen's own fused kernel (at::_fused_adamw_) takes one
// pass but works on one tensor at a time, knows nothing of bf16 moments that are rounded
// stochastically, or of state streamed through a file in chunks.
#include "optimizer_kernels.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstring>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define FSDP_VECTORIZE 1
#else
#define FSDP_VECTORIZE 0
#endif

#define FSDP_CONCAT2(a, b) a##b
#define FSDP_CONCAT(a, b) FSDP_CONCAT2(a, b)

namespace fsdp::detail {
// Everything here lives in a namespace named for the capability: the three compilations of
// this file must not share a symbol (the linker would keep one of them).
namespace CPU_CAPABILITY {
namespace {

using Vec = at::vec::Vectorized<float>;

// Stochastic rounding to bf16: a counter-based hash of (stream key, element index) gives 16
// random bits; adding them below the kept bits and truncating rounds up with probability equal
// to the dropped fraction, so E[round(x)] = x. Round-to-nearest would lose AdamW's second
// moment: with beta2 = 0.999 each step changes it by 0.1%, less than half a bf16 ulp
// (0.2-0.4%), so v * beta2 rounds back to v and the moment never decays.
inline uint32_t mix(uint32_t x) {  // a 32-bit finaliser (lowbias32): full avalanche
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// `key` already mixes in the stream and the high half of the index (see span_key), so one
// finaliser per element suffices: the vector loop stays cheap next to the memory traffic.
// The rounded value's 32 bits (bf16 in the high half); 32-bit lanes only, so that the vector
// path's loop over them vectorises on AVX2 as well as AVX-512.
inline uint32_t rounded_bits(float value, uint32_t key, uint32_t index) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const uint32_t noise = mix(index ^ key) & 0xffffu;
  // Branch-free (masks, not a conditional) so that GCC vectorises the loop on AVX2 too. inf and
  // NaN keep their class: no noise, and a NaN whose payload sits in the dropped bits keeps one.
  const uint32_t special = 0u - static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  const uint32_t payload = 0u - static_cast<uint32_t>((bits & 0xffffu) != 0u);
  return (special & (bits | (payload & 0x10000u))) | (~special & (bits + noise));
}

inline uint16_t round_bf16(float value, uint32_t key, int64_t index) {
  return static_cast<uint16_t>(rounded_bits(value, key, static_cast<uint32_t>(index)) >> 16);
}

// The per-span part of the rounding hash: the stream key and the index's high 32 bits (a span
// never crosses a multiple of 2^32, see for_each_span).
inline uint32_t span_key(uint32_t key, int64_t first) {
  return mix(key ^ mix(static_cast<uint32_t>(first >> 32) + 0x632be5abu));
}

inline float widen_bf16(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof out);
  return out;
}

// Moments are float or bf16; M abstracts the two.
struct F32 {
  static float load(const void* base, int64_t i) { return static_cast<const float*>(base)[i]; }
  static void store(void* base, int64_t i, float v, uint32_t, int64_t) {
    static_cast<float*>(base)[i] = v;
  }
#if FSDP_VECTORIZE
  static Vec loadv(const void* base, int64_t i) {
    return Vec::loadu(static_cast<const float*>(base) + i);
  }
  static void storev(void* base, int64_t i, const Vec& v, uint32_t, int64_t) {
    v.store(static_cast<float*>(base) + i);
  }
#endif
};

struct BF16 {
  static float load(const void* base, int64_t i) {
    return widen_bf16(static_cast<const uint16_t*>(base)[i]);
  }
  static void store(void* base, int64_t i, float v, uint32_t key, int64_t index) {
    static_cast<uint16_t*>(base)[i] = round_bf16(v, key, index);
  }
#if FSDP_VECTORIZE
  // Written with intrinsics: GCC does not vectorise the hash and the 32-to-16-bit narrowing
  // of a plain loop on AVX2 (measured: 6x slower than fp32 moments). Same operations as
  // rounded_bits, lane by lane (the capability test checks them against the scalar code).
#if defined(CPU_CAPABILITY_AVX512)
  using Int = __m512i;
  static Int set1(uint32_t x) {
    return _mm512_set1_epi32(static_cast<int>(x));
  }
  static Int lanes() {
    return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  }
  static Int mul(Int a, Int b) {
    return _mm512_mullo_epi32(a, b);
  }
  static Int xor_shift(Int x, int n) {
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, n));
  }
  static Vec loadv(const void* base, int64_t i) {
    const auto h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
    return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
  static void storev(void* base, int64_t i, const Vec& v, uint32_t key, int64_t index) {
    const Int bits = _mm512_castps_si512(static_cast<__m512>(v));
    Int x =
        _mm512_xor_si512(_mm512_add_epi32(set1(static_cast<uint32_t>(index)), lanes()), set1(key));
    x = mul(xor_shift(x, 16), set1(0x7feb352du));
    x = mul(xor_shift(x, 15), set1(0x846ca68bu));
    x = xor_shift(x, 16);
    const Int noise = _mm512_and_si512(x, set1(0xffffu));
    const __mmask16 special =
        _mm512_cmpeq_epi32_mask(_mm512_and_si512(bits, set1(0x7f800000u)), set1(0x7f800000u));
    const __mmask16 payload = _mm512_test_epi32_mask(bits, set1(0xffffu));
    const Int kept = _mm512_mask_or_epi32(bits, payload, bits, set1(0x10000u));
    const Int rounded = _mm512_mask_blend_epi32(special, _mm512_add_epi32(bits, noise), kept);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
  }
#else  // AVX2
  using Int = __m256i;
  static Int set1(uint32_t x) {
    return _mm256_set1_epi32(static_cast<int>(x));
  }
  static Int mul(Int a, Int b) {
    return _mm256_mullo_epi32(a, b);
  }
  static Int xor_shift(Int x, int n) {
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, n));
  }
  static Vec loadv(const void* base, int64_t i) {
    const auto h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
  static void storev(void* base, int64_t i, const Vec& v, uint32_t key, int64_t index) {
    const Int bits = _mm256_castps_si256(static_cast<__m256>(v));
    Int x = _mm256_xor_si256(_mm256_add_epi32(set1(static_cast<uint32_t>(index)),
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                             set1(key));
    x = mul(xor_shift(x, 16), set1(0x7feb352du));
    x = mul(xor_shift(x, 15), set1(0x846ca68bu));
    x = xor_shift(x, 16);
    const Int noise = _mm256_and_si256(x, set1(0xffffu));
    const Int special =
        _mm256_cmpeq_epi32(_mm256_and_si256(bits, set1(0x7f800000u)), set1(0x7f800000u));
    const Int no_payload =
        _mm256_cmpeq_epi32(_mm256_and_si256(bits, set1(0xffffu)), _mm256_setzero_si256());
    const Int kept = _mm256_or_si256(bits, _mm256_andnot_si256(no_payload, set1(0x10000u)));
    const Int rounded = _mm256_blendv_epi8(_mm256_add_epi32(bits, noise), kept, special);
    // Narrow 8 x 32 to 8 x 16 bits: pack within 128-bit halves, then gather the two low
    // quadwords.
    const Int high = _mm256_srli_epi32(rounded, 16);
    const Int packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i),
                     _mm256_castsi256_si128(packed));
  }
#endif
#endif
};

inline float nan_max(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) {
    const uint32_t all_ones = 0xffffffffu;
    float nan;
    std::memcpy(&nan, &all_ones, sizeof nan);
    return nan;
  }
  return a > b ? a : b;
}

// The order and rounding of every operation is torch::optim::AdamW's as ATen's AVX2/AVX512
// kernels perform it (measured: its exp_avg and exp_avg_sq are bitwise these):
//   p = p * (1 - lr*wd);  m = fma(g, 1-b1, m*b1);  v = fma((1-b2)*g, g, v*b2)
//   p = p + (-lr/bc1 * m) / (sqrt(v) / sqrt(bc2) + eps)
// The one difference: ATen's sqrt of a tensor goes through MKL's vector math, which is not
// always correctly rounded; here sqrt is IEEE (vsqrtps).
template <class M>
void adamw_span(const AdamWScalars& s, const AdamWSpan& x) {
  const uint32_t key_m = span_key(s.rounding_key, x.first),
                 key_v = span_key(s.rounding_key ^ 0x9e3779b9u, x.first),
                 key_x = span_key(s.rounding_key ^ 0x85ebca6bu, x.first);
  int64_t i = 0;
#if FSDP_VECTORIZE
  const Vec decay(s.decay), b1(s.beta1), omb1(s.one_minus_beta1), b2(s.beta2),
      omb2(s.one_minus_beta2), bc2(s.bias_correction2_sqrt), eps(s.eps), nss(s.neg_step_size);
  for (; i + Vec::size() <= x.n; i += Vec::size()) {
    Vec p = Vec::loadu(x.param + i);
    const Vec g = Vec::loadu(x.grad + i);
    if (s.apply_decay)
      p = p * decay;
    const Vec m = at::vec::fmadd(g, omb1, M::loadv(x.exp_avg, i) * b1);
    const Vec v = at::vec::fmadd(omb2 * g, g, M::loadv(x.exp_avg_sq, i) * b2);
    Vec vd = v;
    if (s.amsgrad) {
      vd = at::vec::maximum(M::loadv(x.max_exp_avg_sq, i), v);
      M::storev(x.max_exp_avg_sq, i, vd, key_x, x.first + i);
    }
    const Vec denom = vd.sqrt() / bc2 + eps;
    p = p + (nss * m) / denom;
    p.store(x.param + i);
    M::storev(x.exp_avg, i, m, key_m, x.first + i);
    M::storev(x.exp_avg_sq, i, v, key_v, x.first + i);
  }
#endif
  for (; i < x.n; ++i) {
    float p = x.param[i];
    const float g = x.grad[i];
    if (s.apply_decay)
      p = p * s.decay;
    const float m = std::fma(g, s.one_minus_beta1, M::load(x.exp_avg, i) * s.beta1);
    const float v = std::fma(s.one_minus_beta2 * g, g, M::load(x.exp_avg_sq, i) * s.beta2);
    float vd = v;
    if (s.amsgrad) {
      vd = nan_max(M::load(x.max_exp_avg_sq, i), v);
      M::store(x.max_exp_avg_sq, i, vd, key_x, x.first + i);
    }
    const float denom = std::sqrt(vd) / s.bias_correction2_sqrt + s.eps;
    p = p + (s.neg_step_size * m) / denom;
    x.param[i] = p;
    M::store(x.exp_avg, i, m, key_m, x.first + i);
    M::store(x.exp_avg_sq, i, v, key_v, x.first + i);
  }
}

// torch::optim::SGD, element by element (its adds with alpha are fused multiply-adds in ATen):
//   d = fma(p, wd, g);  buf = first ? d : fma(d, 1-dampening, buf*momentum)
//   d = nesterov ? fma(buf, momentum, d) : buf;  p = fma(d, -lr, p)
template <class M>
void sgd_span(const SGDScalars& s, const SGDSpan& x) {
  const uint32_t key = span_key(s.rounding_key, x.first);
  int64_t i = 0;
#if FSDP_VECTORIZE
  const Vec wd(s.weight_decay), mom(s.momentum), omd(s.one_minus_dampening), nlr(s.neg_lr);
  for (; i + Vec::size() <= x.n; i += Vec::size()) {
    const Vec p = Vec::loadu(x.param + i);
    Vec d = Vec::loadu(x.grad + i);
    if (s.apply_weight_decay)
      d = at::vec::fmadd(p, wd, d);
    if (s.use_momentum) {
      const Vec buf = s.first ? d : at::vec::fmadd(d, omd, M::loadv(x.momentum_buffer, i) * mom);
      M::storev(x.momentum_buffer, i, buf, key, x.first + i);
      d = s.nesterov ? at::vec::fmadd(buf, mom, d) : buf;
    }
    at::vec::fmadd(d, nlr, p).store(x.param + i);
  }
#endif
  for (; i < x.n; ++i) {
    const float p = x.param[i];
    float d = x.grad[i];
    if (s.apply_weight_decay)
      d = std::fma(p, s.weight_decay, d);
    if (s.use_momentum) {
      const float buf =
          s.first ? d
                  : std::fma(d, s.one_minus_dampening, M::load(x.momentum_buffer, i) * s.momentum);
      M::store(x.momentum_buffer, i, buf, key, x.first + i);
      d = s.nesterov ? std::fma(buf, s.momentum, d) : buf;
    }
    x.param[i] = std::fma(d, s.neg_lr, p);
  }
}

void advance(AdamWSpan& x, int64_t bytes) {
  for (void** p : {&x.exp_avg, &x.exp_avg_sq, &x.max_exp_avg_sq})
    if (*p)
      *p = static_cast<char*>(*p) + bytes;
}

void advance(SGDSpan& x, int64_t bytes) {
  if (x.momentum_buffer)
    x.momentum_buffer = static_cast<char*>(x.momentum_buffer) + bytes;
}

// Cuts a span where its element index crosses a multiple of 2^32 (only shards of more than 4G
// elements have such spans), so that span_key holds for all of each piece.
template <class Span, class Fn>
void for_each_span(const Span& x, bool bf16, Fn fn) {
  Span rest = x;
  while (rest.n > 0) {
    const int64_t boundary = ((rest.first >> 32) + 1) << 32;
    Span piece = rest;
    piece.n = std::min(rest.n, boundary - rest.first);
    fn(piece);
    const int64_t es = bf16 ? 2 : 4;
    rest.param += piece.n;
    rest.grad += piece.n;
    rest.first += piece.n;
    rest.n -= piece.n;
    advance(rest, piece.n * es);
  }
}

void adamw(const AdamWScalars& s, const AdamWSpan& x, bool bf16_moments) {
  for_each_span(x, bf16_moments, [&](const AdamWSpan& piece) {
    bf16_moments ? adamw_span<BF16>(s, piece) : adamw_span<F32>(s, piece);
  });
}

void sgd(const SGDScalars& s, const SGDSpan& x, bool bf16_moments) {
  for_each_span(x, bf16_moments, [&](const SGDSpan& piece) {
    bf16_moments ? sgd_span<BF16>(s, piece) : sgd_span<F32>(s, piece);
  });
}

#define FSDP_STRINGIFY2(x) #x
#define FSDP_STRINGIFY(x) FSDP_STRINGIFY2(x)
const KernelTable kTable{FSDP_STRINGIFY(CPU_CAPABILITY), &adamw, &sgd};

}  // namespace
}  // namespace CPU_CAPABILITY

const KernelTable& FSDP_CONCAT(kernel_table_, CPU_CAPABILITY)() {
  return CPU_CAPABILITY::kTable;
}

}  // namespace fsdp::detail
