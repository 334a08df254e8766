// AMX-INT8 path: w8a8 products on tile registers (tdpbusd: a 16 x 64 u8 tile times a
// 16 x 16 x 4 s8 tile into 16 x 16 int32, 16 k-quads per instruction). The weight-only
// kernels are AVX-512 VNNI's: their work is unpacking codes, which tiles do not help.
//
// The w8a8 weight panel [KQ][16][4] is already the tile B layout (16 k-quad rows of 64
// bytes), so a B tile is 1 KiB of one panel read with stride 64. Activations are packed in
// blocks of 16 rows x 16 k-quads (IsaKernels::act_tile_k), so an A tile is 1 KiB as well
// (row-major with a power-of-two stride, 16 rows would collide in a few L1 sets); the handler
// pads them to a multiple of 32 rows so full-height loads stay inside the buffer.
#include "common.h"

#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11))
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cpuid.h>

LOWBIT_TARGET_PUSH("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")

namespace lowbit {
namespace isa_amx {

struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tile registers: 0..3 accumulators C[row block][panel], 4..5 activations, 6..7 weights.
// ROWS2: a second 16-row block (`xstride` u32 further); PANELS2: a second panel.
template <bool ROWS2, bool PANELS2>
static inline void dot_blocks(const uint32_t* xa, int64_t xstride, const int8_t* w0,
                              const int8_t* w1, int64_t quads) {
  for (int64_t q = 0; q < quads; q += 16) {
    const uint32_t* xb = xa + q * 16;
    _tile_loadd(4, xb, 64);
    _tile_loadd(6, w0 + q * 64, 64);
    if constexpr (ROWS2) _tile_loadd(5, xb + xstride, 64);
    if constexpr (PANELS2) _tile_loadd(7, w1 + q * 64, 64);
    _tile_dpbusd(0, 4, 6);
    if constexpr (PANELS2) _tile_dpbusd(1, 4, 7);
    if constexpr (ROWS2) _tile_dpbusd(2, 5, 6);
    if constexpr (ROWS2 && PANELS2) _tile_dpbusd(3, 5, 7);
  }
}

// Copies the first `rows` rows of a 16 x 16 int32 tile image to c (ldc int32 per row).
static inline void copy_rows(const int32_t* tmp, int32_t* c, int64_t ldc, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) std::memcpy(c + r * ldc, tmp + r * 16, 64);
}

// Writes accumulator tile T to rows [0, rows) of c; the tile number must be a literal.
#define LOWBIT_STORE_TILE(T, c, ldc, rows)          \
  do {                                              \
    if ((rows) >= 16) {                             \
      _tile_stored(T, (c), (ldc) * 4);              \
    } else {                                        \
      alignas(64) int32_t tmp_[16 * 16];            \
      _tile_stored(T, tmp_, 64);                    \
      copy_rows(tmp_, (c), (ldc), (rows));          \
    }                                               \
  } while (0)

static void q8_run(const Q8Args& a, int64_t m0, int64_t m1, int64_t p0, int64_t p1, int32_t* c,
                   int64_t ldc) {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
  const int64_t kq = a.kq, full = kq / 16 * 16;
  const int64_t block = (kq + 15) / 16 * 16 * 16;  // u32 per 16-row activation block
  const int64_t pstride = kq * 64;
  for (int64_t p = p0; p < p1; p += 2) {
    const bool two_panels = p + 1 < p1;
    const int8_t* w0 = a.w + p * pstride;
    const int8_t* w1 = w0 + pstride;
    // Row blocks start at multiples of 16 (tasks start at multiples of kRowBlock rows).
    for (int64_t m = m0; m < m1; m += 32) {
      const int64_t mr = std::min<int64_t>(32, m1 - m);
      const uint32_t* xm = a.xa + (m / 16) * block;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      if (mr > 16) {
        if (two_panels) dot_blocks<true, true>(xm, block, w0, w1, full);
        else dot_blocks<true, false>(xm, block, w0, w1, full);
      } else {
        if (two_panels) dot_blocks<false, true>(xm, block, w0, w1, full);
        else dot_blocks<false, false>(xm, block, w0, w1, full);
      }
      int32_t* cm = c + (m - m0) * ldc + (p - p0) * kPanel;
      LOWBIT_STORE_TILE(0, cm, ldc, mr);
      if (two_panels) LOWBIT_STORE_TILE(1, cm + kPanel, ldc, mr);
      if (mr > 16) {
        LOWBIT_STORE_TILE(2, cm + 16 * ldc, ldc, mr - 16);
        if (two_panels) LOWBIT_STORE_TILE(3, cm + 16 * ldc + kPanel, ldc, mr - 16);
      }
      if (full == kq) continue;
      // The last kq % 16 k-quads (a partial tile would need another tile configuration).
      for (int64_t r = 0; r < mr; ++r) {
        const uint32_t* xr = xm + (r / 16) * block + full * 16 + (r % 16) * 16 - full;
        for (int j = 0; j < (two_panels ? 2 : 1); ++j) {
          const int8_t* wj = j ? w1 : w0;
          __m512i acc = _mm512_loadu_si512(cm + r * ldc + j * kPanel);
          for (int64_t q = full; q < kq; ++q)
            acc = _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(static_cast<int>(xr[q])),
                                      _mm512_loadu_si512(wj + q * 64));
          _mm512_storeu_si512(cm + r * ldc + j * kPanel, acc);
        }
      }
    }
  }
  // Drops the tile state so context switches of this (pool) thread stop saving 8 KiB.
  _tile_release();
}

#undef LOWBIT_STORE_TILE

}  // namespace isa_amx
}  // namespace lowbit

LOWBIT_TARGET_POP

namespace lowbit {

bool AmxUsable() {
  static const bool ok = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool tile = (edx >> 24) & 1, int8 = (edx >> 25) & 1;
    if (!tile || !int8) return false;
    // Linux hands out the 8 KiB tile state only on request (once per process).
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

const IsaKernels* IsaAmx() {
  static const IsaKernels table = [] {
    const IsaKernels* vnni = IsaAvx512Vnni();
    return IsaKernels{"amx", 1, 16, vnni->gemm_rows, vnni->wo, isa_amx::q8_run, 16,
                      vnni->quantize_row, vnni->w4, vnni->w4_act_rows, vnni->wo_dequant,
                      vnni->wo_q8, vnni->quantize_groups, vnni->wo_q8_kind,
                      vnni->wo_x_rows};
  }();
  return &table;
}

}  // namespace lowbit

#else  // no AMX here (or a compiler without its intrinsics).

namespace lowbit {
bool AmxUsable() { return false; }
const IsaKernels* IsaAmx() { return nullptr; }
}  // namespace lowbit

#endif
