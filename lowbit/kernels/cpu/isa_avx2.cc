// AVX2 + FMA + F16C instantiation of the kernel tiles.
#include "common.h"

#if defined(__x86_64__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,bmi,bmi2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")
#endif

namespace lowbit {
namespace isa_avx2 {
#include "simd_avx2.h"
#include "kernels_impl.h"
}  // namespace isa_avx2
}  // namespace lowbit

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace lowbit {
const IsaKernels* IsaAvx2() {
  static const IsaKernels table{"avx2", isa_avx2::kActWords, isa_avx2::kQMR, isa_avx2::kFMR, isa_avx2::wo_run, isa_avx2::q8_run, 0, nullptr, isa_avx2::w4_run, isa_avx2::kQMR, isa_avx2::wo_dequant,
                                isa_avx2::wo_q8, isa_avx2::quantize_groups, isa_avx2::wo_q8_kind};
  return &table;
}
}  // namespace lowbit

#else  // not x86-64: this ISA does not exist here.

namespace lowbit {
const IsaKernels* IsaAvx2() { return nullptr; }
}  // namespace lowbit

#endif
