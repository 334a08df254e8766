// Decode attention over a KV cache (float32, float16 or bfloat16, or int8 / int4 / fp8 codes
// with float16 scales):
// one query position per row, the cost following the filled slots only. XLA runs the same
// math as a loop of small fused ops (scores, mask, running softmax, weighted values) whose
// per-op dispatch dominates at decode sizes; here it is one call per layer.
//
// Work is split into chunks of kChunk slots per (row, KV head), each producing a partial
// softmax (max, sum, weighted values) that a final pass merges: the split-K scheme of
// "flash decoding", so one long row still uses every worker.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "common.h"
#include "dispatch.h"
#include "ffi_handlers.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace lowbit {
namespace {

constexpr int64_t kChunk = 128;
// The vector scores pass (attention_chunk.h) prefetches keys this many slots ahead (4 KB at
// D = 64: across the page boundary where the hardware prefetcher stops) and the values of the
// slots it scores (into L2, for the values pass). The cache is read from memory at decode; a
// batch-8 call over 160 slots (forced AVX2, in the model) took 130 us with them against 146.
constexpr int64_t kPrefetchSlots = 16;
// Below this many multiply-adds in all (scores and values) one thread does everything.
constexpr int64_t kMinParallelMacs = int64_t{1} << 16;

// 16 floats: GCC / Clang vector extensions, compiled to one AVX-512 register in the AVX-512
// copy of IntScores (IntScoresAvx512) and to narrower registers in the others.
typedef float V16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));

inline V16 Load(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void Store(float* p, V16 v) { std::memcpy(p, &v, sizeof(v)); }

typedef float V8 __attribute__((vector_size(32)));
typedef int32_t I8 __attribute__((vector_size(32)));
typedef float V4 __attribute__((vector_size(16)));

// Horizontal sum by halves (register extracts, not a round trip through memory).
inline float Sum(V16 v) {
  V8 lo, hi;
  std::memcpy(&lo, &v, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
  const V8 s8 = lo + hi;
  V4 a, b;
  std::memcpy(&a, &s8, sizeof(a));
  std::memcpy(&b, reinterpret_cast<const char*>(&s8) + sizeof(a), sizeof(b));
  const V4 s4 = a + b;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// exp(x) for x <= 0 (a score minus the running maximum), as Cephes' expf: n = round(x log2 e),
// r = x - n ln 2 in two parts, a degree-6 polynomial, scaled by 2^n. Relative error about
// 2e-7; below -87 it returns exp(-87), far below float32's resolution of the sum.
// V: 16 or 8 floats (I: as many int32); always inlined so that each ISA's copy uses its own
// registers.
template <typename V, typename I>
__attribute__((always_inline)) inline V ExpNonPositiveN(V x) {
  const V lo = V{} - 87.0f;
  x = x < lo ? lo : x;
  // Round to nearest by the 1.5 * 2^23 trick (|x log2 e| < 2^22 here).
  const V magic = V{} + 12582912.0f;
  const V n = (x * 1.44269504088896341f + magic) - magic;
  V r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

__attribute__((always_inline)) inline V16 ExpNonPositive(V16 x) {
  return ExpNonPositiveN<V16, I16>(x);
}

inline float ExpNonPositive(float x) {
  V16 v = V16{} + x;
  return ExpNonPositive(v)[0];
}

// Floats per query row of a chunk's score scratch: whole vectors on the vector paths.
constexpr int64_t ScoreStride(int64_t d, int64_t n) {
  return d == 32 || d == 64 || d == 128 ? (n + 15) / 16 * 16 : n;
}

// Two-vector lane shuffle with constant indices (0-15 pick from a, 16-31 from b): one
// vpermt2ps in the AVX-512 copies.
#if defined(__clang__)
#define LOWBIT_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define LOWBIT_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, I16{__VA_ARGS__})
#endif

// The 16 horizontal sums of p[0..15] as one vector (lane u = sum of p[u]'s lanes): four
// levels of pairwise shuffle-and-add, 45 operations where 16 separate sums take about 110.
__attribute__((always_inline)) inline V16 Sum16(const V16* p) {
  V16 c[8], d[4], e[2];
  for (int i = 0; i < 8; ++i)
    c[i] = LOWBIT_SHUFFLE(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                          22, 23) +
           LOWBIT_SHUFFLE(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,
                          28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    d[i] = LOWBIT_SHUFFLE(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24,
                          25, 26, 27) +
           LOWBIT_SHUFFLE(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28,
                          29, 30, 31);
  for (int i = 0; i < 2; ++i)
    e[i] = LOWBIT_SHUFFLE(d[2 * i], d[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24,
                          25, 28, 29) +
           LOWBIT_SHUFFLE(d[2 * i], d[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26,
                          27, 30, 31);
  return LOWBIT_SHUFFLE(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         LOWBIT_SHUFFLE(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// acc[i][d] = sum over slots t of w[i][t] * v[t0 + t] for GB query rows (w: row i at
// w + i * stride): each value row is loaded once for all GB queries.
template <int D16, int GB>
__attribute__((always_inline)) inline void WeightedValues(const float* w, int64_t stride,
                                                          const float* v, int64_t t0, int64_t n,
                                                          float* acc) {
  constexpr int64_t d = 16 * D16;
  V16 a[GB][D16] = {};
  for (int64_t t = 0; t < n; ++t) {
    const float* vr = v + (t0 + t) * d;
    V16 vv[D16];
    for (int c = 0; c < D16; ++c) vv[c] = Load(vr + 16 * c);
    for (int i = 0; i < GB; ++i) {
      const V16 p = V16{} + w[i * stride + t];
      for (int c = 0; c < D16; ++c) a[i][c] += p * vv[c];
    }
  }
  for (int i = 0; i < GB; ++i)
    for (int c = 0; c < D16; ++c) Store(acc + i * d + 16 * c, a[i][c]);
}

// Gemma 2's soft cap on attention scores, cap * tanh(s / cap); cap <= 0 leaves them as they are.
inline void SoftCap(float* row, int64_t n, float cap) {
  if (cap <= 0.0f) return;
  const float inv = 1.0f / cap;
  for (int64_t t = 0; t < n; ++t) row[t] = cap * std::tanh(row[t] * inv);
}

// Partial attention of `g` queries (rows of q, [g][d]) over slots [t0, t1) of one KV head
// (k, v: [slots][d]). Writes the chunk's maximum score m[g], sum of exp(score - m) l[g] and
// weighted values acc[g][d]. `scores` is scratch of g * (t1 - t0 + 15) floats. D16 = d / 16.
// Scores come 16 slots at a time (the key block stays in L1 across the queries); the values
// pass reads each value row once for up to GB queries. The baseline copy: x86-64's AVX2 and
// AVX-512 copies are attention_chunk.h's AttendChunkSimd.
template <int D16>
__attribute__((always_inline)) inline void AttendChunkVec(
    const float* q, int64_t g, const float* k, const float* v, int64_t t0, int64_t t1,
    float* scores, float* m, float* l, float* acc, float cap) {
  constexpr int64_t d = 16 * D16;
  // Query rows per values pass: their accumulators (GB x D16 vectors) stay in registers.
  constexpr int GB = D16 <= 4 ? 4 : 2;
  const int64_t n = t1 - t0;
  const int64_t stride = ScoreStride(d, n);
  for (int64_t i = 0; i < g; ++i) {
    float* row = scores + i * stride;
    if (k != nullptr) {
      V16 qv[D16];
      for (int c = 0; c < D16; ++c) qv[c] = Load(q + i * d + 16 * c);
      int64_t t = 0;
      for (; t + 16 <= n; t += 16) {
        V16 p[16];
        for (int u = 0; u < 16; ++u) {
          const float* kr = k + (t0 + t + u) * d;
          V16 s = qv[0] * Load(kr);
          for (int c = 1; c < D16; ++c) s += qv[c] * Load(kr + 16 * c);
          p[u] = s;
        }
        Store(row + t, Sum16(p));
      }
      for (; t < n; ++t) {
        const float* kr = k + (t0 + t) * d;
        V16 s = qv[0] * Load(kr);
        for (int c = 1; c < D16; ++c) s += qv[c] * Load(kr + 16 * c);
        row[t] = Sum(s);
      }
    }
    SoftCap(row, n, cap);
    float mx = row[0];
    for (int64_t t = 1; t < n; ++t) mx = row[t] > mx ? row[t] : mx;
    // Pad to whole vectors with weight 0 (exp of -inf clamps to exp(-87); zeroed below).
    for (int64_t t = n; t < stride; ++t) row[t] = mx - 1000.0f;
    V16 sum = V16{};
    for (int64_t t = 0; t < stride; t += 16) {
      V16 e = ExpNonPositive(Load(row + t) - mx);
      Store(row + t, e);
    }
    for (int64_t t = n; t < stride; ++t) row[t] = 0.0f;
    for (int64_t t = 0; t < stride; t += 16) sum += Load(row + t);
    m[i] = mx;
    l[i] = Sum(sum);
  }
  for (int64_t i = 0; i < g; i += GB) {
    const float* w = scores + i * stride;
    float* out = acc + i * d;
    switch (std::min<int64_t>(GB, g - i)) {
      case 1:
        WeightedValues<D16, 1>(w, stride, v, t0, n, out);
        break;
      case 2:
        WeightedValues<D16, 2>(w, stride, v, t0, n, out);
        break;
      case 3:
        WeightedValues<D16, (GB >= 3 ? 3 : 1)>(w, stride, v, t0, n, out);
        break;
      default:
        WeightedValues<D16, GB>(w, stride, v, t0, n, out);
        break;
    }
  }
}

// The vector code's instruction set follows the matmul kernels' path (`ActiveIsa`), not the
// CPU: with LOWBIT_CPU_ISA=avx2 every kernel of lowbit runs as on an AVX2-only CPU. (With
// target_clones, which choose by the CPU, a forced AVX2 run still attended with AVX-512.)
enum class Width { kBase, kAvx2, kAvx512 };

// Called once a chunk: a view of the path's name, no copy.
Width ActiveWidth() {
  const std::string_view name = ActiveIsa()->name;
  if (name.substr(0, 6) == "avx512" || name == "amx") return Width::kAvx512;
  if (name.substr(0, 4) == "avx2") return Width::kAvx2;
  return Width::kBase;
}

// The 16-bit float cache elements (float16, bfloat16) as the chunk's template argument.
struct Half {
  uint16_t bits;
};
struct BHalf {
  uint16_t bits;
};

#if defined(__x86_64__)
// The AVX2 and AVX-512 copies of the chunk: attention_chunk.h over each one's vectors.
LOWBIT_TARGET_PUSH("avx2,fma,f16c")
namespace avx2 {
struct Ops {
  using V = __m256;
  using VE = V8;
  using IE = I8;
  static constexpr int kLanes = 8;
  static constexpr int kAccRegs = 8;  // of 16 ymm
  static V Zero() { return _mm256_setzero_ps(); }
  static V Load(const float* p) { return _mm256_loadu_ps(p); }
  static V Load(const Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static V Load(const BHalf* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static void Store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V Bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V Add(V a, V b) { return _mm256_add_ps(a, b); }
  static float Sum(V a);
  static __m256 Fold(const V* a);
};
#include "attention_chunk.h"
inline float Ops::Sum(V a) { return Sum8(a); }
inline __m256 Ops::Fold(const V* a) { return Sum8x8(a); }
}  // namespace avx2
LOWBIT_TARGET_POP

LOWBIT_TARGET_PUSH("avx512f,avx2,fma")
namespace avx512 {
struct Ops {
  using V = __m512;
  using VE = V16;
  using IE = I16;
  static constexpr int kLanes = 16;
  static constexpr int kAccRegs = 16;  // of 32 zmm
  static V Zero() { return _mm512_setzero_ps(); }
  static V Load(const float* p) { return _mm512_loadu_ps(p); }
  static V Load(const Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static V Load(const BHalf* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static void Store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V Bcast(const float* p) { return _mm512_set1_ps(*p); }
  static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V Add(V a, V b) { return _mm512_add_ps(a, b); }
  static float Sum(V a) { return _mm512_reduce_add_ps(a); }
  static __m256 Fold(const V* a);
};
#include "attention_chunk.h"
// Each vector's halves added (8 lanes), then the 8-vector horizontal sums.
inline __m256 Ops::Fold(const V* a) {
  __m256 h[8];
  for (int u = 0; u < 8; ++u)
    h[u] = _mm256_add_ps(_mm512_castps512_ps256(a[u]),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[u]), 1)));
  return Sum8x8(h);
}
}  // namespace avx512
LOWBIT_TARGET_POP
#endif

// The chunk on the path's vector copy; E: the cache's element (float, or Half / BHalf read in
// place and widened as loaded: half the bytes of a float32 cache from memory). False where
// no copy serves E (16-bit elements on the baseline path): the caller widens into scratch.
template <int D16, typename E>
bool AttendChunkWidth(const float* q, int64_t g, const E* k, const E* v, int64_t t0,
                      int64_t t1, float* scores, float* m, float* l, float* acc, float cap) {
  switch (ActiveWidth()) {
#if defined(__x86_64__)
    case Width::kAvx512:
      avx512::AttendChunkSimd<D16>(q, g, k, v, t0, t1, scores, m, l, acc, cap);
      return true;
    case Width::kAvx2:
      avx2::AttendChunkSimd<2 * D16>(q, g, k, v, t0, t1, scores, m, l, acc, cap);
      return true;
#endif
    default:
      if constexpr (!std::is_same_v<E, float>) return false;
      else AttendChunkVec<D16>(q, g, k, v, t0, t1, scores, m, l, acc, cap);
      return true;
  }
}

// Any head size: the same computation with scalar loops.
void AttendChunkScalar(const float* q, int64_t g, int64_t d, const float* k, const float* v,
                       int64_t t0, int64_t t1, float* scores, float* m, float* l, float* acc,
                       float cap) {
  const int64_t n = t1 - t0;
  for (int64_t i = 0; i < g; ++i) {
    float* row = scores + i * ScoreStride(d, n);
    for (int64_t t = 0; k != nullptr && t < n; ++t) {
      const float* kr = k + (t0 + t) * d;
      float s = 0.0f;
      for (int64_t j = 0; j < d; ++j) s += q[i * d + j] * kr[j];
      row[t] = s;
    }
    SoftCap(row, n, cap);
    float mx = row[0];
    for (int64_t t = 1; t < n; ++t) mx = row[t] > mx ? row[t] : mx;
    float sum = 0.0f;
    for (int64_t t = 0; t < n; ++t) sum += (row[t] = ExpNonPositive(row[t] - mx));
    m[i] = mx;
    l[i] = sum;
    float* a = acc + i * d;
    for (int64_t j = 0; j < d; ++j) a[j] = 0.0f;
    for (int64_t t = 0; t < n; ++t) {
      const float* vr = v + (t0 + t) * d;
      for (int64_t j = 0; j < d; ++j) a[j] += row[t] * vr[j];
    }
  }
}

// The chunk's attention (false where only float elements are served: see AttendChunkWidth);
// with k == nullptr the scores are already in `scores` (query row i at
// scores + i * ScoreStride(d, t1 - t0)) and only the softmax and the values remain.
template <typename E>
bool AttendChunk(const float* q, int64_t g, int64_t d, const E* k, const E* v, int64_t t0,
                 int64_t t1, float* scores, float* m, float* l, float* acc, float cap) {
  switch (d) {
    case 32:
      return AttendChunkWidth<2>(q, g, k, v, t0, t1, scores, m, l, acc, cap);
    case 64:
      return AttendChunkWidth<4>(q, g, k, v, t0, t1, scores, m, l, acc, cap);
    case 128:
      return AttendChunkWidth<8>(q, g, k, v, t0, t1, scores, m, l, acc, cap);
    default:
      if constexpr (!std::is_same_v<E, float>) return false;
      else AttendChunkScalar(q, g, d, k, v, t0, t1, scores, m, l, acc, cap);
      return true;
  }
}

// Cache formats (attribute `fmt`), as `lowbit.models` stores them: codes [B, H, L, D] with
// one float16 scale per (slot, head, channel group) for the quantized ones.
enum CacheFormat : int64_t {
  kFloat32 = 0,  // float32 values, no scales
  kInt8 = 1,     // int8 codes: x = code * scale
  kInt4 = 2,     // uint8 [.., D / 2]: channel j in the low nibble, j + D / 2 in the high one,
                 // signed nibbles c with x = (c + 1/2) * scale
  kFp8 = 3,      // float8_e4m3fn codes: x = code * scale
  kFloat16 = 4,  // float16 values, no scales (a 16-bit float cache: half the bytes to read)
  kBFloat16 = 5,  // bfloat16 values, no scales
};

// Whether a format stores codes with float16 scales (the others are plain floats).
constexpr bool Scaled(int64_t fmt) { return fmt >= kInt8 && fmt <= kFp8; }

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(man), -24);  // zero or subnormal
  } else if (exp == 31) {
    f = man ? NAN : INFINITY;
  } else {
    const uint32_t bits = ((exp + 112) << 23) | (man << 13);
    std::memcpy(&f, &bits, sizeof(f));
  }
  return sign ? -f : f;
}

// The 256 float8_e4m3fn values (no infinities; S.1111.111 is NaN).
const float* Fp8Table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int b = 0; b < 256; ++b) {
      const int exp = (b >> 3) & 15, man = b & 7;
      float v = exp == 0 ? std::ldexp(man / 8.0f, -6) : std::ldexp(1.0f + man / 8.0f, exp - 7);
      if (exp == 15 && man == 7) v = NAN;
      t[b] = (b & 0x80) ? -v : v;
    }
    return t;
  }();
  return table.data();
}

// Slots [t0, t1) of one head's codes (`row_bytes` bytes a slot) and scales (`groups` a slot,
// none for the 16-bit float formats) as float32 [t1 - t0][d]. The scalar copy: head sizes the
// vector one (DequantizeSimd) does not take, and non-x86 builds.
void DequantizeScalar(int64_t fmt, const uint8_t* codes, int64_t row_bytes,
                      const uint16_t* scales, int64_t groups, int64_t d, int64_t t0, int64_t t1,
                      float* dst) {
  const float* fp8 = fmt == kFp8 ? Fp8Table() : nullptr;
  for (int64_t t = t0; t < t1; ++t, dst += d) {
    const uint8_t* c = codes + t * row_bytes;
    if (fmt == kInt8) {
      for (int64_t j = 0; j < d; ++j) dst[j] = static_cast<float>(static_cast<int8_t>(c[j]));
    } else if (fmt == kFp8) {
      for (int64_t j = 0; j < d; ++j) dst[j] = fp8[c[j]];
    } else if (fmt == kFloat16 || fmt == kBFloat16) {
      for (int64_t j = 0; j < d; ++j) {
        uint16_t h;
        std::memcpy(&h, c + 2 * j, sizeof(h));
        if (fmt == kFloat16) {
          dst[j] = HalfToFloat(h);
        } else {
          const uint32_t bits = static_cast<uint32_t>(h) << 16;
          std::memcpy(dst + j, &bits, sizeof(bits));
        }
      }
    } else {  // kInt4
      const int64_t half = d / 2;
      for (int64_t j = 0; j < half; ++j) {
        const int lo = static_cast<int8_t>(static_cast<uint8_t>(c[j] << 4)) >> 4;
        const int hi = static_cast<int8_t>(c[j]) >> 4;
        dst[j] = static_cast<float>(lo) + 0.5f;
        dst[j + half] = static_cast<float>(hi) + 0.5f;
      }
    }
    for (int64_t g = 0; g < groups; ++g) {
      const float sc = HalfToFloat(scales[t * groups + g]);
      const int64_t per = d / groups;
      for (int64_t j = g * per; j < (g + 1) * per; ++j) dst[j] *= sc;
    }
  }
}

#if defined(__x86_64__)
// DequantizeScalar's vector copy, 8 channels a step (AVX2 + F16C, for the AVX2 and AVX-512
// paths alike: a pass over one chunk that stays in L2). With the scalar loop an int8 cache
// cost SmolLM2's batch-8 decode 188 us a layer against float32's 118 (forced AVX2, in the
// model); with this one 148. Head sizes of whole 16-channel blocks and scale groups of whole
// 8-channel vectors; DequantizeScalar takes the rest.
LOWBIT_TARGET_PUSH("avx2,fma,f16c")
namespace avx2 {
// 8 bytes at p, sign-extended to int32.
inline __m256i SignedBytes8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

inline __m128i Load16Bytes(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

void DequantizeSimd(int64_t fmt, const uint8_t* codes, int64_t row_bytes, const uint16_t* scales,
                    int64_t groups, int64_t d, int64_t t0, int64_t t1, float* dst) {
  const float* fp8 = fmt == kFp8 ? Fp8Table() : nullptr;
  const int64_t half = d / 2;
  for (int64_t t = t0; t < t1; ++t, dst += d) {
    const uint8_t* c = codes + t * row_bytes;
    switch (fmt) {
      case kInt8:
        for (int64_t j = 0; j < d; j += 8)
          _mm256_storeu_ps(dst + j, _mm256_cvtepi32_ps(SignedBytes8(c + j)));
        break;
      case kFp8:
        for (int64_t j = 0; j < d; j += 8) {
          const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + j));
          _mm256_storeu_ps(dst + j, _mm256_i32gather_ps(fp8, _mm256_cvtepu8_epi32(bytes), 4));
        }
        break;
      case kFloat16:
        for (int64_t j = 0; j < d; j += 8)
          _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(Load16Bytes(c + 2 * j)));
        break;
      case kBFloat16:
        for (int64_t j = 0; j < d; j += 8) {
          const __m256i w = _mm256_cvtepu16_epi32(Load16Bytes(c + 2 * j));
          _mm256_storeu_ps(dst + j, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
        break;
      default: {  // kInt4: signed nibbles (the byte sign-extended, then each nibble's)
        const __m256 h = _mm256_set1_ps(0.5f);
        for (int64_t j = 0; j < half; j += 8) {
          const __m256i b = SignedBytes8(c + j);
          const __m256i lo = _mm256_srai_epi32(_mm256_slli_epi32(b, 28), 28);
          _mm256_storeu_ps(dst + j, _mm256_add_ps(_mm256_cvtepi32_ps(lo), h));
          const __m256i hi = _mm256_srai_epi32(b, 4);
          _mm256_storeu_ps(dst + j + half, _mm256_add_ps(_mm256_cvtepi32_ps(hi), h));
        }
      }
    }
    for (int64_t g = 0; g < groups; ++g) {
      const __m256 sc = _mm256_set1_ps(_cvtsh_ss(scales[t * groups + g]));
      const int64_t per = d / groups;
      for (int64_t j = g * per; j < (g + 1) * per; j += 8)
        _mm256_storeu_ps(dst + j, _mm256_mul_ps(_mm256_loadu_ps(dst + j), sc));
    }
  }
}
}  // namespace avx2
LOWBIT_TARGET_POP
#endif

// DequantizeScalar's contract, on the vector copy where the path and the sizes allow.
void Dequantize(int64_t fmt, const uint8_t* codes, int64_t row_bytes, const uint16_t* scales,
                int64_t groups, int64_t d, int64_t t0, int64_t t1, float* dst) {
#if defined(__x86_64__)
  if (ActiveWidth() != Width::kBase && d % 16 == 0 && (groups == 0 || (d / groups) % 8 == 0))
    return avx2::DequantizeSimd(fmt, codes, row_bytes, scales, groups, d, t0, t1, dst);
#endif
  DequantizeScalar(fmt, codes, row_bytes, scales, groups, d, t0, t1, dst);
}

// Scores of `g` queries (q: [g][d], already scaled) against int8 key codes of slots
// [t0, t1) (kc: [slots][d], one float16 scale per slot and channel group): each query is
// quantized per group to int8 (scale max(absmax / 127, 1e-30), round half to even) and each
// group's dot is an exact int32 product, as `lowbit.models`' `integer_qk` caches define it.
__attribute__((always_inline)) inline void IntScoresVec(
    const float* q, int64_t g, int64_t d, int64_t groups, const int8_t* kc, const uint16_t* ks,
    int64_t t0, int64_t t1, float* scores, int64_t stride) {
  const int64_t per = d / groups;
  std::vector<int8_t> qc(g * d);
  std::vector<float> qs(g * groups);
  for (int64_t i = 0; i < g; ++i) {
    for (int64_t c = 0; c < groups; ++c) {
      const float* src = q + i * d + c * per;
      float amax = 0.0f;
      for (int64_t j = 0; j < per; ++j) amax = std::max(amax, std::fabs(src[j]));
      const float scale = std::max(amax / 127.0f, 1e-30f);
      qs[i * groups + c] = scale;
      for (int64_t j = 0; j < per; ++j)
        qc[i * d + c * per + j] = static_cast<int8_t>(std::nearbyint(src[j] / scale));
    }
  }
  std::vector<float> kscale(groups);
  for (int64_t t = t0; t < t1; ++t) {
    const int8_t* kr = kc + t * d;
    for (int64_t c = 0; c < groups; ++c) kscale[c] = HalfToFloat(ks[t * groups + c]);
    for (int64_t i = 0; i < g; ++i) {
      float total = 0.0f;
      for (int64_t c = 0; c < groups; ++c) {
        int32_t dot = 0;
        for (int64_t j = c * per; j < (c + 1) * per; ++j)
          dot += static_cast<int32_t>(qc[i * d + j]) * static_cast<int32_t>(kr[j]);
        total += static_cast<float>(dot) * qs[i * groups + c] * kscale[c];
      }
      scores[i * stride + (t - t0)] = total;
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"))) void IntScoresAvx512(
    const float* q, int64_t g, int64_t d, int64_t groups, const int8_t* kc, const uint16_t* ks,
    int64_t t0, int64_t t1, float* scores, int64_t stride) {
  IntScoresVec(q, g, d, groups, kc, ks, t0, t1, scores, stride);
}

__attribute__((target("avx2,fma"))) void IntScoresAvx2(
    const float* q, int64_t g, int64_t d, int64_t groups, const int8_t* kc, const uint16_t* ks,
    int64_t t0, int64_t t1, float* scores, int64_t stride) {
  IntScoresVec(q, g, d, groups, kc, ks, t0, t1, scores, stride);
}

void IntScores(const float* q, int64_t g, int64_t d, int64_t groups, const int8_t* kc,
               const uint16_t* ks, int64_t t0, int64_t t1, float* scores, int64_t stride) {
  switch (ActiveWidth()) {
    case Width::kAvx512:
      return IntScoresAvx512(q, g, d, groups, kc, ks, t0, t1, scores, stride);
    case Width::kAvx2:
      return IntScoresAvx2(q, g, d, groups, kc, ks, t0, t1, scores, stride);
    default:
      return IntScoresVec(q, g, d, groups, kc, ks, t0, t1, scores, stride);
  }
}

ffi::Error Invalid(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "lowbit: " + msg);
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                               ffi::AnyBuffer v, ffi::Buffer<ffi::F16> k_scales,
                               ffi::Buffer<ffi::F16> v_scales, ffi::Buffer<ffi::S32> start,
                               ffi::Buffer<ffi::S32> slot, ffi::Buffer<ffi::S32> rows,
                               ffi::ResultBuffer<ffi::F32> out, int64_t fmt, int64_t integer_qk,
                               float softcap) {
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  if (qd.size() != 4) return Invalid("decode attention: q must be [B, H, G, D]");
  const int64_t b = qd[0], h = qd[1], g = qd[2], d = qd[3];
  const ffi::DataType want[] = {ffi::DataType::F32,      ffi::DataType::S8,  ffi::DataType::U8,
                                ffi::DataType::F8E4M3FN, ffi::DataType::F16, ffi::DataType::BF16};
  if (fmt < kFloat32 || fmt > kBFloat16) return Invalid("decode attention: unknown cache format");
  if (integer_qk && fmt != kInt8) return Invalid("decode attention: integer QK needs int8 keys");
  if (k.element_type() != want[fmt] || v.element_type() != want[fmt])
    return Invalid("decode attention: cache codes have the wrong element type for the format");
  const int64_t row = fmt == kInt4 ? d / 2 : d;  // codes per slot
  if (fmt == kInt4 && d % 2 != 0) return Invalid("decode attention: int4 needs an even D");
  // Query row r reads cache row rows[r]: the cache may hold more rows than are decoded.
  if (kd.size() != 4 || kd[1] != h || kd[3] != row)
    return Invalid("decode attention: keys must be [R, H, L, D] matching q [B, H, G, D]");
  const int64_t cache_rows = kd[0];
  if (rows.element_count() != static_cast<size_t>(b))
    return Invalid("decode attention: rows must be [B]");
  for (int64_t r = 0; r < b; ++r)
    if (rows.typed_data()[r] < 0 || rows.typed_data()[r] >= cache_rows)
      return Invalid("decode attention: a row index is outside the cache's rows");
  const int64_t len = kd[2];
  const auto vd = v.dimensions();
  if (vd.size() != 4 || vd[0] != cache_rows || vd[1] != h || vd[2] != len || vd[3] != row)
    return Invalid("decode attention: values must have the keys' shape");
  int64_t groups = 0;
  if (Scaled(fmt)) {
    const auto sd = k_scales.dimensions();
    groups = sd.size() == 4 ? sd[3] : 0;
    if (sd.size() != 4 || sd[0] != cache_rows || sd[1] != h || sd[2] != len || groups < 1 ||
        d % groups != 0 || v_scales.dimensions().size() != 4 ||
        v_scales.element_count() != k_scales.element_count())
      return Invalid("decode attention: scales must be [R, H, L, G] with G dividing D");
  }
  if (start.element_count() != static_cast<size_t>(b))
    return Invalid("decode attention: start must be [B]");
  if (slot.element_count() != 1) return Invalid("decode attention: slot must be a scalar");
  const auto od = out->dimensions();
  if (od.size() != 4 || od[0] != b || od[1] != h || od[2] != g || od[3] != d)
    return Invalid("decode attention: output must be [B, H, G, D]");
  if (b * h * g * d == 0) return ffi::Error::Success();

  const int32_t last = std::min<int64_t>(slot.typed_data()[0], len - 1);
  // Chunks of every (row, head): tasks (row, head, chunk) with their slot ranges.
  struct Task {
    int64_t bh, t0, t1;
  };
  std::vector<Task> tasks;
  std::vector<int64_t> first_task(b * h + 1, 0);
  int64_t macs = 0;
  for (int64_t r = 0; r < b; ++r) {
    const int64_t lo = std::max<int64_t>(0, start.typed_data()[r]);
    for (int64_t head = 0; head < h; ++head) {
      const int64_t bh = r * h + head;
      first_task[bh] = static_cast<int64_t>(tasks.size());
      for (int64_t t0 = lo; t0 <= last; t0 += kChunk)
        tasks.push_back({bh, t0, std::min<int64_t>(last + 1, t0 + kChunk)});
      macs += 2 * std::max<int64_t>(0, last + 1 - lo) * g * d;
    }
  }
  first_task[b * h] = static_cast<int64_t>(tasks.size());

  const int64_t nt = static_cast<int64_t>(tasks.size());
  std::vector<float> ms(nt * g), ls(nt * g), accs(nt * g * d);
  const float* qp = q.typed_data();
  const int64_t code_bytes = fmt == kFloat32 ? 4 : Scaled(fmt) ? 1 : 2;
  const uint8_t* kp = static_cast<const uint8_t*>(k.untyped_data());
  const uint8_t* vp = static_cast<const uint8_t*>(v.untyped_data());
  const uint16_t* ksp = reinterpret_cast<const uint16_t*>(k_scales.typed_data());
  const uint16_t* vsp = reinterpret_cast<const uint16_t*>(v_scales.typed_data());
  const int64_t workers = macs < kMinParallelMacs ? 1 : NumWorkers(pool);
  ParallelFor(pool, workers, nt, [&](int64_t i) {
    const Task& t = tasks[i];
    const int64_t n = t.t1 - t.t0;
    std::vector<float> scores(g * ScoreStride(d, n));
    const float* qi = qp + t.bh * g * d;
    float *mi = ms.data() + i * g, *li = ls.data() + i * g, *ai = accs.data() + i * g * d;
    // The (cache row, head) this task reads.
    const int64_t ch = rows.typed_data()[t.bh / h] * h + t.bh % h;
    const int64_t head = ch * len * row * code_bytes;
    // A float cache read in place, elements of the type of `e` (a float32 one always is).
    auto in_place = [&](auto e) {
      using E = decltype(e);
      return AttendChunk(qi, g, d, reinterpret_cast<const E*>(kp + head),
                         reinterpret_cast<const E*>(vp + head), t.t0, t.t1, scores.data(), mi,
                         li, ai, softcap);
    };
    if ((fmt == kFloat32 && in_place(0.0f)) || (fmt == kFloat16 && in_place(Half{})) ||
        (fmt == kBFloat16 && in_place(BHalf{})))
      return;
    // A quantized or 16-bit cache: this chunk's keys and values as float32 scratch (32 KB
    // each at D = 64), then the float path.
    std::vector<float> kf(integer_qk ? 0 : n * d), vf(n * d);
    const int64_t sc = ch * len * groups;
    if (integer_qk) {
      IntScores(qi, g, d, groups, reinterpret_cast<const int8_t*>(kp + head), ksp + sc, t.t0,
                t.t1, scores.data(), ScoreStride(d, n));
    } else {
      Dequantize(fmt, kp + head, row * code_bytes, ksp + sc, groups, d, t.t0, t.t1, kf.data());
    }
    Dequantize(fmt, vp + head, row * code_bytes, vsp + sc, groups, d, t.t0, t.t1, vf.data());
    AttendChunk<float>(qi, g, d, integer_qk ? nullptr : kf.data(), vf.data(), 0, n,
                       scores.data(), mi, li, ai, softcap);
  });

  // Merge the chunks of each (row, head): rescale each to the overall maximum.
  float* o = out->typed_data();
  for (int64_t bh = 0; bh < b * h; ++bh) {
    const int64_t c0 = first_task[bh], c1 = first_task[bh + 1];
    for (int64_t i = 0; i < g; ++i) {
      float* dst = o + (bh * g + i) * d;
      for (int64_t j = 0; j < d; ++j) dst[j] = 0.0f;
      if (c0 == c1) continue;  // no slot to attend to (start beyond slot): zeros
      float mx = ms[c0 * g + i];
      for (int64_t c = c0 + 1; c < c1; ++c) mx = std::max(mx, ms[c * g + i]);
      float total = 0.0f;
      for (int64_t c = c0; c < c1; ++c) {
        const float w = std::exp(ms[c * g + i] - mx);
        total += ls[c * g + i] * w;
        const float* a = accs.data() + (c * g + i) * d;
        for (int64_t j = 0; j < d; ++j) dst[j] += a[j] * w;
      }
      const float inv = 1.0f / total;
      for (int64_t j = 0; j < d; ++j) dst[j] *= inv;
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace lowbit

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowbitDecodeAttention, lowbit::DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("fmt")
                                  .Attr<int64_t>("integer_qk")
                                  .Attr<float>("softcap"));
