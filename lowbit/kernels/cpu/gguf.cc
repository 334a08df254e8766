// Products and dequantization of weights held as GGUF block rows (gguf_blocks.h): the
// weight is [N, row_bytes], row n the blocks of output n along K, exactly as the file stores
// it. Two arithmetics, both decoding each 256-element unit once per call and reusing it for
// every activation row:
//   - float activations: sum_i (ws q_i + wm) x_i = ws * sum q_i x_i + wm * sum x_i;
//   - int8 activations (llama.cpp's Q8_0 blocks: one float scale per 32, absmax / 127, round
//     half to even): integer dots of q with the codes, then ws * da per 16 and the minimum
//     term from the per-16 activation sums.
// AVX2 (FMA, F16C) code where the CPU path is AVX2 or above; portable code on the scalar path.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "common.h"
#include "dispatch.h"
#include "ffi_handlers.h"
#include "gguf_args.h"
#include "gguf_vnni.h"
#include "gguf_blocks.h"
#include "gguf_tiles.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace lowbit {
namespace gguf {
namespace {

ffi::Error Invalid(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "lowbit: " + msg);
}

// One activation row [kp] (zero-padded past K) to int8 codes per block of `per`: d = amax /
// 127, codes round(x / d) half to even, and per 16 the integer sum (bs) and d times it (sums).
// A NaN or Inf activation makes its block's scale NaN, so the outputs are NaN as a float
// product's would be; a zero block gives zero codes and a zero scale, never a NaN one.
// The portable copy; the AVX2 one (avx2::QuantizeRowQ8) gives the same bytes.
using QuantizeRowFn = void (*)(const float*, int64_t, int, int8_t*, float*, int16_t*, float*);

void QuantizeRowQ8(const float* row, int64_t kp, int per, int8_t* a, float* da, int16_t* bs,
                   float* sums) {
  for (int64_t g = 0; g < kp / per; ++g) {
    const float* v = row + per * g;
    float amax = 0.0f;
    bool finite = true;
    for (int i = 0; i < per; ++i) {
      amax = std::max(amax, std::fabs(v[i]));
      finite = finite && std::isfinite(v[i]);
    }
    const float d = amax / 127.0f;
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < per; ++i) {
      const float t = v[i] * id;
      const int qv = static_cast<int>(std::nearbyint(std::isfinite(t) ? t : 0.0f));
      a[per * g + i] = static_cast<int8_t>(std::clamp(qv, -127, 127));
    }
    da[g] = finite ? d : std::numeric_limits<float>::quiet_NaN();
  }
  for (int64_t g = 0; g < kp / 16; ++g) {
    int s = 0;
    for (int i = 0; i < 16; ++i) s += a[16 * g + i];
    bs[g] = static_cast<int16_t>(s);
    sums[g] = da[16 * g / per] * static_cast<float>(s);
  }
}

// Activations of a call: rows in parallel from 16 rows on. The rows were quantized one at a
// time with a libm rounding call per element (no SSE4.1 in the baseline copy): at 128 rows of
// K = 576 that cost about 1 ms, more than the product itself.
void PrepareActs(ffi::ThreadPool& pool, QuantizeRowFn quantize, const void* x, bool bf16,
                 int64_t m, int64_t k, bool q8, int per, Acts* acts) {
  acts->m = m;
  acts->kp = (k + kUnit - 1) / kUnit * kUnit;
  acts->q8 = q8;
  acts->per = per;
  const int64_t kp = acts->kp;
  acts->sums.assign(m * (kp / 16), 0.0f);
  if (q8) {
    acts->a.assign(m * kp, 0);
    acts->da.assign(m * (kp / per), 0.0f);
    acts->bs.assign(m * (kp / 16), 0);
  } else {
    acts->x.assign(m * kp, 0.0f);
  }
  const int64_t workers = m < 16 ? 1 : NumWorkers(pool);
  const int64_t chunks = std::min<int64_t>(m, workers > 1 ? 4 * workers : 1);
  ParallelFor(pool, workers, chunks, [&](int64_t c) {
    std::vector<float> row(kp, 0.0f);
    for (int64_t r = m * c / chunks; r < m * (c + 1) / chunks; ++r) {
      if (bf16) {
        const uint16_t* src = static_cast<const uint16_t*>(x) + r * k;
        for (int64_t i = 0; i < k; ++i) row[i] = Bf16ToF32(src[i]);
      } else {
        std::memcpy(row.data(), static_cast<const float*>(x) + r * k, sizeof(float) * k);
      }
      float* sums = acts->sums.data() + r * (kp / 16);
      if (!q8) {
        std::memcpy(acts->x.data() + r * kp, row.data(), sizeof(float) * kp);
        for (int64_t g = 0; g < kp / 16; ++g) {
          float s = 0.0f;
          for (int i = 0; i < 16; ++i) s += row[16 * g + i];
          sums[g] = s;
        }
        continue;
      }
      quantize(row.data(), kp, per, acts->a.data() + r * kp, acts->da.data() + r * (kp / per),
               acts->bs.data() + r * (kp / 16), sums);
    }
  });
}

// Blocks in unit u of a row, and the unit's first byte.
inline int UnitBlocks(const Weight& w, int64_t u) {
  const TypeInfo& t = kTypes[w.type];
  const int64_t per = kUnit / t.block;
  return static_cast<int>(std::min<int64_t>(per, w.k / t.block - u * per));
}

inline const uint8_t* UnitBytes(const Weight& w, int64_t row, int64_t u) {
  const TypeInfo& t = kTypes[w.type];
  return w.data + row * w.row_bytes + u * (kUnit / t.block) * t.bytes;
}

using RowsFn = void (*)(const Weight&, const Acts&, int64_t, int64_t, float*);
using DequantFn = void (*)(const Weight&, int64_t, int64_t, float*);

// ---- portable path -------------------------------------------------------------------------
namespace portable {
#define LOWBIT_GGUF_HALF(p) Half(p)
#include "gguf_decode_impl.h"
#undef LOWBIT_GGUF_HALF

template <int type>
void Rows(const Weight& w, const Acts& acts, int64_t n0, int64_t n1, float* out) {
  constexpr bool has_min = kTypes[type].has_min;
  const int64_t units = acts.kp / kUnit;
  Unit u;
  std::vector<double> acc(acts.m);
  for (int64_t n = n0; n < n1; ++n) {
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t ui = 0; ui < units; ++ui) {
      const int blocks = UnitBlocks(w, ui);
      const uint8_t* b = UnitBytes(w, n, ui);
      const int count = blocks * kTypes[type].block;
      DecodeScales<type>(b, blocks, &u);
      DecodeCodesScalar<type>(b, blocks, u.q);
      for (int64_t r = 0; r < acts.m; ++r) {
        const float* sums = acts.sums.data() + r * (acts.kp / 16) + ui * 16;
        float total = 0.0f;
        for (int g = 0; g < count / 16; ++g) {
          float dot = 0.0f;
          if (acts.q8) {
            const int8_t* a = acts.a.data() + r * acts.kp + ui * kUnit + 16 * g;
            int32_t s = 0;
            for (int i = 0; i < 16; ++i) s += static_cast<int32_t>(u.q[16 * g + i]) * a[i];
            const int64_t block = (ui * kUnit + 16 * g) / acts.per;
            dot = static_cast<float>(s) * acts.da[r * (acts.kp / acts.per) + block];
          } else {
            const float* x = acts.x.data() + r * acts.kp + ui * kUnit + 16 * g;
            for (int i = 0; i < 16; ++i) dot += static_cast<float>(u.q[16 * g + i]) * x[i];
          }
          total += u.ws[g] * dot;
          if (has_min) total += u.wm[g] * sums[g];
        }
        acc[r] += total;
      }
    }
    for (int64_t r = 0; r < acts.m; ++r) out[r * w.n + n] = static_cast<float>(acc[r]);
  }
}

template <int type>
void Dequant(const Weight& w, int64_t n0, int64_t n1, float* out) {
  constexpr bool has_min = kTypes[type].has_min;
  const int64_t units = (w.k + kUnit - 1) / kUnit;
  Unit u;
  for (int64_t n = n0; n < n1; ++n) {
    float* y = out + n * w.k;
    for (int64_t ui = 0; ui < units; ++ui) {
      const int blocks = UnitBlocks(w, ui);
      const uint8_t* b = UnitBytes(w, n, ui);
      const int count = blocks * kTypes[type].block;
      DecodeScales<type>(b, blocks, &u);
      DecodeCodesScalar<type>(b, blocks, u.q);
      for (int i = 0; i < count; ++i) {
        const float v = u.ws[i / 16] * static_cast<float>(u.q[i]);
        y[ui * kUnit + i] = has_min ? v + u.wm[i / 16] : v;
      }
    }
  }
}
}  // namespace portable

// ---- AVX2 path -----------------------------------------------------------------------------
#if defined(__x86_64__)
LOWBIT_TARGET_PUSH("avx2,fma,f16c,bmi,bmi2")
namespace avx2 {
inline float HalfF16c(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
#define LOWBIT_GGUF_HALF(p) HalfF16c(p)
#include "gguf_decode_impl.h"
#undef LOWBIT_GGUF_HALF

inline __m256i Nibbles(const uint8_t* p) {  // 16 bytes -> low nibbles then high nibbles
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
  return _mm256_and_si256(both, _mm256_set1_epi8(15));
}

inline __m256i Lookup16(__m256i idx, const int8_t* table) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(table));
  return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), idx);
}

// 32 bits -> 32 bytes, byte i 0xFF where bit i is set.
inline __m256i BitsToBytes(uint32_t bits) {
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                         0x0101010101010101, 0x0000000000000000);
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuf);
  v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
}

inline void Store32(int8_t* q, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(q), v); }
inline __m256i Load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The 32 codes of one block of a 32-element type, in a register.
template <int type>
inline __m256i BlockCodes(const uint8_t* b) {
  if constexpr (type == kQ4_0) {
    return _mm256_sub_epi8(Nibbles(b + 2), _mm256_set1_epi8(8));
  } else if constexpr (type == kQ4_1) {
    return Nibbles(b + 4);
  } else if constexpr (type == kIQ4_NL) {
    return Lookup16(Nibbles(b + 2), kIq4Values);
  } else if constexpr (type == kQ5_0 || type == kQ5_1) {
    constexpr int hoff = type == kQ5_0 ? 2 : 4;
    uint32_t qh;
    std::memcpy(&qh, b + hoff, 4);
    const __m256i v = _mm256_or_si256(Nibbles(b + hoff + 4),
                                      _mm256_and_si256(BitsToBytes(qh), _mm256_set1_epi8(16)));
    if constexpr (type == kQ5_0) return _mm256_sub_epi8(v, _mm256_set1_epi8(16));
    return v;
  } else {
    static_assert(type == kQ8_0);
    return Load32(b + 2);
  }
}

template <int type>
inline void DecodeCodes(const uint8_t* b, int blocks, int8_t* q) {
  const __m256i m15 = _mm256_set1_epi8(15);
  const __m256i m3 = _mm256_set1_epi8(3);
  constexpr TypeInfo t = kTypes[type];
  if constexpr (t.block == 32) {
    for (int j = 0; j < blocks; ++j, b += t.bytes, q += 32) Store32(q, BlockCodes<type>(b));
  } else if constexpr (type == kQ2_K || type == kQ3_K) {
    constexpr bool three = type == kQ3_K;
    const uint8_t* qs = b + (three ? 32 : 16);
    const __m256i hm = Load32(b);
    for (int n = 0; n < 2; ++n) {
      const __m256i v = Load32(qs + 32 * n);
      for (int j = 0; j < 4; ++j) {
        __m256i c = _mm256_and_si256(_mm256_srli_epi16(v, 2 * j), m3);
        if constexpr (three) {
          const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << (4 * n + j)));
          const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
          c = _mm256_sub_epi8(c, _mm256_andnot_si256(set, _mm256_set1_epi8(4)));
        }
        Store32(q + 128 * n + 32 * j, c);
      }
    }
  } else if constexpr (type == kQ4_K || type == kQ5_K) {
    constexpr bool five = type == kQ5_K;
    const uint8_t* qs = b + (five ? 48 : 16);
    const __m256i qh = Load32(b + 16);
    for (int c = 0; c < 4; ++c) {
      const __m256i v = Load32(qs + 32 * c);
      __m256i lo = _mm256_and_si256(v, m15);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
      if constexpr (five) {
        const __m256i b0 = _mm256_set1_epi8(static_cast<char>(1 << (2 * c)));
        const __m256i b1 = _mm256_set1_epi8(static_cast<char>(1 << (2 * c + 1)));
        const __m256i s16 = _mm256_set1_epi8(16);
        lo = _mm256_or_si256(
            lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), s16));
        hi = _mm256_or_si256(
            hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), s16));
      }
      Store32(q + 64 * c, lo);
      Store32(q + 64 * c + 32, hi);
    }
  } else if constexpr (type == kQ6_K) {
    const __m256i m48 = _mm256_set1_epi8(48), s32 = _mm256_set1_epi8(32);
    for (int n = 0; n < 2; ++n) {
      const __m256i l0 = Load32(b + 64 * n), l1 = Load32(b + 64 * n + 32);
      const __m256i h = Load32(b + 128 + 32 * n);
      // (qh >> 2s) & 3 moved to bits 4..5
      const __m256i h0 = _mm256_and_si256(_mm256_slli_epi16(h, 4), m48);
      const __m256i h1 = _mm256_and_si256(_mm256_slli_epi16(h, 2), m48);
      const __m256i h2 = _mm256_and_si256(h, m48);
      const __m256i h3 = _mm256_and_si256(_mm256_srli_epi16(h, 2), m48);
      const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(l0, 4), m15);
      const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(l1, 4), m15);
      int8_t* y = q + 128 * n;
      Store32(y, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(l0, m15), h0), s32));
      Store32(y + 32, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(l1, m15), h1), s32));
      Store32(y + 64, _mm256_sub_epi8(_mm256_or_si256(hi0, h2), s32));
      Store32(y + 96, _mm256_sub_epi8(_mm256_or_si256(hi1, h3), s32));
    }
  } else if constexpr (type == kIQ4_XS) {
    for (int j = 0; j < 8; ++j) Store32(q + 32 * j, Lookup16(Nibbles(b + 8 + 16 * j), kIq4Values));
  }
}

inline float Hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Codes that are never negative multiply as unsigned bytes directly; signed ones through
// their magnitudes and the activations' signs.
template <int type>
constexpr bool kUnsignedCodes = type == kQ4_1 || type == kQ5_1 || type == kQ2_K ||
                                type == kQ4_K || type == kQ5_K;

template <int type>
inline __m256i ByteDots(__m256i q, __m256i a) {  // 16 int16 pair sums of q * a
  if constexpr (kUnsignedCodes<type>) {
    return _mm256_maddubs_epi16(q, a);
  } else {
    return _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(a, q));
  }
}

// The row loops take activation rows M at a time (M = 1, 2, 4 or 8), their accumulators in
// registers: an accumulator kept in memory put a store-to-load round trip on every block's
// dependency chain (measured: the single-row loop ran at half the speed).

// 32-element types: each block decoded in a register and multiplied with the M activation
// rows, no unit buffer (these types carry one float scale a block, nothing to share).
template <int type, int M>
void Rows32(const Weight& w, const Acts& acts, int64_t r0, int64_t n0, int64_t n1, float* out) {
  constexpr bool has_min = kTypes[type].has_min;
  constexpr int bytes = kTypes[type].bytes;
  const int64_t blocks = w.k / 32, kp = acts.kp;
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* a0 = acts.q8 ? acts.a.data() + r0 * kp : nullptr;
  const float* da0 = acts.q8 ? acts.da.data() + r0 * (kp / 32) : nullptr;
  const float* x0 = acts.q8 ? nullptr : acts.x.data() + r0 * kp;
  const float* s0 = acts.sums.data() + r0 * (kp / 16);
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[M];
    float macc[M];
    for (int r = 0; r < M; ++r) {
      acc[r] = _mm256_setzero_ps();
      macc[r] = 0.0f;
    }
    const uint8_t* b = w.data + n * w.row_bytes;
    for (int64_t j = 0; j < blocks; ++j, b += bytes) {
      _mm_prefetch(reinterpret_cast<const char*>(b) + 512, _MM_HINT_T0);
      const __m256i q = BlockCodes<type>(b);
      const float d = HalfF16c(b);
      if (acts.q8) {
#pragma GCC unroll 8
        for (int r = 0; r < M; ++r) {
          const __m256i p = ByteDots<type>(q, Load32(a0 + r * kp + 32 * j));
          const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
          acc[r] = _mm256_fmadd_ps(dots, _mm256_set1_ps(d * da0[r * (kp / 32) + j]), acc[r]);
        }
      } else {
        const __m256i q16a = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
        const __m256i q16b = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(q16a)));
        const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(q16a, 1)));
        const __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(q16b)));
        const __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(q16b, 1)));
        const __m256 dv = _mm256_set1_ps(d);
#pragma GCC unroll 8
        for (int r = 0; r < M; ++r) {
          const float* x = x0 + r * kp + 32 * j;
          __m256 t = _mm256_mul_ps(q0, _mm256_loadu_ps(x));
          t = _mm256_fmadd_ps(q1, _mm256_loadu_ps(x + 8), t);
          t = _mm256_fmadd_ps(q2, _mm256_loadu_ps(x + 16), t);
          t = _mm256_fmadd_ps(q3, _mm256_loadu_ps(x + 24), t);
          acc[r] = _mm256_fmadd_ps(t, dv, acc[r]);
        }
      }
      if constexpr (has_min) {
        const float mn = HalfF16c(b + 2);
        for (int r = 0; r < M; ++r) {
          const float* sums = s0 + r * (kp / 16) + 2 * j;
          macc[r] += mn * (sums[0] + sums[1]);
        }
      }
    }
    for (int r = 0; r < M; ++r) out[(r0 + r) * w.n + n] = Hsum(acc[r]) + macc[r];
  }
}

// 256-element types: a unit decoded once into `Unit` (codes, and the integer scales as pshufb
// operands or the float ones), then multiplied with the M activation rows.
template <int type, int M>
void RowsK(const Weight& w, const Acts& acts, int64_t r0, int64_t n0, int64_t n1, float* out) {
  constexpr bool has_min = kTypes[type].has_min;
  const int64_t units = acts.kp / kUnit, kp = acts.kp;
  Unit u;
  __m256i iscale[8];
  // pshufb controls: chunk c's two int16 scales (2c, 2c+1 of a lane holding 8) to 8 copies
  const __m256i kPick[4] = {
      _mm256_set_epi64x(0x0302030203020302, 0x0302030203020302, 0x0100010001000100, 0x0100010001000100),
      _mm256_set_epi64x(0x0706070607060706, 0x0706070607060706, 0x0504050405040504, 0x0504050405040504),
      _mm256_set_epi64x(0x0b0a0b0a0b0a0b0a, 0x0b0a0b0a0b0a0b0a, 0x0908090809080908, 0x0908090809080908),
      _mm256_set_epi64x(0x0f0e0f0e0f0e0f0e, 0x0f0e0f0e0f0e0f0e, 0x0d0c0d0c0d0c0d0c, 0x0d0c0d0c0d0c0d0c)};
  const float* s0 = acts.sums.data() + r0 * (kp / 16);
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[M], macc[M];
    for (int r = 0; r < M; ++r) acc[r] = macc[r] = _mm256_setzero_ps();
    for (int64_t ui = 0; ui < units; ++ui) {
      const uint8_t* b = UnitBytes(w, n, ui);
      _mm_prefetch(reinterpret_cast<const char*>(b) + 2 * kTypes[type].bytes, _MM_HINT_T0);
      DecodeCodes<type>(b, 1, u.q);
      if (acts.q8) {
        __m256i s16, imins = _mm256_setzero_si256();
        if constexpr (type == kQ4_K || type == kQ5_K) {
          // The 12 scale bytes unpacked in four words (scales 0..3, 4..7, mins 0..3, 4..7),
          // then each byte doubled: one int16 per 16 elements.
          uint32_t w3[3];
          std::memcpy(w3, b + 4, 12);
          const uint32_t lo6 = 0x3f3f3f3fu, lo4 = 0x0f0f0f0fu, lo2 = 0x03030303u;
          const __m128i v = _mm_set_epi32(
              static_cast<int>(((w3[2] >> 4) & lo4) | (((w3[1] >> 6) & lo2) << 4)),
              static_cast<int>(w3[1] & lo6),
              static_cast<int>((w3[2] & lo4) | (((w3[0] >> 6) & lo2) << 4)),
              static_cast<int>(w3[0] & lo6));
          s16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v));
          imins = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(v, v));
          u.d = HalfF16c(b);
          u.dmin = HalfF16c(b + 2);
        } else {
          alignas(16) int8_t is[16];
          alignas(16) uint8_t im[16] = {};
          IntScales<type>(b, is, im, &u.d, &u.dmin);
          s16 = _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(is)));
          if constexpr (has_min)
            imins = _mm256_cvtepu8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(im)));
        }
        // [is[2c] x8 | is[2c+1] x8]: int16 scales in the order of maddubs' pair sums
        const __m256i lanes[2] = {_mm256_permute2x128_si256(s16, s16, 0x00),
                                  _mm256_permute2x128_si256(s16, s16, 0x11)};
        for (int c = 0; c < 8; ++c) iscale[c] = _mm256_shuffle_epi8(lanes[c / 4], kPick[c % 4]);
#pragma GCC unroll 8
        for (int r = 0; r < M; ++r) {
          const int8_t* a = acts.a.data() + (r0 + r) * kp + ui * kUnit;
          __m256i isum = _mm256_setzero_si256();
          for (int c = 0; c < 8; ++c) {
            const __m256i p = ByteDots<type>(
                _mm256_load_si256(reinterpret_cast<const __m256i*>(u.q + 32 * c)), Load32(a + 32 * c));
            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, iscale[c]));
          }
          const float da = acts.da[(r0 + r) * units + ui];
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(u.d * da), acc[r]);
          if constexpr (has_min) {
            const __m256i bs = Load32(acts.bs.data() + (r0 + r) * (kp / 16) + ui * 16);
            const __m256i mins = _mm256_madd_epi16(imins, bs);
            macc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_set1_ps(u.dmin * da), macc[r]);
          }
        }
      } else {
        DecodeScales<type>(b, 1, &u);
#pragma GCC unroll 8
        for (int r = 0; r < M; ++r) {
          const float* x = acts.x.data() + (r0 + r) * kp + ui * kUnit;
          __m256 s = acc[r];
          for (int c = 0; c < 8; ++c) {
            const int8_t* qc = u.q + 32 * c;
            const float* xc = x + 32 * c;
            const __m256i q16a = _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(qc)));
            const __m256i q16b = _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(qc + 16)));
            const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(q16a)));
            const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(q16a, 1)));
            const __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(q16b)));
            const __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(q16b, 1)));
            const __m256 t0 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xc + 8), _mm256_mul_ps(q0, _mm256_loadu_ps(xc)));
            const __m256 t1 = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xc + 24), _mm256_mul_ps(q2, _mm256_loadu_ps(xc + 16)));
            s = _mm256_fmadd_ps(t0, _mm256_set1_ps(u.ws[2 * c]), s);
            s = _mm256_fmadd_ps(t1, _mm256_set1_ps(u.ws[2 * c + 1]), s);
          }
          acc[r] = s;
          if constexpr (has_min) {
            const float* sums = s0 + r * (kp / 16) + ui * 16;
            macc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(u.wm), _mm256_loadu_ps(sums), macc[r]);
            macc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(u.wm + 8), _mm256_loadu_ps(sums + 8), macc[r]);
          }
        }
      }
    }
    for (int r = 0; r < M; ++r) out[(r0 + r) * w.n + n] = Hsum(_mm256_add_ps(acc[r], macc[r]));
  }
}


// ---- tiles of 8 rows (gguf_tiles.h), int8 activations --------------------------------------
// Every cache line of the tile `ahead` tiles on: a tile is 19 (Q4_K) or 27 (Q6_K) lines read
// from three places at once, which the hardware prefetcher alone follows too late.
template <int tb>
inline void PrefetchTile(const uint8_t* t) {
  for (int off = 0; off < tb; off += 64) _mm_prefetch(reinterpret_cast<const char*>(t) + off, _MM_HINT_T0);
}

inline __m256i Bcast4(const int8_t* a) {
  int32_t v;
  std::memcpy(&v, a, 4);
  return _mm256_set1_epi32(v);
}

// int16 pair (lo, hi) broadcast to every int32 lane: madd's second operand.
inline __m256i Pair16(int lo, int hi) {
  return _mm256_set1_epi32(static_cast<int>((static_cast<uint32_t>(hi) << 16) |
                                            (static_cast<uint32_t>(lo) & 0xffffu)));
}

// Q4_K: per sub-block of 32, 8 maddubs sums of 8 rows x 4 elements kept in int16 (at most
// 8 * 2 * 15 * 127 = 30480), then one madd with the 8 rows' scales.
template <int M>
void TilesQ4KOne(const Weight& w, const Acts& acts, int64_t r0, int64_t g0, int64_t g1, float* out) {
  constexpr int tb = TileBytes(kQ4_K);
  const int64_t units = w.k / kUnit, kp = acts.kp;
  const __m256i m15 = _mm256_set1_epi8(15);
  for (int64_t g = g0; g < g1; ++g) {
    __m256 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t u = 0; u < units; ++u) {
      const uint8_t* t = w.data + g * w.row_bytes + u * tb;
      PrefetchTile<tb>(t + 2 * tb);
      __m256i isum[M], imin[M];
      for (int r = 0; r < M; ++r) isum[r] = imin[r] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        __m256i slo[M], shi[M];
        for (int r = 0; r < M; ++r) slo[r] = shi[r] = _mm256_setzero_si256();
        const uint8_t* qs = t + 160 + 256 * j;
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) {
          const __m256i v = Load32(qs + 32 * c);
          const __m256i lo = _mm256_and_si256(v, m15);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
#pragma GCC unroll 4
          for (int r = 0; r < M; ++r) {
            const int8_t* a = acts.a.data() + (r0 + r) * kp + u * kUnit + 64 * j + 4 * c;
            slo[r] = _mm256_add_epi16(slo[r], _mm256_maddubs_epi16(lo, Bcast4(a)));
            shi[r] = _mm256_add_epi16(shi[r], _mm256_maddubs_epi16(hi, Bcast4(a + 32)));
          }
        }
        __m256i sl = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(t + 32 + 16 * j)));
        __m256i sh = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(t + 40 + 16 * j)));
        sl = _mm256_or_si256(sl, _mm256_slli_epi32(sl, 16));
        sh = _mm256_or_si256(sh, _mm256_slli_epi32(sh, 16));
        for (int r = 0; r < M; ++r)
          isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_madd_epi16(slo[r], sl),
                                                               _mm256_madd_epi16(shi[r], sh)));
      }
      for (int p = 0; p < 4; ++p) {
        const __m256i mv =
            _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 96 + 16 * p)));
        for (int r = 0; r < M; ++r) {
          const int16_t* bs = acts.bs.data() + (r0 + r) * (kp / 16) + u * 16 + 4 * p;
          imin[r] = _mm256_add_epi32(imin[r], _mm256_madd_epi16(mv, Pair16(bs[0] + bs[1], bs[2] + bs[3])));
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
      const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16)));
      for (int r = 0; r < M; ++r) {
        const __m256 da = _mm256_set1_ps(acts.da[(r0 + r) * units + u]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, da), acc[r]);
        acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin[r]), _mm256_mul_ps(dm, da), acc[r]);
      }
    }
    for (int r = 0; r < M; ++r) _mm256_storeu_ps(out + (r0 + r) * w.n + kTileRows * g, acc[r]);
  }
}


// Several activation rows: each tile's codes decoded once into `lo` / `hi` (2 KiB, in L1),
// then read by every row; the row's sums in registers.
template <int M>
void TilesQ4K(const Weight& w, const Acts& acts, int64_t r0, int64_t g0, int64_t g1, float* out) {
  if constexpr (M == 1) {
    TilesQ4KOne<1>(w, acts, r0, g0, g1, out);
  } else {
    constexpr int tb = TileBytes(kQ4_K);
    const int64_t units = w.k / kUnit, kp = acts.kp;
    const __m256i m15 = _mm256_set1_epi8(15);
    alignas(32) uint8_t lo[32][32], hi[32][32];
    for (int64_t g = g0; g < g1; ++g) {
      __m256 acc[M];
      for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t u = 0; u < units; ++u) {
        const uint8_t* t = w.data + g * w.row_bytes + u * tb;
        PrefetchTile<tb>(t + 2 * tb);
        for (int c = 0; c < 32; ++c) {
          const __m256i v = Load32(t + 160 + 32 * c);
          _mm256_store_si256(reinterpret_cast<__m256i*>(lo[c]), _mm256_and_si256(v, m15));
          _mm256_store_si256(reinterpret_cast<__m256i*>(hi[c]),
                             _mm256_and_si256(_mm256_srli_epi16(v, 4), m15));
        }
        __m256i sc[8], mv[4];
        for (int s = 0; s < 8; ++s) {
          const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(t + 32 + 8 * s)));
          sc[s] = _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
        }
        for (int p = 0; p < 4; ++p)
          mv[p] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 96 + 16 * p)));
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
        const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16)));
        for (int r = 0; r < M; ++r) {
          const int8_t* a = acts.a.data() + (r0 + r) * kp + u * kUnit;
          const int16_t* bs = acts.bs.data() + (r0 + r) * (kp / 16) + u * 16;
          __m256i isum = _mm256_setzero_si256(), imin = _mm256_setzero_si256();
          for (int j = 0; j < 4; ++j) {
            __m256i slo = _mm256_setzero_si256(), shi = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int c = 0; c < 8; ++c) {
              const int8_t* ac = a + 64 * j + 4 * c;
              slo = _mm256_add_epi16(slo, _mm256_maddubs_epi16(
                  _mm256_load_si256(reinterpret_cast<const __m256i*>(lo[8 * j + c])), Bcast4(ac)));
              shi = _mm256_add_epi16(shi, _mm256_maddubs_epi16(
                  _mm256_load_si256(reinterpret_cast<const __m256i*>(hi[8 * j + c])), Bcast4(ac + 32)));
            }
            isum = _mm256_add_epi32(isum, _mm256_add_epi32(_mm256_madd_epi16(slo, sc[2 * j]),
                                                         _mm256_madd_epi16(shi, sc[2 * j + 1])));
            imin = _mm256_add_epi32(imin, _mm256_madd_epi16(mv[j], Pair16(bs[4 * j] + bs[4 * j + 1],
                                                                           bs[4 * j + 2] + bs[4 * j + 3])));
          }
          const __m256 da = _mm256_set1_ps(acts.da[(r0 + r) * units + u]);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, da), acc[r]);
          acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_mul_ps(dm, da), acc[r]);
        }
      }
      for (int r = 0; r < M; ++r) _mm256_storeu_ps(out + (r0 + r) * w.n + kTileRows * g, acc[r]);
    }
  }
}

// Q6_K: codes taken unsigned (0..63) and 32 * (scale . activation sums) subtracted; per
// sub-block of 16, two maddubs sums kept in int16 (at most 2 * 2 * 63 * 127 = 32004), then
// one madd with the 8 rows' scales.
template <int M>
void TilesQ6KOne(const Weight& w, const Acts& acts, int64_t r0, int64_t g0, int64_t g1, float* out) {
  constexpr int tb = TileBytes(kQ6_K);
  const int64_t units = w.k / kUnit, kp = acts.kp;
  const __m256i m15 = _mm256_set1_epi8(15), m48 = _mm256_set1_epi8(48);
  // int16 scales (2p, 2p+1) of each row -> (2p, 2p) or (2p+1, 2p+1)
  const __m256i even = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                        0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
  const __m256i odd = _mm256_add_epi8(even, _mm256_set1_epi8(2));
  for (int64_t g = g0; g < g1; ++g) {
    __m256 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t u = 0; u < units; ++u) {
      const uint8_t* t = w.data + g * w.row_bytes + u * tb;
      PrefetchTile<tb>(t + 2 * tb);
      const uint8_t* ql = t + 144;
      const uint8_t* qh = t + 1168;
      __m256i isum[M], corr[M];
      for (int r = 0; r < M; ++r) isum[r] = corr[r] = _mm256_setzero_si256();
      __m256i sc16[8];
      for (int p = 0; p < 8; ++p) {
        sc16[p] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16 + 16 * p)));
        for (int r = 0; r < M; ++r) {
          const int16_t* bs = acts.bs.data() + (r0 + r) * (kp / 16) + u * 16 + 2 * p;
          corr[r] = _mm256_add_epi32(corr[r], _mm256_madd_epi16(sc16[p], Pair16(bs[0], bs[1])));
        }
      }
      for (int h = 0; h < 2; ++h) {
        for (int half = 0; half < 2; ++half) {  // positions l in [16 half, 16 half + 16)
          // sub-block of element 128h + 32s + l: 8h + 2s + half, scale pair 4h + s
          __m256i scale[4];
          for (int s = 0; s < 4; ++s)
            scale[s] = _mm256_shuffle_epi8(sc16[4 * h + s], half ? odd : even);
          for (int q2 = 0; q2 < 2; ++q2) {
            __m256i pend[M][4];
#pragma GCC unroll 2
            for (int q1 = 0; q1 < 2; ++q1) {
              const int l = 16 * half + 8 * q2 + 4 * q1;
              const __m256i A = Load32(ql + 8 * (64 * h + l));
              const __m256i B = Load32(ql + 8 * (64 * h + 32 + l));
              const __m256i C = Load32(qh + 8 * (32 * h + l));
              __m256i c[4];
              c[0] = _mm256_or_si256(_mm256_and_si256(A, m15), _mm256_and_si256(_mm256_slli_epi16(C, 4), m48));
              c[1] = _mm256_or_si256(_mm256_and_si256(B, m15), _mm256_and_si256(_mm256_slli_epi16(C, 2), m48));
              c[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), m15), _mm256_and_si256(C, m48));
              c[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), m15),
                                     _mm256_and_si256(_mm256_srli_epi16(C, 2), m48));
#pragma GCC unroll 4
              for (int r = 0; r < M; ++r) {
                const int8_t* a = acts.a.data() + (r0 + r) * kp + u * kUnit + 128 * h + l;
                for (int s = 0; s < 4; ++s) {
                  const __m256i prod = _mm256_maddubs_epi16(c[s], Bcast4(a + 32 * s));
                  pend[r][s] = q1 == 0 ? prod : _mm256_add_epi16(pend[r][s], prod);
                }
              }
            }
            for (int r = 0; r < M; ++r)
              for (int s = 0; s < 4; ++s)
                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(pend[r][s], scale[s]));
          }
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
      for (int r = 0; r < M; ++r) {
        const __m256 da = _mm256_set1_ps(acts.da[(r0 + r) * units + u]);
        const __m256i dot = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(corr[r], 5));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, da), acc[r]);
      }
    }
    for (int r = 0; r < M; ++r) _mm256_storeu_ps(out + (r0 + r) * w.n + kTileRows * g, acc[r]);
  }
}


// Several activation rows: the tile's 6-bit codes decoded once into `codes` (2 KiB), its 16
// scale vectors once, then read by every row.
template <int M>
void TilesQ6K(const Weight& w, const Acts& acts, int64_t r0, int64_t g0, int64_t g1, float* out) {
  if constexpr (M == 1) {
    TilesQ6KOne<1>(w, acts, r0, g0, g1, out);
  } else {
    constexpr int tb = TileBytes(kQ6_K);
    const int64_t units = w.k / kUnit, kp = acts.kp;
    const __m256i m15 = _mm256_set1_epi8(15), m48 = _mm256_set1_epi8(48);
    const __m256i even = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                          0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
    const __m256i odd = _mm256_add_epi8(even, _mm256_set1_epi8(2));
    // codes[h][i][s]: elements 128h + 32s + 4i .. + 3 of the 8 rows
    alignas(32) uint8_t codes[2][8][4][32];
    for (int64_t g = g0; g < g1; ++g) {
      __m256 acc[M];
      for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t u = 0; u < units; ++u) {
        const uint8_t* t = w.data + g * w.row_bytes + u * tb;
        PrefetchTile<tb>(t + 2 * tb);
        const uint8_t* ql = t + 144;
        const uint8_t* qh = t + 1168;
        auto store = [](uint8_t* dst, __m256i v) {
          _mm256_store_si256(reinterpret_cast<__m256i*>(dst), v);
        };
        for (int h = 0; h < 2; ++h) {
          for (int i = 0; i < 8; ++i) {
            const __m256i A = Load32(ql + 8 * (64 * h + 4 * i));
            const __m256i B = Load32(ql + 8 * (64 * h + 32 + 4 * i));
            const __m256i C = Load32(qh + 8 * (32 * h + 4 * i));
            store(codes[h][i][0], _mm256_or_si256(_mm256_and_si256(A, m15), _mm256_and_si256(_mm256_slli_epi16(C, 4), m48)));
            store(codes[h][i][1], _mm256_or_si256(_mm256_and_si256(B, m15), _mm256_and_si256(_mm256_slli_epi16(C, 2), m48)));
            store(codes[h][i][2], _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), m15), _mm256_and_si256(C, m48)));
            store(codes[h][i][3], _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), m15),
                                                  _mm256_and_si256(_mm256_srli_epi16(C, 2), m48)));
          }
        }
        __m256i sc16[8], scale[16];  // scale[sub-block]
        for (int p = 0; p < 8; ++p) {
          sc16[p] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16 + 16 * p)));
          scale[2 * p] = _mm256_shuffle_epi8(sc16[p], even);
          scale[2 * p + 1] = _mm256_shuffle_epi8(sc16[p], odd);
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
        for (int r = 0; r < M; ++r) {
          const int8_t* a = acts.a.data() + (r0 + r) * kp + u * kUnit;
          const int16_t* bs = acts.bs.data() + (r0 + r) * (kp / 16) + u * 16;
          __m256i isum = _mm256_setzero_si256(), corr = _mm256_setzero_si256();
          for (int p = 0; p < 8; ++p)
            corr = _mm256_add_epi32(corr, _mm256_madd_epi16(sc16[p], Pair16(bs[2 * p], bs[2 * p + 1])));
          for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 4
            for (int i = 0; i < 8; i += 2) {  // positions 4i .. 4i + 7: one sub-block each s
              for (int s = 0; s < 4; ++s) {
                const int8_t* as = a + 128 * h + 32 * s + 4 * i;
                const __m256i p0 = _mm256_maddubs_epi16(
                    _mm256_load_si256(reinterpret_cast<const __m256i*>(codes[h][i][s])), Bcast4(as));
                const __m256i p1 = _mm256_maddubs_epi16(
                    _mm256_load_si256(reinterpret_cast<const __m256i*>(codes[h][i + 1][s])), Bcast4(as + 4));
                isum = _mm256_add_epi32(
                    isum, _mm256_madd_epi16(_mm256_add_epi16(p0, p1), scale[8 * h + 2 * s + i / 4]));
              }
            }
          }
          const __m256 da = _mm256_set1_ps(acts.da[(r0 + r) * units + u]);
          const __m256i dot = _mm256_sub_epi32(isum, _mm256_slli_epi32(corr, 5));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, da), acc[r]);
        }
      }
      for (int r = 0; r < M; ++r) _mm256_storeu_ps(out + (r0 + r) * w.n + kTileRows * g, acc[r]);
    }
  }
}

// Q5_K: Q4_K's tile product with the fifth bit of each code from the tile's qh; 5-bit codes
// sum in int16 over 4 chunks at a time (at most 4 * 2 * 31 * 127 = 31496), not 8.
template <int M>
void TilesQ5K(const Weight& w, const Acts& acts, int64_t r0, int64_t g0, int64_t g1, float* out) {
  constexpr int tb = TileBytes(kQ5_K);
  const int64_t units = w.k / kUnit, kp = acts.kp;
  const __m256i m15 = _mm256_set1_epi8(15), s16 = _mm256_set1_epi8(16);
  for (int64_t g = g0; g < g1; ++g) {
    __m256 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t u = 0; u < units; ++u) {
      const uint8_t* t = w.data + g * w.row_bytes + u * tb;
      PrefetchTile<tb>(t + 2 * tb);
      __m256i isum[M], imin[M];
      for (int r = 0; r < M; ++r) isum[r] = imin[r] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256i b0 = _mm256_set1_epi8(static_cast<char>(1 << (2 * j)));
        const __m256i b1 = _mm256_set1_epi8(static_cast<char>(1 << (2 * j + 1)));
        __m256i slo[2][M], shi[2][M];
        for (int h = 0; h < 2; ++h)
          for (int r = 0; r < M; ++r) slo[h][r] = shi[h][r] = _mm256_setzero_si256();
        const uint8_t* qs = t + 160 + 256 * j;
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) {
          const __m256i v = Load32(qs + 32 * c);
          const __m256i qh = Load32(t + 1184 + 32 * c);
          const __m256i lo = _mm256_or_si256(
              _mm256_and_si256(v, m15), _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), s16));
          const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m15),
                                             _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), s16));
#pragma GCC unroll 8
          for (int r = 0; r < M; ++r) {
            const int8_t* a = acts.a.data() + (r0 + r) * kp + u * kUnit + 64 * j + 4 * c;
            slo[c / 4][r] = _mm256_add_epi16(slo[c / 4][r], _mm256_maddubs_epi16(lo, Bcast4(a)));
            shi[c / 4][r] = _mm256_add_epi16(shi[c / 4][r], _mm256_maddubs_epi16(hi, Bcast4(a + 32)));
          }
        }
        __m256i sl = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(t + 32 + 16 * j)));
        __m256i sh = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(t + 40 + 16 * j)));
        sl = _mm256_or_si256(sl, _mm256_slli_epi32(sl, 16));
        sh = _mm256_or_si256(sh, _mm256_slli_epi32(sh, 16));
        for (int r = 0; r < M; ++r) {
          const __m256i l = _mm256_add_epi32(_mm256_madd_epi16(slo[0][r], sl), _mm256_madd_epi16(slo[1][r], sl));
          const __m256i h = _mm256_add_epi32(_mm256_madd_epi16(shi[0][r], sh), _mm256_madd_epi16(shi[1][r], sh));
          isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(l, h));
        }
      }
      for (int p = 0; p < 4; ++p) {
        const __m256i mv =
            _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 96 + 16 * p)));
        for (int r = 0; r < M; ++r) {
          const int16_t* bs = acts.bs.data() + (r0 + r) * (kp / 16) + u * 16 + 4 * p;
          imin[r] = _mm256_add_epi32(imin[r], _mm256_madd_epi16(mv, Pair16(bs[0] + bs[1], bs[2] + bs[3])));
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
      const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16)));
      for (int r = 0; r < M; ++r) {
        const __m256 da = _mm256_set1_ps(acts.da[(r0 + r) * units + u]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, da), acc[r]);
        acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin[r]), _mm256_mul_ps(dm, da), acc[r]);
      }
    }
    for (int r = 0; r < M; ++r) _mm256_storeu_ps(out + (r0 + r) * w.n + kTileRows * g, acc[r]);
  }
}

// Q2_K and Q3_K: each 4-byte chunk's 2-bit codes as unsigned bytes (Q3_K: with the hmask bit
// as + 4, 0..7), multiplied by maddubs with one broadcast activation word and summed in int16
// per sub-block of 16 (at most 4 * 2 * 7 * 127 = 7112), then one madd with the 8 rows'
// scales. `corr` sums scale (Q3_K) or minimum (Q2_K) times the activations' sum over each
// sub-block: Q3_K's + 4 comes off as 4 * corr, as in Q6_K's tiles; Q2_K's minimums as
// dmin * da * corr, as in the row kernel.
template <int type, int M>
void TilesQ23K(const Weight& w, const Acts& acts, int64_t r0, int64_t g0, int64_t g1, float* out) {
  constexpr bool q3 = type == kQ3_K;
  constexpr int tb = TileBytes(type);
  const int64_t units = w.k / kUnit, kp = acts.kp;
  const __m256i m3 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4), m15 = _mm256_set1_epi16(15);
  const __m256i even = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                        0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
  const __m256i odd = _mm256_add_epi8(even, _mm256_set1_epi8(2));
  for (int64_t g = g0; g < g1; ++g) {
    __m256 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t u = 0; u < units; ++u) {
      const uint8_t* t = w.data + g * w.row_bytes + u * tb;
      PrefetchTile<tb>(t + 2 * tb);
      const uint8_t* qs = t + (q3 ? 144 : 160);
      const uint8_t* hm = t + 656;  // Q3_K's hmask
      __m256i isum[M], corr[M];
      for (int r = 0; r < M; ++r) isum[r] = corr[r] = _mm256_setzero_si256();
      for (int p = 0; p < 8; ++p) {  // sub-blocks 2p, 2p + 1: h = p / 4, j = p % 4
        const int h = p / 4, j = p % 4;
        __m256i sc16, by16;  // scales; what `corr` multiplies the sums by
        if constexpr (q3) {
          sc16 = by16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16 + 16 * p)));
        } else {
          const __m256i b16 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 32 + 16 * p)));
          sc16 = _mm256_and_si256(b16, m15), by16 = _mm256_srli_epi16(b16, 4);
        }
        const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << (4 * h + j)));
        __m256i s[2][M];
        for (int half = 0; half < 2; ++half)
          for (int r = 0; r < M; ++r) s[half][r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) {  // elements 128h + 32j + 4c .. + 3 of the 8 rows
          __m256i v = _mm256_and_si256(_mm256_srli_epi16(Load32(qs + 32 * (8 * h + c)), 2 * j), m3);
          if constexpr (q3) {
            const __m256i hb = _mm256_cmpeq_epi8(_mm256_and_si256(Load32(hm + 32 * c), bit), bit);
            v = _mm256_or_si256(v, _mm256_and_si256(hb, four));
          }
#pragma GCC unroll 8
          for (int r = 0; r < M; ++r) {
            const int8_t* a = acts.a.data() + (r0 + r) * kp + u * kUnit + 128 * h + 32 * j + 4 * c;
            s[c / 4][r] = _mm256_add_epi16(s[c / 4][r], _mm256_maddubs_epi16(v, Bcast4(a)));
          }
        }
        const __m256i lo = _mm256_shuffle_epi8(sc16, even), hi = _mm256_shuffle_epi8(sc16, odd);
        for (int r = 0; r < M; ++r) {
          const int16_t* bs = acts.bs.data() + (r0 + r) * (kp / 16) + u * 16 + 2 * p;
          isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_madd_epi16(s[0][r], lo),
                                                               _mm256_madd_epi16(s[1][r], hi)));
          corr[r] = _mm256_add_epi32(corr[r], _mm256_madd_epi16(by16, Pair16(bs[0], bs[1])));
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
      for (int r = 0; r < M; ++r) {
        const __m256 da = _mm256_set1_ps(acts.da[(r0 + r) * units + u]);
        if constexpr (q3) {
          const __m256i dot = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(corr[r], 2));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, da), acc[r]);
        } else {
          const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16)));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, da), acc[r]);
          acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(corr[r]), _mm256_mul_ps(dm, da), acc[r]);
        }
      }
    }
    for (int r = 0; r < M; ++r) _mm256_storeu_ps(out + (r0 + r) * w.n + kTileRows * g, acc[r]);
  }
}

// 32-element types (Q4_0, Q4_1, Q5_0, Q5_1): a tile's codes as unsigned bytes in 8 registers
// (nibbles, with the fifth bit of Q5_0 / Q5_1 picked from each row's 32-bit qh), multiplied
// by maddubs with one broadcast activation word; the offset of Q4_0 / Q5_0 (8 / 16) comes off
// as that many times the activation block's integer sum, the minimum of Q4_1 / Q5_1 as
// m * da * sum(a), as in the row kernel. Q8_0's signed bytes: `Q8Tile`.
// pshufb control: byte `byte` of each 32-bit lane copied to the lane's four bytes.
inline __m256i LanePick(int byte) {
  const int64_t b = static_cast<int64_t>(byte) * 0x0101010101010101;
  return _mm256_set_epi64x(b + 0x0c0c0c0c08080808, b + 0x0404040400000000,
                           b + 0x0c0c0c0c08080808, b + 0x0404040400000000);
}

// One Q8_0 tile (block j of 8 rows, scales d) on M activation rows from r0: signed codes,
// so the sign trick (|q| times a with q's sign) and every maddubs pair widened to int32 at
// once (|q| <= 128, |a| <= 127: a pair reaches 32512, two would overflow int16).
template <int M>
inline void Q8Tile(const uint8_t* t, const Acts& acts, int64_t r0, int64_t j, __m256 d, __m256* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i q[8], mag[8];
  for (int c = 0; c < 8; ++c) {
    q[c] = Load32(t + TileNibbles(kQ8_0) + 32 * c);
    mag[c] = _mm256_abs_epi8(q[c]);
  }
  const int64_t kp = acts.kp;
#pragma GCC unroll 8
  for (int r = 0; r < M; ++r) {
    const int8_t* a = acts.a.data() + (r0 + r) * kp + 32 * j;
    __m256i dot = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i p = _mm256_maddubs_epi16(mag[c], _mm256_sign_epi8(Bcast4(a + 4 * c), q[c]));
      dot = _mm256_add_epi32(dot, _mm256_madd_epi16(p, ones));
    }
    const __m256 da = _mm256_set1_ps(acts.da[(r0 + r) * (kp / 32) + j]);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, da), acc[r]);
  }
}

template <int type, int M>
void Tiles32(const Weight& w, const Acts& acts, int64_t r0, int64_t g0, int64_t g1, float* out) {
  constexpr int tb = TileBytes(type);
  constexpr bool has_min = kTypes[type].has_min;
  constexpr bool five = HasFifthBit(type);
  constexpr int offset = CodeOffset(type);
  const int64_t blocks = w.k / 32, kp = acts.kp;
  const __m256i m15 = _mm256_set1_epi8(15), s16 = _mm256_set1_epi8(16);
  const __m256i ones = _mm256_set1_epi16(1);
  // Element 4c + i (i < 4) of a row is bit 4c + i of its qh: byte c / 2 (16 + 4c + i: byte
  // 2 + c / 2) copied to the four bytes of the row's lane, then tested with its bit mask.
  const __m256i sel[4] = {LanePick(0), LanePick(1), LanePick(2), LanePick(3)};
  const __m256i bit[2] = {_mm256_set1_epi32(0x08040201), _mm256_set1_epi32(static_cast<int>(0x80402010u))};
  for (int64_t g = g0; g < g1; ++g) {
    __m256 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
    const uint8_t* t = w.data + g * w.row_bytes;
    for (int64_t j = 0; j < blocks; ++j, t += tb) {
      _mm_prefetch(reinterpret_cast<const char*>(t) + 8 * tb, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(t) + 8 * tb + 64, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(t) + 8 * tb + 128, _MM_HINT_T0);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
      if constexpr (type == kQ8_0) {
        Q8Tile<M>(t, acts, r0, j, d, acc);
        continue;
      }
      __m256i u[8];  // u[c]: elements 4c.. of the 8 rows; u[4 + c]: elements 16 + 4c..
      for (int c = 0; c < 4; ++c) {
        const __m256i v = Load32(t + TileNibbles(type) + 32 * c);
        u[c] = _mm256_and_si256(v, m15);
        u[4 + c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
        if constexpr (five) {
          const __m256i qh = Load32(t + TileHighBits(type));
          const __m256i b = bit[c % 2];
          const __m256i lo = _mm256_and_si256(_mm256_shuffle_epi8(qh, sel[c / 2]), b);
          const __m256i hi = _mm256_and_si256(_mm256_shuffle_epi8(qh, sel[2 + c / 2]), b);
          u[c] = _mm256_or_si256(u[c], _mm256_and_si256(_mm256_cmpeq_epi8(lo, b), s16));
          u[4 + c] = _mm256_or_si256(u[4 + c], _mm256_and_si256(_mm256_cmpeq_epi8(hi, b), s16));
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r) {
        const int8_t* a = acts.a.data() + (r0 + r) * kp + 32 * j;
        __m256i slo = _mm256_maddubs_epi16(u[0], Bcast4(a));
        __m256i shi = _mm256_maddubs_epi16(u[4], Bcast4(a + 16));
        for (int c = 1; c < 4; ++c) {  // at most 4 * 2 * 31 * 127 = 31496: no int16 overflow
          slo = _mm256_add_epi16(slo, _mm256_maddubs_epi16(u[c], Bcast4(a + 4 * c)));
          shi = _mm256_add_epi16(shi, _mm256_maddubs_epi16(u[4 + c], Bcast4(a + 16 + 4 * c)));
        }
        __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(slo, ones), _mm256_madd_epi16(shi, ones));
        const int64_t s = (r0 + r) * (kp / 16) + 2 * j;  // the block's two sums of 16
        if constexpr (offset != 0)
          dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(offset * (acts.bs[s] + acts.bs[s + 1])));
        const __m256 da = _mm256_set1_ps(acts.da[(r0 + r) * (kp / 32) + j]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, da), acc[r]);
        if constexpr (has_min) {
          const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16)));
          acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(acts.sums[s] + acts.sums[s + 1]), acc[r]);
        }
      }
    }
    for (int r = 0; r < M; ++r) _mm256_storeu_ps(out + (r0 + r) * w.n + kTileRows * g, acc[r]);
  }
}

// Groups g0..g1 of a tiled weight on int8 activations, activation rows 8 at a time.
template <int type>
void Tiles(const Weight& w, const Acts& acts, int64_t g0, int64_t g1, float* out) {
  constexpr auto fn = [](auto m) {
    constexpr int M = decltype(m)::value;
    if constexpr (type == kQ4_K) return &TilesQ4K<M>;
    else if constexpr (type == kQ6_K) return &TilesQ6K<M>;
    else if constexpr (type == kQ3_K || type == kQ2_K) return &TilesQ23K<type, M>;
    else if constexpr (type == kQ5_K) return &TilesQ5K<M>;
    else return &Tiles32<type, M>;
  };
  int64_t r = 0;
  for (; r + 8 <= acts.m; r += 8) fn(std::integral_constant<int, 8>{})(w, acts, r, g0, g1, out);
  if (acts.m - r >= 4) fn(std::integral_constant<int, 4>{})(w, acts, r, g0, g1, out), r += 4;
  if (acts.m - r >= 2) fn(std::integral_constant<int, 2>{})(w, acts, r, g0, g1, out), r += 2;
  if (acts.m - r >= 1) fn(std::integral_constant<int, 1>{})(w, acts, r, g0, g1, out);
}

template <int type, int M>
void RowsM(const Weight& w, const Acts& acts, int64_t r0, int64_t n0, int64_t n1, float* out) {
  if constexpr (kTypes[type].block == kUnit) {
    RowsK<type, M>(w, acts, r0, n0, n1, out);
  } else {
    Rows32<type, M>(w, acts, r0, n0, n1, out);
  }
}

template <int type>
void Rows(const Weight& w, const Acts& acts, int64_t n0, int64_t n1, float* out) {
  int64_t r = 0;
  for (; r + 8 <= acts.m; r += 8) RowsM<type, 8>(w, acts, r, n0, n1, out);
  if (acts.m - r >= 4) RowsM<type, 4>(w, acts, r, n0, n1, out), r += 4;
  if (acts.m - r >= 2) RowsM<type, 2>(w, acts, r, n0, n1, out), r += 2;
  if (acts.m - r >= 1) RowsM<type, 1>(w, acts, r, n0, n1, out);
}

template <int type>
void Dequant(const Weight& w, int64_t n0, int64_t n1, float* out) {
  constexpr bool has_min = kTypes[type].has_min;
  const int64_t units = (w.k + kUnit - 1) / kUnit;
  Unit u;
  for (int64_t n = n0; n < n1; ++n) {
    float* y = out + n * w.k;
    for (int64_t ui = 0; ui < units; ++ui) {
      const int blocks = UnitBlocks(w, ui);
      const uint8_t* b = UnitBytes(w, n, ui);
      const int count = blocks * kTypes[type].block;
      DecodeScales<type>(b, blocks, &u);
      DecodeCodes<type>(b, blocks, u.q);
      for (int i = 0; i < count; i += 8) {
        const __m256 q = _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(u.q + i))));
        __m256 v = _mm256_mul_ps(_mm256_set1_ps(u.ws[i / 16]), q);
        if (has_min) v = _mm256_add_ps(v, _mm256_set1_ps(u.wm[i / 16]));
        _mm256_storeu_ps(y + ui * kUnit + i, v);
      }
    }
  }
}

// QuantizeRowQ8 in vectors of 8: the same products v * id, rounded half to even by
// vroundps (nearbyint's default mode), the same bytes.
void QuantizeRowQ8(const float* row, int64_t kp, int per, int8_t* a, float* da, int16_t* bs,
                   float* sums) {
  const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(3.402823466e38f);
  const __m256 lim = _mm256_set1_ps(127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t g = 0; g < kp / per; ++g) {
    const float* v = row + per * g;
    __m256 mx = _mm256_setzero_ps(), ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int i = 0; i < per; i += 8) {
      const __m256 x = _mm256_andnot_ps(sign, _mm256_loadu_ps(v + i));
      mx = _mm256_max_ps(x, mx);  // a NaN x gives mx back (maxps returns its second operand)
      ok = _mm256_and_ps(ok, _mm256_cmp_ps(x, big, _CMP_LE_OQ));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const bool finite = _mm256_movemask_ps(ok) == 0xff;
    const float d = amax / 127.0f;
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    const __m256 vid = _mm256_set1_ps(id);
    for (int i = 0; i < per; i += 32) {
      __m256i q[4];
      for (int u = 0; u < 4; ++u) {
        __m256 t = _mm256_mul_ps(_mm256_loadu_ps(v + i + 8 * u), vid);
        // A non-finite product (an Inf or NaN activation) codes as 0, as in the portable copy.
        t = _mm256_and_ps(t, _mm256_cmp_ps(_mm256_andnot_ps(sign, t), big, _CMP_LE_OQ));
        t = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        t = _mm256_max_ps(_mm256_min_ps(t, lim), _mm256_sub_ps(_mm256_setzero_ps(), lim));
        q[u] = _mm256_cvtps_epi32(t);
      }
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + per * g + i), _mm256_permutevar8x32_epi32(p, order));
    }
    da[g] = finite ? d : std::numeric_limits<float>::quiet_NaN();
  }
  // Per 16 codes, 8 groups (128 codes) at a time: maddubs and madd with ones give 4 int32
  // partial sums a group, two rounds of hadd finish them (lanes in the order 0 2 4 6 1 3 5 7,
  // permuted back). kp is a whole number of 256-code units.
  const __m256i ones = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  const __m256i back = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const int shift = __builtin_ctz(per / 16);  // per (32 or 256) / 16 groups share a scale
  for (int64_t g = 0; g < kp / 16; g += 8) {
    __m256i q[4];
    for (int c = 0; c < 4; ++c)
      q[c] = _mm256_madd_epi16(_mm256_maddubs_epi16(ones, Load32(a + 16 * g + 32 * c)), ones16);
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(q[0], q[1]), _mm256_hadd_epi32(q[2], q[3]));
    const __m256i s8 = _mm256_permutevar8x32_epi32(h, back);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(bs + g),
                     _mm_packs_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1)));
    float d8[8];
    for (int j = 0; j < 8; ++j) d8[j] = da[(g + j) >> shift];
    _mm256_storeu_ps(sums + g, _mm256_mul_ps(_mm256_loadu_ps(d8), _mm256_cvtepi32_ps(s8)));
  }
}
}  // namespace avx2
LOWBIT_TARGET_POP
#endif

// Per-type entry points of one path.
#define LOWBIT_GGUF_TABLE(ns, fn, F)                                                        \
  std::array<F, kNumTypes> {                                                               \
    ns::fn<0>, ns::fn<1>, ns::fn<2>, ns::fn<3>, ns::fn<4>, ns::fn<5>, ns::fn<6>, ns::fn<7>, \
        ns::fn<8>, ns::fn<9>, ns::fn<10>, ns::fn<11>                                       \
  }

bool UseAvx2() {
#if defined(__x86_64__)
  return std::string(ActiveIsa()->name) != "scalar";
#else
  return false;
#endif
}

// Asked on every call (the path can be changed at run time): compared in place, no string
// built.
bool UseAvx512Vnni() {
#if defined(__x86_64__)
  const char* isa = ActiveIsa()->name;
  return std::strcmp(isa, "avx512vnni") == 0 || std::strcmp(isa, "amx") == 0;
#else
  return false;
#endif
}

bool UseAvxVnni() {
#if defined(__x86_64__)
  return std::strcmp(ActiveIsa()->name, "avx2vnni") == 0;
#else
  return false;
#endif
}

// Checks the weight against type, K, N and layout (block rows, or tiles); fills `w`.
ffi::Error CheckWeight(const ffi::Buffer<ffi::U8>& data, int64_t type, int64_t k, int64_t n,
                       int64_t tiled, Weight* w) {
  if (type < 0 || type >= kNumTypes) return Invalid("unknown GGUF block type id " + std::to_string(type));
  const TypeInfo& t = kTypes[type];
  if (k <= 0 || k % t.block != 0)
    return Invalid("K = " + std::to_string(k) + " is not a whole number of blocks");
  const auto d = data.dimensions();
  if (tiled) {
    const int tb = TileBytes(static_cast<int>(type));
    if (tb == 0) return Invalid("GGUF type id " + std::to_string(type) + " has no tiled layout");
    if (n % kTileRows != 0) return Invalid("a tiled weight needs N a multiple of 8");
    const int64_t group_bytes = k / t.block * tb;
    if (d.size() != 2 || d[0] != n / kTileRows || d[1] != group_bytes)
      return Invalid("tiled GGUF weight must be [N / 8, " + std::to_string(group_bytes) + "] bytes");
    *w = Weight{static_cast<int>(type), k, n, group_bytes, data.typed_data(), true};
    return ffi::Error::Success();
  }
  const int64_t row_bytes = k / t.block * t.bytes;
  if (d.size() != 2 || d[0] != n || d[1] != row_bytes)
    return Invalid("GGUF weight rows must be [N, " + std::to_string(row_bytes) + "] bytes");
  *w = Weight{static_cast<int>(type), k, n, row_bytes, data.typed_data()};
  return ffi::Error::Success();
}

// The block rows of groups g0..g1 of a tiled weight, one group at a time, as a Weight of 8
// rows in `rows` (scratch): for the paths that read rows (float activations, the portable
// code, dequantization).
template <typename F>
void OverUntiledGroups(const Weight& w, int64_t g0, int64_t g1, F&& f) {
  const int64_t row_bytes = w.k / kTypes[w.type].block * kTypes[w.type].bytes;
  std::vector<uint8_t> rows(kTileRows * row_bytes);
  for (int64_t g = g0; g < g1; ++g) {
    UntileGroup(w.type, w.data + g * w.row_bytes, w.k / kTypes[w.type].block, rows.data());
    f(g, Weight{w.type, w.k, kTileRows, row_bytes, rows.data()});
  }
}

// Row ranges for the workers: a few per worker, claimed dynamically.
template <typename F>
void OverRows(ffi::ThreadPool& pool, int64_t n, int64_t work, F&& f) {
  const int64_t workers = work < (int64_t{1} << 17) ? 1 : NumWorkers(pool);
  const int64_t chunks = std::min<int64_t>(n, workers > 1 ? 4 * workers : 1);
  ParallelFor(pool, workers, chunks, [&](int64_t c) { f(n * c / chunks, n * (c + 1) / chunks); });
}

ffi::Error LinearImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> data,
                      ffi::Result<ffi::AnyBuffer> y, int64_t type, int64_t k, int64_t n,
                      int64_t act_q8, int64_t tiled) {
  Weight w;
  if (ffi::Error e = CheckWeight(data, type, k, n, tiled, &w); e.failure()) return e;
  const auto xt = x.element_type(), yt = y->element_type();
  if ((xt != ffi::DataType::F32 && xt != ffi::DataType::BF16) ||
      (yt != ffi::DataType::F32 && yt != ffi::DataType::BF16))
    return Invalid("x and the output must be float32 or bfloat16");
  const auto xd = x.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || xd[1] != k) return Invalid("x must be [M, K] with K = " + std::to_string(k));
  const int64_t m = xd[0];
  if (yd.size() != 2 || yd[0] != m || yd[1] != n) return Invalid("output must be [M, N]");
  if (m == 0 || n == 0) return ffi::Error::Success();
  Acts acts;
  QuantizeRowFn quantize = QuantizeRowQ8;
#if defined(__x86_64__)
  if (UseAvx2()) quantize = avx2::QuantizeRowQ8;
#endif
  PrepareActs(pool, quantize, x.untyped_data(), xt == ffi::DataType::BF16, m, k, act_q8 != 0,
              kTypes[type].block == kUnit ? kUnit : 32, &acts);
  const bool ybf16 = yt == ffi::DataType::BF16;
  std::vector<float> tmp(ybf16 ? m * n : 0);
  float* out = ybf16 ? tmp.data() : static_cast<float*>(y->untyped_data());
  static const auto portable_rows = LOWBIT_GGUF_TABLE(portable, Rows, RowsFn);
  RowsFn rows = portable_rows[type];
#if defined(__x86_64__)
  static const auto avx2_rows = LOWBIT_GGUF_TABLE(avx2, Rows, RowsFn);
  if (UseAvx2()) rows = avx2_rows[type];
#endif
  if (!w.tiled) {
    OverRows(pool, n, m * k * n, [&](int64_t n0, int64_t n1) { rows(w, acts, n0, n1, out); });
  } else {
    const int64_t groups = n / kTileRows;
    bool done = false;
#if defined(__x86_64__)
    if (UseAvx2() && acts.q8) {  // the tile kernels
      using TilesFn = void (*)(const Weight&, const Acts&, int64_t, int64_t, float*);
      static const std::array<TilesFn, kNumTypes> table = [] {
        std::array<TilesFn, kNumTypes> t{};
        t[kQ4_0] = avx2::Tiles<kQ4_0>, t[kQ4_1] = avx2::Tiles<kQ4_1>;
        t[kQ5_0] = avx2::Tiles<kQ5_0>, t[kQ5_1] = avx2::Tiles<kQ5_1>, t[kQ8_0] = avx2::Tiles<kQ8_0>;
        t[kQ2_K] = avx2::Tiles<kQ2_K>, t[kQ3_K] = avx2::Tiles<kQ3_K>, t[kQ4_K] = avx2::Tiles<kQ4_K>;
        t[kQ5_K] = avx2::Tiles<kQ5_K>, t[kQ6_K] = avx2::Tiles<kQ6_K>;
        return t;
      }();
      const TilesFn tiles = table[type];
      // Several activation rows on VNNI (gguf_vnni.h): on AVX-512 pairs of groups in 64-byte
      // registers, the workers' ranges in whole pairs (an odd last group on AVX2); on
      // AVX-VNNI one group in 32 bytes. One row is bound by memory, not instructions, and
      // keeps the AVX2 tiles.
      const bool vnni = m > 1 && HasVnniTiles(static_cast<int>(type));
      if (vnni && UseAvx512Vnni()) {
        const int64_t pairs = groups / 2;
        OverRows(pool, std::max<int64_t>(pairs, 1), m * k * n, [&](int64_t p0, int64_t p1) {
          TilesAvx512Vnni(w, acts, 2 * p0, std::min(2 * p1, groups / 2 * 2), out);
          if (p1 >= pairs && groups % 2) tiles(w, acts, groups - 1, groups, out);
        });
      } else if (vnni && UseAvxVnni()) {
        OverRows(pool, groups, m * k * n,
                 [&](int64_t g0, int64_t g1) { TilesAvxVnni(w, acts, g0, g1, out); });
      } else {
        OverRows(pool, groups, m * k * n,
                 [&](int64_t g0, int64_t g1) { tiles(w, acts, g0, g1, out); });
      }
      done = true;
    }
#endif
    if (!done) {  // float activations or the portable path: rows untiled a group at a time
      OverRows(pool, groups, m * k * n, [&](int64_t g0, int64_t g1) {
        std::vector<float> part(m * kTileRows);
        OverUntiledGroups(w, g0, g1, [&](int64_t g, const Weight& rw) {
          rows(rw, acts, 0, kTileRows, part.data());
          for (int64_t r = 0; r < m; ++r)
            std::memcpy(out + r * n + kTileRows * g, part.data() + r * kTileRows,
                        sizeof(float) * kTileRows);
        });
      });
    }
  }
  if (ybf16) {
    uint16_t* dst = static_cast<uint16_t*>(y->untyped_data());
    for (int64_t i = 0; i < m * n; ++i) dst[i] = F32ToBf16(tmp[i]);
  }
  return ffi::Error::Success();
}

ffi::Error DequantizeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> data,
                          ffi::Result<ffi::Buffer<ffi::F32>> y, int64_t type, int64_t k,
                          int64_t n, int64_t tiled) {
  Weight w;
  if (ffi::Error e = CheckWeight(data, type, k, n, tiled, &w); e.failure()) return e;
  const auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != n || yd[1] != k) return Invalid("output must be [N, K]");
  float* out = y->typed_data();
  static const auto portable_dequant = LOWBIT_GGUF_TABLE(portable, Dequant, DequantFn);
  DequantFn dequant = portable_dequant[type];
#if defined(__x86_64__)
  static const auto avx2_dequant = LOWBIT_GGUF_TABLE(avx2, Dequant, DequantFn);
  if (UseAvx2()) dequant = avx2_dequant[type];
#endif
  if (!w.tiled) {
    OverRows(pool, n, k * n, [&](int64_t n0, int64_t n1) { dequant(w, n0, n1, out); });
  } else {
    OverRows(pool, n / kTileRows, k * n, [&](int64_t g0, int64_t g1) {
      OverUntiledGroups(w, g0, g1, [&](int64_t g, const Weight& rw) {
        dequant(rw, 0, kTileRows, out + g * kTileRows * k);
      });
    });
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace gguf
}  // namespace lowbit

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowbitGgufLinear, lowbit::gguf::LinearImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("type")
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("act_q8")
                                  .Attr<int64_t>("tiled"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowbitGgufDequantize, lowbit::gguf::DequantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("type")
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("tiled"));
