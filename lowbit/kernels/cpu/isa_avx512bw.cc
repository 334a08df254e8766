// AVX-512 F/BW/VL/DQ (no VNNI) instantiation of the kernel tiles.
#define LOWBIT_ISA_NS isa_avx512bw
#define LOWBIT_ISA_NAME "avx512bw"
#define LOWBIT_ISA_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2"
#define LOWBIT_ISA_SIMD "simd_avx512.h"
#define LOWBIT_ISA_GETTER IsaAvx512Bw
#define LOWBIT_ISA_QUANTIZE_ROW isa_avx512bw::quantize_row
#include "isa_instance.h"
