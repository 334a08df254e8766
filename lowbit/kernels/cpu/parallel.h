// Fork-join over XLA's intra-op thread pool. The calling thread works too, and work items
// are claimed from a shared counter, so a helper that starts late (or never, when the pool
// is busy with other ops) only means the caller does more items itself: no deadlock when
// every pool thread is inside one of these calls.
#ifndef LOWBIT_KERNELS_CPU_PARALLEL_H_
#define LOWBIT_KERNELS_CPU_PARALLEL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace lowbit {

// Number of workers (caller included) to use: the pool size capped by the hardware and by
// LOWBIT_NUM_THREADS when set.
int64_t NumWorkers(xla::ffi::ThreadPool& pool);

template <class F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t workers, int64_t n, F&& f) {
  if (workers <= 1 || n <= 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    int64_t n = 0;
    std::function<void(int64_t)> fn;
  };
  // Helpers may outlive this call (if they start after all items are done), so the shared
  // state is reference-counted; they never touch `f` once every item has been claimed.
  auto st = std::make_shared<State>();
  st->n = n;
  st->fn = [&f](int64_t i) { f(i); };
  auto work = [](State& s) {
    for (;;) {
      const int64_t i = s.next.fetch_add(1, std::memory_order_relaxed);
      if (i >= s.n) return;
      s.fn(i);
      s.done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(workers, n) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([st, work] { work(*st); });
  work(*st);
  for (int spins = 0; st->done.load(std::memory_order_acquire) < n; ++spins) {
    if (spins > 64) std::this_thread::yield();
  }
}

}  // namespace lowbit

#endif  // LOWBIT_KERNELS_CPU_PARALLEL_H_
