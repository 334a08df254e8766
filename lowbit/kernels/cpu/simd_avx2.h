// AVX2 (+FMA, F16C) vocabulary for kernels_impl.h: a 16-column panel row is a pair of ymm.
// Define LOWBIT_VNNI for AVX-VNNI (VEX vpdpbusd); otherwise u8 x s8 dots use exact int16
// vpmaddwd.

constexpr int kMR = 2;
constexpr int kNP = 1;
constexpr int kMRWide = 2;  // rows per single-panel tile when M > kMR (small M)
constexpr int kQMR = 4;
constexpr int kFMR = 4;  // rows per float GEMM tile (large M)
constexpr int kFNP = 1;
// Decode 4-bit int4/uint4 codes with the 16-entry table lookup (else integer convert).
constexpr bool kLutNibbles = false;
constexpr int kQNP = 1;

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
