// AVX2 (+FMA, F16C) vocabulary for kernels_impl.h: a 16-column panel row is a pair of ymm.
// Define LOWBIT_VNNI for AVX-VNNI (VEX vpdpbusd); otherwise u8 x s8 dots use exact int16
// vpmaddwd.

// mr, np, mr_wide, fmr, fnp, qmr, qnp, lut_nibbles (TileShape in common.h).
constexpr TileShape kTile{2, 1, 4, 6, 1, 4, 1, false};
// 3 or 4 rows of a weight-only tile: wo_tile_one_chain (kernels_impl.h).
#define LOWBIT_WO_ONE_CHAIN 1

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

// Bytes [0, 8) and [8, 16) at p zero-extended to dwords, with one 16-byte broadcast load and two
// in-lane shuffles: the zero-extending loads (vpmovzxbd ymm) cross lanes, and on Zen 3 two of
// them a pair row kept the shuffle ports busier than the eight multiply-adds of a 2-row tile
// (llvm-mca -mcpu=znver3: 10.1 cycles a pair row, 8.8 with these; Skylake and Zen 2 7.1 both).
static inline void load_u8x16(const uint8_t* p, __m256i& v0, __m256i& v1) {
  const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const char z = -1;  // vpshufb: an index with the top bit set writes 0
  v0 = _mm256_shuffle_epi8(b, _mm256_setr_epi8(0, z, z, z, 1, z, z, z, 2, z, z, z, 3, z, z, z, 4, z,
                                               z, z, 5, z, z, z, 6, z, z, z, 7, z, z, z));
  v1 = _mm256_shuffle_epi8(b, _mm256_setr_epi8(8, z, z, z, 9, z, z, z, 10, z, z, z, 11, z, z, z, 12,
                                               z, z, z, 13, z, z, z, 14, z, z, z, 15, z, z, z));
}

static inline void deq_nib(const uint8_t* p, V& lo, V& hi) {
  __m256i v0, v1;
  load_u8x16(p, v0, v1);
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
// simd_avx512.h, each 16-column quad as two ymm of 8 dwords. The 4-bit codes are vpmaddubsw's
// unsigned operand, whose int16 pair sums (at most 2 * 15 * 127) never saturate. int8 codes
// take their magnitudes as that operand and the activations their signs (q8_dot), as
// llama.cpp's AVX2 Q8_0 dot does: pair sums at most 2 * 128 * 127, exact.
#define LOWBIT_HAS_WO_Q8 1
#define LOWBIT_HAS_WO_Q8_SIGNS 1

// 32 bytes at p, two rows of the 16 columns' bytes, as 16 words in which each column's byte of
// the first row sits beside its byte of the second: columns 0-7, then 8-15, one lane each.
// One vpermq, then in-lane shuffles only.
static inline __m256i column_pairs(const uint8_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  // Lanes [row 0 0-7, row 1 0-7 | row 0 8-15, row 1 8-15], then interleaved within each.
  const __m256i q = _mm256_permute4x64_epi64(v, _MM_SHUFFLE(3, 1, 2, 0));
  return _mm256_shuffle_epi8(q, _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7,
                                                 15, 0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14,
                                                 7, 15));
}

// One k-quad (pair rows t, t + 1: 32 bytes) of a 16-column 4-bit panel as two ymm of 8 dwords,
// column j's dword holding its codes for k = 4q .. 4q + 3 in byte order, in the column order
// [0-3, 8-11] and [4-7, 12-15] (quad_order). Built from column_pairs: four zero-extending
// loads (vpmovzxbd ymm, as simd_avx512.h unpacks) cross lanes and kept the shuffle ports
// busy. A 4-row tile's quad, with udot16 below (llvm-mca, cycles): Zen 3 12.9 -> 7.9, Zen 2
// 14.1 -> 8.6, Skylake 13.1 -> 9.1.
static inline VI q4_quad(const uint8_t* p) {
  const __m256i b = column_pairs(p);
  const __m256i m = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(b, m);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
  return VI{_mm256_unpacklo_epi8(lo, hi), _mm256_unpackhi_epi8(lo, hi)};
}
// Sixteen floats from column order 0-7, 8-15 to q4_quad's (or q8_quad's), and back: the
// exchange of the middle two quarters is its own inverse.
static inline V quad_order(const V& v) {
  return V{_mm256_permute2f128_ps(v.a, v.b, 0x20), _mm256_permute2f128_ps(v.a, v.b, 0x31)};
}

// One k-quad of an int8 panel (64 bytes: the 16 columns' codes of k = 4q, then 4q + 1, 4q + 2,
// 4q + 3) as q4_quad lays a 4-bit one out: column j's dword holds its 4 codes in k order,
// columns in the order [0-3, 8-11] and [4-7, 12-15].
static inline VI q8_quad(const uint8_t* p) {
  // Each column's codes of k = 4q, 4q + 1, then of 4q + 2, 4q + 3, side by side.
  const __m256i lo = column_pairs(p), hi = column_pairs(p + 32);
  return VI{_mm256_unpacklo_epi16(lo, hi), _mm256_unpackhi_epi16(lo, hi)};
}
// The codes' magnitudes, vpmaddubsw's unsigned operand (128 for a code of -128).
static inline VI q8_magnitudes(const VI& w) { return VI{_mm256_abs_epi8(w.a), _mm256_abs_epi8(w.b)}; }
// acc += per column the 4 products of the int8 codes w (magnitudes m) with the 4 activation
// bytes at x, broadcast: |w| * (x with w's sign) in vpmaddubsw, then int32 (two quads' pair
// sums could pass int16). In asm as udot16 below, to keep the sums in registers.
static inline VI q8_dot(VI acc, const VI& w, const VI& m, const int8_t* x) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i t, u;
  asm("vpbroadcastd %[x], %[t]\n\t"
      "vpsignb %[wa], %[t], %[u]\n\t"
      "vpsignb %[wb], %[t], %[t]\n\t"
      "vpmaddubsw %[u], %[ma], %[u]\n\t"
      "vpmaddubsw %[t], %[mb], %[t]\n\t"
      "vpmaddwd %[ones], %[u], %[u]\n\t"
      "vpmaddwd %[ones], %[t], %[t]\n\t"
      "vpaddd %[u], %[pa], %[pa]\n\t"
      "vpaddd %[t], %[pb], %[pb]"
      : [pa] "+x"(acc.a), [pb] "+x"(acc.b), [t] "=&x"(t), [u] "=&x"(u)
      : [wa] "x"(w.a), [wb] "x"(w.b), [ma] "x"(m.a), [mb] "x"(m.b), [ones] "x"(ones),
        [x] "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
}

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
// acc += the pair sums of codes x the 4 activation bytes at x, broadcast. One asm block, so
// that each row's sums stay in registers: from intrinsics GCC broadcast every row's bytes
// before the first product and kept three of a 4-row tile's eight sums on the stack, each
// quad then waiting on a store and its reload.
static inline VI udot16(VI acc, const VI& codes, const int8_t* x) {
  __m256i t, u;
  asm("vpbroadcastd %[x], %[t]\n\t"
      "vpmaddubsw %[t], %[wa], %[u]\n\t"
      "vpmaddubsw %[t], %[wb], %[t]\n\t"
      "vpaddw %[u], %[pa], %[pa]\n\t"
      "vpaddw %[t], %[pb], %[pb]"
      : [pa] "+x"(acc.a), [pb] "+x"(acc.b), [t] "=&x"(t), [u] "=&x"(u)
      : [wa] "x"(codes.a), [wb] "x"(codes.b), [x] "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
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
