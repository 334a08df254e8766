// The loader's tiling of GGUF block rows (gguf_tiles.h): the same bytes reordered, 8 rows to
// a group. In XLA the reordering was gathers of 1-4 bytes at 0.2-0.6 GB/s, most of the time
// it took to lay out a file (a 1.5B Q4_K_M model's weights: about 2 s of every start); here
// each 4-byte piece is one copy, the groups split over the pool's threads.
//
// A type whose tiles are the size of its rows can have them written over the rows: XLA then
// passes one buffer as both (the call's operand aliased to its result, which has the rows'
// shape, the operand donated by the loader), and each group is copied aside before its tiles
// are written. A loader so never holds a weight twice.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ffi_handlers.h"
#include "gguf_tiles.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace lowbit {
namespace gguf {
namespace {

// Groups a work item: a few hundred KiB of rows, so two threads share even a small weight.
constexpr int64_t kItemBytes = 256 * 1024;

ffi::Error TileImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> rows,
                    ffi::ResultBuffer<ffi::U8> tiles, int64_t type) {
  if (type < 0 || type >= kNumTypes || TileBytes(static_cast<int>(type)) == 0)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "lowbit: gguf tile: no tiled layout");
  const auto dims = rows.dimensions();
  const int t = static_cast<int>(type);
  if (dims.size() != 2 || dims[0] % kTileRows != 0 || dims[1] % kTypes[t].bytes != 0)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "lowbit: gguf tile: rows must be uint8 [8 G, blocks * block bytes]");
  const int64_t n = dims[0], row_bytes = dims[1];
  const int64_t blocks = row_bytes / kTypes[t].bytes, groups = n / kTileRows;
  const int64_t group_bytes = blocks * TileBytes(t);
  if (static_cast<int64_t>(tiles->element_count()) != groups * group_bytes)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "lowbit: gguf tile: tiles must be G * blocks * tile bytes");
  const uint8_t* in = rows.typed_data();
  uint8_t* out = tiles->typed_data();
  const bool in_place = in == out;
  if (in_place && group_bytes != kTileRows * row_bytes)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "lowbit: gguf tile: tiles larger than their rows cannot overwrite them");
  const int64_t per_item = std::max<int64_t>(1, kItemBytes / std::max<int64_t>(1, group_bytes));
  const int64_t items = (groups + per_item - 1) / per_item;
  ParallelFor(pool, NumWorkers(pool), items, [&](int64_t item) {
    const int64_t end = std::min(groups, (item + 1) * per_item);
    // Written over: a group's rows are read from a copy (one group, a few KiB to tens of KiB).
    std::vector<uint8_t> aside(in_place ? kTileRows * row_bytes : 0);
    for (int64_t g = item * per_item; g < end; ++g) {
      const uint8_t* group = in + g * kTileRows * row_bytes;
      if (in_place) {
        std::memcpy(aside.data(), group, aside.size());
        group = aside.data();
      }
      TileGroup(t, group, blocks, out + g * group_bytes);
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace gguf
}  // namespace lowbit

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowbitGgufTile, lowbit::gguf::TileImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Attr<int64_t>("type"));
