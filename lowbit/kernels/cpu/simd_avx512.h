// AVX-512 vocabulary for kernels_impl.h: one zmm holds a 16-column panel row.
// Included inside an ISA namespace with the matching target pragma active; define
// LOWBIT_VNNI to use vpdpbusd, otherwise u8 x s8 dots go through exact int16 vpmaddwd
// (vpmaddubsw could saturate with u8 activations up to 255).

constexpr int kMR = 4;    // activation rows per weight-only tile
constexpr int kNP = 2;    // panels per tile
constexpr int kMRWide = 8;  // rows per single-panel tile when M > kMR (small M)
constexpr int kQMR = 8;
constexpr int kFMR = 8;  // rows per float GEMM tile (large M)
constexpr int kFNP = 2;
// Decode 4-bit int4/uint4 codes with the 16-entry table lookup (else integer convert).
constexpr bool kLutNibbles = true;
constexpr int kQNP = 2;

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
