// One ISA's copy of the decode-attention chunk (see attention.cc). Included, without include
// guard, inside a namespace that defines `Ops` (its vector type and operations) with that
// ISA's target pragma active, so every function here compiles for the ISA and the intrinsics
// inline. `Ops` provides: V (a native vector of kLanes floats), VE / IE (the same width as GCC
// vector-extension float / int32 types, for ExpNonPositiveN), kAccRegs (vectors of running
// sums that fit in registers beside the operands), Zero, Load (kLanes floats, or kLanes Half /
// BHalf cache elements widened), Store, Bcast, Fma, Add, Sum (one vector's horizontal sum) and
// Fold (8 vectors' horizontal sums as one __m256).

// The 8 horizontal sums of a[0..7] as one vector (lane u = sum of a[u]'s lanes).
inline __m256 Sum8x8(const __m256* a) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // h0 = [sums of a0..a3 over lanes 0-3 | the same over lanes 4-7], h1 likewise for a4..a7.
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

inline float Sum8(__m256 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// acc[i][L c0 .. L (c0 + B)) = sum over slots t of w[i][t] * v[t0 + t] (same columns) for GB
// queries (w: query i at w + i * stride): each value row is loaded once for all GB queries.
template <int DV, int B, int GB, typename E>
inline void WeightedValuesSimd(const float* w, int64_t stride, const E* v, int64_t t0,
                               int64_t n, int c0, float* acc) {
  using V = typename Ops::V;
  constexpr int64_t d = Ops::kLanes * DV;
  V a[GB][B];
  for (int i = 0; i < GB; ++i)
    for (int c = 0; c < B; ++c) a[i][c] = Ops::Zero();
  for (int64_t t = 0; t < n; ++t) {
    const E* vr = v + (t0 + t) * d + Ops::kLanes * c0;
    V vv[B];
    for (int c = 0; c < B; ++c) vv[c] = Ops::Load(vr + Ops::kLanes * c);
    for (int i = 0; i < GB; ++i) {
      const V p = Ops::Bcast(w + i * stride + t);
      for (int c = 0; c < B; ++c) a[i][c] = Ops::Fma(p, vv[c], a[i][c]);
    }
  }
  for (int i = 0; i < GB; ++i)
    for (int c = 0; c < B; ++c) Ops::Store(acc + i * d + Ops::kLanes * (c0 + c), a[i][c]);
}

// The chunk (AttendChunkVec's contract) with DV = d / kLanes vectors a row. Every product is
// an FMA (the build's fp-contract=off keeps GCC from fusing the generic code's). Scores: 8
// slots at a time, one chain a slot (8 independent chains hide the FMA latency), joined by
// Fold; the first query's pass prefetches keys kPrefetchSlots ahead and the values it will
// weigh. Values: up to kAccRegs vectors of sums a pass, as many queries as fit sharing each
// loaded value row.
// E: the cache's element (float, or Half / BHalf widened as they are loaded).
template <int DV, typename E>
void AttendChunkSimd(const float* q, int64_t g, const E* k, const E* v, int64_t t0,
                     int64_t t1, float* scores, float* m, float* l, float* acc, float cap) {
  using V = typename Ops::V;
  using VE = typename Ops::VE;
  constexpr int L = Ops::kLanes;
  constexpr int64_t d = L * DV;
  const int64_t n = t1 - t0;
  const int64_t stride = ScoreStride(d, n);  // whole 16-float vectors
  for (int64_t i = 0; i < g; ++i) {
    float* row = scores + i * stride;
    const float* qi = q + i * d;
    if (k != nullptr) {
      int64_t t = 0;
      for (; t + 8 <= n; t += 8) {
        const E* kr = k + (t0 + t) * d;
        if (i == 0) {
          const char* ahead = reinterpret_cast<const char*>(kr + kPrefetchSlots * d);
          const char* values = reinterpret_cast<const char*>(v + (t0 + t) * d);
          for (int64_t b = 0; b < 8 * d * int64_t{sizeof(E)}; b += 64) {
            _mm_prefetch(ahead + b, _MM_HINT_T0);
            _mm_prefetch(values + b, _MM_HINT_T1);
          }
        }
        V a[8];
        for (int u = 0; u < 8; ++u) a[u] = Ops::Zero();
        for (int c = 0; c < DV; ++c) {
          const V qc = Ops::Load(qi + L * c);
          for (int u = 0; u < 8; ++u) a[u] = Ops::Fma(qc, Ops::Load(kr + u * d + L * c), a[u]);
        }
        _mm256_storeu_ps(row + t, Ops::Fold(a));
      }
      for (; t < n; ++t) {
        const E* kr = k + (t0 + t) * d;
        V a = Ops::Zero();
        for (int c = 0; c < DV; ++c)
          a = Ops::Fma(Ops::Load(qi + L * c), Ops::Load(kr + L * c), a);
        row[t] = Ops::Sum(a);
      }
    }
    SoftCap(row, n, cap);
    float mx = row[0];
    for (int64_t t = 1; t < n; ++t) mx = row[t] > mx ? row[t] : mx;
    // Pad to whole vectors with weight 0 (exp clamps to exp(-87); zeroed below).
    for (int64_t t = n; t < stride; ++t) row[t] = mx - 1000.0f;
    const VE mv = VE{} + mx;
    for (int64_t t = 0; t < stride; t += L) {
      VE x;
      std::memcpy(&x, row + t, sizeof(x));
      x = ExpNonPositiveN<VE, typename Ops::IE>(x - mv);
      std::memcpy(row + t, &x, sizeof(x));
    }
    for (int64_t t = n; t < stride; ++t) row[t] = 0.0f;
    V sum = Ops::Zero();
    for (int64_t t = 0; t < stride; t += L) sum = Ops::Add(sum, Ops::Load(row + t));
    m[i] = mx;
    l[i] = Ops::Sum(sum);
  }
  constexpr int B = DV < Ops::kAccRegs ? DV : Ops::kAccRegs;  // vectors of sums a pass
  constexpr int GB = Ops::kAccRegs / B < 4 ? Ops::kAccRegs / B : 4;  // queries a pass
  for (int64_t i = 0; i < g; i += GB) {
    const float* w = scores + i * stride;
    float* out = acc + i * d;
    for (int c0 = 0; c0 < DV; c0 += B) {
      switch (std::min<int64_t>(GB, g - i)) {
        case 1:
          WeightedValuesSimd<DV, B, 1, E>(w, stride, v, t0, n, c0, out);
          break;
        case 2:
          WeightedValuesSimd<DV, B, (GB >= 2 ? 2 : 1), E>(w, stride, v, t0, n, c0, out);
          break;
        case 3:
          WeightedValuesSimd<DV, B, (GB >= 3 ? 3 : 1), E>(w, stride, v, t0, n, c0, out);
          break;
        default:
          WeightedValuesSimd<DV, B, GB, E>(w, stride, v, t0, n, c0, out);
          break;
      }
    }
  }
}
