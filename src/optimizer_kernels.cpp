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
inline uint16_t round_bf16(float value, uint32_t key, int64_t index) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const uint32_t noise = mix(static_cast<uint32_t>(index) ^ key) & 0xffffu;
  const bool special = (bits & 0x7f800000u) == 0x7f800000u;  // inf and NaN keep their class
  const uint32_t rounded = special ? bits | ((bits & 0xffffu) ? 0x10000u : 0u) : bits + noise;
  return static_cast<uint16_t>(rounded >> 16);
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
  // Through a small array: GCC turns both loops into vector widening/narrowing and the hash
  // into vector integer arithmetic.
  static Vec loadv(const void* base, int64_t i) {
    const uint16_t* src = static_cast<const uint16_t*>(base) + i;
    alignas(64) uint32_t wide[Vec::size()];
    for (int k = 0; k < Vec::size(); ++k)
      wide[k] = static_cast<uint32_t>(src[k]) << 16;
    float out[Vec::size()];
    std::memcpy(out, wide, sizeof out);
    return Vec::loadu(out);
  }
  static void storev(void* base, int64_t i, const Vec& v, uint32_t key, int64_t index) {
    alignas(64) float values[Vec::size()];
    v.store(values);
    uint16_t* dst = static_cast<uint16_t*>(base) + i;
    for (int k = 0; k < Vec::size(); ++k)
      dst[k] = round_bf16(values[k], key, index + k);
  }
#endif
};

// torch::max_out: NaN propagates. The NaN is at::vec::maximum's (all bits set), so that the
// scalar tail stores the same bits as the vector loop.
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
