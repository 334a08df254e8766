// The arguments every GGUF product kernel takes (gguf.cc, gguf_vnni.h): the weight's
// block rows or tiles, and the activations as prepared once a call.
#ifndef LOWBIT_KERNELS_CPU_GGUF_ARGS_H_
#define LOWBIT_KERNELS_CPU_GGUF_ARGS_H_

#include <cstdint>
#include <vector>

namespace lowbit {
namespace gguf {

// Activations prepared once a call, shared by every worker. K is padded to whole units.
// int8 activations come in llama.cpp's blocks for the weight's type: Q8_0 (a float scale per
// 32) for the 32-element types, Q8_K (a float scale per 256, integer sums per 16) for the
// K-quants, whose integer sub-block scales then multiply integer dots.
struct Acts {
  int64_t m = 0, kp = 0;
  bool q8 = false;
  int per = 32;             // elements per activation scale (int8 path)
  std::vector<float> x;     // float path: [M, Kp]
  std::vector<int8_t> a;    // int8 path: [M, Kp]
  std::vector<float> da;    // int8 path: [M, Kp / per] scales
  std::vector<int16_t> bs;  // int8 path: [M, Kp / 16] integer sums of a
  std::vector<float> sums;  // [M, Kp / 16]: sum of x (float) or da * sum of a (int8)
};

// Block rows [N, row_bytes], or tiles (gguf_tiles.h) [N / 8, row_bytes], row_bytes then the
// bytes of one group of 8 rows.
struct Weight {
  int type;
  int64_t k, n, row_bytes;
  const uint8_t* data;
  bool tiled = false;
};

}  // namespace gguf
}  // namespace lowbit

#endif  // LOWBIT_KERNELS_CPU_GGUF_ARGS_H_
