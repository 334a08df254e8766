// Portable vocabulary for kernels_impl.h: plain 16-lane arrays the compiler may vectorize
// with whatever the baseline target offers. Used on non-x86 hosts and as the reference ISA.

// mr, np, mr_wide, fmr, fnp, qmr, qnp, lut_nibbles (TileShape in common.h).
constexpr TileShape kTile{2, 1, 2, 2, 1, 2, 1, false};

// 16 lanes of T, the stand-in for a vector register (V: float, VI: int32).
template <typename T>
struct Lanes {
  T v[16];
};
template <typename T>
static inline Lanes<T> lanes_fill(T x) {
  Lanes<T> r;
  for (int i = 0; i < 16; ++i) r.v[i] = x;
  return r;
}
template <typename T>
static inline Lanes<T> lanes_load(const T* p) {
  Lanes<T> r;
  for (int i = 0; i < 16; ++i) r.v[i] = p[i];
  return r;
}
template <typename T>
static inline void lanes_store(T* p, const Lanes<T>& a) {
  for (int i = 0; i < 16; ++i) p[i] = a.v[i];
}

using V = Lanes<float>;
static inline V vzero() { return lanes_fill(0.0f); }
static inline V vload(const float* p) { return lanes_load(p); }
static inline void vstore(float* p, const V& a) { lanes_store(p, a); }
static inline V vbcast(float x) { return lanes_fill(x); }
static inline V vadd(const V& a, const V& b) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] + b.v[i];
  return r;
}
static inline V vsub(const V& a, const V& b) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] - b.v[i];
  return r;
}
static inline V vmul(const V& a, const V& b) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i];
  return r;
}
// Unfused on purpose: baseline x86-64 has no FMA and std::fma would be a library call.
static inline V vfmadd(const V& a, const V& b, const V& c) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i];
  return r;
}
static inline V vfnmadd(const V& a, const V& b, const V& c) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = c.v[i] - a.v[i] * b.v[i];
  return r;
}

static inline V deq_s8(const uint8_t* p) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(static_cast<int8_t>(p[i]));
  return r;
}
static inline void deq_nib(const uint8_t* p, V& lo, V& hi) {
  for (int i = 0; i < 16; ++i) {
    lo.v[i] = static_cast<float>(p[i] & 15);
    hi.v[i] = static_cast<float>(p[i] >> 4);
  }
}

struct Lut {
  float t[16];
};
static inline Lut make_lut(const float* t16) {
  Lut l;
  for (int i = 0; i < 16; ++i) l.t[i] = t16[i];
  return l;
}
static inline void deq_lut(const uint8_t* p, const Lut& l, V& lo, V& hi) {
  for (int i = 0; i < 16; ++i) {
    lo.v[i] = l.t[p[i] & 15];
    hi.v[i] = l.t[p[i] >> 4];
  }
}

// e4m3fn value / 256, matching the vector ISAs (which get that factor from the f16 trick).
static inline float fp8_div256(uint8_t b) {
  const int e = (b >> 3) & 15;
  const int m = b & 7;
  const float mag = e ? std::ldexp(1.0f + m / 8.0f, e - 7 - 8) : std::ldexp(m / 8.0f, -6 - 8);
  return (b & 0x80) ? -mag : mag;
}
struct Fp8Table {
  float t[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) t[i] = fp8_div256(static_cast<uint8_t>(i));
  }
};
static inline V deq_fp8(const uint8_t* p) {
  static const Fp8Table table;
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = table.t[p[i]];
  return r;
}

using VI = Lanes<int32_t>;
static inline VI izero() { return lanes_fill(int32_t{0}); }
static inline VI iload(const int32_t* p) { return lanes_load(p); }
static inline void istore(int32_t* p, const VI& a) { lanes_store(p, a); }

constexpr int kActWords = 1;
struct WQ {
  const int8_t* p;
};
static inline WQ wq_load(const int8_t* p) { return WQ{p}; }
static inline VI idot(VI acc, const WQ& w, const uint32_t* x) {
  const uint32_t a = x[0];
  const int32_t a0 = a & 255, a1 = (a >> 8) & 255, a2 = (a >> 16) & 255, a3 = a >> 24;
  for (int i = 0; i < 16; ++i) {
    const int8_t* c = w.p + 4 * i;
    acc.v[i] += a0 * c[0] + a1 * c[1] + a2 * c[2] + a3 * c[3];
  }
  return acc;
}
