// AVX-512 with VNNI (vpdpbusd) instantiation of the kernel tiles.
#include "common.h"

#if defined(__x86_64__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi,bmi2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi,bmi2")
#endif
#define LOWBIT_VNNI 1
namespace lowbit {
namespace isa_avx512vnni {
#include "simd_avx512.h"
#include "kernels_impl.h"
}  // namespace isa_avx512vnni
}  // namespace lowbit
#undef LOWBIT_VNNI
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace lowbit {
const IsaKernels* IsaAvx512Vnni() {
  static const IsaKernels table{"avx512vnni", isa_avx512vnni::kActWords, isa_avx512vnni::kQMR, isa_avx512vnni::kFMR, isa_avx512vnni::wo_run, isa_avx512vnni::q8_run, 0, isa_avx512vnni::quantize_row,
                                isa_avx512vnni::w4_run, isa_avx512vnni::kQMR, isa_avx512vnni::wo_dequant,
                                isa_avx512vnni::wo_q8, isa_avx512vnni::quantize_groups,
                                isa_avx512vnni::wo_q8_kind};
  return &table;
}
}  // namespace lowbit

#else  // not x86-64: this ISA does not exist here.

namespace lowbit {
const IsaKernels* IsaAvx512Vnni() { return nullptr; }
}  // namespace lowbit

#endif
