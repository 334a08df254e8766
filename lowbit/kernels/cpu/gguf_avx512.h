// Tile kernels (gguf_tiles.h) in AVX-512 VNNI registers: two groups of 8 rows at once, one
// 64-byte register holding 4 codes of each of 16 rows, multiplied with a broadcast activation
// word by vpdpbusd. The integer sums and the float epilogue are those of the AVX2 tiles
// (gguf.cc), in the same order, so both give the same bits.
#ifndef LOWBIT_KERNELS_CPU_GGUF_AVX512_H_
#define LOWBIT_KERNELS_CPU_GGUF_AVX512_H_

#include <cstdint>

#include "gguf_args.h"

namespace lowbit {
namespace gguf {

// Whether `type` has a tile kernel here (and the binary was built with one).
bool HasTilesAvx512(int type);

// out[m, 8 g0 .. 8 g1) of a tiled weight of such a type on int8 activations; g1 - g0 even.
void TilesAvx512(const Weight& w, const Acts& acts, int64_t g0, int64_t g1, float* out);

}  // namespace gguf
}  // namespace lowbit

#endif  // LOWBIT_KERNELS_CPU_GGUF_AVX512_H_
