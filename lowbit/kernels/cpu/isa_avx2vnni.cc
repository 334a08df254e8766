// AVX2 with AVX-VNNI instantiation of the kernel tiles.
#include "common.h"

#if defined(__x86_64__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,bmi,bmi2,avxvnni"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,avxvnni")
#endif
#define LOWBIT_VNNI 1
namespace lowbit {
namespace isa_avx2vnni {
#include "simd_avx2.h"
#include "kernels_impl.h"
}  // namespace isa_avx2vnni
}  // namespace lowbit
#undef LOWBIT_VNNI
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace lowbit {
const IsaKernels* IsaAvx2Vnni() {
  static const IsaKernels table{"avx2vnni", isa_avx2vnni::kActWords, isa_avx2vnni::kQMR, isa_avx2vnni::kFMR, isa_avx2vnni::wo_run, isa_avx2vnni::q8_run, 0, nullptr, isa_avx2vnni::w4_run, isa_avx2vnni::kQMR, isa_avx2vnni::wo_dequant,
                                isa_avx2vnni::wo_q8, isa_avx2vnni::quantize_groups, isa_avx2vnni::wo_q8_kind};
  return &table;
}
}  // namespace lowbit

#else  // not x86-64: this ISA does not exist here.

namespace lowbit {
const IsaKernels* IsaAvx2Vnni() { return nullptr; }
}  // namespace lowbit

#endif
