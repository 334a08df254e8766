// The decoders of gguf_blocks.h's canonical form, included once per instruction set by
// gguf.cc (no include guard): LOWBIT_GGUF_HALF(p) reads the fp16 at p (F16C where the region
// has it), and every function is a template on the block type so that a row loop decodes
// one type without a switch per unit.

// The scales (ws, wm) of a unit of `blocks` blocks starting at `b` (all 16 entries written;
// unused ones zero).
template <int type>
inline void DecodeScales(const uint8_t* b, int blocks, Unit* u) {
  if (kTypes[type].has_min || kTypes[type].block == 32) {
    for (int i = 0; i < kUnit / 16; ++i) u->ws[i] = u->wm[i] = 0.0f;
  }
  u->dmin = 0.0f;
  const TypeInfo& t = kTypes[type];
  if (t.block == 32) {
    for (int j = 0; j < blocks; ++j, b += t.bytes) {
      const float d = LOWBIT_GGUF_HALF(b);
      u->ws[2 * j] = u->ws[2 * j + 1] = d;
      if (type == kQ4_1 || type == kQ5_1) u->wm[2 * j] = u->wm[2 * j + 1] = LOWBIT_GGUF_HALF(b + 2);
    }
    return;
  }
  switch (type) {
    case kQ2_K: {
      const float d = LOWBIT_GGUF_HALF(b + 80), dmin = LOWBIT_GGUF_HALF(b + 82);
      u->d = d;
      u->dmin = dmin;
      for (int i = 0; i < 16; ++i) {
        u->ws[i] = d * static_cast<float>(b[i] & 15);
        u->wm[i] = -(dmin * static_cast<float>(b[i] >> 4));
      }
      break;
    }
    case kQ3_K: {
      const float d = LOWBIT_GGUF_HALF(b + 108);
      int sc[16];
      Q3Scales(b + 96, sc);
      u->d = d;
      for (int i = 0; i < 16; ++i) u->ws[i] = d * static_cast<float>(sc[i] - 32);
      break;
    }
    case kQ4_K:
    case kQ5_K: {
      const float d = LOWBIT_GGUF_HALF(b), dmin = LOWBIT_GGUF_HALF(b + 2);
      u->d = d;
      u->dmin = dmin;
      for (int j = 0; j < 8; ++j) {
        int sc, m;
        ScaleMinK4(j, b + 4, &sc, &m);
        u->ws[2 * j] = u->ws[2 * j + 1] = d * static_cast<float>(sc);
        u->wm[2 * j] = u->wm[2 * j + 1] = -(dmin * static_cast<float>(m));
      }
      break;
    }
    case kQ6_K: {
      const float d = LOWBIT_GGUF_HALF(b + 208);
      u->d = d;
      for (int i = 0; i < 16; ++i)
        u->ws[i] = d * static_cast<float>(static_cast<int8_t>(b[192 + i]));
      break;
    }
    case kIQ4_XS: {
      const float d = LOWBIT_GGUF_HALF(b);
      u->d = d;
      uint16_t sh;
      std::memcpy(&sh, b + 2, 2);
      for (int j = 0; j < 8; ++j) {
        const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4);
        u->ws[2 * j] = u->ws[2 * j + 1] = d * static_cast<float>(ls - 32);
      }
      break;
    }
    default:
      break;
  }
}

// The codes q of a unit, portable C++ (the scalar path and the reference the vector decoders
// are tested against).
template <int type>
inline void DecodeCodesScalar(const uint8_t* b, int blocks, int8_t* q) {
  const TypeInfo& t = kTypes[type];
  if (t.block == 32) {
    for (int j = 0; j < blocks; ++j, b += t.bytes, q += 32) {
      switch (type) {
        case kQ4_0:
        case kQ4_1:
        case kIQ4_NL: {
          const uint8_t* qs = b + (type == kQ4_1 ? 4 : 2);
          for (int l = 0; l < 16; ++l) {
            int lo = qs[l] & 15, hi = qs[l] >> 4;
            if (type == kIQ4_NL) {
              q[l] = kIq4Values[lo];
              q[l + 16] = kIq4Values[hi];
            } else {
              const int off = type == kQ4_0 ? 8 : 0;
              q[l] = static_cast<int8_t>(lo - off);
              q[l + 16] = static_cast<int8_t>(hi - off);
            }
          }
          break;
        }
        case kQ5_0:
        case kQ5_1: {
          const int hoff = type == kQ5_0 ? 2 : 4;
          uint32_t qh;
          std::memcpy(&qh, b + hoff, 4);
          const uint8_t* qs = b + hoff + 4;
          const int off = type == kQ5_0 ? 16 : 0;
          for (int l = 0; l < 16; ++l) {
            const int h0 = ((qh >> l) << 4) & 0x10, h1 = (qh >> (l + 12)) & 0x10;
            q[l] = static_cast<int8_t>(((qs[l] & 15) | h0) - off);
            q[l + 16] = static_cast<int8_t>(((qs[l] >> 4) | h1) - off);
          }
          break;
        }
        case kQ8_0:
          std::memcpy(q, b + 2, 32);
          break;
        default:
          break;
      }
    }
    return;
  }
  switch (type) {
    case kQ2_K: {
      const uint8_t* qs = b + 16;
      for (int n = 0; n < 2; ++n)
        for (int j = 0; j < 4; ++j)
          for (int l = 0; l < 32; ++l)
            q[128 * n + 32 * j + l] = static_cast<int8_t>((qs[32 * n + l] >> (2 * j)) & 3);
      break;
    }
    case kQ3_K: {
      const uint8_t* hm = b;
      const uint8_t* qs = b + 32;
      for (int n = 0; n < 2; ++n)
        for (int j = 0; j < 4; ++j)
          for (int l = 0; l < 32; ++l) {
            const int low = (qs[32 * n + l] >> (2 * j)) & 3;
            const int high = (hm[l] >> (4 * n + j)) & 1;
            q[128 * n + 32 * j + l] = static_cast<int8_t>(low - (high ? 0 : 4));
          }
      break;
    }
    case kQ4_K:
    case kQ5_K: {
      const bool five = type == kQ5_K;
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (five ? 48 : 16);
      for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
          int lo = qs[32 * c + l] & 15, hi = qs[32 * c + l] >> 4;
          if (five) {
            lo |= ((qh[l] >> (2 * c)) & 1) << 4;
            hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
          }
          q[64 * c + l] = static_cast<int8_t>(lo);
          q[64 * c + 32 + l] = static_cast<int8_t>(hi);
        }
      break;
    }
    case kQ6_K: {
      for (int n = 0; n < 2; ++n) {
        const uint8_t* ql = b + 64 * n;
        const uint8_t* qh = b + 128 + 32 * n;
        int8_t* y = q + 128 * n;
        for (int l = 0; l < 32; ++l) {
          y[l] = static_cast<int8_t>(((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32);
          y[l + 32] = static_cast<int8_t>(((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
          y[l + 64] = static_cast<int8_t>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
          y[l + 96] = static_cast<int8_t>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
      }
      break;
    }
    case kIQ4_XS: {
      const uint8_t* qs = b + 8;
      for (int j = 0; j < 8; ++j)
        for (int l = 0; l < 16; ++l) {
          q[32 * j + l] = kIq4Values[qs[16 * j + l] & 15];
          q[32 * j + l + 16] = kIq4Values[qs[16 * j + l] >> 4];
        }
      break;
    }
    default:
      break;
  }
}


// The integer parts of a 256-element unit's scales, per 16 elements: is (signed) and, for
// types with minimums, im; with the unit's d and dmin. Cheaper than DecodeScales: the
// integer-dot path never needs the float products.
template <int type>
inline void IntScales(const uint8_t* b, int8_t* is, uint8_t* im, float* d, float* dmin) {
  if constexpr (type == kQ2_K) {
    for (int i = 0; i < 16; ++i) {
      is[i] = static_cast<int8_t>(b[i] & 15);
      im[i] = b[i] >> 4;
    }
    *d = LOWBIT_GGUF_HALF(b + 80);
    *dmin = LOWBIT_GGUF_HALF(b + 82);
  } else if constexpr (type == kQ3_K) {
    int sc[16];
    Q3Scales(b + 96, sc);
    for (int i = 0; i < 16; ++i) is[i] = static_cast<int8_t>(sc[i] - 32);
    *d = LOWBIT_GGUF_HALF(b + 108);
  } else if constexpr (type == kQ4_K || type == kQ5_K) {
    // The 12 bytes as 3 words: scales 0..3 and mins 0..3 in their low 6 bits; the upper
    // ones' low 4 bits in word 2 and high 2 bits in the top bits of words 0 and 1.
    uint32_t w[3];
    std::memcpy(w, b + 4, 12);
    const uint32_t lo6 = 0x3f3f3f3fu, lo4 = 0x0f0f0f0fu, lo2 = 0x03030303u;
    const uint32_t sc[2] = {w[0] & lo6, (w[2] & lo4) | (((w[0] >> 6) & lo2) << 4)};
    const uint32_t mn[2] = {w[1] & lo6, ((w[2] >> 4) & lo4) | (((w[1] >> 6) & lo2) << 4)};
    for (int j = 0; j < 8; ++j) {
      const int s = (sc[j / 4] >> (8 * (j % 4))) & 0xff, m = (mn[j / 4] >> (8 * (j % 4))) & 0xff;
      is[2 * j] = is[2 * j + 1] = static_cast<int8_t>(s);
      im[2 * j] = im[2 * j + 1] = static_cast<uint8_t>(m);
    }
    *d = LOWBIT_GGUF_HALF(b);
    *dmin = LOWBIT_GGUF_HALF(b + 2);
  } else if constexpr (type == kQ6_K) {
    std::memcpy(is, b + 192, 16);
    *d = LOWBIT_GGUF_HALF(b + 208);
  } else if constexpr (type == kIQ4_XS) {
    uint16_t sh;
    std::memcpy(&sh, b + 2, 2);
    for (int j = 0; j < 8; ++j) {
      const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4);
      is[2 * j] = is[2 * j + 1] = static_cast<int8_t>(ls - 32);
    }
    *d = LOWBIT_GGUF_HALF(b);
  }
}
