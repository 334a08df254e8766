// ISA-generic tiles for the weight-only and w8a8 kernels. Included (without include guard)
// inside an ISA namespace after one of the simd_*.h vocabularies, with that ISA's target
// pragma active, so each ISA gets its own copy compiled for its instruction set.

// Loops over a tile's compile-time rows and panels must be unrolled for the accumulators to
// stay in registers: without it GCC kept the uint4 tile's (with its zero-point term) on the
// stack, and uint4 decoded at 60% of int4's speed.
#ifndef LOWBIT_UNROLL
#define LOWBIT_UNROLL _Pragma("GCC unroll 16")
#endif

// The ISA's tile sizes (kTile, from its simd_*.h) under the names the tiles use.
constexpr int kMR = kTile.mr;
constexpr int kNP = kTile.np;
constexpr int kMRWide = kTile.mr_wide;
constexpr int kFMR = kTile.fmr;
constexpr int kFNP = kTile.fnp;
constexpr int kQMR = kTile.qmr;
constexpr int kQNP = kTile.qnp;
constexpr bool kLutNibbles = kTile.lut_nibbles;
// Whether rows past kMR (up to kMRWide) take wo_tile_one_chain (the ISA's vocabulary says).
#if defined(LOWBIT_WO_ONE_CHAIN)
constexpr bool kWoOneChain = true;
#else
constexpr bool kWoOneChain = false;
#endif

// Calls f(std::integral_constant<int, mr>{}) for a runtime row count 1 <= mr <= R: a tile's
// row count is a template argument (its loops over rows unroll), the rows left at the end
// of M are not.
template <int R, typename F>
static inline void with_rows(int64_t mr, F&& f) {
  if constexpr (R > 1) {
    if (mr < R) {
      with_rows<R - 1>(mr, f);
      return;
    }
  }
  f(std::integral_constant<int, R>{});
}

// Bytes ahead of the current read position to prefetch in the weight stream. Hardware
// prefetchers alone leave the decode GEMV short of memory bandwidth, and 1 KB ahead was too
// close: the AVX2 int4 GEMV (8192 x 8192, weights from memory) waited on its loads, 1.53-1.56
// ms a call against 1.42-1.48 with 4 KB (2 cores, Zen 4, forced AVX2; on AVX-512 the GEMV
// stayed within noise and SmolLM2's batch-1 decode ran 5-8% faster).
constexpr int64_t kPrefetch = 4096;
// K-block (in k) for weight-only tiles when M is large: the dequantized block (kc x fnp * 16
// f32, 16 KB on every ISA) stays in L1 beside the tile's activations while all row tiles of a
// task pass over it (a group longer than kc makes the block one group). The 64 KB AVX-512
// block (512 x 32) it replaced spilled to L2: at M = 512 on 4096 x 4096 that ran 0.92-0.94x
// XLA's float GEMM against 0.97-1.05x with 32 or 16 KB (2 cores, Xeon with AVX-512 and 48 KB
// L1; 12-row tiles were no faster). 16 KB leaves room beside it in Zen 4's 32 KB L1.
constexpr int64_t kWoKc = 256 / kFNP;
// K-block in k-quads for w8a8.
constexpr int64_t kQ8Kq = 512;

// Tables for 4-bit kinds decoded by lookup (kLutNibbles): int4 codes are stored offset-binary,
// so entry i is i - 8 and the stored zero point (8) is not needed; uint4 entry i is i.
alignas(64) static const float kInt4Table[16] = {-8, -7, -6, -5, -4, -3, -2, -1,
                                                 0,  1,  2,  3,  4,  5,  6,  7};
alignas(64) static const float kUint4Table[16] = {0, 1, 2,  3,  4,  5,  6,  7,
                                                  8, 9, 10, 11, 12, 13, 14, 15};

template <int KIND>
struct Deq {
  static constexpr int PB = (KIND == kInt8 || KIND == kFp8) ? 32 : 16;
  static constexpr bool kLut = KIND == kNf4 || (kLutNibbles && (KIND == kInt4 || KIND == kUint4));
  static constexpr bool kZp = KIND == kUint4 || (KIND == kInt4 && !kLutNibbles);
  static constexpr float kScaleMul = (KIND == kFp8) ? 256.0f : 1.0f;
  static inline void pair(const uint8_t* p, const Lut& l, V& w0, V& w1) {
    (void)l;
    if constexpr (KIND == kInt8) {
      w0 = deq_s8(p);
      w1 = deq_s8(p + 16);
    } else if constexpr (KIND == kFp8) {
      w0 = deq_fp8(p);
      w1 = deq_fp8(p + 16);
    } else if constexpr (kLut) {
      deq_lut(p, l, w0, w1);
    } else {
      deq_nib(p, w0, w1);
    }
  }
};

// One MR x (NP * 16) tile over groups [g0, g1). Inside a group the raw codes are
// accumulated (two chains per panel: even and odd k); the group scale and zero point are
// applied once per group: acc += s * sum(x * q) - s * zp * sum(x).
// x is k-major for the tile: element (r, k) at x[k * xr + r], so the MR activations of one
// k share a cache line (rows a power-of-two apart would collide in the same L1 sets).
template <int KIND, int MR, int NP>
static void wo_tile(const WoArgs& a, const float* x, int64_t xr, const float* sx,
                    const uint8_t* pan, int64_t g0, int64_t g1, float* c, int64_t ldc, bool first,
                    const Lut& lut) {
  using D = Deq<KIND>;
  V acc[MR][NP];
  LOWBIT_UNROLL for (int r = 0; r < MR; ++r)
    LOWBIT_UNROLL for (int j = 0; j < NP; ++j) acc[r][j] = first ? vzero() : vload(c + r * ldc + j * kPanel);
  const int64_t npairs = a.gs / 2;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gp[NP];
    LOWBIT_UNROLL for (int j = 0; j < NP; ++j) gp[j] = pan + j * a.panel_bytes + g * a.group_bytes;
    V e[MR][NP], o[MR][NP];
    LOWBIT_UNROLL for (int r = 0; r < MR; ++r)
      LOWBIT_UNROLL for (int j = 0; j < NP; ++j) e[r][j] = o[r][j] = vzero();
    const float* xg = x + g * a.gs * xr;
    for (int64_t t = 0; t < npairs; ++t) {
      LOWBIT_UNROLL for (int j = 0; j < NP; ++j) {
        const uint8_t* p = gp[j] + kGroupHeader + t * D::PB;
        if (((t * D::PB) & 63) == 0) __builtin_prefetch(p + kPrefetch);
        V w0, w1;
        D::pair(p, lut, w0, w1);
        LOWBIT_UNROLL for (int r = 0; r < MR; ++r) {
          e[r][j] = vfmadd(vbcast(xg[2 * t * xr + r]), w0, e[r][j]);
          o[r][j] = vfmadd(vbcast(xg[(2 * t + 1) * xr + r]), w1, o[r][j]);
        }
      }
    }
    LOWBIT_UNROLL for (int j = 0; j < NP; ++j) {
      const float* hdr = reinterpret_cast<const float*>(gp[j]);
      V s = vload(hdr);
      if constexpr (D::kScaleMul != 1.0f) s = vmul(s, vbcast(D::kScaleMul));
      LOWBIT_UNROLL for (int r = 0; r < MR; ++r) acc[r][j] = vfmadd(s, vadd(e[r][j], o[r][j]), acc[r][j]);
      if constexpr (D::kZp) {
        const V szp = vmul(s, vload(hdr + kPanel));
        LOWBIT_UNROLL for (int r = 0; r < MR; ++r)
          acc[r][j] = vfnmadd(szp, vbcast(sx[r * a.groups + g]), acc[r][j]);
      }
    }
  }
  LOWBIT_UNROLL for (int r = 0; r < MR; ++r)
    LOWBIT_UNROLL for (int j = 0; j < NP; ++j) vstore(c + r * ldc + j * kPanel, acc[r][j]);
}

// MR rows of one panel over all groups, for ISAs whose 16 registers cannot hold wo_tile's
// three sums a row (AVX2: with 2 rows a tile, 8 rows unpacked every weight four times). One
// chain a row (even and odd k into the same sum) and the running output kept in c, updated
// once a group: 4 rows' sums, the pair's weights and a broadcast fit in 14 ymm.
template <int KIND, int MR>
static void wo_tile_one_chain(const WoArgs& a, const float* x, int64_t xr, const float* sx,
                              const uint8_t* pan, float* c, int64_t ldc, const Lut& lut) {
  using D = Deq<KIND>;
  const int64_t npairs = a.gs / 2;
  for (int64_t g = 0; g < a.groups; ++g) {
    const uint8_t* gp = pan + g * a.group_bytes;
    V e[MR];
    LOWBIT_UNROLL for (int r = 0; r < MR; ++r) e[r] = vzero();
    const float* xg = x + g * a.gs * xr;
    for (int64_t t = 0; t < npairs; ++t) {
      const uint8_t* p = gp + kGroupHeader + t * D::PB;
      if (((t * D::PB) & 63) == 0) __builtin_prefetch(p + kPrefetch);
      V w0, w1;
      D::pair(p, lut, w0, w1);
      LOWBIT_UNROLL for (int r = 0; r < MR; ++r) {
        e[r] = vfmadd(vbcast(xg[2 * t * xr + r]), w0, e[r]);
        e[r] = vfmadd(vbcast(xg[(2 * t + 1) * xr + r]), w1, e[r]);
      }
    }
    const float* hdr = reinterpret_cast<const float*>(gp);
    V s = vload(hdr);
    if constexpr (D::kScaleMul != 1.0f) s = vmul(s, vbcast(D::kScaleMul));
    V szp = vzero();
    if constexpr (D::kZp) szp = vmul(s, vload(hdr + kPanel));
    LOWBIT_UNROLL for (int r = 0; r < MR; ++r) {
      V out = g == 0 ? vzero() : vload(c + r * ldc);
      out = vfmadd(s, e[r], out);
      if constexpr (D::kZp) out = vfnmadd(szp, vbcast(sx[r * a.groups + g]), out);
      vstore(c + r * ldc, out);
    }
  }
}

// Large M: dequantize groups [g0, g1) of `np` panels once into buf [k][np * 16] (exactly
// (q - zp) * s, as the reference does) and run a float GEMM tile over it for every row
// block, so the unpack cost is shared by all rows.
// The scale and zero point of one panel's group (gp: its header).
template <int KIND>
static inline void group_scale(const uint8_t* gp, V& s, V& zp) {
  using D = Deq<KIND>;
  const float* hdr = reinterpret_cast<const float*>(gp);
  s = vload(hdr);
  if constexpr (D::kScaleMul != 1.0f) s = vmul(s, vbcast(D::kScaleMul));
  zp = vload(hdr + kPanel);
}

// Rows 2t and 2t + 1 of one panel's group as (q - zp) * s into row0 / row1 (16 floats each).
template <int KIND>
static inline void dequant_pair(const uint8_t* gp, int64_t t, const Lut& lut, V s, V zp,
                                float* row0, float* row1) {
  using D = Deq<KIND>;
  V w0, w1;
  D::pair(gp + kGroupHeader + t * D::PB, lut, w0, w1);
  if constexpr (D::kZp) {
    w0 = vsub(w0, zp);
    w1 = vsub(w1, zp);
  }
  vstore(row0, vmul(w0, s));
  vstore(row1, vmul(w1, s));
}

template <int KIND>
static void wo_dequant_block(const WoArgs& a, const uint8_t* pan, int64_t np, int64_t g0,
                             int64_t g1, const Lut& lut, float* buf, int64_t ldb) {
  const int64_t npairs = a.gs / 2;
  for (int64_t j = 0; j < np; ++j) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* gp = pan + j * a.panel_bytes + g * a.group_bytes;
      V s, zp;
      group_scale<KIND>(gp, s, zp);
      float* out = buf + (g - g0) * a.gs * ldb + j * kPanel;
      for (int64_t t = 0; t < npairs; ++t)
        dequant_pair<KIND>(gp, t, lut, s, zp, out + 2 * t * ldb, out + (2 * t + 1) * ldb);
    }
  }
}

// C[MR x NP*16] (+)= x @ buf[kc x NP*16], x packed k-major as xt[kc][ldx] (row r of the
// tile at xt[k * ldx + r]): one contiguous activation stream instead of MR rows whose equal
// power-of-two strides would fight over the same L1 sets.
template <int MR, int NP>
static void f32_tile(const float* x, int64_t ldx, const float* buf, int64_t ldb, int64_t kc,
                     float* c, int64_t ldc, bool first) {
  V acc[MR][NP];
  LOWBIT_UNROLL for (int r = 0; r < MR; ++r)
    LOWBIT_UNROLL for (int j = 0; j < NP; ++j) acc[r][j] = first ? vzero() : vload(c + r * ldc + j * kPanel);
  for (int64_t k = 0; k < kc; ++k) {
    V w[NP];
    LOWBIT_UNROLL for (int j = 0; j < NP; ++j) w[j] = vload(buf + k * ldb + j * kPanel);
    LOWBIT_UNROLL for (int r = 0; r < MR; ++r) {
      const V xv = vbcast(x[k * ldx + r]);
      LOWBIT_UNROLL for (int j = 0; j < NP; ++j) acc[r][j] = vfmadd(xv, w[j], acc[r][j]);
    }
  }
  LOWBIT_UNROLL for (int r = 0; r < MR; ++r)
    LOWBIT_UNROLL for (int j = 0; j < NP; ++j) vstore(c + r * ldc + j * kPanel, acc[r][j]);
}

template <int KIND>
static void wo_run_blocked(const WoArgs& a, int64_t m0, int64_t m1, int64_t p0, int64_t p1,
                           float* c, int64_t ldc, const Lut& lut) {
  const int64_t gblk = std::max<int64_t>(1, kWoKc / a.gs);
  const int64_t ldb = kFNP * kPanel;
  std::vector<float> buf(gblk * a.gs * ldb);
  for (int64_t g0 = 0; g0 < a.groups; g0 += gblk) {
    const int64_t g1 = std::min(a.groups, g0 + gblk);
    const int64_t kc = (g1 - g0) * a.gs;
    for (int64_t p = p0; p < p1; p += kFNP) {
      const int64_t np = std::min<int64_t>(kFNP, p1 - p);
      wo_dequant_block<KIND>(a, a.blob + p * a.panel_bytes, np, g0, g1, lut, buf.data(), ldb);
      for (int64_t m = m0; m < m1; m += kFMR) {
        const int64_t mr = std::min<int64_t>(kFMR, m1 - m);
        // Row tiles start at multiples of kFMR (tasks start at multiples of kRowBlock rows).
        const float* x = a.xt + (m / kFMR) * a.kp * kFMR + g0 * a.gs * kFMR;
        float* cc = c + (m - m0) * ldc + (p - p0) * kPanel;
        if (np == kFNP) {
          with_rows<kFMR>(mr, [&](auto r) {
            f32_tile<decltype(r)::value, kFNP>(x, kFMR, buf.data(), ldb, kc, cc, ldc, g0 == 0);
          });
        } else {
          for (int64_t j = 0; j < np; ++j)
            with_rows<kFMR>(mr, [&](auto r) {
              f32_tile<decltype(r)::value, 1>(x, kFMR, buf.data() + j * kPanel, ldb, kc,
                                              cc + j * kPanel, ldc, g0 == 0);
            });
        }
      }
    }
  }
}

// Rows per small-M tile of activations (WoArgs::xs) for a call of m rows: up to kMR rows
// take one tile of kNP panels, more (up to kMRWide) tiles of one panel.
static int64_t wo_x_rows(int64_t m) { return m <= kMR ? m : std::min<int64_t>(m, kMRWide); }

template <int KIND>
static void wo_run_kind(const WoArgs& a, int64_t m0, int64_t m1, int64_t p0, int64_t p1,
                        float* c, int64_t ldc) {
  const Lut lut = make_lut(KIND == kNf4 ? a.lut : KIND == kInt4 ? kInt4Table : kUint4Table);
  // The call's activations come k-major (a.xt) when its M is large: every task then takes
  // the blocked path, a short last row block too.
  if (a.xt != nullptr) {
    wo_run_blocked<KIND>(a, m0, m1, p0, p1, c, ldc, lut);
    return;
  }
  // Small M: unpack in registers straight into the products, one pass over all of K. Up to
  // kMR rows take kNP panels per tile; more rows (up to kMRWide) take one panel per tile so
  // the weight stream is still read once.
  const bool wide = m1 - m0 > kMR;
  const int64_t step = wide ? 1 : kNP;
  // Activations per row tile, k-major (a.xs, built by the caller; small-M tasks hold rows
  // from a multiple of the tile height).
  const int64_t xr = a.xs_rows;
  for (int64_t p = p0; p < p1; p += step) {
    const int64_t np = std::min<int64_t>(step, p1 - p);
    const uint8_t* pan = a.blob + p * a.panel_bytes;
    for (int64_t m = m0; m < m1; m += xr) {
      const int64_t mr = std::min<int64_t>(xr, m1 - m);
      const float* x = a.xs + (m / xr) * a.kp * xr;
      const float* sx = a.sumx + m * a.groups;
      float* cc = c + (m - m0) * ldc + (p - p0) * kPanel;
      // The tile of r rows and `panels` panels over all groups.
      auto tile = [&](auto r, auto panels) {
        wo_tile<KIND, decltype(r)::value, decltype(panels)::value>(a, x, xr, sx, pan, 0, a.groups,
                                                                    cc, ldc, true, lut);
      };
      using One = std::integral_constant<int, 1>;
      if (wide) {
        with_rows<kMRWide>(mr, [&](auto r) {
          if constexpr (kWoOneChain && decltype(r)::value > kMR)
            wo_tile_one_chain<KIND, decltype(r)::value>(a, x, xr, sx, pan, cc, ldc, lut);
          else
            tile(r, One{});
        });
      } else if (np == kNP) {
        with_rows<kMR>(mr, [&](auto r) { tile(r, std::integral_constant<int, kNP>{}); });
      } else {
        with_rows<kMR>(mr, [&](auto r) { tile(r, One{}); });
      }
    }
  }
}

// Float weights above this many bytes are written row by row (see `wo_dequant_kind`).
constexpr int64_t kDequantRowsBytes = int64_t{8} << 20;

// The whole weight. Small ones panel by panel (`wo_dequant_block`, reading each panel's codes
// in one stream). Past a few MB the output outgrows the caches and the TLB's reach: it is then
// written row by row across the panels, so consecutive stores fill one row's 64-byte pieces in
// order, where panel by panel every store lands a whole row (16 KB at N = 4096) past the last.
// Measured (2 cores, int4 g64, 2048 x 2048): 1.6-1.7 ms -> 0.6-0.9 ms; 576 x 1536 stays
// faster panel by panel (0.08-0.10 against 0.11-0.24 ms).
template <int KIND>
static void wo_dequant_kind(const WoArgs& a, int64_t p0, int64_t p1, float* out, int64_t ldo) {
  const Lut lut = make_lut(KIND == kNf4 ? a.lut : KIND == kInt4 ? kInt4Table : kUint4Table);
  if (a.kp * ldo * int64_t{sizeof(float)} <= kDequantRowsBytes) {
    wo_dequant_block<KIND>(a, a.blob + p0 * a.panel_bytes, p1 - p0, 0, a.groups, lut,
                           out + p0 * kPanel, ldo);
    return;
  }
  const uint8_t* base = a.blob + p0 * a.panel_bytes;
  const int64_t np = p1 - p0, npairs = a.gs / 2;
  out += p0 * kPanel;
  for (int64_t g = 0; g < a.groups; ++g) {
    for (int64_t t = 0; t < npairs; ++t) {
      float* row0 = out + (g * a.gs + 2 * t) * ldo;
      float* row1 = row0 + ldo;
      for (int64_t j = 0; j < np; ++j) {
        const uint8_t* gp = base + j * a.panel_bytes + g * a.group_bytes;
        V s, zp;
        group_scale<KIND>(gp, s, zp);
        dequant_pair<KIND>(gp, t, lut, s, zp, row0 + j * kPanel, row1 + j * kPanel);
      }
    }
  }
}

// Calls f(std::integral_constant<int, KIND>{}) for the weight-only kind `kind` (fp8 for any
// other value): one switch for every entry point templated on the kind.
template <typename F>
static void with_wo_kind(int kind, F&& f) {
  switch (kind) {
    case kInt8: return f(std::integral_constant<int, kInt8>{});
    case kInt4: return f(std::integral_constant<int, kInt4>{});
    case kUint4: return f(std::integral_constant<int, kUint4>{});
    case kNf4: return f(std::integral_constant<int, kNf4>{});
    default: return f(std::integral_constant<int, kFp8>{});
  }
}

// The whole weight of panels [p0, p1) as float32 out[k][16 p + j] (ldo floats a row): what
// the large-M path dequantizes block by block, for an external GEMM.
static void wo_dequant(const WoArgs& a, int64_t p0, int64_t p1, float* out, int64_t ldo) {
  with_wo_kind(a.kind, [&](auto k) { wo_dequant_kind<decltype(k)::value>(a, p0, p1, out, ldo); });
}

static void wo_run(const WoArgs& a, int64_t m0, int64_t m1, int64_t p0, int64_t p1, float* c,
                   int64_t ldc) {
  with_wo_kind(a.kind, [&](auto k) { wo_run_kind<decltype(k)::value>(a, m0, m1, p0, p1, c, ldc); });
}

// MR x (NP * 16) int32 tile over k-quads [q0, q1).
template <int MR, int NP>
static void q8_tile(const Q8Args& a, const uint32_t* xa, const int8_t* w, int64_t q0, int64_t q1,
                    int32_t* c, int64_t ldc, bool first) {
  VI acc[MR][NP];
  LOWBIT_UNROLL for (int r = 0; r < MR; ++r)
    LOWBIT_UNROLL for (int j = 0; j < NP; ++j) acc[r][j] = first ? izero() : iload(c + r * ldc + j * kPanel);
  const int64_t pstride = a.kq * 64;
  for (int64_t q = q0; q < q1; ++q) {
    const uint32_t* xq = xa + q * (kQMR * kActWords);
    LOWBIT_UNROLL for (int j = 0; j < NP; ++j) {
      const int8_t* p = w + j * pstride + q * 64;
      __builtin_prefetch(p + kPrefetch);
      const WQ wq = wq_load(p);
      LOWBIT_UNROLL for (int r = 0; r < MR; ++r) acc[r][j] = idot(acc[r][j], wq, xq + r * kActWords);
    }
  }
  LOWBIT_UNROLL for (int r = 0; r < MR; ++r)
    LOWBIT_UNROLL for (int j = 0; j < NP; ++j) istore(c + r * ldc + j * kPanel, acc[r][j]);
}

static void q8_run(const Q8Args& a, int64_t m0, int64_t m1, int64_t p0, int64_t p1, int32_t* c,
                   int64_t ldc) {
  const int64_t qblk = (m1 - m0 <= kSmallM) ? a.kq : kQ8Kq;
  // Activations come in tiles of kQMR rows: [M / kQMR][kq][kQMR][kActWords].
  const int64_t tile_words = a.kq * kQMR * kActWords;
  for (int64_t q0 = 0; q0 < a.kq; q0 += qblk) {
    const int64_t q1 = std::min(a.kq, q0 + qblk);
    for (int64_t p = p0; p < p1; p += kQNP) {
      const int64_t np = std::min<int64_t>(kQNP, p1 - p);
      const int8_t* w = a.w + p * a.kq * 64;
      for (int64_t m = m0; m < m1; m += kQMR) {
        const int64_t mr = std::min<int64_t>(kQMR, m1 - m);
        int32_t* cc = c + (m - m0) * ldc + (p - p0) * kPanel;
        const uint32_t* xa = a.xa + m / kQMR * tile_words;
        if (np == kQNP) {
          with_rows<kQMR>(mr, [&](auto r) {
            q8_tile<decltype(r)::value, kQNP>(a, xa, w, q0, q1, cc, ldc, q0 == 0);
          });
        } else {
          with_rows<kQMR>(mr, [&](auto r) {
            q8_tile<decltype(r)::value, 1>(a, xa, w, q0, q1, cc, ldc, q0 == 0);
          });
        }
      }
    }
  }
}

// w4a8: MR x NP tile over all groups. Per group, up to kW4Chunk rows of 8 k are unpacked to
// signed bytes in the w8a8 layout (one k-quad = 64 bytes), dotted with the u8 activations in
// int32, corrected by 128 * (column sum) for the +128 activation offset, and accumulated in
// float32 with the group scale.
constexpr int64_t kW4Chunk = 32;

template <int MR, int NP>
static void w4_tile(const W4Args& a, const uint32_t* xt, const uint8_t* pan, float* c,
                    int64_t ldc) {
  alignas(64) float acc[MR][NP][kPanel] = {};
  alignas(64) int8_t buf[NP][2 * kW4Chunk * 64];
  alignas(64) int32_t dot[kPanel];
  const int64_t rows8 = a.gs / 8;
  for (int64_t g = 0; g < a.groups; ++g) {
    VI iacc[MR][NP];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NP; ++j) iacc[r][j] = izero();
    for (int64_t t0 = 0; t0 < rows8; t0 += kW4Chunk) {
      const int64_t nt = std::min<int64_t>(kW4Chunk, rows8 - t0);
      for (int j = 0; j < NP; ++j) {
        const uint8_t* body =
            pan + j * a.panel_bytes + g * a.group_bytes + kGroupHeader + t0 * 64;
        int8_t* out = buf[j];
        for (int64_t t = 0; t < nt; ++t) {
          __builtin_prefetch(body + t * 64 + kPrefetch);
          for (int b = 0; b < 64; ++b) {
            const int v = body[t * 64 + b];
            out[2 * t * 64 + b] = static_cast<int8_t>((v & 15) - 8);
            out[(2 * t + 1) * 64 + b] = static_cast<int8_t>((v >> 4) - 8);
          }
        }
      }
      const int64_t q0 = g * (a.gs / 4) + 2 * t0;
      for (int64_t tq = 0; tq < 2 * nt; ++tq) {
        const uint32_t* xq = xt + (q0 + tq) * (kQMR * kActWords);
        for (int j = 0; j < NP; ++j) {
          const WQ wq = wq_load(buf[j] + tq * 64);
          for (int r = 0; r < MR; ++r) iacc[r][j] = idot(iacc[r][j], wq, xq + r * kActWords);
        }
      }
    }
    for (int j = 0; j < NP; ++j) {
      const uint8_t* hdr = pan + j * a.panel_bytes + g * a.group_bytes;
      const float* s = reinterpret_cast<const float*>(hdr);
      const int32_t* colsum = reinterpret_cast<const int32_t*>(hdr + 4 * kPanel);
      for (int r = 0; r < MR; ++r) {
        istore(dot, iacc[r][j]);
        for (int l = 0; l < kPanel; ++l)
          acc[r][j][l] += static_cast<float>(dot[l] - 128 * colsum[l]) * s[l];
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP; ++j)
      for (int l = 0; l < kPanel; ++l) c[r * ldc + j * kPanel + l] = acc[r][j][l];
}

static void w4_run(const W4Args& a, int64_t m0, int64_t m1, int64_t p0, int64_t p1, float* c,
                   int64_t ldc) {
  const int64_t kq = a.groups * a.gs / 4;
  const int64_t tile_words = kq * kQMR * kActWords;
  for (int64_t p = p0; p < p1; p += kQNP) {
    const int64_t np = std::min<int64_t>(kQNP, p1 - p);
    const uint8_t* pan = a.blob + p * a.panel_bytes;
    for (int64_t m = m0; m < m1; m += kQMR) {
      const int64_t mr = std::min<int64_t>(kQMR, m1 - m);
      const uint32_t* xt = a.xa + m / kQMR * tile_words;
      float* cc = c + (m - m0) * ldc + (p - p0) * kPanel;
      if (np == kQNP) {
        with_rows<kQMR>(mr, [&](auto r) { w4_tile<decltype(r)::value, kQNP>(a, xt, pan, cc, ldc); });
      } else {
        with_rows<kQMR>(mr, [&](auto r) { w4_tile<decltype(r)::value, 1>(a, xt, pan, cc, ldc); });
      }
    }
  }
}

#if defined(LOWBIT_HAS_WO_Q8)
// 4-bit (int4, uint4) and int8 (AVX-512 VNNI, AVX2) weight-only panels times int8 activations
// (IsaKernels::wo_q8). Per group g and row r, the integer dot of the codes c with the
// activation codes q, then acc += s * (dx * dot - zp * dx * sum(q)) with dx the row's scale
// for the group and zp the group's zero point (8 for int4, whose codes are stored
// offset-binary; none for int8). The 4-bit codes are the dot's unsigned operand. int8 codes
// are signed: with VNNI the activations are (q + 128) and the dot loses 128 * sum(c), summed
// by one more dot with ones; AVX2 multiplies |c| by q with c's sign (q8_dot; AVX-512 has no
// vpsignb, so AVX-512 BW keeps int8 on the float path). The weight stream is read as the
// float path reads it (same layout); MR rows share each unpacked k-quad.
// Rows per tile: the ISA's activation tile height (AVX2: 4, whose sums of a row take two of
// its 16 registers; AVX-512: 8).
constexpr int kQ8Rows = kQMR;
// Independent integer sums a row in wq8_tile at one or two rows: with VNNI each dot adds
// into its sum in one instruction, so one sum a row chains the dots at its latency; without,
// vpmaddubsw / vpmaddwd come first and only a cheap add is chained.
#if defined(LOWBIT_VNNI)
constexpr int kQ8Chains = 4;
#else
constexpr int kQ8Chains = 1;
#endif

template <int KIND, int MR>
static void wq8_tile(const WoArgs& a, int64_t m, const uint8_t* pan, float* c, int64_t ldc) {
  constexpr bool kInt8Codes = KIND == kInt8;
  V acc[MR];
  LOWBIT_UNROLL for (int r = 0; r < MR; ++r) acc[r] = vzero();
  const int64_t nq = a.gs / 4;
  const int64_t quad_bytes = kInt8Codes ? 64 : 32;
  const int8_t* xr = a.xq + m * a.kp;
  const float* xs = a.xq_scale + m * a.groups;
  const float* xz = a.xq_sum + m * a.groups;
  for (int64_t g = 0; g < a.groups; ++g) {
    const uint8_t* gp = pan + g * a.group_bytes;
    const uint8_t* body = gp + kGroupHeader;
    const int8_t* xg = xr + g * a.gs;
    VI iacc[MR];
    LOWBIT_UNROLL for (int r = 0; r < MR; ++r) iacc[r] = izero();
#if defined(LOWBIT_HAS_WO_Q8_INT8)
    __m512i csum = _mm512_setzero_si512();
#endif
    if constexpr (kInt8Codes) {
#if defined(LOWBIT_HAS_WO_Q8_SIGNS)
      for (int64_t q = 0; q < nq; ++q) {
        const uint8_t* p = body + q * quad_bytes;
        __builtin_prefetch(p + kPrefetch);
        const VI w = q8_quad(p);
        const VI mag = q8_magnitudes(w);
        LOWBIT_UNROLL for (int r = 0; r < MR; ++r) iacc[r] = q8_dot(iacc[r], w, mag, xg + r * a.kp + 4 * q);
      }
#elif defined(LOWBIT_HAS_WO_Q8_INT8)
      for (int64_t q = 0; q < nq; ++q) {
        const uint8_t* p = body + q * quad_bytes;
        __builtin_prefetch(p + kPrefetch);
        const __m512i w = q8_quad(p);
        csum = sdot(csum, w, 0x01010101);
        LOWBIT_UNROLL for (int r = 0; r < MR; ++r) {
          uint32_t x4;
          std::memcpy(&x4, xg + r * a.kp + 4 * q, 4);
          iacc[r] = sdot(iacc[r], w, static_cast<int32_t>(x4 ^ 0x80808080u));
        }
      }
#endif
    } else {
      // Unpacks quad q once and hands it with each row's 4 activation bytes to dot(r, w, x).
      auto quad_rows = [&](int64_t q, auto&& dot) {
        const uint8_t* p = body + q * quad_bytes;
        if ((q & 1) == 0) __builtin_prefetch(p + kPrefetch);
        const auto w = q4_quad(p);
        LOWBIT_UNROLL for (int r = 0; r < MR; ++r) dot(r, w, xg + r * a.kp + 4 * q);
      };
      if constexpr (kShortQuads > 0) {
        // Without VNNI: exact int16 sums over up to kShortQuads quads, widened to int32 once
        // (one vpmaddwd per row and 8 quads, where each quad took one).
        if (nq <= kShortQuads) {
          // One block (groups of 32 or fewer: GGUF's): widened straight into the group's
          // sums, which then need no running total across blocks.
          VI part[MR];
          LOWBIT_UNROLL for (int r = 0; r < MR; ++r) part[r] = izero();
          for (int64_t q = 0; q < nq; ++q)
            quad_rows(q, [&](int r, const auto& w, const int8_t* x) { part[r] = udot16(part[r], w, x); });
          LOWBIT_UNROLL for (int r = 0; r < MR; ++r) iacc[r] = widen16(part[r]);
        } else {
          for (int64_t q0 = 0; q0 < nq; q0 += kShortQuads) {
            const int64_t q1 = std::min<int64_t>(nq, q0 + kShortQuads);
            VI part[MR];
            LOWBIT_UNROLL for (int r = 0; r < MR; ++r) part[r] = izero();
            for (int64_t q = q0; q < q1; ++q)
              quad_rows(q, [&](int r, const auto& w, const int8_t* x) { part[r] = udot16(part[r], w, x); });
            LOWBIT_UNROLL for (int r = 0; r < MR; ++r) iacc[r] = iadd(iacc[r], widen16(part[r]));
          }
        }
      } else {
        // With one or two rows, each row's dots go into kChains independent sums: a single
        // sum makes every dot wait for the previous one (gs / 4 in a row: 8 at llama.cpp's
        // groups of 32), and decode then runs at the dot's latency instead of its throughput.
        constexpr int kChains = MR <= 2 ? kQ8Chains : 1;
        VI part[MR][kChains];
        LOWBIT_UNROLL for (int r = 0; r < MR; ++r)
          LOWBIT_UNROLL for (int c = 0; c < kChains; ++c) part[r][c] = izero();
        auto quad = [&](int64_t q, auto chain) {
          constexpr int c = decltype(chain)::value;
          quad_rows(q, [&](int r, const auto& w, const int8_t* x) {
            int32_t x4;
            std::memcpy(&x4, x, 4);
            part[r][c] = udot(part[r][c], w, x4);
          });
        };
        int64_t q = 0;
        for (; q + kChains <= nq; q += kChains) {
          quad(q, std::integral_constant<int, 0>{});
          if constexpr (kChains > 1) quad(q + 1, std::integral_constant<int, 1 % kChains>{});
          if constexpr (kChains > 2) {
            quad(q + 2, std::integral_constant<int, 2 % kChains>{});
            quad(q + 3, std::integral_constant<int, 3 % kChains>{});
          }
        }
        for (; q < nq; ++q) quad(q, std::integral_constant<int, 0>{});
        LOWBIT_UNROLL for (int r = 0; r < MR; ++r) {
          iacc[r] = part[r][0];
          LOWBIT_UNROLL for (int c = 1; c < kChains; ++c) iacc[r] = iadd(iacc[r], part[r][c]);
        }
      }
    }
    // The sums come in the quads' column order (quad_order): so do the scales and zero
    // points, once a group for all rows, and the tile's accumulators until they are stored.
    const float* hdr = reinterpret_cast<const float*>(gp);
    const V s = quad_order(vload(hdr));
    if constexpr (kInt8Codes) {
#if defined(LOWBIT_HAS_WO_Q8_SIGNS)
      LOWBIT_UNROLL for (int r = 0; r < MR; ++r)
        acc[r] = vfmadd(s, vmul(vcvt(iacc[r]), vbcast(xs[r * a.groups + g])), acc[r]);
#elif defined(LOWBIT_HAS_WO_Q8_INT8)
      const __m512i off = _mm512_slli_epi32(csum, 7);  // 128 * sum(c)
      LOWBIT_UNROLL for (int r = 0; r < MR; ++r) {
        const V t = vmul(vcvt(_mm512_sub_epi32(iacc[r], off)), vbcast(xs[r * a.groups + g]));
        acc[r] = vfmadd(s, t, acc[r]);
      }
#endif
    } else {
      const V zp = KIND == kInt4 ? vbcast(8.0f) : quad_order(vload(hdr + kPanel));
      LOWBIT_UNROLL for (int r = 0; r < MR; ++r) {
        V t = vmul(vcvt(iacc[r]), vbcast(xs[r * a.groups + g]));
        t = vfnmadd(zp, vbcast(xz[r * a.groups + g]), t);
        acc[r] = vfmadd(s, t, acc[r]);
      }
    }
  }
  LOWBIT_UNROLL for (int r = 0; r < MR; ++r) vstore(c + r * ldc, quad_order(acc[r]));
}

template <int KIND>
static void wq8_run_kind(const WoArgs& a, int64_t m0, int64_t m1, int64_t p0, int64_t p1,
                         float* c, int64_t ldc) {
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* pan = a.blob + p * a.panel_bytes;
    for (int64_t m = m0; m < m1; m += kQ8Rows) {
      const int64_t mr = std::min<int64_t>(kQ8Rows, m1 - m);
      float* cc = c + (m - m0) * ldc + (p - p0) * kPanel;
      with_rows<kQ8Rows>(mr, [&](auto r) { wq8_tile<KIND, decltype(r)::value>(a, m, pan, cc, ldc); });
    }
  }
}

// One activation row [kp] to int8 codes per group of gs (IsaKernels::quantize_groups): scale =
// absmax / 127 (codes 0 for an all-zero group; a NaN scale when the group holds a non-finite
// value, so the outputs it touches are NaN as on the float path), round half to even, and
// per group the scale times the codes' sum. The ISA's GroupQ8 takes kLanes floats a step;
// the scalar loops finish a group whose size is not a multiple of that.
static void quantize_groups(const float* x, int64_t kp, int64_t gs, int8_t* q, float* scale,
                            float* scaled_sum) {
  constexpr int kLanes = GroupQ8::kLanes;
  for (int64_t g = 0; g * gs < kp; ++g) {
    const float* v = x + g * gs;
    int8_t* c = q + g * gs;
    int64_t i = 0;
    GroupQ8::Max vmax = GroupQ8::max_init();
    for (; i + kLanes <= gs; i += kLanes) GroupQ8::max_step(vmax, v + i);
    float amax = GroupQ8::max_value(vmax);
    bool finite = vmax.bad == 0;
    for (int64_t j = i; j < gs; ++j) {
      finite = finite && std::isfinite(v[j]);
      amax = std::max(amax, std::fabs(v[j]));
    }
    const float s = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
    const bool zero = !finite || !(amax > 0.0f);
    const auto vs = GroupQ8::bcast(zero ? 1.0f : s);
    auto vsum = GroupQ8::sum_init();
    for (i = 0; i + kLanes <= gs; i += kLanes) GroupQ8::codes_step(vsum, v + i, vs, zero, c + i);
    int32_t sum = GroupQ8::sum_value(vsum);
    for (; i < gs; ++i) {
      float t = std::min(127.0f, std::max(-127.0f, v[i] / (zero ? 1.0f : s)));
      t = (t + 12582912.0f) - 12582912.0f;
      const int32_t k = zero ? 0 : static_cast<int32_t>(t);
      c[i] = static_cast<int8_t>(k);
      sum += k;
    }
    scale[g] = s;
    scaled_sum[g] = s * static_cast<float>(sum);
  }
}

// The kinds wo_q8 serves here.
static bool wo_q8_kind(int kind) {
#if defined(LOWBIT_HAS_WO_Q8_INT8) || defined(LOWBIT_HAS_WO_Q8_SIGNS)
  if (kind == kInt8) return true;
#endif
  return kind == kInt4 || kind == kUint4;
}

static void wo_q8(const WoArgs& a, int64_t m0, int64_t m1, int64_t p0, int64_t p1, float* c,
                  int64_t ldc) {
  switch (a.kind) {
    case kInt4:
      wq8_run_kind<kInt4>(a, m0, m1, p0, p1, c, ldc);
      break;
#if defined(LOWBIT_HAS_WO_Q8_INT8) || defined(LOWBIT_HAS_WO_Q8_SIGNS)
    case kInt8:
      wq8_run_kind<kInt8>(a, m0, m1, p0, p1, c, ldc);
      break;
#endif
    default:
      wq8_run_kind<kUint4>(a, m0, m1, p0, p1, c, ldc);
      break;
  }
}
#endif  // LOWBIT_HAS_WO_Q8
