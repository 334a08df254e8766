// Tile kernels (gguf_tiles.h) on VNNI: vpdpbusd multiplies 4 unsigned codes of each row with
// a broadcast word of int8 activations and adds into int32 sums, one instruction where the
// AVX2 tiles (gguf.cc) take maddubs, an int16 add and a widening madd. Written once
// (gguf_vnni_impl.h) for two register widths:
//   AVX-512 VNNI (gguf_avx512.cc): one 64-byte register holds two groups of 8 rows, and a
//     weight register is decoded once for up to 8 activation rows (32 registers hold their
//     sums).
//   AVX-VNNI (gguf_avxvnni.cc; Intel's cores from Alder Lake on that lack AVX-512): one
//     32-byte register holds a group, decoded once for 4 or 8 rows (16 registers); Q6_K's
//     codes decoded once a unit into a buffer in L1 instead.
// The integer sums and the float epilogue are those of the AVX2 tiles, in the same order, so
// every path gives the same bits.
#ifndef LOWBIT_KERNELS_CPU_GGUF_VNNI_H_
#define LOWBIT_KERNELS_CPU_GGUF_VNNI_H_

#include <cstdint>

#include "gguf_args.h"
#include "gguf_blocks.h"

namespace lowbit {
namespace gguf {

// Whether `type` has a VNNI tile kernel (on both widths, where the binary has them): every
// type with tiles but IQ4_NL / IQ4_XS.
constexpr bool HasVnniTiles(int type) {
  return type == kQ2_K || type == kQ3_K || type == kQ4_K || type == kQ5_K || type == kQ6_K ||
         type == kQ4_0 || type == kQ4_1 || type == kQ5_0 || type == kQ5_1 || type == kQ8_0;
}

// A tile of each of a VNNI register's groups (gguf_vnni_impl.h): group g's at t, g + 1's at
// t + stride.
struct Group {
  const uint8_t* t;
  int64_t stride;
};

// out[m, 8 g0 .. 8 g1) of a tiled weight of such a type on int8 activations, on AVX-512
// VNNI; g1 - g0 even.
void TilesAvx512Vnni(const Weight& w, const Acts& acts, int64_t g0, int64_t g1, float* out);

// The same on AVX-VNNI (256-bit registers), any g0 < g1.
void TilesAvxVnni(const Weight& w, const Acts& acts, int64_t g0, int64_t g1, float* out);

}  // namespace gguf
}  // namespace lowbit

#endif  // LOWBIT_KERNELS_CPU_GGUF_VNNI_H_
