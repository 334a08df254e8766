// XLA FFI handlers: argument checking, activation packing, work splitting over the intra-op
// pool and the epilogues. The inner loops live in the per-ISA tables (dispatch.h).
#include "ffi_handlers.h"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "common.h"
#include "dispatch.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace lowbit {

int64_t NumWorkers(ffi::ThreadPool& pool) {
  static const int64_t cap = [] {
    int64_t c = std::max<int64_t>(1, std::thread::hardware_concurrency());
    if (const char* env = std::getenv("LOWBIT_NUM_THREADS")) {
      const int64_t v = std::atoll(env);
      if (v > 0) c = std::min(c, v);
    }
    return c;
  }();
  return std::max<int64_t>(1, std::min(cap, pool.num_threads()));
}

namespace {

// Row blocks for large M: small enough that a block of packed activations stays in L2, and
// a multiple of every ISA's row tile (AVX2 float GEMM 6, AVX-512 8, AMX 16), on which the
// kernels index their packed activations.
constexpr int64_t kRowBlock = 192;
static_assert(kRowBlock % 6 == 0 && kRowBlock % 16 == 0);
// Panel chunks per worker (see SplitWork).
constexpr int64_t kChunksPerWorker = 4;
// Below this many multiply-adds the fork/join costs more than it saves.
constexpr int64_t kMinParallelMacs = int64_t{1} << 18;

// Row m of x [M, K] (float32 or bfloat16) as float32 into dst[i * stride], i < k.
inline void LoadRow(const void* x, bool bf16, int64_t m, int64_t k, float* dst,
                    int64_t stride = 1) {
  if (bf16) {
    const uint16_t* src = static_cast<const uint16_t*>(x) + m * k;
    for (int64_t i = 0; i < k; ++i) dst[i * stride] = Bf16ToF32(src[i]);
  } else if (stride == 1) {
    std::memcpy(dst, static_cast<const float*>(x) + m * k, sizeof(float) * k);
  } else {
    const float* src = static_cast<const float*>(x) + m * k;
    for (int64_t i = 0; i < k; ++i) dst[i * stride] = src[i];
  }
}

inline void StoreRow(void* y, bool bf16, int64_t m, int64_t ldy, int64_t n0, const float* v,
                     int64_t count) {
  if (bf16) {
    uint16_t* dst = static_cast<uint16_t*>(y) + m * ldy + n0;
    for (int64_t i = 0; i < count; ++i) dst[i] = F32ToBf16(v[i]);
  } else {
    std::memcpy(static_cast<float*>(y) + m * ldy + n0, v, sizeof(float) * count);
  }
}

bool IsFloat(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; }

ffi::Error Invalid(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "lowbit: " + msg);
}

// A unit of work: rows [m0, m1) x panels [p0, p1).
struct Task {
  int64_t m0, m1, p0, p1;
};

// Splits M x P into tasks: contiguous panel ranges (each one weight stream), times row
// blocks when M is large so the activation block stays cache resident. A few chunks per
// worker, claimed dynamically, keep the split balanced when a worker is descheduled or starts
// late (a busy machine), at little cost to stream length.
std::vector<Task> SplitWork(int64_t m, int64_t panels, int64_t workers, int64_t pair) {
  std::vector<Task> tasks;
  const int64_t row_block = m <= kSmallM ? m : kRowBlock;
  const int64_t per_worker = workers > 1 ? kChunksPerWorker : 1;
  int64_t chunks = std::min<int64_t>(workers * per_worker, (panels + pair - 1) / pair);
  if (panels < 2 * workers * per_worker && m > kSmallM) chunks = 1;  // few columns: split rows
  for (int64_t r = 0; r < m; r += row_block) {
    for (int64_t c = 0; c < chunks; ++c) {
      int64_t p0 = panels * c / chunks, p1 = panels * (c + 1) / chunks;
      p0 = std::min(panels, (p0 + pair - 1) / pair * pair);
      p1 = c + 1 == chunks ? panels : std::min(panels, (p1 + pair - 1) / pair * pair);
      if (p0 < p1) tasks.push_back(Task{r, std::min(m, r + row_block), p0, p1});
    }
  }
  return tasks;
}

int64_t WorkersFor(ffi::ThreadPool& pool, int64_t m, int64_t k, int64_t n) {
  return m * k * n < kMinParallelMacs ? 1 : NumWorkers(pool);
}

// Runs `kernel` (an IsaKernels entry) over the tasks of M x panels into a scratch block
// [rows][ldc] of T each, then hands each of its rows to `store(r, row, n0, cols, f)`: output
// row r, its valid columns [n0, n0 + cols), and for integer blocks `f`, a float row of
// scratch for the conversion. (Tiles writing the output in place, rows n floats apart, ran
// slower: at N = 4096 a tile's rows fall in the same L1 sets.)
template <typename Args, typename T, typename Store>
void RunTasks(ffi::ThreadPool& pool, int64_t workers, int64_t m, int64_t panels, int64_t n,
              void (*kernel)(const Args&, int64_t, int64_t, int64_t, int64_t, T*, int64_t),
              const Args& a, Store&& store) {
  const std::vector<Task> tasks = SplitWork(m, panels, workers, 2);
  ParallelFor(pool, workers, static_cast<int64_t>(tasks.size()), [&](int64_t i) {
    const Task& t = tasks[i];
    const int64_t ldc = (t.p1 - t.p0) * kPanel;
    // Every kernel writes its whole block before reading it: no zeroing.
    std::unique_ptr<T[]> c(new T[(t.m1 - t.m0) * ldc]);
    kernel(a, t.m0, t.m1, t.p0, t.p1, c.get(), ldc);
    const int64_t n0 = t.p0 * kPanel, cols = std::min(n, t.p1 * kPanel) - n0;
    std::vector<float> f(std::is_same_v<T, float> ? 0 : cols);
    for (int64_t r = t.m0; r < t.m1; ++r)
      store(r, c.get() + (r - t.m0) * ldc, n0, cols, f.data());
  });
}

// Checks a weight-only blob [P, G * group_bytes] against N columns and group size gs.
ffi::Error WoBlobShape(const KindInfo& info, const ffi::Buffer<ffi::U8>& blob, int64_t n,
                       int64_t gs, int64_t* group_bytes, int64_t* panels, int64_t* groups) {
  if (gs <= 0 || gs % 2 != 0) return Invalid("group size must be positive and even");
  *group_bytes = kGroupHeader + gs / 2 * info.pair_bytes;
  *panels = (n + kPanel - 1) / kPanel;
  const auto bd = blob.dimensions();
  if (bd.size() != 2 || bd[0] != *panels || bd[1] % *group_bytes != 0)
    return Invalid("packed weight has the wrong shape for N and the group size");
  *groups = bd[1] / *group_bytes;
  return ffi::Error::Success();
}

// The weight fields of WoArgs for a blob checked by WoBlobShape (activation fields unset).
WoArgs WoWeightArgs(int64_t kind, int64_t gs, int64_t groups, int64_t group_bytes,
                    const ffi::Buffer<ffi::U8>& blob, const ffi::Buffer<ffi::F32>& lut) {
  WoArgs a;
  a.kind = static_cast<int>(kind);
  a.kp = groups * gs;
  a.gs = gs;
  a.groups = groups;
  a.panel_bytes = blob.dimensions()[1];
  a.group_bytes = group_bytes;
  a.blob = blob.typed_data();
  a.lut = lut.typed_data();
  return a;
}

ffi::Error WoLinearImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> blob,
                        ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::F32> lut,
                        ffi::Result<ffi::AnyBuffer> y, int64_t kind, int64_t k, int64_t n,
                        int64_t gs, int64_t act_q8) {
  const KindInfo* info = FindKind(kind);
  if (info == nullptr) return Invalid("unknown weight kind " + std::to_string(kind));
  if (!IsFloat(x.element_type()) || !IsFloat(y->element_type()))
    return Invalid("x and the output must be float32 or bfloat16");
  const auto xd = x.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || xd[1] != k) return Invalid("x must be [M, K] with K = " + std::to_string(k));
  int64_t group_bytes, panels, groups;
  if (ffi::Error e = WoBlobShape(*info, blob, n, gs, &group_bytes, &panels, &groups); e.failure())
    return e;
  const int64_t kp = groups * gs;
  if (kp < k || kp - k >= gs) return Invalid("packed weight does not match K");
  const int64_t m = xd[0];
  if (yd.size() != 2 || yd[0] != m || yd[1] != n) return Invalid("output must be [M, N]");
  if (bias.element_count() != static_cast<size_t>(n)) return Invalid("bias must be [N]");
  if (lut.element_count() != 16) return Invalid("codebook must have 16 entries");
  if (m == 0 || n == 0) return ffi::Error::Success();

  const bool xbf16 = x.element_type() == ffi::DataType::BF16;
  const bool ybf16 = y->element_type() == ffi::DataType::BF16;
  const int64_t workers = WorkersFor(pool, m, kp, panels * kPanel);

  const IsaKernels* isa = ActiveIsa();
  // Activations as f32, zero-padded to Kp, with per-group sums for the zero-point term. For
  // the large-M path also k-major in row tiles, built once here: packed per task instead,
  // the transposing copy was repeated for every panel chunk and cost up to a third of a
  // prefill-sized call.
  const int64_t fr = isa->gemm_rows;
  // Only 4-bit integer kinds subtract a zero-point term (int4 with its fixed 8 where an ISA
  // decodes nibbles arithmetically); the serial per-group sums cost ~5% of a call otherwise.
  // int8 activations, one scale per row and weight group (as llama.cpp's Q8 blocks): asked
  // for, whole k-quads per group, and an ISA with the path for this kind (elsewhere the float
  // path serves the call), at any M: its tiles of kQ8Rows rows share each unpacked k-quad,
  // and at 512 rows it ran 2-2.5x the float path. Its zero-point term comes with the codes'
  // sums.
  const bool q8 = act_q8 != 0 && gs % 4 == 0 && isa->wo_q8 != nullptr &&
                  isa->wo_q8_kind(static_cast<int>(kind));
  // Large M on the float path: every tile reads the k-major copy only (`wo` dequantizes the
  // weight exactly there, so no zero-point sums either); the row-major one is not made.
  const bool blocked = m > kSmallM && !q8;
  const bool zero_points = info->zero_point != kNoZeroPoint && !q8 && !blocked;
  std::vector<float> xp(blocked ? 0 : m * kp), sumx(zero_points ? m * groups : 0);
  std::vector<float> xt(blocked ? (m + fr - 1) / fr * fr * kp : 0, 0.0f);
  std::vector<int8_t> xq(q8 ? m * kp : 0);
  std::vector<float> xq_scale(q8 ? m * groups : 0), xq_sum(q8 ? m * groups : 0);
  ParallelFor(pool, m >= 64 ? workers : 1, m, [&](int64_t r) {
    if (blocked) {
      LoadRow(x.untyped_data(), xbf16, r, k, xt.data() + (r / fr) * kp * fr + r % fr, fr);
      return;
    }
    float* row = xp.data() + r * kp;
    LoadRow(x.untyped_data(), xbf16, r, k, row);
    std::fill(row + k, row + kp, 0.0f);
    if (zero_points) {
      for (int64_t g = 0; g < groups; ++g) {
        float s = 0.0f;
        for (int64_t i = 0; i < gs; ++i) s += row[g * gs + i];
        sumx[r * groups + g] = s;
      }
    }
    if (q8)
      isa->quantize_groups(row, kp, gs, xq.data() + r * kp, xq_scale.data() + r * groups,
                           xq_sum.data() + r * groups);
  });

  // Small M on the float path: the tiles' k-major copy, once for every task (see WoArgs::xs);
  // one row a tile is x itself.
  const int64_t xr = blocked || q8 ? 0 : isa->wo_x_rows(m);
  std::vector<float> xs(xr > 1 ? (m + xr - 1) / xr * xr * kp : 0, 0.0f);
  for (int64_t r = 0; r < m && xr > 1; ++r) {
    const float* src = xp.data() + r * kp;
    float* dst = xs.data() + (r / xr) * kp * xr + r % xr;
    for (int64_t i = 0; i < kp; ++i) dst[i * xr] = src[i];
  }

  WoArgs a = WoWeightArgs(kind, gs, groups, group_bytes, blob, lut);
  a.xt = xt.empty() ? nullptr : xt.data();
  a.xs = xr > 1 ? xs.data() : xp.data();
  a.xs_rows = xr;
  a.sumx = sumx.data();
  a.xq = xq.data();
  a.xq_scale = xq_scale.data();
  a.xq_sum = xq_sum.data();
  const float* b = bias.typed_data();
  void* out = y->untyped_data();
  RunTasks(pool, workers, m, panels, n, q8 ? isa->wo_q8 : isa->wo, a,
           [&](int64_t r, float* row, int64_t n0, int64_t cols, float*) {
             for (int64_t j = 0; j < cols; ++j) row[j] += b[n0 + j];
             StoreRow(out, ybf16, r, n, n0, row, cols);
           });
  return ffi::Error::Success();
}

// The dequantized weight [Kp, 16 P] float32 of a prepared weight-only layout, for a float
// GEMM outside (large M: XLA's GEMM is faster than the kernels' register-tiled one there).
ffi::Error WoDequantizeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> blob,
                            ffi::Buffer<ffi::F32> lut, ffi::ResultBuffer<ffi::F32> w,
                            int64_t kind, int64_t n, int64_t gs) {
  const KindInfo* info = FindKind(kind);
  if (info == nullptr) return Invalid("unknown weight kind " + std::to_string(kind));
  int64_t group_bytes, panels, groups;
  if (ffi::Error e = WoBlobShape(*info, blob, n, gs, &group_bytes, &panels, &groups); e.failure())
    return e;
  const auto wd = w->dimensions();
  if (wd.size() != 2 || wd[0] != groups * gs || wd[1] != panels * kPanel)
    return Invalid("dequantized weight must be [Kp, 16 P]");
  if (lut.element_count() != 16) return Invalid("codebook must have 16 entries");
  const WoArgs a = WoWeightArgs(kind, gs, groups, group_bytes, blob, lut);
  const IsaKernels* isa = ActiveIsa();
  float* out = w->typed_data();
  const int64_t ldo = panels * kPanel;
  const int64_t workers = a.kp * ldo < (int64_t{1} << 16) ? 1 : NumWorkers(pool);
  const int64_t chunks = std::min<int64_t>(panels, workers * kChunksPerWorker);
  ParallelFor(pool, workers, chunks, [&](int64_t c) {
    const int64_t p0 = panels * c / chunks, p1 = panels * (c + 1) / chunks;
    if (p1 > p0) isa->wo_dequant(a, p0, p1, out, ldo);
  });
  return ffi::Error::Success();
}

// Quads per packed activation row: kq, rounded up to whole blocks for blocked packing.
int64_t PackedQuads(int64_t kq, const IsaKernels& isa) {
  const int64_t tk = isa.act_tile_k;
  return tk ? (kq + tk - 1) / tk * tk : kq;
}

// Packs u8 activation codes (q + 128) of row m into the ISA's layout: tiles of `rows` rows,
// [M / rows][kq][rows][act_words] u32, so a kernel tile reads one contiguous stream; or
// blocks of rows x act_tile_k quads (see IsaKernels).
void PackActRow(const uint8_t* u, int64_t m, int64_t kq, const IsaKernels& isa, uint32_t* xa) {
  const int64_t rows = isa.act_rows, aw = isa.act_words;
  auto word = [u](int64_t q) {
    return static_cast<uint32_t>(u[4 * q]) | (static_cast<uint32_t>(u[4 * q + 1]) << 8) |
           (static_cast<uint32_t>(u[4 * q + 2]) << 16) |
           (static_cast<uint32_t>(u[4 * q + 3]) << 24);
  };
  if (const int64_t tk = isa.act_tile_k) {
    uint32_t* dst = xa + (m / rows) * PackedQuads(kq, isa) * rows + (m % rows) * tk;
    for (int64_t q = 0; q < kq; ++q) dst[(q / tk) * rows * tk + q % tk] = word(q);
    return;
  }
  uint32_t* dst = xa + (m / rows) * kq * rows * aw + (m % rows) * aw;
  const int64_t step = rows * aw;
  for (int64_t q = 0; q < kq; ++q) {
    const uint32_t b0 = u[4 * q], b1 = u[4 * q + 1], b2 = u[4 * q + 2], b3 = u[4 * q + 3];
    if (aw == 1) {
      dst[q * step] = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24);
    } else {
      dst[q * step] = b0 | (b2 << 16);
      dst[q * step + 1] = b1 | (b3 << 16);
    }
  }
}

// Dynamic per-token int8: *scale = absmax / 127 (1 for a zero row) and u[i] = q + 128 with
// q = round_half_even(clamp(row[i] / scale, -127, 127)), for i < k (u beyond k untouched).
void QuantizeRow(const IsaKernels& isa, const float* row, int64_t k, uint8_t* u, float* scale) {
  if (isa.quantize_row != nullptr) {
    isa.quantize_row(row, k, u, scale);
    return;
  }
  float amax = 0.0f;
  for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(row[i]));
  const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
  *scale = s;
  for (int64_t i = 0; i < k; ++i) {
    // Adding and removing 1.5 * 2^23 rounds half to even for |v| < 2^22.
    float v = row[i] / s;
    v = std::min(127.0f, std::max(-127.0f, v));
    v = (v + 12582912.0f) - 12582912.0f;
    u[i] = static_cast<uint8_t>(static_cast<int32_t>(v) + 128);
  }
}

enum class Q8Mode { kFloatIn, kQuantIn, kInt32Out };

struct Q8Inputs {
  const void* x = nullptr;        // [M, K] f32/bf16 (kFloatIn) or int8 (otherwise)
  bool xbf16 = false;
  const float* xscale = nullptr;  // [M] (kQuantIn)
  const int8_t* w = nullptr;
  const int32_t* colsum = nullptr;
  const float* wscale = nullptr;
  const float* bias = nullptr;
  void* out = nullptr;
  bool ybf16 = false;
};

ffi::Error Q8Run(ffi::ThreadPool& pool, Q8Mode mode, const Q8Inputs& in, int64_t m, int64_t k,
                 int64_t n) {
  if (m == 0 || n == 0) return ffi::Error::Success();
  const int64_t kq = (k + 3) / 4;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const IsaKernels* isa = ActiveIsa();
  const int aw = isa->act_words;
  const int64_t workers = WorkersFor(pool, m, 4 * kq, panels * kPanel);

  // Whole tiles of rows, and at least 32 (the AMX path loads 32 rows even when fewer are
  // valid).
  const int64_t row_pad = std::max<int64_t>(isa->act_rows, 32);
  const int64_t padded_m = (m + row_pad - 1) / row_pad * row_pad;
  std::vector<uint32_t> xa(padded_m * PackedQuads(kq, *isa) * aw);
  std::vector<float> xs(mode == Q8Mode::kFloatIn ? m : 0);
  ParallelFor(pool, m >= 64 ? workers : 1, m, [&](int64_t r) {
    std::vector<uint8_t> u(4 * kq, 128);
    if (mode == Q8Mode::kFloatIn) {
      std::vector<float> row(k);
      LoadRow(in.x, in.xbf16, r, k, row.data());
      QuantizeRow(*isa, row.data(), k, u.data(), &xs[r]);
    } else {
      const int8_t* src = static_cast<const int8_t*>(in.x) + r * k;
      for (int64_t i = 0; i < k; ++i) u[i] = static_cast<uint8_t>(src[i] + 128);
    }
    PackActRow(u.data(), r, kq, *isa, xa.data());
  });

  Q8Args a;
  a.kq = kq;
  a.xa = xa.data();
  a.w = in.w;
  const float* row_scale = mode == Q8Mode::kFloatIn ? xs.data() : in.xscale;

  RunTasks(pool, workers, m, panels, n, isa->q8, a,
           [&](int64_t r, int32_t* row, int64_t n0, int64_t cols, float* f) {
             // Activations went in as q + 128: remove 128 * sum_k w[k, n].
             for (int64_t j = 0; j < cols; ++j)
               row[j] = static_cast<int32_t>(static_cast<uint32_t>(row[j]) -
                                             128u * static_cast<uint32_t>(in.colsum[n0 + j]));
             if (mode == Q8Mode::kInt32Out) {
               std::memcpy(static_cast<int32_t*>(in.out) + r * n + n0, row,
                           sizeof(int32_t) * cols);
               return;
             }
             const float xsr = row_scale[r];
             for (int64_t j = 0; j < cols; ++j)
               f[j] = static_cast<float>(row[j]) * xsr * in.wscale[n0 + j] + in.bias[n0 + j];
             StoreRow(in.out, in.ybf16, r, n, n0, f, cols);
           });
  return ffi::Error::Success();
}

ffi::Error W4A8LinearImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> blob,
                          ffi::Buffer<ffi::F32> bias, ffi::Result<ffi::AnyBuffer> y, int64_t k,
                          int64_t n, int64_t gs) {
  if (!IsFloat(x.element_type()) || !IsFloat(y->element_type()))
    return Invalid("x and the output must be float32 or bfloat16");
  const auto xd = x.dimensions();
  const auto bd = blob.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || xd[1] != k) return Invalid("x must be [M, K] with K = " + std::to_string(k));
  if (gs <= 0 || gs % 8 != 0) return Invalid("w4a8 group size must be a positive multiple of 8");
  const int64_t group_bytes = kGroupHeader + gs * 8;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  if (bd.size() != 2 || bd[0] != panels || bd[1] % group_bytes != 0)
    return Invalid("packed w4a8 weight has the wrong shape for K, N and the group size");
  const int64_t groups = bd[1] / group_bytes;
  const int64_t kp = groups * gs;
  if (kp < k || kp - k >= gs) return Invalid("packed w4a8 weight does not match K");
  const int64_t m = xd[0];
  if (yd.size() != 2 || yd[0] != m || yd[1] != n) return Invalid("output must be [M, N]");
  if (bias.element_count() != static_cast<size_t>(n)) return Invalid("bias must be [N]");
  if (m == 0 || n == 0) return ffi::Error::Success();

  const IsaKernels* isa = ActiveIsa();
  IsaKernels pack = *isa;  // the w4 tiles read the plain tile layout
  pack.act_rows = isa->w4_act_rows;
  pack.act_tile_k = 0;
  const int64_t kq = kp / 4, aw = pack.act_words;
  const int64_t workers = WorkersFor(pool, m, kp, panels * kPanel);
  const bool xbf16 = x.element_type() == ffi::DataType::BF16;
  const int64_t padded_m = (m + pack.act_rows - 1) / pack.act_rows * pack.act_rows;
  std::vector<uint32_t> xa(padded_m * kq * aw);
  std::vector<float> xs(m);
  ParallelFor(pool, m >= 64 ? workers : 1, m, [&](int64_t r) {
    std::vector<uint8_t> u(kp, 128);
    std::vector<float> row(k);
    LoadRow(x.untyped_data(), xbf16, r, k, row.data());
    QuantizeRow(*isa, row.data(), k, u.data(), &xs[r]);
    PackActRow(u.data(), r, kq, pack, xa.data());
  });

  W4Args a;
  a.gs = gs;
  a.groups = groups;
  a.panel_bytes = bd[1];
  a.group_bytes = group_bytes;
  a.xa = xa.data();
  a.blob = blob.typed_data();
  const float* b = bias.typed_data();
  void* out = y->untyped_data();
  const bool ybf16 = y->element_type() == ffi::DataType::BF16;
  RunTasks(pool, workers, m, panels, n, isa->w4, a,
           [&](int64_t r, float* row, int64_t n0, int64_t cols, float*) {
             for (int64_t j = 0; j < cols; ++j) row[j] = row[j] * xs[r] + b[n0 + j];
             StoreRow(out, ybf16, r, n, n0, row, cols);
           });
  return ffi::Error::Success();
}

ffi::Error CheckQ8Weight(const ffi::Buffer<ffi::S8>& w, const ffi::Buffer<ffi::S32>& colsum,
                         int64_t k, int64_t n) {
  const auto wd = w.dimensions();
  const int64_t panels = (n + kPanel - 1) / kPanel;
  if (wd.size() != 2 || wd[0] != panels || wd[1] != (k + 3) / 4 * 64)
    return Invalid("packed w8a8 weight has the wrong shape for K and N");
  if (colsum.element_count() != static_cast<size_t>(panels * kPanel))
    return Invalid("column sums must have one entry per padded column");
  return ffi::Error::Success();
}

// The float-output w8a8 calls after their activation checks: checks the weight, the output
// [m, N] and the weight scale and bias [N], fills their fields of `in` and runs.
ffi::Error Q8FloatOut(ffi::ThreadPool& pool, Q8Mode mode, Q8Inputs in,
                      const ffi::Buffer<ffi::S8>& w, const ffi::Buffer<ffi::S32>& colsum,
                      const ffi::Buffer<ffi::F32>& wscale, const ffi::Buffer<ffi::F32>& bias,
                      ffi::Result<ffi::AnyBuffer>& y, int64_t m, int64_t k, int64_t n) {
  if (ffi::Error e = CheckQ8Weight(w, colsum, k, n); e.failure()) return e;
  const auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != m || yd[1] != n) return Invalid("output must be [M, N]");
  if (bias.element_count() != static_cast<size_t>(n) ||
      wscale.element_count() != static_cast<size_t>(n))
    return Invalid("weight scale and bias must be [N]");
  in.w = w.typed_data();
  in.colsum = colsum.typed_data();
  in.wscale = wscale.typed_data();
  in.bias = bias.typed_data();
  in.out = y->untyped_data();
  in.ybf16 = y->element_type() == ffi::DataType::BF16;
  return Q8Run(pool, mode, in, m, k, n);
}

ffi::Error W8A8LinearImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S8> w,
                          ffi::Buffer<ffi::S32> colsum, ffi::Buffer<ffi::F32> wscale,
                          ffi::Buffer<ffi::F32> bias, ffi::Result<ffi::AnyBuffer> y, int64_t k,
                          int64_t n) {
  if (!IsFloat(x.element_type()) || !IsFloat(y->element_type()))
    return Invalid("x and the output must be float32 or bfloat16");
  const auto xd = x.dimensions();
  if (xd.size() != 2 || xd[1] != k) return Invalid("x must be [M, K] with K = " + std::to_string(k));
  Q8Inputs in;
  in.x = x.untyped_data();
  in.xbf16 = x.element_type() == ffi::DataType::BF16;
  return Q8FloatOut(pool, Q8Mode::kFloatIn, in, w, colsum, wscale, bias, y, xd[0], k, n);
}

ffi::Error W8A8LinearQImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> xq,
                           ffi::Buffer<ffi::F32> xscale, ffi::Buffer<ffi::S8> w,
                           ffi::Buffer<ffi::S32> colsum, ffi::Buffer<ffi::F32> wscale,
                           ffi::Buffer<ffi::F32> bias, ffi::Result<ffi::AnyBuffer> y, int64_t k,
                           int64_t n) {
  if (!IsFloat(y->element_type())) return Invalid("the output must be float32 or bfloat16");
  const auto xd = xq.dimensions();
  if (xd.size() != 2 || xd[1] != k) return Invalid("xq must be [M, K] with K = " + std::to_string(k));
  if (xscale.element_count() != static_cast<size_t>(xd[0])) return Invalid("x_scale must be [M]");
  Q8Inputs in;
  in.x = xq.typed_data();
  in.xscale = xscale.typed_data();
  return Q8FloatOut(pool, Q8Mode::kQuantIn, in, w, colsum, wscale, bias, y, xd[0], k, n);
}

ffi::Error W8A8Int32Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> xq, ffi::Buffer<ffi::S8> w,
                         ffi::Buffer<ffi::S32> colsum, ffi::Result<ffi::Buffer<ffi::S32>> y,
                         int64_t k, int64_t n) {
  const auto xd = xq.dimensions();
  if (xd.size() != 2 || xd[1] != k) return Invalid("xq must be [M, K] with K = " + std::to_string(k));
  if (ffi::Error e = CheckQ8Weight(w, colsum, k, n); e.failure()) return e;
  const auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != xd[0] || yd[1] != n) return Invalid("output must be [M, N]");
  Q8Inputs in;
  in.x = xq.typed_data();
  in.w = w.typed_data();
  in.colsum = colsum.typed_data();
  in.out = y->typed_data();
  return Q8Run(pool, Q8Mode::kInt32Out, in, xd[0], k, n);
}

}  // namespace
}  // namespace lowbit

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowbitWoLinear, lowbit::WoLinearImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("kind")
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("gs")
                                  .Attr<int64_t>("act_q8"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowbitW8A8Linear, lowbit::W8A8LinearImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowbitW8A8LinearQ, lowbit::W8A8LinearQImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowbitW8A8Int32, lowbit::W8A8Int32Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowbitWoDequantize, lowbit::WoDequantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("kind")
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("gs"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowbitW4A8Linear, lowbit::W4A8LinearImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("gs"));
