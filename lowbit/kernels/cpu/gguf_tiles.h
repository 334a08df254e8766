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
// A tiled weight is uint8 [N / 8, blocks * TileBytes(type)]: group g holds rows 8g..8g+7, its
// tiles in block order. One tile (one block of 8 rows: 256 elements of a K-quant, 32 of the
// 32-element types), row r of the group:
//
//   Q4_K (1184 bytes, 32 more than 8 blocks):
//     [0, 16)      d[r]                      fp16
//     [16, 32)     dmin[r]                   fp16
//     [32, 96)     scale[s][r]               u8, sub-block s < 8 (32 elements each)
//     [96, 160)    min[p][r][t]              u8, the minimum of sub-block 2p + t
//     [160, 1184)  qs[c][r][0..3]            block bytes qs[4c .. 4c + 3], c < 32
//   Q5_K (1440 bytes): Q4_K's tile (its qs the block's bytes 48..175), then
//     [1184, 1440) qh[c][r][0..3]            block bytes qh[4c .. 4c + 3], c < 8
//   Q6_K (1680 bytes, the same as 8 blocks):
//     [0, 16)      d[r]                      fp16
//     [16, 144)    scale[p][r][t]            i8, the scale of sub-block 2p + t (16 elements)
//     [144, 1168)  ql[c][r][0..3]            block bytes ql[4c .. 4c + 3], c < 32
//     [1168, 1680) qh[c][r][0..3]            block bytes qh[4c .. 4c + 3], c < 16
//   Q2_K (672 bytes, the same as 8 blocks):
//     [0, 16)      d[r]                      fp16
//     [16, 32)     dmin[r]                   fp16
//     [32, 160)    scales[p][r][t]           u8, sub-block 2p + t's byte (scale | min << 4)
//     [160, 672)   qs[c][r][0..3]            block bytes qs[4c .. 4c + 3], c < 16
//   Q3_K (912 bytes, 32 more than 8 blocks):
//     [0, 16)      d[r]                      fp16
//     [16, 144)    scale[p][r][t]            i8, the scale of sub-block 2p + t (16 elements)
//                                            less 32 (the 6-bit scales spelled out)
//     [144, 656)   qs[c][r][0..3]            block bytes qs[4c .. 4c + 3], c < 16
//     [656, 912)   hmask[c][r][0..3]         block bytes hmask[4c .. 4c + 3], c < 8
//   Q4_0 (144), Q4_1 (160), Q5_0 (176), Q5_1 (192 bytes: the same as 8 blocks):
//     [0, 16)      d[r]                      fp16
//     [16, 32)     m[r]                      fp16 (Q4_1, Q5_1 only; the fields below move up
//                                            16 bytes in Q4_0 / Q5_0)
//     [32, 64)     qh[r]                     u32, the 32 high bits (Q5_0, Q5_1 only)
//     [64, 192)    qs[c][r][0..3]            block bytes qs[4c .. 4c + 3], c < 4: low nibbles
//                                            elements 4c.., high nibbles 16 + 4c..
//   Q8_0 (272 bytes, the same as 8 blocks):
//     [0, 16)      d[r]                      fp16
//     [16, 272)    qs[c][r][0..3]            block bytes qs[4c .. 4c + 3] (int8 elements
//                                            4c..), c < 8
//
// `TileGroup` (the loader's layout, `lowbit_gguf_tile`) and `UntileGroup` build and read it;
// `lowbit/kernels/_gguf.py` (`gguf_tile`'s reference, `gguf_untile`) does the same in JAX.
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
  switch (type) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: case kQ2_K:
      return kTileRows * kTypes[type].bytes;
    case kQ3_K: return 912;
    case kQ4_K: return 1184;
    case kQ5_K: return 1440;
    case kQ6_K: return 1680;
    default: return 0;
  }
}

// 32-element types: whether codes have a fifth bit (Q5_0, Q5_1), and the offset their
// unsigned codes carry (x = d (q - 8) for Q4_0, d (q - 16) for Q5_0; Q8_0's signed codes are
// read with their sign bit flipped, q + 128; 0 where a minimum is stored instead).
inline constexpr bool HasFifthBit(int type) { return type == kQ5_0 || type == kQ5_1; }
inline constexpr int CodeOffset(int type) {
  return type == kQ4_0 ? 8 : type == kQ5_0 ? 16 : type == kQ8_0 ? 128 : 0;
}

// 32-element tiles: where the high bits (Q5_0 / Q5_1) and the nibbles start.
inline constexpr int TileHighBits(int type) { return kTypes[type].has_min ? 32 : 16; }
inline constexpr int TileNibbles(int type) {
  return TileHighBits(type) + (HasFifthBit(type) ? 32 : 0);
}

// Row r's block of one tile, in the file's block layout (kTypes[type].bytes bytes).
inline void UntileBlock(int type, const uint8_t* tile, int r, uint8_t* b) {
  if (kTypes[type].block == 32) {  // d, [m], [qh], qs: the block's own field order
    int at = 0;
    std::memcpy(b, tile + 2 * r, 2), at = 2;
    if (kTypes[type].has_min) std::memcpy(b + at, tile + 16 + 2 * r, 2), at += 2;
    if (TileNibbles(type) != TileHighBits(type))
      std::memcpy(b + at, tile + TileHighBits(type) + 4 * r, 4), at += 4;
    for (int c = 0; at + 4 * c < kTypes[type].bytes; ++c)  // the codes, 4 bytes a chunk
      std::memcpy(b + at + 4 * c, tile + TileNibbles(type) + 32 * c + 4 * r, 4);
  } else if (type == kQ2_K) {
    for (int s = 0; s < 16; ++s) b[s] = tile[32 + 16 * (s / 2) + 2 * r + s % 2];
    for (int c = 0; c < 16; ++c) std::memcpy(b + 16 + 4 * c, tile + 160 + 32 * c + 4 * r, 4);
    std::memcpy(b + 80, tile + 2 * r, 2);
    std::memcpy(b + 82, tile + 16 + 2 * r, 2);
  } else if (type == kQ3_K) {
    for (int c = 0; c < 8; ++c) std::memcpy(b + 4 * c, tile + 656 + 32 * c + 4 * r, 4);
    for (int c = 0; c < 16; ++c) std::memcpy(b + 32 + 4 * c, tile + 144 + 32 * c + 4 * r, 4);
    int sc[16];
    for (int s = 0; s < 16; ++s) sc[s] = (static_cast<int8_t>(tile[16 + 16 * (s / 2) + 2 * r + s % 2]) + 32) & 63;
    uint8_t* k = b + 96;  // the 12 packed bytes (Q3Scales read backwards)
    for (int i = 0; i < 8; ++i) k[i] = static_cast<uint8_t>((sc[i] & 15) | ((sc[i + 8] & 15) << 4));
    for (int j = 0; j < 4; ++j)
      k[8 + j] = static_cast<uint8_t>((sc[j] >> 4) | ((sc[j + 4] >> 4) << 2) | ((sc[j + 8] >> 4) << 4) |
                                      ((sc[j + 12] >> 4) << 6));
    std::memcpy(b + 108, tile + 2 * r, 2);
  } else if (type == kQ4_K || type == kQ5_K) {
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
    uint8_t* qs = b + 16;
    if (type == kQ5_K) {
      for (int c = 0; c < 8; ++c) std::memcpy(b + 16 + 4 * c, tile + 1184 + 32 * c + 4 * r, 4);
      qs = b + 48;
    }
    for (int c = 0; c < 32; ++c) std::memcpy(qs + 4 * c, tile + 160 + 32 * c + 4 * r, 4);
  } else {  // kQ6_K
    for (int c = 0; c < 32; ++c) std::memcpy(b + 4 * c, tile + 144 + 32 * c + 4 * r, 4);
    for (int c = 0; c < 16; ++c) std::memcpy(b + 128 + 4 * c, tile + 1168 + 32 * c + 4 * r, 4);
    for (int s = 0; s < 16; ++s) b[192 + s] = tile[16 + 16 * (s / 2) + 2 * r + s % 2];
    std::memcpy(b + 208, tile + 2 * r, 2);
  }
}

// Row r's block `b` (the file's layout) written into its place in one tile: `UntileBlock`'s
// inverse, field by field.
inline void TileBlock(int type, const uint8_t* b, int r, uint8_t* tile) {
  if (kTypes[type].block == 32) {
    int at = 0;
    std::memcpy(tile + 2 * r, b, 2), at = 2;
    if (kTypes[type].has_min) std::memcpy(tile + 16 + 2 * r, b + at, 2), at += 2;
    if (TileNibbles(type) != TileHighBits(type))
      std::memcpy(tile + TileHighBits(type) + 4 * r, b + at, 4), at += 4;
    for (int c = 0; at + 4 * c < kTypes[type].bytes; ++c)
      std::memcpy(tile + TileNibbles(type) + 32 * c + 4 * r, b + at + 4 * c, 4);
  } else if (type == kQ2_K) {
    for (int s = 0; s < 16; ++s) tile[32 + 16 * (s / 2) + 2 * r + s % 2] = b[s];
    for (int c = 0; c < 16; ++c) std::memcpy(tile + 160 + 32 * c + 4 * r, b + 16 + 4 * c, 4);
    std::memcpy(tile + 2 * r, b + 80, 2);
    std::memcpy(tile + 16 + 2 * r, b + 82, 2);
  } else if (type == kQ3_K) {
    for (int c = 0; c < 8; ++c) std::memcpy(tile + 656 + 32 * c + 4 * r, b + 4 * c, 4);
    for (int c = 0; c < 16; ++c) std::memcpy(tile + 144 + 32 * c + 4 * r, b + 32 + 4 * c, 4);
    const uint8_t* k = b + 96;  // the 16 6-bit scales (Q3Scales), spelled out less 32
    for (int s = 0; s < 16; ++s) {
      const int low = s < 8 ? k[s] & 15 : k[s - 8] >> 4;
      const int sc = low | (((k[8 + s % 4] >> (2 * (s / 4))) & 3) << 4);
      tile[16 + 16 * (s / 2) + 2 * r + s % 2] = static_cast<uint8_t>(sc - 32);
    }
    std::memcpy(tile + 2 * r, b + 108, 2);
  } else if (type == kQ4_K || type == kQ5_K) {
    std::memcpy(tile + 2 * r, b, 2);
    std::memcpy(tile + 16 + 2 * r, b + 2, 2);
    const uint8_t* k = b + 4;  // the 8 6-bit scales and minimums (ScaleMinK4)
    for (int j = 0; j < 4; ++j) {
      const int sc_lo = k[j] & 63, m_lo = k[j + 4] & 63;
      const int sc_hi = (k[j + 8] & 15) | ((k[j] >> 6) << 4);
      const int m_hi = (k[j + 8] >> 4) | ((k[j + 4] >> 6) << 4);
      tile[32 + 8 * j + r] = static_cast<uint8_t>(sc_lo);
      tile[32 + 8 * (j + 4) + r] = static_cast<uint8_t>(sc_hi);
      tile[96 + 16 * (j / 2) + 2 * r + j % 2] = static_cast<uint8_t>(m_lo);
      tile[96 + 16 * ((j + 4) / 2) + 2 * r + j % 2] = static_cast<uint8_t>(m_hi);
    }
    const uint8_t* qs = b + 16;
    if (type == kQ5_K) {
      for (int c = 0; c < 8; ++c) std::memcpy(tile + 1184 + 32 * c + 4 * r, b + 16 + 4 * c, 4);
      qs = b + 48;
    }
    for (int c = 0; c < 32; ++c) std::memcpy(tile + 160 + 32 * c + 4 * r, qs + 4 * c, 4);
  } else {  // kQ6_K
    for (int c = 0; c < 32; ++c) std::memcpy(tile + 144 + 32 * c + 4 * r, b + 4 * c, 4);
    for (int c = 0; c < 16; ++c) std::memcpy(tile + 1168 + 32 * c + 4 * r, b + 128 + 4 * c, 4);
    for (int s = 0; s < 16; ++s) tile[16 + 16 * (s / 2) + 2 * r + s % 2] = b[192 + s];
    std::memcpy(tile + 2 * r, b + 208, 2);
  }
}

// Group `tiles` (`blocks` tiles of `type`) of the 8 block rows `rows` (8 x row_bytes).
inline void TileGroup(int type, const uint8_t* rows, int64_t blocks, uint8_t* tiles) {
  const int tb = TileBytes(type), bb = kTypes[type].bytes;
  const int64_t row_bytes = blocks * bb;
  for (int64_t u = 0; u < blocks; ++u)
    for (int r = 0; r < kTileRows; ++r)
      TileBlock(type, rows + r * row_bytes + u * bb, r, tiles + u * tb);
}

// The 8 block rows (8 x row_bytes) of group `tiles` (`blocks` tiles of `type`).
inline void UntileGroup(int type, const uint8_t* tiles, int64_t blocks, uint8_t* rows) {
  const int tb = TileBytes(type), bb = kTypes[type].bytes;
  const int64_t row_bytes = blocks * bb;
  for (int64_t u = 0; u < blocks; ++u)
    for (int r = 0; r < kTileRows; ++r)
      UntileBlock(type, tiles + u * tb, r, rows + r * row_bytes + u * bb);
}

}  // namespace gguf
}  // namespace lowbit

#endif  // LOWBIT_KERNELS_CPU_GGUF_TILES_H_
