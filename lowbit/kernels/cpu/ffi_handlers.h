// XLA FFI handler symbols exported to Python as capsules (see module.cc).
#ifndef LOWBIT_KERNELS_CPU_FFI_HANDLERS_H_
#define LOWBIT_KERNELS_CPU_FFI_HANDLERS_H_

#include "xla/ffi/api/c_api.h"

extern "C" {
// Weight-only linear: (x [M,K] f32|bf16, blob u8 [P, panel_bytes], bias f32 [N],
// codebook f32 [16]) -> y [M,N] f32|bf16; attrs kind, k, n, gs.
XLA_FFI_Error* LowbitWoLinear(XLA_FFI_CallFrame* call_frame);
// w8a8 linear with dynamic per-row activation quantization: (x, w s8 [P, KQ*64],
// colsum s32 [16P], wscale f32 [N], bias f32 [N]) -> y; attrs k, n.
XLA_FFI_Error* LowbitW8A8Linear(XLA_FFI_CallFrame* call_frame);
// Same on already-quantized activations: (xq s8 [M,K], x_scale f32 [M], w, colsum, wscale,
// bias) -> y.
XLA_FFI_Error* LowbitW8A8LinearQ(XLA_FFI_CallFrame* call_frame);
// int4 weights x dynamic per-token int8 activations: (x [M,K] f32|bf16, blob u8
// [P, G * (128 + 8 gs)], bias f32 [N]) -> y [M,N]; attrs k, n, gs.
XLA_FFI_Error* LowbitW4A8Linear(XLA_FFI_CallFrame* call_frame);
// The dequantized weight of a weight-only layout: (blob u8 [P, panel_bytes], codebook f32
// [16]) -> f32 [Kp, 16 P]; attrs kind, n, gs.
XLA_FFI_Error* LowbitWoDequantize(XLA_FFI_CallFrame* call_frame);
// Integer product only: (xq s8 [M,K], w, colsum) -> s32 [M,N].
XLA_FFI_Error* LowbitW8A8Int32(XLA_FFI_CallFrame* call_frame);
// Decode attention over a KV cache (attention.cc): (q f32 [B,H,G,D], keys and values
// [B,H,L,D] f32 | s8 | f8e4m3fn or u8 [B,H,L,D/2] (int4), key and value scales f16 [B,H,L,G],
// start s32 [B], slot s32 []) -> f32 [B,H,G,D], each row attending to slots start[b] .. slot;
// attr fmt (0 float32, 1 int8, 2 int4, 3 fp8).
XLA_FFI_Error* LowbitDecodeAttention(XLA_FFI_CallFrame* call_frame);
// GGUF block rows (gguf.cc): (x [M,K] f32|bf16, w u8 [N, row_bytes]) -> y [M,N] f32|bf16;
// attrs type (gguf_blocks.h), k, n, act_q8.
XLA_FFI_Error* LowbitGgufLinear(XLA_FFI_CallFrame* call_frame);
// The sum over the last axis in one fixed pairwise order (row_sum.cc): (x f32 [..., D]) -> f32
// [...]; attr square (sum the squares).
XLA_FFI_Error* LowbitRowSum(XLA_FFI_CallFrame* call_frame);
// The float32 weight [N, K] of GGUF block rows: (w u8 [N, row_bytes]) -> f32 [N, K].
XLA_FFI_Error* LowbitGgufDequantize(XLA_FFI_CallFrame* call_frame);
// GGUF block rows as tiles of 8 rows (gguf_tile.cc): (w u8 [N, row_bytes]) -> u8
// [N / 8, blocks * tile bytes]; attr type (gguf_blocks.h).
XLA_FFI_Error* LowbitGgufTile(XLA_FFI_CallFrame* call_frame);
}

#endif  // LOWBIT_KERNELS_CPU_FFI_HANDLERS_H_
