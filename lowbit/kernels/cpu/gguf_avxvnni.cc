// AVX-VNNI tile kernels (gguf_vnni.h): the kernels of gguf_vnni_impl.h on 32-byte registers,
// each holding 4 bytes of the 8 rows of one group (the AVX2 tiles' layout), with VEX vpdpbusd.
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
LOWBIT_TARGET_PUSH("avx2,fma,f16c,bmi,bmi2,avxvnni")
namespace {

using I = __m256i;
using F = __m256;
constexpr int kGroups = 1;
// Rows at once, measured (4096 x 4096 in cache, 64 rows, against 2 and 8): Q4_K and Q5_K
// hold 3 sums a row (two sub-blocks and the total), and 8 rows' 24 exceed the 16 registers
// (Q4_K 1.37x the AVX2 tiles at 4 rows, 1.16x at 8); the other types gain from 4 to 8 rows
// or stay level (Q8_0 1.59x -> 1.67x, Q3_K 1.35x -> 1.53x).
constexpr int MaxRows(int type) { return type == kQ4_K || type == kQ5_K ? 4 : 8; }
// Q6_K from a buffer: 1.33x the AVX2 tiles at 8 and 64 rows (its codes rebuilt in registers,
// as on AVX-512: 0.75-0.99x).
constexpr bool kQ6KBuffered = true;

inline I Load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m128i Load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline I Codes(Group g, int off) { return Load(g.t + off); }
inline I Widen16u(Group g, int off) { return _mm256_cvtepu8_epi16(Load16(g.t + off)); }
inline I Widen16s(Group g, int off) { return _mm256_cvtepi8_epi16(Load16(g.t + off)); }
inline I Widen32u(Group g, int off) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(g.t + off)));
}
inline F Halves(Group g, int off) { return _mm256_cvtph_ps(Load16(g.t + off)); }

inline I LoadI(const uint8_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }
inline void StoreI(uint8_t* p, I v) { _mm256_store_si256(reinterpret_cast<__m256i*>(p), v); }

inline I Bcast4(const int8_t* a) {
  int32_t v;
  std::memcpy(&v, a, 4);
  return _mm256_set1_epi32(v);
}
inline I Dot(I acc, I u, I s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
inline I ByteIf(I v, I bit, I val) {
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), val);
}
inline I And(I a, I b) { return _mm256_and_si256(a, b); }
inline I Or(I a, I b) { return _mm256_or_si256(a, b); }
inline I Xor(I a, I b) { return _mm256_xor_si256(a, b); }
inline I Add32(I a, I b) { return _mm256_add_epi32(a, b); }
inline I Sub32(I a, I b) { return _mm256_sub_epi32(a, b); }
inline I Mul32(I a, I b) { return _mm256_mullo_epi32(a, b); }
inline I Madd16(I a, I b) { return _mm256_madd_epi16(a, b); }
inline I Srl16(I a, int n) { return _mm256_srli_epi16(a, n); }
inline I Sll16(I a, int n) { return _mm256_slli_epi16(a, n); }
inline I Sll32(I a, int n) { return _mm256_slli_epi32(a, n); }
inline I Sra32(I a, int n) { return _mm256_srai_epi32(a, n); }
inline I Shuffle8(I a, I control) { return _mm256_shuffle_epi8(a, control); }
inline I Zero() { return _mm256_setzero_si256(); }
inline I Set8(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
inline I Set16(int v) { return _mm256_set1_epi16(static_cast<int16_t>(v)); }
inline I Set32(int v) { return _mm256_set1_epi32(v); }
inline I Set4x64(int64_t d, int64_t c, int64_t b, int64_t a) { return _mm256_set_epi64x(d, c, b, a); }
inline F FZero() { return _mm256_setzero_ps(); }
inline F FSet(float v) { return _mm256_set1_ps(v); }
inline F Fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline F Fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
inline F FMul(F a, F b) { return _mm256_mul_ps(a, b); }
inline F ToFloat(I a) { return _mm256_cvtepi32_ps(a); }
inline void Store(float* p, F v) { _mm256_storeu_ps(p, v); }

#include "gguf_vnni_impl.h"
}  // namespace
LOWBIT_TARGET_POP

void TilesAvxVnni(const Weight& w, const Acts& acts, int64_t g0, int64_t g1, float* out) {
  TilesAny(w, acts, g0, g1, out);
}
#else
void TilesAvxVnni(const Weight&, const Acts&, int64_t, int64_t, float*) {}
#endif

}  // namespace gguf
}  // namespace lowbit
