// AVX2 (+FMA, F16C) vocabulary for kernels_impl.h: a 16-column panel row is a pair of ymm.
// Define LOWBIT_VNNI for AVX-VNNI (VEX vpdpbusd); otherwise u8 x s8 dots use exact int16
// vpmaddwd.

// mr, np, mr_wide, fmr, fnp, qmr, qnp, lut_nibbles (TileShape in common.h).
constexpr TileShape kTile{2, 1, 2, 6, 1, 4, 1, false};

struct V {
  __m256 a, b;
};
static inline V vzero() { return V{_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline V vload(const float* p) { return V{_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vstore(float* p, V v) {
  _mm256_storeu_ps(p, v.a);
  _mm256_storeu_ps(p + 8, v.b);
}
static inline V vbcast(float x) {
  const __m256 s = _mm256_set1_ps(x);
  return V{s, s};
}
static inline V vadd(V x, V y) { return V{_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
static inline V vsub(V x, V y) { return V{_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)}; }
static inline V vmul(V x, V y) { return V{_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
static inline V vfmadd(V x, V y, V z) {
  return V{_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)};
}
static inline V vfnmadd(V x, V y, V z) {
  return V{_mm256_fnmadd_ps(x.a, y.a, z.a), _mm256_fnmadd_ps(x.b, y.b, z.b)};
}

static inline __m128i load8(const uint8_t* p) {
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
}

static inline V deq_s8(const uint8_t* p) {
  return V{_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(p))),
           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(p + 8)))};
}

static inline void deq_nib(const uint8_t* p, V& lo, V& hi) {
  const __m256i v0 = _mm256_cvtepu8_epi32(load8(p));
  const __m256i v1 = _mm256_cvtepu8_epi32(load8(p + 8));
  const __m256i m = _mm256_set1_epi32(15);
  lo = V{_mm256_cvtepi32_ps(_mm256_and_si256(v0, m)), _mm256_cvtepi32_ps(_mm256_and_si256(v1, m))};
  hi = V{_mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4))};
}

struct Lut {
  __m256 t0, t1;
};
static inline Lut make_lut(const float* t16) {
  return Lut{_mm256_loadu_ps(t16), _mm256_loadu_ps(t16 + 8)};
}
// vpermps uses the low 3 index bits; bit 3 (moved to the sign bit) picks the table half.
static inline __m256 lut8(const Lut& l, __m256i idx) {
  const __m256 r0 = _mm256_permutevar8x32_ps(l.t0, idx);
  const __m256 r1 = _mm256_permutevar8x32_ps(l.t1, idx);
  return _mm256_blendv_ps(r0, r1, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}
static inline void deq_lut(const uint8_t* p, const Lut& l, V& lo, V& hi) {
  const __m256i v0 = _mm256_cvtepu8_epi32(load8(p));
  const __m256i v1 = _mm256_cvtepu8_epi32(load8(p + 8));
  lo = V{lut8(l, v0), lut8(l, v1)};
  hi = V{lut8(l, _mm256_srli_epi32(v0, 4)), lut8(l, _mm256_srli_epi32(v1, 4))};
}

// Same bit move as the AVX-512 version: the result is the e4m3 value / 256.
static inline V deq_fp8(const uint8_t* p) {
  __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
  return V{_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
}

struct VI {
  __m256i a, b;
};
static inline VI izero() { return VI{_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline VI iload(const int32_t* p) {
  return VI{_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8))};
}
static inline void istore(int32_t* p, VI v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v.a);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 8), v.b);
}

#if defined(LOWBIT_VNNI)
constexpr int kActWords = 1;
struct WQ {
  __m256i a, b;
};
static inline WQ wq_load(const int8_t* p) {
  return WQ{_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
static inline VI idot(VI acc, const WQ& w, const uint32_t* x) {
  const __m256i s = _mm256_set1_epi32(static_cast<int>(x[0]));
  return VI{_mm256_dpbusd_avx_epi32(acc.a, s, w.a), _mm256_dpbusd_avx_epi32(acc.b, s, w.b)};
}
#else
constexpr int kActWords = 2;
struct WQ {
  __m256i alo, ahi, blo, bhi;
};
static inline WQ wq_load(const int8_t* p) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
  return WQ{_mm256_srai_epi16(_mm256_slli_epi16(a, 8), 8), _mm256_srai_epi16(a, 8),
            _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8), _mm256_srai_epi16(b, 8)};
}
static inline VI idot(VI acc, const WQ& w, const uint32_t* x) {
  const __m256i s0 = _mm256_set1_epi32(static_cast<int>(x[0]));
  const __m256i s1 = _mm256_set1_epi32(static_cast<int>(x[1]));
  acc.a = _mm256_add_epi32(acc.a, _mm256_madd_epi16(w.alo, s0));
  acc.a = _mm256_add_epi32(acc.a, _mm256_madd_epi16(w.ahi, s1));
  acc.b = _mm256_add_epi32(acc.b, _mm256_madd_epi16(w.blo, s0));
  acc.b = _mm256_add_epi32(acc.b, _mm256_madd_epi16(w.bhi, s1));
  return acc;
}
#endif

// int4 / uint4 weight-only panels with int8 activations (wo_q8 in kernels_impl.h) as in
// simd_avx512.h, each 16-column quad as two ymm of 8 dwords (columns 0-7 and 8-15). The 4-bit
// codes are vpmaddubsw's unsigned operand, whose int16 pair sums (at most 2 * 15 * 127) never
// saturate; int8 codes would, so they stay on the float path here.
#define LOWBIT_HAS_WO_Q8 1

// simd_avx512.h's q4_quad bit moves for 8 of the 16 columns: d = a | b << 16 from the bytes
// a of row t and b of row t + 1, then (d | d << 4) & 0x0F0F0F0F.
static inline __m256i q4_dwords(const uint8_t* p) {
  const __m256i d = _mm256_or_si256(_mm256_cvtepu8_epi32(load8(p)),
                                    _mm256_slli_epi32(_mm256_cvtepu8_epi32(load8(p + 16)), 16));
  return _mm256_and_si256(_mm256_or_si256(d, _mm256_slli_epi32(d, 4)),
                          _mm256_set1_epi32(0x0F0F0F0F));
}
static inline VI q4_quad(const uint8_t* p) { return VI{q4_dwords(p), q4_dwords(p + 8)}; }

static inline __m256i udot8(__m256i acc, __m256i codes, __m256i x) {
#if defined(LOWBIT_VNNI)
  return _mm256_dpbusd_avx_epi32(acc, codes, x);
#else
  const __m256i pairs = _mm256_maddubs_epi16(codes, x);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}
static inline VI udot(VI acc, const VI& codes, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
  return VI{udot8(acc.a, codes.a, x), udot8(acc.b, codes.b, x)};
}
#if !defined(LOWBIT_VNNI)
// Short sums (wq8_tile): int16 sums of a few quads' products, widened once (kShortQuads in
// kernels_impl.h). A vpmaddubsw lane adds two products of at most 15 * 128, so 8 quads sum
// to at most 30720 < 2**15: exact, with one vpmaddwd per 8 quads instead of one per quad.
constexpr int kShortQuads = 8;
static inline VI udot16(VI acc, const VI& codes, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
  return VI{_mm256_add_epi16(acc.a, _mm256_maddubs_epi16(codes.a, x)),
            _mm256_add_epi16(acc.b, _mm256_maddubs_epi16(codes.b, x))};
}
static inline VI widen16(const VI& s) {
  const __m256i ones = _mm256_set1_epi16(1);
  return VI{_mm256_madd_epi16(s.a, ones), _mm256_madd_epi16(s.b, ones)};
}
#else
constexpr int kShortQuads = 0;  // vpdpbusd sums into int32 in one instruction
#endif
static inline V vcvt(VI v) { return V{_mm256_cvtepi32_ps(v.a), _mm256_cvtepi32_ps(v.b)}; }
static inline VI iadd(const VI& x, const VI& y) {
  return VI{_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)};
}

// quantize_groups' vector steps (kernels_impl.h), 8 floats each.
struct GroupQ8 {
  static constexpr int kLanes = 8;
  struct Max {
    __m256 v;  // running max of |x|
    int bad;   // lanes that saw NaN or inf (movemask bits)
  };
  static Max max_init() { return Max{_mm256_setzero_ps(), 0}; }
  static void max_step(Max& m, const float* p) {
    const __m256 a =
        _mm256_and_ps(_mm256_loadu_ps(p), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
    m.bad |= _mm256_movemask_ps(
        _mm256_cmp_ps(a, _mm256_set1_ps(std::numeric_limits<float>::max()), _CMP_NLE_UQ));
    m.v = _mm256_max_ps(a, m.v);
  }
  static float max_value(const Max& m) {
    __m128 r = _mm_max_ps(_mm256_castps256_ps128(m.v), _mm256_extractf128_ps(m.v, 1));
    r = _mm_max_ps(r, _mm_movehl_ps(r, r));
    r = _mm_max_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
  }
  // Adds the codes of p[0, 8) / scale (0 where `zero`) to `sum` and stores them to c.
  static void codes_step(__m256i& sum, const float* p, __m256 scale, bool zero, int8_t* c) {
    __m256 t = _mm256_div_ps(_mm256_loadu_ps(p), scale);
    t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    __m256i k = _mm256_cvttps_epi32(_mm256_sub_ps(_mm256_add_ps(t, magic), magic));
    if (zero) k = _mm256_setzero_si256();
    sum = _mm256_add_epi32(sum, k);
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), k);
    for (int l = 0; l < 8; ++l) c[l] = static_cast<int8_t>(lanes[l]);
  }
  static int32_t sum_value(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
  }
  static __m256 bcast(float x) { return _mm256_set1_ps(x); }
  static __m256i sum_init() { return _mm256_setzero_si256(); }
};
