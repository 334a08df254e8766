// AVX-512 F/BW/VL/DQ (no VNNI) instantiation of the kernel tiles.
#include "common.h"

#if defined(__x86_64__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2")
#endif

namespace lowbit {
namespace isa_avx512bw {
#include "simd_avx512.h"
#include "kernels_impl.h"
}  // namespace isa_avx512bw
}  // namespace lowbit

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace lowbit {
const IsaKernels* IsaAvx512Bw() {
  static const IsaKernels table{"avx512bw", isa_avx512bw::kActWords, isa_avx512bw::kQMR, isa_avx512bw::kFMR, isa_avx512bw::wo_run, isa_avx512bw::q8_run, 0, isa_avx512bw::quantize_row,
                                isa_avx512bw::w4_run, isa_avx512bw::kQMR, isa_avx512bw::wo_dequant,
                                isa_avx512bw::wo_q8, isa_avx512bw::quantize_groups,
                                isa_avx512bw::wo_q8_kind};
  return &table;
}
}  // namespace lowbit

#else  // not x86-64: this ISA does not exist here.

namespace lowbit {
const IsaKernels* IsaAvx512Bw() { return nullptr; }
}  // namespace lowbit

#endif
