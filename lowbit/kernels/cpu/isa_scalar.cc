// Portable instantiation of the kernel tiles (baseline target flags, any architecture).
#include "common.h"

namespace lowbit {
namespace isa_scalar {
#include "simd_scalar.h"
#include "kernels_impl.h"
}  // namespace isa_scalar

const IsaKernels* IsaScalar() {
  static const IsaKernels table{"scalar", isa_scalar::kActWords, isa_scalar::kQMR, isa_scalar::kFMR, isa_scalar::wo_run,
                                isa_scalar::q8_run, 0, nullptr, isa_scalar::w4_run, isa_scalar::kQMR, isa_scalar::wo_dequant,
                                nullptr, nullptr, nullptr, isa_scalar::wo_x_rows};
  return &table;
}
}  // namespace lowbit
