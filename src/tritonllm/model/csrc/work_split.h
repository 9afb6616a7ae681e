// How the weight-streaming kernels share their items (tiles of weight rows) among the engine's threads.
//
// Each thread owns a contiguous range, as at::parallel_for's static split gives, and takes its items from the
// front; a thread done with its own range then takes items from the back of ranges still unfinished. Left alone,
// that is the static split: one contiguous stream of weights per thread, which batch-1 decode needs (tiles dealt
// from one shared counter interleave the two streams, and were slower). But when the OS gives one engine
// thread's core to another thread for a while (the response sender, the server, the client: on a machine the
// engine fills, every token's response does), the other engine thread does the waiting range's items instead of
// spinning at the region's end.
//
// A thread that called `use_thread_pool(n)` (the engine's, for the models whose heavy work is all in these
// kernels) runs the loops on thread_pool.h's workers instead of OpenMP's: a loop there ends when its items are
// done, not when a descheduled thread gets its core back.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

#include "thread_pool.h"

namespace work_split {

// The threads a loop of the calling thread runs on: its pool's, or PyTorch's (OpenMP's).
inline int64_t num_threads() { return thread_pool::pooled_threads > 0 ? thread_pool::pooled_threads : at::get_num_threads(); }

// Items [front, back) of one thread's range not yet taken, in one word so that front and back move atomically.
struct alignas(64) Range {
  std::atomic<uint64_t> bounds{0};
};

inline uint64_t pack(uint64_t front, uint64_t back) { return front << 32 | back; }

// Up to `grain` of the range's next items, from the front (`from_back` false: its owner) or the back (another
// thread), as [begin, end); begin == end when none are left.
inline std::pair<int64_t, int64_t> take(Range& range, int64_t grain, bool from_back) {
  uint64_t now = range.bounds.load(std::memory_order_relaxed);
  while (true) {
    const uint64_t front = now >> 32, back = now & 0xffffffffu;
    if (front >= back) return {0, 0};
    const uint64_t count = std::min<uint64_t>(grain, back - front);
    const uint64_t next = from_back ? pack(front, back - count) : pack(front + count, back);
    if (range.bounds.compare_exchange_weak(now, next, std::memory_order_relaxed)) {
      const int64_t begin = static_cast<int64_t>(from_back ? back - count : front);
      return {begin, begin + static_cast<int64_t>(count)};
    }
  }
}

// fn(begin, end) over [0, n) in pieces of at most `grain` items, each item once, on the engine's threads (items
// are independent). The grain keeps the bookkeeping (an atomic compare-and-swap a piece) small against the work.
template <typename F>
void for_each(int64_t n, int64_t grain, const F& fn) {
  const int64_t threads = std::min<int64_t>(num_threads(), (n + grain - 1) / grain);
  if (threads <= 1 || at::in_parallel_region() || thread_pool::in_loop) {
    if (n > 0) fn(0, n);
    return;
  }
  if (thread_pool::pooled_threads > 0 && thread_pool::try_run(n, grain, static_cast<int>(threads), fn)) return;
  std::vector<Range> ranges(threads);
  for (int64_t t = 0; t < threads; ++t) ranges[t].bounds.store(pack(t * n / threads, (t + 1) * n / threads));
  at::parallel_for(0, threads, 1, [&](int64_t own, int64_t) {
    // Its own range from the front, then the others' from the back.
    for (int64_t k = 0; k < threads; ++k) {
      Range& range = ranges[(own + k) % threads];
      for (auto piece = take(range, grain, k > 0); piece.first < piece.second; piece = take(range, grain, k > 0))
        fn(piece.first, piece.second);
    }
  });
}

}  // namespace work_split
