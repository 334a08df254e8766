// GGML block types read as a GGUF file stores them: each weight row [K] is consecutive blocks
// (32 or 256 elements, scales inside). Every type decodes, 256 elements (a "unit") at a time,
// to one canonical form the products share:
//
//   w[i] = ws[i / 16] * q[i] + wm[i / 16]      q int8, ws / wm float32 per 16 elements
//
// (wm only for types with minimums: Q4_1, Q5_1, Q2_K, Q4_K, Q5_K). The float operations are
// llama.cpp's dequantization's own (ws = d * sc, wm = -(dmin * m), then ws * q + wm), so a
// dequantized weight equals llama.cpp's bit for bit. A unit of a 32-element type is up to 8
// consecutive blocks.
#ifndef LOWBIT_KERNELS_CPU_GGUF_BLOCKS_H_
#define LOWBIT_KERNELS_CPU_GGUF_BLOCKS_H_

#include <cstdint>
#include <cstring>

namespace lowbit {
namespace gguf {

// Type ids shared with lowbit/kernels/_gguf.py (GGUF_TYPE_IDS).
enum Type : int {
  kQ4_0 = 0,
  kQ4_1 = 1,
  kQ5_0 = 2,
  kQ5_1 = 3,
  kQ8_0 = 4,
  kIQ4_NL = 5,
  kQ2_K = 6,
  kQ3_K = 7,
  kQ4_K = 8,
  kQ5_K = 9,
  kQ6_K = 10,
  kIQ4_XS = 11,
  kNumTypes = 12,
};

struct TypeInfo {
  int block;     // elements a block
  int bytes;     // bytes a block
  bool has_min;  // wm is not all zero
};

inline constexpr TypeInfo kTypes[kNumTypes] = {
    {32, 18, false},  {32, 20, true},    {32, 22, false},   {32, 24, true},
    {32, 34, false},  {32, 18, false},   {256, 84, true},   {256, 110, false},
    {256, 144, true}, {256, 176, true},  {256, 210, false}, {256, 136, false},
};

inline constexpr int kUnit = 256;

inline constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                          1,    13,   25,  38,  53,  69,  89,  113};

// One decoded unit. `q` is 32-byte aligned for vector loads.
// d and dmin: a 256-element unit's superblock scales, for the integer dots on Q8_K
// activations (whose integer sub-block scales `IntScales` reads from the block itself).
struct alignas(32) Unit {
  int8_t q[kUnit];
  float ws[kUnit / 16];
  float wm[kUnit / 16];
  float d, dmin;
};

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ffu, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return HalfToFloat(h);
}

// Q4_K / Q5_K: scale and minimum j (< 8) of the 12 packed 6-bit bytes.
inline void ScaleMinK4(int j, const uint8_t* s, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q3_K: its 16 6-bit scales (stored + 32).
inline void Q3Scales(const uint8_t* s, int out[16]) {
  for (int i = 0; i < 16; ++i) {
    const int low = i < 8 ? s[i] & 15 : s[i - 8] >> 4;
    const int high = (s[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
    out[i] = low | (high << 4);
  }
}

}  // namespace gguf
}  // namespace lowbit

#endif  // LOWBIT_KERNELS_CPU_GGUF_BLOCKS_H_
