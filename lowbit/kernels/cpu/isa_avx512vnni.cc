// AVX-512 with VNNI (vpdpbusd) instantiation of the kernel tiles.
#define LOWBIT_ISA_NS isa_avx512vnni
#define LOWBIT_ISA_NAME "avx512vnni"
#define LOWBIT_ISA_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi,bmi2"
#define LOWBIT_ISA_SIMD "simd_avx512.h"
#define LOWBIT_ISA_GETTER IsaAvx512Vnni
#define LOWBIT_ISA_QUANTIZE_ROW isa_avx512vnni::quantize_row
#define LOWBIT_VNNI 1
#include "isa_instance.h"
