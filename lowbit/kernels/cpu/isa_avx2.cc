// AVX2 + FMA + F16C instantiation of the kernel tiles.
#define LOWBIT_ISA_NS isa_avx2
#define LOWBIT_ISA_NAME "avx2"
#define LOWBIT_ISA_TARGET "avx2,fma,f16c,bmi,bmi2"
#define LOWBIT_ISA_SIMD "simd_avx2.h"
#define LOWBIT_ISA_GETTER IsaAvx2
#define LOWBIT_ISA_QUANTIZE_ROW nullptr
#include "isa_instance.h"
