// A row's sum (or sum of squares) in one fixed order: the row zero-padded to a power of two
// and halved by elementwise adds, the first half plus the second, until one value is left.
// That is the order of the pure-JAX reference (`_reference.row_sum`), so the two give the same
// bits, and each row rounds the same way however many rows there are (`lowbit.models`' RMSNorm
// and softmax are built on it; XLA picks a reduce's order by its shape).
//
// In XLA the same tree is a materialized level per halving, in every norm of every program: a
// SmolLM2 server's programs took about 250 MiB more resident memory and 15% more compile time
// than with XLA's own reduce. Here it is one call.
// Compiled without -ffast-math and with -ffp-contract=off (setup.py): the compiler keeps the
// written adds (it vectorizes across i, which does not change any add), and a square is
// rounded before it is added.
//
// One thread: a norm's rows are a few microseconds of work.
#include <cstdint>
#include <vector>

#include "ffi_handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace lowbit {
namespace {

// The fixed-order sum of x[0 .. d) (squared first if `square`); `buf` holds `width` floats,
// width the power of two at or above d.
float TreeSum(const float* x, int64_t d, int64_t width, bool square, float* buf) {
  if (square) {
    for (int64_t i = 0; i < d; ++i) buf[i] = x[i] * x[i];
  } else {
    for (int64_t i = 0; i < d; ++i) buf[i] = x[i];
  }
  for (int64_t i = d; i < width; ++i) buf[i] = 0.0f;
  for (int64_t half = width / 2; half >= 1; half /= 2) {
    for (int64_t i = 0; i < half; ++i) buf[i] = buf[i] + buf[i + half];
  }
  return buf[0];
}

ffi::Error RowSumImpl(ffi::Buffer<ffi::F32> x,
                      ffi::ResultBuffer<ffi::F32> out, int64_t square) {
  const auto dims = x.dimensions();
  if (dims.size() < 1)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "lowbit: row sum: x must be [..., D]");
  const int64_t d = dims.back();
  const int64_t rows = static_cast<int64_t>(out->element_count());
  if (d * rows != static_cast<int64_t>(x.element_count()))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "lowbit: row sum: the output must have x's leading shape");
  float* o = out->typed_data();
  if (d == 0) {
    for (int64_t r = 0; r < rows; ++r) o[r] = 0.0f;
    return ffi::Error::Success();
  }
  int64_t width = 1;
  while (width < d) width *= 2;
  const float* xp = x.typed_data();
  std::vector<float> buf(width);
  for (int64_t r = 0; r < rows; ++r) o[r] = TreeSum(xp + r * d, d, width, square != 0, buf.data());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace lowbit

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowbitRowSum, lowbit::RowSumImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("square"));
