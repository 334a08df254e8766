// GGUF K-quant blocks of 8 rows interleaved ("tiles"), the layout the tile kernels read.
//
// A row-at-a-time product multiplies one row's block with the activations and then applies
// that row's sub-block scales one by one, broadcast across a register. In a tile, one 32-byte
// register holds 4 bytes of each of 8 rows, so one broadcast activation word multiplies 8
// rows at once, the sub-block scales of 8 rows are one vector, and the 8 outputs accumulate
// in one register with no horizontal sum. Tiles hold the same codes, scales and minimums as
// the blocks (only reordered, the 6-bit Q4_K scales spelled out as bytes), so `UntileGroup`
// gives the file's blocks back byte for byte.
//
// A tiled weight is uint8 [N / 8, units * TileBytes(type)]: group g holds rows 8g..8g+7, its
// tiles in unit order. One tile (one 256-element unit of 8 rows), row r of the group:
//
//   Q4_K (1184 bytes, 32 more than 8 blocks):
//     [0, 16)      d[r]                      fp16
//     [16, 32)     dmin[r]                   fp16
//     [32, 96)     scale[s][r]               u8, sub-block s < 8 (32 elements each)
//     [96, 160)    min[p][r][t]              u8, the minimum of sub-block 2p + t
//     [160, 1184)  qs[c][r][0..3]            block bytes qs[4c .. 4c + 3], c < 32
//   Q6_K (1680 bytes, the same as 8 blocks):
//     [0, 16)      d[r]                      fp16
//     [16, 144)    scale[p][r][t]            i8, the scale of sub-block 2p + t (16 elements)
//     [144, 1168)  ql[c][r][0..3]            block bytes ql[4c .. 4c + 3], c < 32
//     [1168, 1680) qh[c][r][0..3]            block bytes qh[4c .. 4c + 3], c < 16
//
// `lowbit/kernels/_gguf.py` (`gguf_tile`, `gguf_untile`) builds and reads the same layout.
#ifndef LOWBIT_KERNELS_CPU_GGUF_TILES_H_
#define LOWBIT_KERNELS_CPU_GGUF_TILES_H_

#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"

namespace lowbit {
namespace gguf {

inline constexpr int kTileRows = 8;

// Bytes of one tile of `type`, or 0 when the type has no tiled layout.
inline constexpr int TileBytes(int type) {
  return type == kQ4_K ? 1184 : type == kQ6_K ? 1680 : 0;
}

// Row r's block of one tile, in the file's block layout (kTypes[type].bytes bytes).
inline void UntileBlock(int type, const uint8_t* tile, int r, uint8_t* b) {
  if (type == kQ4_K) {
    std::memcpy(b, tile + 2 * r, 2);
    std::memcpy(b + 2, tile + 16 + 2 * r, 2);
    int sc[8], m[8];
    for (int s = 0; s < 8; ++s) {
      sc[s] = tile[32 + 8 * s + r];
      m[s] = tile[96 + 16 * (s / 2) + 2 * r + s % 2];
    }
    uint8_t* k = b + 4;  // the 12 packed 6-bit bytes (ScaleMinK4 read backwards)
    for (int j = 0; j < 4; ++j) {
      k[j] = static_cast<uint8_t>((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
      k[j + 4] = static_cast<uint8_t>((m[j] & 63) | ((m[j + 4] >> 4) << 6));
      k[j + 8] = static_cast<uint8_t>((sc[j + 4] & 15) | ((m[j + 4] & 15) << 4));
    }
    for (int c = 0; c < 32; ++c) std::memcpy(b + 16 + 4 * c, tile + 160 + 32 * c + 4 * r, 4);
  } else {  // kQ6_K
    for (int c = 0; c < 32; ++c) std::memcpy(b + 4 * c, tile + 144 + 32 * c + 4 * r, 4);
    for (int c = 0; c < 16; ++c) std::memcpy(b + 128 + 4 * c, tile + 1168 + 32 * c + 4 * r, 4);
    for (int s = 0; s < 16; ++s) b[192 + s] = tile[16 + 16 * (s / 2) + 2 * r + s % 2];
    std::memcpy(b + 208, tile + 2 * r, 2);
  }
}

// The 8 block rows (8 x row_bytes) of group `tiles` (units tiles of `type`).
inline void UntileGroup(int type, const uint8_t* tiles, int64_t units, uint8_t* rows) {
  const int tb = TileBytes(type), bb = kTypes[type].bytes;
  const int64_t row_bytes = units * bb;
  for (int64_t u = 0; u < units; ++u)
    for (int r = 0; r < kTileRows; ++r)
      UntileBlock(type, tiles + u * tb, r, rows + r * row_bytes + u * bb);
}

}  // namespace gguf
}  // namespace lowbit

#endif  // LOWBIT_KERNELS_CPU_GGUF_TILES_H_
