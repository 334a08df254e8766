// AVX-512 VNNI tile kernels for the K-quants (Q2_K to Q6_K) and the 32-element types (gguf_avx512.h).
//
// The AVX2 tiles multiply a 32-byte register of 8 rows by maddubs and add int16 sums; a
// broadcast activation load and a weight load feed every 32 multiply-adds. Here one 64-byte
// register holds the same 4 bytes of two groups (16 rows), vpdpbusd adds into int32 sums, and
// the weight register is decoded once for up to 8 activation rows: about a quarter of the
// instructions a multiply-add. Sub-block scales multiply the int32 sums (vpmulld) instead of
// the int16 ones (vpmaddwd): the same integers, so the same results.
#include "gguf_avx512.h"

#include <cstring>

#include "common.h"
#include "gguf_blocks.h"
#include "gguf_tiles.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace lowbit {
namespace gguf {

#if defined(__x86_64__)
LOWBIT_TARGET_PUSH("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi,bmi2")
namespace {

// 32 bytes at the same place of two tiles: rows 0-7 of group g, then rows 0-7 of group g + 1.
inline __m512i Pair(const uint8_t* t0, const uint8_t* t1) {
  return _mm512_inserti64x4(
      _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t0))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t1)), 1);
}

inline __m512i Bcast4(const int8_t* a) {
  int32_t v;
  std::memcpy(&v, a, 4);
  return _mm512_set1_epi32(v);
}

inline __m512i Pair16(int lo, int hi) {
  return _mm512_set1_epi32(static_cast<int>((static_cast<uint32_t>(hi) << 16) |
                                            (static_cast<uint32_t>(lo) & 0xffffu)));
}

// 16 bytes of each tile, joined.
inline __m256i Join16(const uint8_t* t0, const uint8_t* t1) {
  return _mm256_inserti128_si256(
      _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t0))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(t1)), 1);
}

// 8 fp16 of each tile -> 16 floats.
inline __m512 Halves(const uint8_t* t0, const uint8_t* t1) { return _mm512_cvtph_ps(Join16(t0, t1)); }

// 8 bytes of each tile -> 16 int32.
inline __m512i Bytes8(const uint8_t* t0, const uint8_t* t1) {
  return _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(t0)),
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(t1))));
}

template <int tb>
inline void PrefetchTile(const uint8_t* t) {
  for (int off = 0; off < tb; off += 64) _mm_prefetch(reinterpret_cast<const char*>(t) + off, _MM_HINT_T0);
}

// The frame of every kernel here: pairs of groups (g, g + 1) for M activation rows from r0.
// `unit(t0, t1, u, acc)` adds unit u's products to the rows' 16 outputs `acc[M]` (t0 / t1:
// the unit's tile in each group); the tiles `ahead` units on are prefetched, and the outputs
// are stored once.
template <int tb, int M, int ahead, typename Unit>
inline void OverPairs(const Weight& w, int64_t r0, int64_t g0, int64_t g1, int64_t units,
                      float* out, Unit&& unit) {
  for (int64_t g = g0; g < g1; g += 2) {
    __m512 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t u = 0; u < units; ++u) {
      const uint8_t* t0 = w.data + g * w.row_bytes + u * tb;
      const uint8_t* t1 = t0 + w.row_bytes;
      PrefetchTile<tb>(t0 + ahead * tb);
      PrefetchTile<tb>(t1 + ahead * tb);
      unit(t0, t1, u, acc);
    }
    for (int r = 0; r < M; ++r) _mm512_storeu_ps(out + (r0 + r) * w.n + kTileRows * g, acc[r]);
  }
}

// acc += dot * (d * da): the float epilogue of the AVX2 tiles, in their order.
inline __m512 AddScaled(__m512 acc, __m512i dot, __m512 d, float da) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(da)), acc);
}

// Q4_K and Q5_K: per sub-block of 32 an int32 sum of 8 vpdpbusd a row, times the 16 rows'
// scales. Q5_K's tile is Q4_K's with the codes' fifth bits after it (qh chunk c holds the
// bits of the elements that qs chunk c of every sub-block pair holds: bit 2j for sub-block
// 2j, 2j + 1 for 2j + 1), set here as 16 into the unsigned codes, as in the AVX2 tiles.
template <int M, bool five>
void Q45K(const Weight& w, const Acts& acts, int64_t r0, int64_t g0, int64_t g1, float* out) {
  constexpr int tb = TileBytes(five ? kQ5_K : kQ4_K);
  const int64_t units = w.k / kUnit, kp = acts.kp;
  const __m512i m15 = _mm512_set1_epi8(15), s16 = _mm512_set1_epi8(16);
  OverPairs<tb, M, 2>(w, r0, g0, g1, units, out,
                      [&](const uint8_t* t0, const uint8_t* t1, int64_t u, __m512* acc) {
    __m512i isum[M];
    for (int r = 0; r < M; ++r) isum[r] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {  // sub-blocks 2j (low nibbles) and 2j + 1 (high)
      __m512i slo[M], shi[M];
      for (int r = 0; r < M; ++r) slo[r] = shi[r] = _mm512_setzero_si512();
      const int off = 160 + 256 * j;
      const __m512i b0 = _mm512_set1_epi8(static_cast<char>(1 << (2 * j)));
      const __m512i b1 = _mm512_set1_epi8(static_cast<char>(1 << (2 * j + 1)));
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const __m512i v = Pair(t0 + off + 32 * c, t1 + off + 32 * c);
        __m512i lo = _mm512_and_si512(v, m15);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m15);
        if constexpr (five) {
          const __m512i qh = Pair(t0 + 1184 + 32 * c, t1 + 1184 + 32 * c);
          lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh, b0), s16));
          hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh, b1), s16));
        }
#pragma GCC unroll 8
        for (int r = 0; r < M; ++r) {
          const int8_t* a = acts.a.data() + (r0 + r) * kp + u * kUnit + 64 * j + 4 * c;
          slo[r] = _mm512_dpbusd_epi32(slo[r], lo, Bcast4(a));
          shi[r] = _mm512_dpbusd_epi32(shi[r], hi, Bcast4(a + 32));
        }
      }
      const __m512i sl = Bytes8(t0 + 32 + 16 * j, t1 + 32 + 16 * j);
      const __m512i sh = Bytes8(t0 + 40 + 16 * j, t1 + 40 + 16 * j);
      for (int r = 0; r < M; ++r)
        isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(_mm512_mullo_epi32(slo[r], sl),
                                                             _mm512_mullo_epi32(shi[r], sh)));
    }
    __m512i mv[4];
    for (int p = 0; p < 4; ++p) mv[p] = _mm512_cvtepu8_epi16(Join16(t0 + 96 + 16 * p, t1 + 96 + 16 * p));
    const __m512 d = Halves(t0, t1), dm = Halves(t0 + 16, t1 + 16);
    for (int r = 0; r < M; ++r) {
      const int16_t* bs = acts.bs.data() + (r0 + r) * (kp / 16) + u * 16;
      __m512i imin = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p)
        imin = _mm512_add_epi32(imin, _mm512_madd_epi16(mv[p], Pair16(bs[4 * p] + bs[4 * p + 1],
                                                                      bs[4 * p + 2] + bs[4 * p + 3])));
      const __m512 da = _mm512_set1_ps(acts.da[(r0 + r) * units + u]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, da), acc[r]);
      acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(imin), _mm512_mul_ps(dm, da), acc[r]);
    }
  });
}

// Q6_K: codes taken unsigned (0..63), 32 * (scale . activation sums) subtracted, as in the
// AVX2 tiles; one sub-block of 16 at a time, its code register rebuilt from ql / qh.
template <int M>
void Q6K(const Weight& w, const Acts& acts, int64_t r0, int64_t g0, int64_t g1, float* out) {
  constexpr int tb = TileBytes(kQ6_K);
  const int64_t units = w.k / kUnit, kp = acts.kp;
  const __m512i m15 = _mm512_set1_epi8(15), m48 = _mm512_set1_epi8(48);
  OverPairs<tb, M, 2>(w, r0, g0, g1, units, out,
                      [&](const uint8_t* t0, const uint8_t* t1, int64_t u, __m512* acc) {
    __m512i isum[M], corr[M];
    for (int r = 0; r < M; ++r) isum[r] = corr[r] = _mm512_setzero_si512();
    for (int p = 0; p < 8; ++p) {  // scale pair p: int16 (scale 2p, scale 2p + 1) a row
      const __m512i sc16 = _mm512_cvtepi8_epi16(Join16(t0 + 16 + 16 * p, t1 + 16 + 16 * p));
      for (int r = 0; r < M; ++r) {
        const int16_t* bs = acts.bs.data() + (r0 + r) * (kp / 16) + u * 16 + 2 * p;
        corr[r] = _mm512_add_epi32(corr[r], _mm512_madd_epi16(sc16, Pair16(bs[0], bs[1])));
      }
      // Sub-block 2p + half holds elements 128h + 32s + 16 half .. + 15 (h = p / 4, s = p % 4).
      const int h = p / 4, s = p % 4;
      for (int half = 0; half < 2; ++half) {
        const __m512i scale = half ? _mm512_srai_epi32(sc16, 16)
                                   : _mm512_srai_epi32(_mm512_slli_epi32(sc16, 16), 16);
        __m512i sm[M];
        for (int r = 0; r < M; ++r) sm[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
          const int l = 16 * half + 4 * q;
          const int lo_off = 144 + 8 * (64 * h + 32 * (s & 1) + l);  // ql: A (s even) or B
          const __m512i lo = Pair(t0 + lo_off, t1 + lo_off);
          const __m512i hb = Pair(t0 + 1168 + 8 * (32 * h + l), t1 + 1168 + 8 * (32 * h + l));
          const __m512i low4 = _mm512_and_si512(s < 2 ? lo : _mm512_srli_epi16(lo, 4), m15);
          const __m512i high2 = _mm512_and_si512(
              s == 0 ? _mm512_slli_epi16(hb, 4) : s == 1 ? _mm512_slli_epi16(hb, 2)
                       : s == 2 ? hb : _mm512_srli_epi16(hb, 2), m48);
          const __m512i v = _mm512_or_si512(low4, high2);
#pragma GCC unroll 8
          for (int r = 0; r < M; ++r) {
            const int8_t* a = acts.a.data() + (r0 + r) * kp + u * kUnit + 128 * h + 32 * s + l;
            sm[r] = _mm512_dpbusd_epi32(sm[r], v, Bcast4(a));
          }
        }
        for (int r = 0; r < M; ++r) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(sm[r], scale));
      }
    }
    const __m512 d = Halves(t0, t1);
    for (int r = 0; r < M; ++r)
      acc[r] = AddScaled(acc[r], _mm512_sub_epi32(isum[r], _mm512_slli_epi32(corr[r], 5)), d,
                         acts.da[(r0 + r) * units + u]);
  });
}

// Q2_K and Q3_K: each chunk's 2-bit codes as unsigned bytes (Q3_K: with the hmask bit as
// + 4, 0..7), summed per sub-block of 16 and scaled; Q3_K's + 4 comes off as 4 * sum_s
// scale_s * sum(a over s), Q2_K's minimums as dmin * sum_s min_s * sum(a over s), as in the
// AVX2 tiles.
// Sub-block pair p's scales (`sc16`) and what the activation sums are multiplied by (`by16`:
// the scales for Q3_K, the minimums for Q2_K), int16 (row, sub-block) of the 16 rows.
template <int type>
inline void Q23Scales(const uint8_t* t0, const uint8_t* t1, int p, __m512i* sc16, __m512i* by16) {
  if constexpr (type == kQ3_K) {
    *sc16 = *by16 = _mm512_cvtepi8_epi16(Join16(t0 + 16 + 16 * p, t1 + 16 + 16 * p));
  } else {
    const __m512i b16 = _mm512_cvtepu8_epi16(Join16(t0 + 32 + 16 * p, t1 + 32 + 16 * p));
    *sc16 = _mm512_and_si512(b16, _mm512_set1_epi16(15)), *by16 = _mm512_srli_epi16(b16, 4);
  }
}

template <int type, int M>
void Q23K(const Weight& w, const Acts& acts, int64_t r0, int64_t g0, int64_t g1, float* out) {
  constexpr bool q3 = type == kQ3_K;
  constexpr int tb = TileBytes(type);
  const int64_t units = w.k / kUnit, kp = acts.kp;
  const __m512i m3 = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
  OverPairs<tb, M, 2>(w, r0, g0, g1, units, out,
                      [&](const uint8_t* t0, const uint8_t* t1, int64_t u, __m512* acc) {
    __m512i isum[M];
    for (int r = 0; r < M; ++r) isum[r] = _mm512_setzero_si512();
    for (int p = 0; p < 8; ++p) {  // sub-blocks 2p, 2p + 1: h = p / 4, j = p % 4
      const int h = p / 4, j = p % 4;
      const __m512i bit = _mm512_set1_epi8(static_cast<char>(1 << (4 * h + j)));
      __m512i sm[2][M];
      for (int half = 0; half < 2; ++half)
        for (int r = 0; r < M; ++r) sm[half][r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {  // elements 128h + 32j + 4c .. + 3 of the 16 rows
        const int qo = (q3 ? 144 : 160) + 32 * (8 * h + c), ho = 656 + 32 * c;
        __m512i v = _mm512_and_si512(_mm512_srli_epi16(Pair(t0 + qo, t1 + qo), 2 * j), m3);
        if constexpr (q3)
          v = _mm512_or_si512(v, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(Pair(t0 + ho, t1 + ho), bit), four));
#pragma GCC unroll 8
        for (int r = 0; r < M; ++r) {
          const int8_t* a = acts.a.data() + (r0 + r) * kp + u * kUnit + 128 * h + 32 * j + 4 * c;
          sm[c / 4][r] = _mm512_dpbusd_epi32(sm[c / 4][r], v, Bcast4(a));
        }
      }
      __m512i sc16, by16;
      Q23Scales<type>(t0, t1, p, &sc16, &by16);
      const __m512i lo = _mm512_srai_epi32(_mm512_slli_epi32(sc16, 16), 16);
      const __m512i hi = _mm512_srai_epi32(sc16, 16);
      for (int r = 0; r < M; ++r)
        isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(_mm512_mullo_epi32(sm[0][r], lo),
                                                             _mm512_mullo_epi32(sm[1][r], hi)));
    }
    // Each row's `corr` after the codes (held through the loop above, it would not fit in
    // the registers beside the sums).
    const __m512 d = Halves(t0, t1);
    for (int r = 0; r < M; ++r) {
      const int16_t* bs = acts.bs.data() + (r0 + r) * (kp / 16) + u * 16;
      __m512i corr = _mm512_setzero_si512();
      for (int p = 0; p < 8; ++p) {
        __m512i sc16, by16;
        Q23Scales<type>(t0, t1, p, &sc16, &by16);
        corr = _mm512_add_epi32(corr, _mm512_madd_epi16(by16, Pair16(bs[2 * p], bs[2 * p + 1])));
      }
      const float da = acts.da[(r0 + r) * units + u];
      if constexpr (q3) {
        acc[r] = AddScaled(acc[r], _mm512_sub_epi32(isum[r], _mm512_slli_epi32(corr, 2)), d, da);
      } else {
        const __m512 dm = Halves(t0 + 16, t1 + 16), vda = _mm512_set1_ps(da);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, vda), acc[r]);
        acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(corr), _mm512_mul_ps(dm, vda), acc[r]);
      }
    }
  });
}

// 32-element types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): a pair of tiles' codes as unsigned bytes
// in 8 registers (Q8_0's with their sign bit flipped), each row's 8 vpdpbusd into one sum
// (the block has one scale), then the offset (Q4_0 / Q5_0 / Q8_0) or minimum (Q4_1 / Q5_1)
// terms of the AVX2 tiles.
inline __m512i LanePick(int byte) {  // byte `byte` of each 32-bit lane to the lane's 4 bytes
  const int64_t b = static_cast<int64_t>(byte) * 0x0101010101010101;
  return _mm512_set_epi64(b + 0x0c0c0c0c08080808, b + 0x0404040400000000,
                          b + 0x0c0c0c0c08080808, b + 0x0404040400000000,
                          b + 0x0c0c0c0c08080808, b + 0x0404040400000000,
                          b + 0x0c0c0c0c08080808, b + 0x0404040400000000);
}

template <int type, int M>
void Q32(const Weight& w, const Acts& acts, int64_t r0, int64_t g0, int64_t g1, float* out) {
  constexpr int tb = TileBytes(type);
  constexpr bool has_min = kTypes[type].has_min;
  constexpr bool five = HasFifthBit(type);
  constexpr int offset = CodeOffset(type);
  const int64_t blocks = w.k / 32, kp = acts.kp;
  const __m512i m15 = _mm512_set1_epi8(15), s16 = _mm512_set1_epi8(16);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i sel[4] = {LanePick(0), LanePick(1), LanePick(2), LanePick(3)};
  const __m512i bit[2] = {_mm512_set1_epi32(0x08040201), _mm512_set1_epi32(static_cast<int>(0x80402010u))};
  OverPairs<tb, M, 8>(w, r0, g0, g1, blocks, out,
                      [&](const uint8_t* t0, const uint8_t* t1, int64_t j, __m512* acc) {
    __m512i u[8];  // u[c]: elements 4c.. of the 16 rows; u[4 + c]: elements 16 + 4c..
    if constexpr (type == kQ8_0) {  // the signed codes plus 128: unsigned bytes for vpdpbusd
      for (int c = 0; c < 8; ++c)
        u[c] = _mm512_xor_si512(Pair(t0 + TileNibbles(type) + 32 * c, t1 + TileNibbles(type) + 32 * c), flip);
    } else for (int c = 0; c < 4; ++c) {
      const __m512i v = Pair(t0 + TileNibbles(type) + 32 * c, t1 + TileNibbles(type) + 32 * c);
      u[c] = _mm512_and_si512(v, m15);
      u[4 + c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m15);
      if constexpr (five) {
        const __m512i qh = Pair(t0 + TileHighBits(type), t1 + TileHighBits(type));
        const __m512i b = bit[c % 2];
        const __m512i lo = _mm512_and_si512(_mm512_shuffle_epi8(qh, sel[c / 2]), b);
        const __m512i hi = _mm512_and_si512(_mm512_shuffle_epi8(qh, sel[2 + c / 2]), b);
        u[c] = _mm512_or_si512(u[c], _mm512_maskz_mov_epi8(_mm512_cmpeq_epi8_mask(lo, b), s16));
        u[4 + c] = _mm512_or_si512(u[4 + c], _mm512_maskz_mov_epi8(_mm512_cmpeq_epi8_mask(hi, b), s16));
      }
    }
    const __m512 d = Halves(t0, t1);
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r) {
      const int8_t* a = acts.a.data() + (r0 + r) * kp + 32 * j;
      __m512i dot = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        dot = _mm512_dpbusd_epi32(dot, u[c], Bcast4(a + 4 * c));
        dot = _mm512_dpbusd_epi32(dot, u[4 + c], Bcast4(a + 16 + 4 * c));
      }
      const int64_t s = (r0 + r) * (kp / 16) + 2 * j;  // the block's two sums of 16
      if constexpr (offset != 0)
        dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(offset * (acts.bs[s] + acts.bs[s + 1])));
      acc[r] = AddScaled(acc[r], dot, d, acts.da[(r0 + r) * (kp / 32) + j]);
      if constexpr (has_min)
        acc[r] = _mm512_fmadd_ps(Halves(t0 + 16, t1 + 16), _mm512_set1_ps(acts.sums[s] + acts.sums[s + 1]), acc[r]);
    }
  });
}

template <int type, int M>
void Run(const Weight& w, const Acts& acts, int64_t r0, int64_t g0, int64_t g1, float* out) {
  if constexpr (type == kQ4_K || type == kQ5_K) Q45K<M, type == kQ5_K>(w, acts, r0, g0, g1, out);
  else if constexpr (type == kQ6_K) Q6K<M>(w, acts, r0, g0, g1, out);
  else if constexpr (type == kQ2_K || type == kQ3_K) Q23K<type, M>(w, acts, r0, g0, g1, out);
  else Q32<type, M>(w, acts, r0, g0, g1, out);
}

template <int type>
void Tiles(const Weight& w, const Acts& acts, int64_t g0, int64_t g1, float* out) {
  int64_t r = 0;
  for (; r + 8 <= acts.m; r += 8) Run<type, 8>(w, acts, r, g0, g1, out);
  if (acts.m - r >= 4) Run<type, 4>(w, acts, r, g0, g1, out), r += 4;
  if (acts.m - r >= 2) Run<type, 2>(w, acts, r, g0, g1, out), r += 2;
  if (acts.m - r >= 1) Run<type, 1>(w, acts, r, g0, g1, out);
}

}  // namespace
LOWBIT_TARGET_POP

bool HasTilesAvx512(int type) {
  return type == kQ2_K || type == kQ3_K || type == kQ4_K || type == kQ5_K || type == kQ6_K || type == kQ4_0 || type == kQ4_1 ||
         type == kQ5_0 || type == kQ5_1 || type == kQ8_0;
}

void TilesAvx512(const Weight& w, const Acts& acts, int64_t g0, int64_t g1, float* out) {
  switch (w.type) {
    case kQ4_K: return Tiles<kQ4_K>(w, acts, g0, g1, out);
    case kQ5_K: return Tiles<kQ5_K>(w, acts, g0, g1, out);
    case kQ6_K: return Tiles<kQ6_K>(w, acts, g0, g1, out);
    case kQ2_K: return Tiles<kQ2_K>(w, acts, g0, g1, out);
    case kQ3_K: return Tiles<kQ3_K>(w, acts, g0, g1, out);
    case kQ4_0: return Tiles<kQ4_0>(w, acts, g0, g1, out);
    case kQ4_1: return Tiles<kQ4_1>(w, acts, g0, g1, out);
    case kQ5_0: return Tiles<kQ5_0>(w, acts, g0, g1, out);
    case kQ8_0: return Tiles<kQ8_0>(w, acts, g0, g1, out);
    default: return Tiles<kQ5_1>(w, acts, g0, g1, out);
  }
}
#else
bool HasTilesAvx512(int) { return false; }
void TilesAvx512(const Weight&, const Acts&, int64_t, int64_t, float*) {}
#endif

}  // namespace gguf
}  // namespace lowbit
