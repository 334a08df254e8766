// One x86-64 ISA's instantiation of the kernel tiles and its IsaKernels table; elsewhere its
// getter returns nullptr (the ISA does not exist there). Each isa_*.cc file defines these,
// then includes this header once:
//   LOWBIT_ISA_NS            namespace of the instantiation, e.g. isa_avx2
//   LOWBIT_ISA_NAME          the name the table reports, e.g. "avx2"
//   LOWBIT_ISA_TARGET        its target features, e.g. "avx2,fma,f16c,bmi,bmi2"
//   LOWBIT_ISA_SIMD          its SIMD header, e.g. "simd_avx2.h"
//   LOWBIT_ISA_GETTER        the table's getter, e.g. IsaAvx2
//   LOWBIT_ISA_QUANTIZE_ROW  its row quantizer (e.g. isa_avx512bw::quantize_row) or nullptr
// and LOWBIT_VNNI where the u8 x s8 dots use vpdpbusd.
#include "common.h"

#if defined(__x86_64__)
#include <immintrin.h>

LOWBIT_TARGET_PUSH(LOWBIT_ISA_TARGET)

namespace lowbit {
namespace LOWBIT_ISA_NS {
#include LOWBIT_ISA_SIMD
#include "kernels_impl.h"
}  // namespace LOWBIT_ISA_NS
}  // namespace lowbit

LOWBIT_TARGET_POP

namespace lowbit {
const IsaKernels* LOWBIT_ISA_GETTER() {
  namespace isa = LOWBIT_ISA_NS;
  static const IsaKernels table{LOWBIT_ISA_NAME, isa::kActWords, isa::kQMR, isa::kFMR, isa::wo_run, isa::q8_run, 0, LOWBIT_ISA_QUANTIZE_ROW,
                                isa::w4_run, isa::kQMR, isa::wo_dequant, isa::wo_q8, isa::quantize_groups, isa::wo_q8_kind,
                                isa::wo_x_rows};
  return &table;
}
}  // namespace lowbit

#else

namespace lowbit {
const IsaKernels* LOWBIT_ISA_GETTER() { return nullptr; }
}  // namespace lowbit

#endif
