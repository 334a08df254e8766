// Shared types for lowbit's CPU kernels: kernel kinds, argument blocks and the per-ISA
// function table. Everything here is ISA-neutral and compiled with default flags.
#ifndef LOWBIT_KERNELS_CPU_COMMON_H_
#define LOWBIT_KERNELS_CPU_COMMON_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace lowbit {

// Weight-only kinds. lowbit/kernels/_kinds.py holds the Python table; a test compares it
// with kKindTable below (exported by the module's `kinds()`).
enum WoKind : int {
  kInt8 = 0,   // int8 codes, per-channel scale
  kInt4 = 1,   // int4 two's-complement codes, stored offset-binary (code ^ 8) with zp = 8
  kUint4 = 2,  // uint4 codes with a float zero point per group
  kNf4 = 3,    // 4-bit index into a 16-entry codebook (NF4 levels, FP4 E2M1 values)
  kFp8 = 4,    // float8_e4m3fn codes, per-channel scale
};

enum ZeroPoint : int {
  kNoZeroPoint = 0,     // w = q * s
  kFixedZeroPoint = 1,  // w = (q - 8) * s (offset-binary int4)
  kGroupZeroPoint = 2,  // w = (q - zp[g, n]) * s, zp stored in the group header
};

struct KindInfo {
  int id;
  const char* name;
  int pair_bytes;  // bytes per pair row of a 16-column panel (see below)
  bool lut;        // codes index the 16-entry codebook passed with the call
  int zero_point;  // ZeroPoint
};

inline constexpr KindInfo kKindTable[] = {
    {kInt8, "int8", 32, false, kNoZeroPoint},
    {kInt4, "int4", 16, false, kFixedZeroPoint},
    {kUint4, "uint4", 16, false, kGroupZeroPoint},
    {kNf4, "lut4", 16, true, kNoZeroPoint},
    {kFp8, "fp8", 32, false, kNoZeroPoint},
};
inline constexpr int kNumKinds = sizeof(kKindTable) / sizeof(kKindTable[0]);

// The entry for `kind`, or null when it is unknown.
inline const KindInfo* FindKind(int64_t kind) {
  for (const KindInfo& k : kKindTable) {
    if (k.id == kind) return &k;
  }
  return nullptr;
}

// Every weight-only panel holds 16 output columns. A panel is a sequence of groups; each
// group is a 128-byte header (16 f32 scales, 16 f32 zero points) followed by gs/2 "pair
// rows" of PB bytes (PB = 16 for 4-bit kinds: one byte per column, low nibble = even k,
// high nibble = odd k; PB = 32 for 8-bit kinds: 16 bytes for the even k, then 16 for odd k).
constexpr int kPanel = 16;
// Rows (per task) above which weight-only switches from unpacking in registers to
// dequantize-a-block-then-float-GEMM, and w8a8 starts blocking K.
constexpr int64_t kSmallM = 16;
constexpr int kGroupHeader = 128;

inline int PairBytes(int kind) { return FindKind(kind)->pair_bytes; }

struct WoArgs {
  int kind;
  int64_t kp;            // padded K (= G * gs)
  int64_t gs;            // storage group size (even)
  int64_t groups;        // G
  int64_t panel_bytes;   // bytes per 16-column panel
  int64_t group_bytes;   // kGroupHeader + gs / 2 * PairBytes(kind)
  // Float activations, zero beyond K. Small M (<= 16): k-major in tiles of `xs_rows` rows
  // (the ISA's `wo_x_rows(M)`), [ceil(M / xs_rows)][kp][xs_rows], zero past M, with per-group
  // sums [M][G] for the zero-point term; built once a call (made per task, the copy was
  // repeated for every panel chunk: a fifth of a decode-sized call at M = 8, K = 1536). Large
  // M: k-major in tiles of `gemm_rows` rows, [M/rows][kp][rows], for the blocked path (then
  // xs and sumx are null).
  const float* xs = nullptr;
  const float* xt = nullptr;
  const float* sumx = nullptr;
  int64_t xs_rows = 0;
  // int8 activations (IsaKernels::wo_q8 only): codes [M][kp], and per row and group the
  // scale and the scale times the group's code sum, [M][G] each.
  const int8_t* xq = nullptr;
  const float* xq_scale = nullptr;
  const float* xq_sum = nullptr;
  const uint8_t* blob;   // [P][panel_bytes]
  const float* lut;      // 16 NF4 levels
};

// w8a8 weights: panels of 16 columns, [P][KQ][16][4] int8 where KQ = ceil(K / 4): the 4
// bytes of a column for k-quad q are contiguous, so one 64-byte load feeds a u8 x s8 dot.
// Activations are u8 (q + 128) in tiles of `act_rows` rows, [M/rows][kq][rows][act_words] u32
// (or in blocks, see IsaKernels::act_tile_k).
struct Q8Args {
  int64_t kq;            // k-quads
  const uint32_t* xa;    // packed activations (see above)
  const int8_t* w;       // [P][kq][16][4]
};

// w4a8 weights: panels of 16 columns, each G groups of [16 f32 scales][16 int32 column sums
// of the group's codes][gs / 8 rows of 64 bytes]. Byte 4 j + i of row t holds column j:
// low nibble k = 8 t + i, high nibble k = 8 t + 4 + i, as offset-binary int4 (code ^ 8), so
// one row unpacks into two k-quads of the w8a8 layout. Activations as for w8a8 (u8, q + 128)
// in tiles of `w4_act_rows` rows, [M/rows][kq][rows][act_words] u32.
struct W4Args {
  int64_t gs;           // group size (multiple of 8)
  int64_t groups;       // G
  int64_t panel_bytes;  // G * group_bytes
  int64_t group_bytes;  // kGroupHeader + gs * 8
  const uint32_t* xa;   // packed activations
  const uint8_t* blob;  // [P][panel_bytes]
};

// The tile sizes one ISA's vocabulary (simd_*.h) picks for the generic tiles in
// kernels_impl.h, as one constant `kTile`: what differs between ISAs is the numbers, not
// their meaning.
struct TileShape {
  int mr;            // activation rows per weight-only tile (small M)
  int np;            // panels per weight-only tile
  int mr_wide;       // rows per single-panel tile when M > mr (small M)
  int fmr;           // rows per float GEMM tile (large M)
  int fnp;           // panels per float GEMM tile
  int qmr;           // rows per w8a8 / w4a8 tile (the activation tile height)
  int qnp;           // panels per w8a8 / w4a8 tile
  bool lut_nibbles;  // decode int4 / uint4 codes with the 16-entry table (else integer convert)
};

struct IsaKernels {
  const char* name;
  int act_words;  // u32 words per k-quad of packed activations
  int act_rows;   // activations are packed in tiles of this many rows (see PackAct)
  int gemm_rows;  // rows per float GEMM tile of the large-M weight-only path (WoArgs::xt)
  // C[m0:m1, 16*p0 : 16*p1] (ldc floats per row, C points at (m0, 16*p0)) = x @ W * scale,
  // without bias.
  void (*wo)(const WoArgs&, int64_t m0, int64_t m1, int64_t p0, int64_t p1, float* c,
             int64_t ldc);
  // C = sum_k (xq + 128) * w over the whole K, int32, before the column-sum correction.
  void (*q8)(const Q8Args&, int64_t m0, int64_t m1, int64_t p0, int64_t p1, int32_t* c,
             int64_t ldc);
  // When nonzero, activations are packed in blocks of act_rows rows x act_tile_k k-quads,
  // each block contiguous and row-major ([M/rows][ceil(kq/tile_k)][rows][tile_k] u32,
  // act_words = 1): one AMX tile load each.
  int act_tile_k = 0;
  // Optional vectorized per-token quantization of one activation row (the handler's scalar
  // loop otherwise), bit-identical to it: *scale = absmax / 127 (1 for a zero row), u[i] =
  // round_half_even(clamp(x[i] / scale, -127, 127)) + 128 for i < k.
  void (*quantize_row)(const float* x, int64_t k, uint8_t* u, float* scale) = nullptr;
  // C[m0:m1, panels] = sum_g scale_g * (int4 dot of group g), before the activation scale.
  void (*w4)(const W4Args&, int64_t m0, int64_t m1, int64_t p0, int64_t p1, float* c,
             int64_t ldc) = nullptr;
  int w4_act_rows = 0;  // activation tile rows of `w4` (tile layout, never blocked)
  // out[k][16 p + j] = the dequantized weight of panels [p0, p1), ldo floats a row.
  void (*wo_dequant)(const WoArgs&, int64_t p0, int64_t p1, float* out, int64_t ldo) = nullptr;
  // Weight-only layouts (the kinds `wo_q8_kind` accepts) times int8 activations quantized per
  // row and group (WoArgs::xq*), small M only; like `wo`, C = x @ W * scale. Null where the
  // ISA has no such path (the float path serves those calls).
  void (*wo_q8)(const WoArgs&, int64_t m0, int64_t m1, int64_t p0, int64_t p1, float* c,
                int64_t ldc) = nullptr;
  // Its activations: row x [kp] -> q [kp] int8 per group of gs, scale [G] = absmax / 127 and
  // scaled_sum [G] = scale * sum(q) (see WoArgs::xq).
  void (*quantize_groups)(const float* x, int64_t kp, int64_t gs, int8_t* q, float* scale,
                          float* scaled_sum) = nullptr;
  // Whether wo_q8 serves a weight-only kind (int4 / uint4; int8 too with VNNI).
  bool (*wo_q8_kind)(int kind) = nullptr;
  // Rows per tile of `wo`'s small-M activations (WoArgs::xs) for a call of M <= 16 rows.
  int64_t (*wo_x_rows)(int64_t m) = nullptr;
};

const IsaKernels* IsaScalar();
const IsaKernels* IsaAvx2();
const IsaKernels* IsaAvx2Vnni();
const IsaKernels* IsaAvx512Bw();
const IsaKernels* IsaAvx512Vnni();
// AVX-512 VNNI weight-only kernels with AMX-INT8 w8a8 tiles; AmxUsable() also asks the OS
// for the tile state.
const IsaKernels* IsaAmx();
bool AmxUsable();

// bfloat16 <-> float32 (round to nearest even; NaN stays NaN), for the handlers' float I/O.
inline float Bf16ToF32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t F32ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace lowbit

// Functions between LOWBIT_TARGET_PUSH("avx2,fma,...") and LOWBIT_TARGET_POP compile for those
// target features, with GCC or Clang: the per-ISA files wrap their kernels in them.
#define LOWBIT_PRAGMA_TEXT(text) _Pragma(#text)
#define LOWBIT_PRAGMA(text) LOWBIT_PRAGMA_TEXT(text)
#if defined(__clang__)
#define LOWBIT_TARGET_PUSH(features) \
  LOWBIT_PRAGMA(clang attribute push(__attribute__((target(features))), apply_to = function))
#define LOWBIT_TARGET_POP _Pragma("clang attribute pop")
#else
#define LOWBIT_TARGET_PUSH(features) _Pragma("GCC push_options") LOWBIT_PRAGMA(GCC target(features))
#define LOWBIT_TARGET_POP _Pragma("GCC pop_options")
#endif

#endif  // LOWBIT_KERNELS_CPU_COMMON_H_
