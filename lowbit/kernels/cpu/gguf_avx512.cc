// AVX-512 VNNI tile kernels (gguf_vnni.h): the kernels of gguf_vnni_impl.h on 64-byte
// registers, each holding the same 4 bytes of two groups (16 rows).
#include <cstring>

#include "common.h"
#include "gguf_blocks.h"
#include "gguf_tiles.h"
#include "gguf_vnni.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace lowbit {
namespace gguf {

#if defined(__x86_64__)
LOWBIT_TARGET_PUSH("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi,bmi2")
namespace {

using I = __m512i;
using F = __m512;
constexpr int kGroups = 2;
constexpr int MaxRows(int) { return 8; }  // 32 registers hold 8 rows' sums
// Q6_K's codes rebuilt in registers for 8 rows: no slower than from a buffer (measured).
constexpr bool kQ6KBuffered = false;

// 32 (16, 8) bytes at `off` of both tiles: group g's in the low half.
inline I Codes(Group g, int off) {
  const uint8_t* t = g.t + off;
  return _mm512_inserti64x4(
      _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + g.stride)), 1);
}
inline __m256i Join16(Group g, int off) {
  const uint8_t* t = g.t + off;
  return _mm256_inserti128_si256(
      _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(t + g.stride)), 1);
}
inline I Widen16u(Group g, int off) { return _mm512_cvtepu8_epi16(Join16(g, off)); }
inline I Widen16s(Group g, int off) { return _mm512_cvtepi8_epi16(Join16(g, off)); }
inline I Widen32u(Group g, int off) {
  const uint8_t* t = g.t + off;
  return _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(t)),
                                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(t + g.stride))));
}
inline F Halves(Group g, int off) { return _mm512_cvtph_ps(Join16(g, off)); }

inline I LoadI(const uint8_t* p) { return _mm512_load_si512(p); }
inline void StoreI(uint8_t* p, I v) { _mm512_store_si512(p, v); }

inline I Bcast4(const int8_t* a) {
  int32_t v;
  std::memcpy(&v, a, 4);
  return _mm512_set1_epi32(v);
}
inline I Dot(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline I ByteIf(I v, I bit, I val) { return _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(v, bit), val); }
inline I And(I a, I b) { return _mm512_and_si512(a, b); }
inline I Or(I a, I b) { return _mm512_or_si512(a, b); }
inline I Xor(I a, I b) { return _mm512_xor_si512(a, b); }
inline I Add32(I a, I b) { return _mm512_add_epi32(a, b); }
inline I Sub32(I a, I b) { return _mm512_sub_epi32(a, b); }
inline I Mul32(I a, I b) { return _mm512_mullo_epi32(a, b); }
inline I Madd16(I a, I b) { return _mm512_madd_epi16(a, b); }
inline I Srl16(I a, int n) { return _mm512_srli_epi16(a, n); }
inline I Sll16(I a, int n) { return _mm512_slli_epi16(a, n); }
inline I Sll32(I a, int n) { return _mm512_slli_epi32(a, n); }
inline I Sra32(I a, int n) { return _mm512_srai_epi32(a, n); }
inline I Shuffle8(I a, I control) { return _mm512_shuffle_epi8(a, control); }
inline I Zero() { return _mm512_setzero_si512(); }
inline I Set8(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
inline I Set16(int v) { return _mm512_set1_epi16(static_cast<int16_t>(v)); }
inline I Set32(int v) { return _mm512_set1_epi32(v); }
inline I Set4x64(int64_t d, int64_t c, int64_t b, int64_t a) { return _mm512_set4_epi64(d, c, b, a); }
inline F FZero() { return _mm512_setzero_ps(); }
inline F FSet(float v) { return _mm512_set1_ps(v); }
inline F Fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline F Fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
inline F FMul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F ToFloat(I a) { return _mm512_cvtepi32_ps(a); }
inline void Store(float* p, F v) { _mm512_storeu_ps(p, v); }

#include "gguf_vnni_impl.h"
}  // namespace
LOWBIT_TARGET_POP

void TilesAvx512Vnni(const Weight& w, const Acts& acts, int64_t g0, int64_t g1, float* out) {
  TilesAny(w, acts, g0, g1, out);
}
#else
void TilesAvx512Vnni(const Weight&, const Acts&, int64_t, int64_t, float*) {}
#endif

}  // namespace gguf
}  // namespace lowbit
