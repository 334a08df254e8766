// The VNNI tile kernels (gguf_vnni.h), written once on a small SIMD layer that the including
// file defines before it includes this one, inside its namespace and target region:
//
//   I, F                  an integer and a float register: `kGroups` groups of 8 rows
//   kGroups               groups of 8 rows a register holds (2 for 64 bytes, 1 for 32)
//   MaxRows(type)         activation rows a kernel of `type` takes at once (8, 4, 2 or 1),
//                         chosen by measurement: what the registers hold
//   Codes(g, off)         I: 32 bytes at `off` of each group's tile (g: a Group, gguf_vnni.h)
//   Widen16u / Widen16s(g, off)  I: 16 bytes of each tile as uint8 / int8 -> int16
//   Widen32u(g, off)      I: 8 bytes of each tile -> int32
//   Halves(g, off)        F: 8 fp16 of each tile -> float
//   LoadI(p), StoreI(p, v)  I from / to an aligned buffer
//   kQ6KBuffered          whether Q6_K decodes a unit's codes into a buffer (Q6KBuffered)
//   Bcast4(a)             I: the 4 bytes at a in every 32-bit lane
//   Dot(acc, u, s)        I: acc + the 4 products of each 32-bit lane's u (uint8) and s (int8)
//   ByteIf(v, bit, val)   I: val's bytes where v's byte has `bit`'s byte (one bit set), else 0
//   And Or Xor Add32 Sub32 Mul32 Madd16 Srl16 Sll16 Sll32 Sra32 Shuffle8 Zero Set8 Set16
//                         Set32
//   Set4x64(d, c, b, a)   I: the int64 a, b, c, d (low to high) repeated over the register
//   FZero FSet Fmadd Fnmadd FMul ToFloat Store  the float operations
//
// The AVX2 tiles (gguf.cc) multiply a 32-byte register of 8 rows by maddubs and add int16
// sums; here vpdpbusd adds into int32 sums, and a weight register is decoded once for up to
// MaxRows activation rows. Sub-block scales multiply the int32 sums (vpmulld) instead of the
// int16 ones (vpmaddwd): the same integers, and the float epilogue of the AVX2 tiles in their
// order, so every path gives the same bits.

template <int tb>
inline void PrefetchTile(const uint8_t* t) {
  for (int off = 0; off < tb; off += 64) _mm_prefetch(reinterpret_cast<const char*>(t) + off, _MM_HINT_T0);
}

// The frame of every kernel here: kGroups groups at a time for M activation rows from r0.
// `unit(g, u, acc)` adds unit u's products to the rows' outputs `acc[M]` (g: the unit's
// tiles); the tiles `ahead` units on are prefetched, and the outputs are stored once.
template <int tb, int M, int ahead, typename Unit>
inline void OverGroups(const Weight& w, int64_t r0, int64_t g0, int64_t g1, int64_t units,
                       float* out, Unit&& unit) {
  for (int64_t g = g0; g < g1; g += kGroups) {
    F acc[M];
    for (int r = 0; r < M; ++r) acc[r] = FZero();
    for (int64_t u = 0; u < units; ++u) {
      const Group tiles{w.data + g * w.row_bytes + u * tb, w.row_bytes};
      for (int i = 0; i < kGroups; ++i) PrefetchTile<tb>(tiles.t + i * w.row_bytes + ahead * tb);
      unit(tiles, u, acc);
    }
    for (int r = 0; r < M; ++r) Store(out + (r0 + r) * w.n + kTileRows * g, acc[r]);
  }
}

// int16 (lo, hi) in every 32-bit lane: madd's second operand.
inline I Pair16(int lo, int hi) {
  return Set32(static_cast<int>((static_cast<uint32_t>(hi) << 16) | (static_cast<uint32_t>(lo) & 0xffffu)));
}

// pshufb control copying byte `byte` of each 32-bit lane to the lane's 4 bytes.
inline I LanePick(int byte) {
  const int64_t b = static_cast<int64_t>(byte) * 0x0101010101010101;
  return Set4x64(b + 0x0c0c0c0c08080808, b + 0x0404040400000000, b + 0x0c0c0c0c08080808,
                 b + 0x0404040400000000);
}

// acc += dot * (d * da): the float epilogue of the AVX2 tiles, in their order.
inline F AddScaled(F acc, I dot, F d, float da) { return Fmadd(ToFloat(dot), FMul(d, FSet(da)), acc); }

// Q4_K and Q5_K: per sub-block of 32 an int32 sum of 8 Dot a row, times the rows' scales.
// Q5_K's tile is Q4_K's with the codes' fifth bits after it (qh chunk c holds the bits of the
// elements that qs chunk c of every sub-block pair holds: bit 2j for sub-block 2j, 2j + 1 for
// 2j + 1), set here as 16 into the unsigned codes, as in the AVX2 tiles.
template <int M, bool five>
void Q45K(const Weight& w, const Acts& acts, int64_t r0, int64_t g0, int64_t g1, float* out) {
  constexpr int tb = TileBytes(five ? kQ5_K : kQ4_K);
  const int64_t units = w.k / kUnit, kp = acts.kp;
  const I m15 = Set8(15), s16 = Set8(16);
  OverGroups<tb, M, 2>(w, r0, g0, g1, units, out, [&](Group g, int64_t u, F* acc) {
    I isum[M];
    for (int r = 0; r < M; ++r) isum[r] = Zero();
    for (int j = 0; j < 4; ++j) {  // sub-blocks 2j (low nibbles) and 2j + 1 (high)
      I slo[M], shi[M];
      for (int r = 0; r < M; ++r) slo[r] = shi[r] = Zero();
      const int off = 160 + 256 * j;
      const I b0 = Set8(1 << (2 * j)), b1 = Set8(1 << (2 * j + 1));
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const I v = Codes(g, off + 32 * c);
        I lo = And(v, m15);
        I hi = And(Srl16(v, 4), m15);
        if constexpr (five) {
          const I qh = Codes(g, 1184 + 32 * c);
          lo = Or(lo, ByteIf(qh, b0, s16));
          hi = Or(hi, ByteIf(qh, b1, s16));
        }
#pragma GCC unroll 8
        for (int r = 0; r < M; ++r) {
          const int8_t* a = acts.a.data() + (r0 + r) * kp + u * kUnit + 64 * j + 4 * c;
          slo[r] = Dot(slo[r], lo, Bcast4(a));
          shi[r] = Dot(shi[r], hi, Bcast4(a + 32));
        }
      }
      const I sl = Widen32u(g, 32 + 16 * j), sh = Widen32u(g, 40 + 16 * j);
      for (int r = 0; r < M; ++r) isum[r] = Add32(isum[r], Add32(Mul32(slo[r], sl), Mul32(shi[r], sh)));
    }
    I mv[4];
    for (int p = 0; p < 4; ++p) mv[p] = Widen16u(g, 96 + 16 * p);
    const F d = Halves(g, 0), dm = Halves(g, 16);
    for (int r = 0; r < M; ++r) {
      const int16_t* bs = acts.bs.data() + (r0 + r) * (kp / 16) + u * 16;
      I imin = Zero();
      for (int p = 0; p < 4; ++p)
        imin = Add32(imin, Madd16(mv[p], Pair16(bs[4 * p] + bs[4 * p + 1], bs[4 * p + 2] + bs[4 * p + 3])));
      const F da = FSet(acts.da[(r0 + r) * units + u]);
      acc[r] = Fmadd(ToFloat(isum[r]), FMul(d, da), acc[r]);
      acc[r] = Fnmadd(ToFloat(imin), FMul(dm, da), acc[r]);
    }
  });
}

// Q6_K: codes taken unsigned (0..63), 32 * (scale . activation sums) subtracted, as in the
// AVX2 tiles; one sub-block of 16 at a time, its code register rebuilt from ql / qh.
template <int M>
void Q6K(const Weight& w, const Acts& acts, int64_t r0, int64_t g0, int64_t g1, float* out) {
  constexpr int tb = TileBytes(kQ6_K);
  const int64_t units = w.k / kUnit, kp = acts.kp;
  const I m15 = Set8(15), m48 = Set8(48);
  OverGroups<tb, M, 2>(w, r0, g0, g1, units, out, [&](Group g, int64_t u, F* acc) {
    I isum[M], corr[M];
    for (int r = 0; r < M; ++r) isum[r] = corr[r] = Zero();
    for (int p = 0; p < 8; ++p) {  // scale pair p: int16 (scale 2p, scale 2p + 1) a row
      const I sc16 = Widen16s(g, 16 + 16 * p);
      for (int r = 0; r < M; ++r) {
        const int16_t* bs = acts.bs.data() + (r0 + r) * (kp / 16) + u * 16 + 2 * p;
        corr[r] = Add32(corr[r], Madd16(sc16, Pair16(bs[0], bs[1])));
      }
      // Sub-block 2p + half holds elements 128h + 32s + 16 half .. + 15 (h = p / 4, s = p % 4).
      const int h = p / 4, s = p % 4;
      for (int half = 0; half < 2; ++half) {
        const I scale = half ? Sra32(sc16, 16) : Sra32(Sll32(sc16, 16), 16);
        I sm[M];
        for (int r = 0; r < M; ++r) sm[r] = Zero();
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
          const int l = 16 * half + 4 * q;
          const I lo = Codes(g, 144 + 8 * (64 * h + 32 * (s & 1) + l));  // ql: A (s even) or B
          const I hb = Codes(g, 1168 + 8 * (32 * h + l));
          const I low4 = And(s < 2 ? lo : Srl16(lo, 4), m15);
          const I high2 = And(s == 0 ? Sll16(hb, 4) : s == 1 ? Sll16(hb, 2) : s == 2 ? hb : Srl16(hb, 2), m48);
          const I v = Or(low4, high2);
#pragma GCC unroll 8
          for (int r = 0; r < M; ++r) {
            const int8_t* a = acts.a.data() + (r0 + r) * kp + u * kUnit + 128 * h + 32 * s + l;
            sm[r] = Dot(sm[r], v, Bcast4(a));
          }
        }
        for (int r = 0; r < M; ++r) isum[r] = Add32(isum[r], Mul32(sm[r], scale));
      }
    }
    const F d = Halves(g, 0);
    for (int r = 0; r < M; ++r)
      acc[r] = AddScaled(acc[r], Sub32(isum[r], Sll32(corr[r], 5)), d, acts.da[(r0 + r) * units + u]);
  });
}

// Q6_K for a narrow register file (kQ6KBuffered): a unit's 6-bit codes decoded once into a
// buffer (2 KiB a group, in L1) and read back for every row, as the AVX2 tiles do; each
// sub-block of 16 is then 4 Dot and one scale multiply a row, two rows sharing each code
// load. Rebuilding the codes in registers (Q6K) costs two loads and four shifts a register,
// which 16 registers cannot spread over enough rows.
template <int M>
void Q6KBuffered(const Weight& w, const Acts& acts, int64_t r0, int64_t g0, int64_t g1, float* out) {
  constexpr int tb = TileBytes(kQ6_K);
  const int64_t units = w.k / kUnit, kp = acts.kp;
  const I m15 = Set8(15), m48 = Set8(48);
  alignas(64) uint8_t codes[2][8][4][sizeof(I)];  // [h][i][s]: elements 128h + 32s + 4i.. + 3
  alignas(64) uint8_t scales[16][sizeof(I)];      // int32 scale of sub-block 0..15 a row
  OverGroups<tb, M, 2>(w, r0, g0, g1, units, out, [&](Group g, int64_t u, F* acc) {
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < 8; ++i) {
        const I A = Codes(g, 144 + 8 * (64 * h + 4 * i));
        const I B = Codes(g, 144 + 8 * (64 * h + 32 + 4 * i));
        const I C = Codes(g, 1168 + 8 * (32 * h + 4 * i));
        StoreI(codes[h][i][0], Or(And(A, m15), And(Sll16(C, 4), m48)));
        StoreI(codes[h][i][1], Or(And(B, m15), And(Sll16(C, 2), m48)));
        StoreI(codes[h][i][2], Or(And(Srl16(A, 4), m15), And(C, m48)));
        StoreI(codes[h][i][3], Or(And(Srl16(B, 4), m15), And(Srl16(C, 2), m48)));
      }
    }
    for (int p = 0; p < 8; ++p) {
      const I sc16 = Widen16s(g, 16 + 16 * p);
      StoreI(scales[2 * p], Sra32(Sll32(sc16, 16), 16));
      StoreI(scales[2 * p + 1], Sra32(sc16, 16));
    }
    const F d = Halves(g, 0);
    constexpr int R = M > 1 ? 2 : 1;  // rows sharing each code load
    for (int r = 0; r < M; r += R) {
      I isum[R], corr[R];
      for (int e = 0; e < R; ++e) {
        const int16_t* bs = acts.bs.data() + (r0 + r + e) * (kp / 16) + u * 16;
        isum[e] = corr[e] = Zero();
        for (int p = 0; p < 8; ++p)
          corr[e] = Add32(corr[e], Madd16(Widen16s(g, 16 + 16 * p), Pair16(bs[2 * p], bs[2 * p + 1])));
      }
      const int8_t* a = acts.a.data() + (r0 + r) * kp + u * kUnit;
      for (int h = 0; h < 2; ++h) {
        for (int s = 0; s < 4; ++s) {
#pragma GCC unroll 2
          for (int half = 0; half < 2; ++half) {  // sub-block 8h + 2s + half
            I sm[R];
            for (int e = 0; e < R; ++e) sm[e] = Zero();
#pragma GCC unroll 4
            for (int q = 0; q < 4; ++q) {
              const int i = 4 * half + q;
              const I c = LoadI(codes[h][i][s]);
              for (int e = 0; e < R; ++e) sm[e] = Dot(sm[e], c, Bcast4(a + e * kp + 128 * h + 32 * s + 4 * i));
            }
            const I scale = LoadI(scales[8 * h + 2 * s + half]);
            for (int e = 0; e < R; ++e) isum[e] = Add32(isum[e], Mul32(sm[e], scale));
          }
        }
      }
      for (int e = 0; e < R; ++e)
        acc[r + e] = AddScaled(acc[r + e], Sub32(isum[e], Sll32(corr[e], 5)), d, acts.da[(r0 + r + e) * units + u]);
    }
  });
}

// Q2_K and Q3_K: each chunk's 2-bit codes as unsigned bytes (Q3_K: with the hmask bit as
// + 4, 0..7), summed per sub-block of 16 and scaled; Q3_K's + 4 comes off as 4 * sum_s
// scale_s * sum(a over s), Q2_K's minimums as dmin * sum_s min_s * sum(a over s), as in the
// AVX2 tiles.
// Sub-block pair p's scales (`sc16`) and what the activation sums are multiplied by (`by16`:
// the scales for Q3_K, the minimums for Q2_K), int16 (row, sub-block) of the rows.
template <int type>
inline void Q23Scales(Group g, int p, I* sc16, I* by16) {
  if constexpr (type == kQ3_K) {
    *sc16 = *by16 = Widen16s(g, 16 + 16 * p);
  } else {
    const I b16 = Widen16u(g, 32 + 16 * p);
    *sc16 = And(b16, Set16(15)), *by16 = Srl16(b16, 4);
  }
}

template <int type, int M>
void Q23K(const Weight& w, const Acts& acts, int64_t r0, int64_t g0, int64_t g1, float* out) {
  constexpr bool q3 = type == kQ3_K;
  constexpr int tb = TileBytes(type);
  const int64_t units = w.k / kUnit, kp = acts.kp;
  const I m3 = Set8(3), four = Set8(4);
  OverGroups<tb, M, 2>(w, r0, g0, g1, units, out, [&](Group g, int64_t u, F* acc) {
    I isum[M];
    for (int r = 0; r < M; ++r) isum[r] = Zero();
    for (int p = 0; p < 8; ++p) {  // sub-blocks 2p, 2p + 1: h = p / 4, j = p % 4
      const int h = p / 4, j = p % 4;
      const I bit = Set8(1 << (4 * h + j));
      I sm[2][M];
      for (int half = 0; half < 2; ++half)
        for (int r = 0; r < M; ++r) sm[half][r] = Zero();
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {  // elements 128h + 32j + 4c .. + 3 of the rows
        I v = And(Srl16(Codes(g, (q3 ? 144 : 160) + 32 * (8 * h + c)), 2 * j), m3);
        if constexpr (q3) v = Or(v, ByteIf(Codes(g, 656 + 32 * c), bit, four));
#pragma GCC unroll 8
        for (int r = 0; r < M; ++r) {
          const int8_t* a = acts.a.data() + (r0 + r) * kp + u * kUnit + 128 * h + 32 * j + 4 * c;
          sm[c / 4][r] = Dot(sm[c / 4][r], v, Bcast4(a));
        }
      }
      I sc16, by16;
      Q23Scales<type>(g, p, &sc16, &by16);
      const I lo = Sra32(Sll32(sc16, 16), 16), hi = Sra32(sc16, 16);
      for (int r = 0; r < M; ++r)
        isum[r] = Add32(isum[r], Add32(Mul32(sm[0][r], lo), Mul32(sm[1][r], hi)));
    }
    // Each row's `corr` after the codes (held through the loop above, it would not fit in
    // the registers beside the sums).
    const F d = Halves(g, 0);
    for (int r = 0; r < M; ++r) {
      const int16_t* bs = acts.bs.data() + (r0 + r) * (kp / 16) + u * 16;
      I corr = Zero();
      for (int p = 0; p < 8; ++p) {
        I sc16, by16;
        Q23Scales<type>(g, p, &sc16, &by16);
        corr = Add32(corr, Madd16(by16, Pair16(bs[2 * p], bs[2 * p + 1])));
      }
      const float da = acts.da[(r0 + r) * units + u];
      if constexpr (q3) {
        acc[r] = AddScaled(acc[r], Sub32(isum[r], Sll32(corr, 2)), d, da);
      } else {
        const F dm = Halves(g, 16), vda = FSet(da);
        acc[r] = Fmadd(ToFloat(isum[r]), FMul(d, vda), acc[r]);
        acc[r] = Fnmadd(ToFloat(corr), FMul(dm, vda), acc[r]);
      }
    }
  });
}

// 32-element types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): the tiles' codes as unsigned bytes in 8
// registers (Q8_0's with their sign bit flipped), each row's 8 Dot into one sum (the block has
// one scale), then the offset (Q4_0 / Q5_0 / Q8_0) or minimum (Q4_1 / Q5_1) terms of the AVX2
// tiles.
template <int type, int M>
void Q32(const Weight& w, const Acts& acts, int64_t r0, int64_t g0, int64_t g1, float* out) {
  constexpr int tb = TileBytes(type);
  constexpr bool has_min = kTypes[type].has_min;
  constexpr bool five = HasFifthBit(type);
  constexpr int offset = CodeOffset(type);
  const int64_t blocks = w.k / 32, kp = acts.kp;
  const I m15 = Set8(15), s16 = Set8(16), flip = Set8(0x80);
  // Element 4c + i (i < 4) of a row is bit 4c + i of its qh: byte c / 2 (16 + 4c + i: byte
  // 2 + c / 2) copied to the four bytes of the row's lane, then tested with its bit.
  const I sel[4] = {LanePick(0), LanePick(1), LanePick(2), LanePick(3)};
  const I bit[2] = {Set32(0x08040201), Set32(static_cast<int>(0x80402010u))};
  OverGroups<tb, M, 8>(w, r0, g0, g1, blocks, out, [&](Group g, int64_t j, F* acc) {
    I u[8];  // u[c]: elements 4c.. of the rows; u[4 + c]: elements 16 + 4c..
    if constexpr (type == kQ8_0) {  // the signed codes plus 128: unsigned bytes for Dot
      for (int c = 0; c < 8; ++c) u[c] = Xor(Codes(g, TileNibbles(type) + 32 * c), flip);
    } else {
      for (int c = 0; c < 4; ++c) {
        const I v = Codes(g, TileNibbles(type) + 32 * c);
        u[c] = And(v, m15);
        u[4 + c] = And(Srl16(v, 4), m15);
        if constexpr (five) {
          const I qh = Codes(g, TileHighBits(type));
          u[c] = Or(u[c], ByteIf(Shuffle8(qh, sel[c / 2]), bit[c % 2], s16));
          u[4 + c] = Or(u[4 + c], ByteIf(Shuffle8(qh, sel[2 + c / 2]), bit[c % 2], s16));
        }
      }
    }
    const F d = Halves(g, 0);
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r) {
      const int8_t* a = acts.a.data() + (r0 + r) * kp + 32 * j;
      I dot = Zero();
      for (int c = 0; c < 4; ++c) {
        dot = Dot(dot, u[c], Bcast4(a + 4 * c));
        dot = Dot(dot, u[4 + c], Bcast4(a + 16 + 4 * c));
      }
      const int64_t s = (r0 + r) * (kp / 16) + 2 * j;  // the block's two sums of 16
      if constexpr (offset != 0) dot = Sub32(dot, Set32(offset * (acts.bs[s] + acts.bs[s + 1])));
      acc[r] = AddScaled(acc[r], dot, d, acts.da[(r0 + r) * (kp / 32) + j]);
      if constexpr (has_min) acc[r] = Fmadd(Halves(g, 16), FSet(acts.sums[s] + acts.sums[s + 1]), acc[r]);
    }
  });
}

template <int type, int M>
void Run(const Weight& w, const Acts& acts, int64_t r0, int64_t g0, int64_t g1, float* out) {
  if constexpr (type == kQ4_K || type == kQ5_K) Q45K<M, type == kQ5_K>(w, acts, r0, g0, g1, out);
  else if constexpr (type == kQ6_K && kQ6KBuffered) Q6KBuffered<M>(w, acts, r0, g0, g1, out);
  else if constexpr (type == kQ6_K) Q6K<M>(w, acts, r0, g0, g1, out);
  else if constexpr (type == kQ2_K || type == kQ3_K) Q23K<type, M>(w, acts, r0, g0, g1, out);
  else Q32<type, M>(w, acts, r0, g0, g1, out);
}

// All activation rows, MaxRows(type) at a time (then 4, 2, 1).
template <int type>
void TilesOf(const Weight& w, const Acts& acts, int64_t g0, int64_t g1, float* out) {
  constexpr int rows = MaxRows(type);
  int64_t r = 0;
  for (; r + rows <= acts.m; r += rows) Run<type, rows>(w, acts, r, g0, g1, out);
  if constexpr (rows > 4)
    if (acts.m - r >= 4) Run<type, 4>(w, acts, r, g0, g1, out), r += 4;
  if constexpr (rows > 2)
    if (acts.m - r >= 2) Run<type, 2>(w, acts, r, g0, g1, out), r += 2;
  if constexpr (rows > 1)
    if (acts.m - r >= 1) Run<type, 1>(w, acts, r, g0, g1, out);
}

// The kernel of w's type (one the including file has: HasVnniTiles, HasAvxVnniTiles).
void TilesAny(const Weight& w, const Acts& acts, int64_t g0, int64_t g1, float* out) {
  switch (w.type) {
    case kQ4_K: return TilesOf<kQ4_K>(w, acts, g0, g1, out);
    case kQ5_K: return TilesOf<kQ5_K>(w, acts, g0, g1, out);
    case kQ6_K: return TilesOf<kQ6_K>(w, acts, g0, g1, out);
    case kQ2_K: return TilesOf<kQ2_K>(w, acts, g0, g1, out);
    case kQ3_K: return TilesOf<kQ3_K>(w, acts, g0, g1, out);
    case kQ4_0: return TilesOf<kQ4_0>(w, acts, g0, g1, out);
    case kQ4_1: return TilesOf<kQ4_1>(w, acts, g0, g1, out);
    case kQ5_0: return TilesOf<kQ5_0>(w, acts, g0, g1, out);
    case kQ8_0: return TilesOf<kQ8_0>(w, acts, g0, g1, out);
    default: return TilesOf<kQ5_1>(w, acts, g0, g1, out);
  }
}
