// AVX-512 vocabulary for kernels_impl.h: one zmm holds a 16-column panel row.
// Included inside an ISA namespace with the matching target pragma active; define
// LOWBIT_VNNI to use vpdpbusd, otherwise u8 x s8 dots go through exact int16 vpmaddwd
// (vpmaddubsw could saturate with u8 activations up to 255).

// mr, np, mr_wide, fmr, fnp, qmr, qnp, lut_nibbles (TileShape in common.h). One panel per
// small-M tile (np 1): on an AMD EPYC (2 cores, 2026-11-27), two panels ran int4 at M = 1
// 1.17x slower on 4096 x 4096 (0.384 against 0.328 ms) and 1.3x slower at M = 4.
constexpr TileShape kTile{4, 1, 8, 8, 2, 8, 2, true};

using V = __m512;
static inline V vzero() { return _mm512_setzero_ps(); }
static inline V vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
static inline V vbcast(float a) { return _mm512_set1_ps(a); }
static inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
static inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
static inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
static inline V vfmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
static inline V vfnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }

static inline __m128i load16(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

static inline V deq_s8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16(p)));
}

static inline void deq_nib(const uint8_t* p, V& lo, V& hi) {
  const __m512i v = _mm512_cvtepu8_epi32(load16(p));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}

struct Lut {
  __m512 t;
};
static inline Lut make_lut(const float* t16) { return Lut{_mm512_loadu_ps(t16)}; }
// vpermps only looks at the low 4 index bits, so the low nibble needs no mask.
static inline void deq_lut(const uint8_t* p, const Lut& l, V& lo, V& hi) {
  const __m512i v = _mm512_cvtepu8_epi32(load16(p));
  lo = _mm512_permutexvar_ps(v, l.t);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), l.t);
}

// e4m3fn -> f16 by moving bits: sign-extend to 16 bits, shift the exponent/mantissa into f16
// position and clear bit 14; the f16 value is the e4m3 value / 256 (exact, subnormals too,
// and unaffected by denormals-are-zero since vcvtph2ps converts exactly).
static inline V deq_fp8(const uint8_t* p) {
  __m256i h = _mm256_cvtepi8_epi16(load16(p));
  h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
  return _mm512_cvtph_ps(h);
}

using VI = __m512i;
static inline VI izero() { return _mm512_setzero_si512(); }
static inline VI iload(const int32_t* p) { return _mm512_loadu_si512(p); }
static inline void istore(int32_t* p, VI v) { _mm512_storeu_si512(p, v); }

#if defined(LOWBIT_VNNI)
constexpr int kActWords = 1;
using WQ = __m512i;
static inline WQ wq_load(const int8_t* p) { return _mm512_loadu_si512(p); }
static inline VI idot(VI acc, const WQ& w, const uint32_t* a) {
  return _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(static_cast<int>(a[0])), w);
}
#else
// Each 32-bit lane holds bytes (b0, b1, b2, b3) of one column: split into int16 words
// (b0, b2) and (b1, b3); the activation words are packed to match.
constexpr int kActWords = 2;
struct WQ {
  __m512i lo, hi;
};
static inline WQ wq_load(const int8_t* p) {
  const __m512i v = _mm512_loadu_si512(p);
  return WQ{_mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8), _mm512_srai_epi16(v, 8)};
}
static inline VI idot(VI acc, const WQ& w, const uint32_t* a) {
  acc = _mm512_add_epi32(acc, _mm512_madd_epi16(w.lo, _mm512_set1_epi32(static_cast<int>(a[0]))));
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w.hi, _mm512_set1_epi32(static_cast<int>(a[1]))));
}
#endif

// int4 / uint4 weight-only panels with int8 activations (wo_q8 in kernels_impl.h): the
// unsigned 4-bit codes are the u8 operand of the dot, the activations the s8 one, so no
// offset correction is needed and products stay far from int16 saturation (15 * 127 * 2).
#define LOWBIT_HAS_WO_Q8 1

// One k-quad (pair rows t, t + 1: 32 bytes) of a 16-column 4-bit panel as 16 dwords, column
// j holding its codes for k = 4q .. 4q + 3 in byte order. With a = byte j of row t and b of
// row t + 1, d = a | b << 16 has bytes (a, 0, b, 0); d << 4 moves the high nibbles into
// bytes 1 and 3 and leaves zeros in the low nibbles of bytes 0 and 2, so
// (d | d << 4) & 0x0F0F0F0F (one ternary-logic op: 0xA8 = (A | B) & C) is (a_lo, a_hi, b_lo, b_hi).
static inline __m512i q4_quad(const uint8_t* p) {
  const __m512i a = _mm512_cvtepu8_epi32(load16(p));
  const __m512i b = _mm512_cvtepu8_epi32(load16(p + 16));
  const __m512i d = _mm512_or_si512(a, _mm512_slli_epi32(b, 16));
  return _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 4), _mm512_set1_epi32(0x0F0F0F0F),
                                   0xA8);
}

// q4_quad keeps the column order.
static inline V quad_order(V v) { return v; }

// acc + per-lane sum of 4 (u8 code x s8 activation) products, the activation dword broadcast.
static inline __m512i udot(__m512i acc, __m512i codes, int32_t x4) {
#if defined(LOWBIT_VNNI)
  return _mm512_dpbusd_epi32(acc, codes, _mm512_set1_epi32(x4));
#else
  const __m512i pairs = _mm512_maddubs_epi16(codes, _mm512_set1_epi32(x4));
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
}
#if !defined(LOWBIT_VNNI)
// Short sums: as simd_avx2.h's (exact int16 sums of up to 8 quads, widened once).
constexpr int kShortQuads = 8;
static inline __m512i udot16(__m512i acc, __m512i codes, const int8_t* x) {
  int32_t x4;
  std::memcpy(&x4, x, 4);
  return _mm512_add_epi16(acc, _mm512_maddubs_epi16(codes, _mm512_set1_epi32(x4)));
}
static inline __m512i widen16(__m512i s) { return _mm512_madd_epi16(s, _mm512_set1_epi16(1)); }
#else
constexpr int kShortQuads = 0;  // vpdpbusd sums into int32 in one instruction
#endif
static inline V vcvt(__m512i v) { return _mm512_cvtepi32_ps(v); }
static inline __m512i iadd(__m512i a, __m512i b) { return _mm512_add_epi32(a, b); }

#if defined(LOWBIT_VNNI)
// int8 panels too (only with vpdpbusd: the offset activations, up to 255, times int8 codes
// would saturate vpmaddubsw's int16 pairs).
#define LOWBIT_HAS_WO_Q8_INT8 1

// One k-quad (pair rows t, t + 1 of an int8 panel: 16 codes of k = 4q, then 4q + 1, 4q + 2,
// 4q + 3) as 16 dwords, column j holding its 4 codes in k order: dword 4 r + l of the input
// (k-row r, columns 4 l .. 4 l + 3) moves to lane l, then each lane's 4 x 4 bytes transpose.
static inline __m512i q8_quad(const uint8_t* p) {
  const __m512i rows = _mm512_loadu_si512(p);
  const __m512i lanes = _mm512_permutexvar_epi32(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), rows);
  const __m512i transpose = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  return _mm512_shuffle_epi8(lanes, transpose);
}

// acc + per-lane sum of 4 (u8 activation x s8 code) products, the activation dword broadcast.
static inline __m512i sdot(__m512i acc, __m512i codes, int32_t x4) {
  return _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(x4), codes);
}
#endif

// quantize_groups' vector steps (kernels_impl.h), 16 floats each.
struct GroupQ8 {
  static constexpr int kLanes = 16;
  struct Max {
    __m512 v;       // running max of |x|
    __mmask16 bad;  // lanes that saw NaN or inf
  };
  static Max max_init() { return Max{_mm512_setzero_ps(), 0}; }
  static void max_step(Max& m, const float* p) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(p));
    const __m512 big = _mm512_set1_ps(std::numeric_limits<float>::max());
    m.bad |= _mm512_cmp_ps_mask(a, big, _CMP_NLE_UQ);
    m.v = _mm512_max_ps(a, m.v);
  }
  static float max_value(const Max& m) { return _mm512_reduce_max_ps(m.v); }
  // Adds the codes of p[0, 16) / scale (0 where `zero`) to `sum` and stores them to c.
  static void codes_step(__m512i& sum, const float* p, __m512 scale, bool zero, int8_t* c) {
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    const __m512 t = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(_mm512_loadu_ps(p), scale), lo), hi);
    __m512i k = _mm512_cvttps_epi32(_mm512_sub_ps(_mm512_add_ps(t, magic), magic));
    if (zero) k = _mm512_setzero_si512();
    sum = _mm512_add_epi32(sum, k);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c), _mm512_cvtepi32_epi8(k));
  }
  static int32_t sum_value(__m512i v) { return _mm512_reduce_add_epi32(v); }
  static __m512 bcast(float x) { return _mm512_set1_ps(x); }
  static __m512i sum_init() { return _mm512_setzero_si512(); }
};

// Per-token activation quantization (IsaKernels::quantize_row). Operand order of max / min
// matches std::max / std::min in the handler's scalar loop, so NaN inputs behave the same.
static void quantize_row(const float* x, int64_t k, uint8_t* u, float* scale_out) {
  __m512 vmax = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) vmax = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), vmax);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, vmax);
  float amax = 0.0f;
  for (float v : lanes) amax = std::max(amax, v);
  for (int64_t j = i; j < k; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
  *scale_out = scale;
  const __m512 s = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-127.0f);
  const __m512 hi = _mm512_set1_ps(127.0f), magic = _mm512_set1_ps(12582912.0f);
  const __m512i offset = _mm512_set1_epi32(128);
  for (i = 0; i + 16 <= k; i += 16) {
    __m512 v = _mm512_div_ps(_mm512_loadu_ps(x + i), s);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    v = _mm512_sub_ps(_mm512_add_ps(v, magic), magic);
    const __m512i q = _mm512_add_epi32(_mm512_cvttps_epi32(v), offset);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(u + i), _mm512_cvtepi32_epi8(q));
  }
  for (; i < k; ++i) {
    float v = x[i] / scale;
    v = std::min(127.0f, std::max(-127.0f, v));
    v = (v + 12582912.0f) - 12582912.0f;
    u[i] = static_cast<uint8_t>(static_cast<int32_t>(v) + 128);
  }
}
