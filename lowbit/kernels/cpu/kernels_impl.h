// ISA-generic tiles for the weight-only and w8a8 kernels. Included (without include guard)
// inside an ISA namespace after one of the simd_*.h vocabularies, with that ISA's target
// pragma active, so each ISA gets its own copy compiled for its instruction set.

// Bytes ahead of the current read position to prefetch in the weight stream. Hardware
// prefetchers alone leave the decode GEMV short of memory bandwidth.
constexpr int64_t kPrefetch = 1024;
// K-block (in k) for weight-only tiles when M is large, so the activation block stays in L2
// while all panels of a thread pass over it.
constexpr int64_t kWoKc = 1024;
// Rows above which K is blocked (below, a whole K pass per tile keeps the code simple and
// the activation rows are tiny anyway).
constexpr int64_t kSmallM = 16;
// K-block in k-quads for w8a8.
constexpr int64_t kQ8Kq = 512;

template <int KIND>
struct Deq {
  static constexpr int PB = (KIND == kInt8 || KIND == kFp8) ? 32 : 16;
  static constexpr bool kZp = (KIND == kInt4 || KIND == kUint4);
  static constexpr float kScaleMul = (KIND == kFp8) ? 256.0f : 1.0f;
  static inline void pair(const uint8_t* p, const Lut& l, V& w0, V& w1) {
    (void)l;
    if constexpr (KIND == kInt8) {
      w0 = deq_s8(p);
      w1 = deq_s8(p + 16);
    } else if constexpr (KIND == kFp8) {
      w0 = deq_fp8(p);
      w1 = deq_fp8(p + 16);
    } else if constexpr (KIND == kNf4) {
      deq_lut(p, l, w0, w1);
    } else {
      deq_nib(p, w0, w1);
    }
  }
};

// One MR x (NP * 16) tile over groups [g0, g1). Inside a group the raw codes are
// accumulated (two chains per panel: even and odd k); the group scale and zero point are
// applied once per group: acc += s * sum(x * q) - s * zp * sum(x).
template <int KIND, int MR, int NP>
static void wo_tile(const WoArgs& a, const float* x, const float* sx, const uint8_t* pan,
                    int64_t g0, int64_t g1, float* c, int64_t ldc, bool first, const Lut& lut) {
  using D = Deq<KIND>;
  V acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP; ++j) acc[r][j] = first ? vzero() : vload(c + r * ldc + j * kPanel);
  const int64_t npairs = a.gs / 2;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gp[NP];
    for (int j = 0; j < NP; ++j) gp[j] = pan + j * a.panel_bytes + g * a.group_bytes;
    V e[MR][NP], o[MR][NP];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NP; ++j) e[r][j] = o[r][j] = vzero();
    const float* xg = x + g * a.gs;
    for (int64_t t = 0; t < npairs; ++t) {
      for (int j = 0; j < NP; ++j) {
        const uint8_t* p = gp[j] + kGroupHeader + t * D::PB;
        if (((t * D::PB) & 63) == 0) __builtin_prefetch(p + kPrefetch);
        V w0, w1;
        D::pair(p, lut, w0, w1);
        for (int r = 0; r < MR; ++r) {
          e[r][j] = vfmadd(vbcast(xg[r * a.kp + 2 * t]), w0, e[r][j]);
          o[r][j] = vfmadd(vbcast(xg[r * a.kp + 2 * t + 1]), w1, o[r][j]);
        }
      }
    }
    for (int j = 0; j < NP; ++j) {
      const float* hdr = reinterpret_cast<const float*>(gp[j]);
      V s = vload(hdr);
      if constexpr (D::kScaleMul != 1.0f) s = vmul(s, vbcast(D::kScaleMul));
      for (int r = 0; r < MR; ++r) acc[r][j] = vfmadd(s, vadd(e[r][j], o[r][j]), acc[r][j]);
      if constexpr (D::kZp) {
        const V szp = vmul(s, vload(hdr + kPanel));
        for (int r = 0; r < MR; ++r)
          acc[r][j] = vfnmadd(szp, vbcast(sx[r * a.groups + g]), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP; ++j) vstore(c + r * ldc + j * kPanel, acc[r][j]);
}

template <int KIND, int NP>
static inline void wo_tile_rows(int64_t mr, const WoArgs& a, const float* x, const float* sx,
                                const uint8_t* pan, int64_t g0, int64_t g1, float* c,
                                int64_t ldc, bool first, const Lut& lut) {
  switch (mr) {
    case 1:
      wo_tile<KIND, 1, NP>(a, x, sx, pan, g0, g1, c, ldc, first, lut);
      break;
    case 2:
      if constexpr (kMR >= 2) wo_tile<KIND, 2, NP>(a, x, sx, pan, g0, g1, c, ldc, first, lut);
      break;
    case 3:
      if constexpr (kMR >= 3) wo_tile<KIND, 3, NP>(a, x, sx, pan, g0, g1, c, ldc, first, lut);
      break;
    default:
      if constexpr (kMR >= 4) wo_tile<KIND, 4, NP>(a, x, sx, pan, g0, g1, c, ldc, first, lut);
      break;
  }
}

template <int KIND>
static void wo_run_kind(const WoArgs& a, int64_t m0, int64_t m1, int64_t p0, int64_t p1,
                        float* c, int64_t ldc) {
  const Lut lut = make_lut(a.lut);
  const int64_t gblk = (m1 - m0 <= kSmallM) ? a.groups : std::max<int64_t>(1, kWoKc / a.gs);
  for (int64_t g0 = 0; g0 < a.groups; g0 += gblk) {
    const int64_t g1 = std::min(a.groups, g0 + gblk);
    for (int64_t p = p0; p < p1; p += kNP) {
      const int64_t np = std::min<int64_t>(kNP, p1 - p);
      const uint8_t* pan = a.blob + p * a.panel_bytes;
      for (int64_t m = m0; m < m1; m += kMR) {
        const int64_t mr = std::min<int64_t>(kMR, m1 - m);
        const float* x = a.x + m * a.kp;
        const float* sx = a.sumx + m * a.groups;
        float* cc = c + (m - m0) * ldc + (p - p0) * kPanel;
        if (np == kNP) {
          wo_tile_rows<KIND, kNP>(mr, a, x, sx, pan, g0, g1, cc, ldc, g0 == 0, lut);
        } else {
          wo_tile_rows<KIND, 1>(mr, a, x, sx, pan, g0, g1, cc, ldc, g0 == 0, lut);
        }
      }
    }
  }
}

static void wo_run(const WoArgs& a, int64_t m0, int64_t m1, int64_t p0, int64_t p1, float* c,
                   int64_t ldc) {
  switch (a.kind) {
    case kInt8:
      wo_run_kind<kInt8>(a, m0, m1, p0, p1, c, ldc);
      break;
    case kInt4:
      wo_run_kind<kInt4>(a, m0, m1, p0, p1, c, ldc);
      break;
    case kUint4:
      wo_run_kind<kUint4>(a, m0, m1, p0, p1, c, ldc);
      break;
    case kNf4:
      wo_run_kind<kNf4>(a, m0, m1, p0, p1, c, ldc);
      break;
    default:
      wo_run_kind<kFp8>(a, m0, m1, p0, p1, c, ldc);
      break;
  }
}

// MR x (NP * 16) int32 tile over k-quads [q0, q1).
template <int MR, int NP>
static void q8_tile(const Q8Args& a, const uint32_t* xa, const int8_t* w, int64_t q0, int64_t q1,
                    int32_t* c, int64_t ldc, bool first) {
  VI acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP; ++j) acc[r][j] = first ? izero() : iload(c + r * ldc + j * kPanel);
  const int64_t lda = a.kq * kActWords;
  const int64_t pstride = a.kq * 64;
  for (int64_t q = q0; q < q1; ++q) {
    for (int j = 0; j < NP; ++j) {
      const int8_t* p = w + j * pstride + q * 64;
      __builtin_prefetch(p + kPrefetch);
      const WQ wq = wq_load(p);
      for (int r = 0; r < MR; ++r) acc[r][j] = idot(acc[r][j], wq, xa + r * lda + q * kActWords);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP; ++j) istore(c + r * ldc + j * kPanel, acc[r][j]);
}

template <int NP>
static inline void q8_tile_rows(int64_t mr, const Q8Args& a, const uint32_t* xa, const int8_t* w,
                                int64_t q0, int64_t q1, int32_t* c, int64_t ldc, bool first) {
  switch (mr) {
    case 1:
      q8_tile<1, NP>(a, xa, w, q0, q1, c, ldc, first);
      break;
    case 2:
      if constexpr (kQMR >= 2) q8_tile<2, NP>(a, xa, w, q0, q1, c, ldc, first);
      break;
    case 3:
      if constexpr (kQMR >= 3) q8_tile<3, NP>(a, xa, w, q0, q1, c, ldc, first);
      break;
    default:
      if constexpr (kQMR >= 4) q8_tile<4, NP>(a, xa, w, q0, q1, c, ldc, first);
      break;
  }
}

static void q8_run(const Q8Args& a, int64_t m0, int64_t m1, int64_t p0, int64_t p1, int32_t* c,
                   int64_t ldc) {
  const int64_t qblk = (m1 - m0 <= kSmallM) ? a.kq : kQ8Kq;
  const int64_t lda = a.kq * kActWords;
  for (int64_t q0 = 0; q0 < a.kq; q0 += qblk) {
    const int64_t q1 = std::min(a.kq, q0 + qblk);
    for (int64_t p = p0; p < p1; p += kQNP) {
      const int64_t np = std::min<int64_t>(kQNP, p1 - p);
      const int8_t* w = a.w + p * a.kq * 64;
      for (int64_t m = m0; m < m1; m += kQMR) {
        const int64_t mr = std::min<int64_t>(kQMR, m1 - m);
        int32_t* cc = c + (m - m0) * ldc + (p - p0) * kPanel;
        if (np == kQNP) {
          q8_tile_rows<kQNP>(mr, a, a.xa + m * lda, w, q0, q1, cc, ldc, q0 == 0);
        } else {
          q8_tile_rows<1>(mr, a, a.xa + m * lda, w, q0, q1, cc, ldc, q0 == 0);
        }
      }
    }
  }
}
