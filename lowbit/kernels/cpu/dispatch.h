// Runtime choice of the instruction-set path.
#ifndef LOWBIT_KERNELS_CPU_DISPATCH_H_
#define LOWBIT_KERNELS_CPU_DISPATCH_H_

#include <string>
#include <vector>

#include "common.h"

namespace lowbit {

// Paths this CPU (and OS) can run, slowest first; "scalar" is always present.
std::vector<std::string> SupportedIsas();

// The active path. Initially the best supported one, capped by LOWBIT_CPU_ISA if set.
const IsaKernels* ActiveIsa();

// Selects `name` capped by what the CPU supports (the best supported path not above it).
// Returns the name actually selected, or an empty string if `name` is unknown.
std::string SelectIsa(const std::string& name);

}  // namespace lowbit

#endif  // LOWBIT_KERNELS_CPU_DISPATCH_H_
