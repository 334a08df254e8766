// AVX2 with AVX-VNNI instantiation of the kernel tiles.
#define LOWBIT_ISA_NS isa_avx2vnni
#define LOWBIT_ISA_NAME "avx2vnni"
#define LOWBIT_ISA_TARGET "avx2,fma,f16c,bmi,bmi2,avxvnni"
#define LOWBIT_ISA_SIMD "simd_avx2.h"
#define LOWBIT_ISA_GETTER IsaAvx2Vnni
#define LOWBIT_ISA_QUANTIZE_ROW nullptr
#define LOWBIT_VNNI 1
#include "isa_instance.h"
