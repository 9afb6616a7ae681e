// The engine's own worker threads for the kernels' loops, in place of OpenMP's regions (`use`: a thread opts in;
// the engine's steps do for block-quantized models, whose heavy work is all in these kernels).
//
// On a machine the engine fills, every streamed token wakes other threads (the response sender, the server,
// the client) that take a core from one of the engine's threads for a while. An OpenMP region then waits at its
// closing barrier for that thread to get its core back and arrive, even when the other thread has done all the
// items (work_split.h lets it), and a decode step has ~150 regions. Here a loop is done when its items are:
// the calling thread takes the items a late or descheduled worker has not started and returns without waiting
// for that worker. A waiting worker spins for new work but yields its core every few microseconds, so a
// woken sender or server thread runs in the engine's idle moments rather than in the middle of its work; after
// 2 ms without work it sleeps (an idle engine takes no CPU). The pool is the process's, whichever thread made
// it: unlike OpenMP's teams (one per thread that starts regions; two teams make libgomp stop spinning, and
// batch-1 decode took twice as long), an engine stepped on another thread than the one that loaded it is as fast.
//
// Each loop's per-thread ranges carry the loop's number (a tag) in the same atomic word as their bounds, so a
// worker that read an old loop's description can take nothing from a newer loop.
#pragma once
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace thread_pool {

constexpr int kMaxThreads = 64;
constexpr int kTagBits = 24, kBoundBits = 20;
constexpr uint64_t kBoundMask = (uint64_t{1} << kBoundBits) - 1, kTagMask = (uint64_t{1} << kTagBits) - 1;
constexpr int64_t kMaxItems = static_cast<int64_t>(kBoundMask);  // larger loops use at::parallel_for
constexpr int kSpinsPerYield = 256;                                 // a few microseconds of pause instructions
constexpr auto kIdleBeforeSleep = std::chrono::milliseconds(2);

inline uint64_t pack(uint64_t tag, uint64_t front, uint64_t back) {
  return (tag & kTagMask) << (2 * kBoundBits) | front << kBoundBits | back;
}

// Items [front, back) of one thread's range not yet taken, and the loop they belong to, in one word.
struct alignas(64) Range {
  std::atomic<uint64_t> word{0};
};

// Up to `grain` of the range's next items of loop `tag`, from the front (its owner) or the back (another
// thread), as [begin, end); begin == end when none are left or the range belongs to another loop.
inline std::pair<int64_t, int64_t> take(Range& range, uint64_t tag, int64_t grain, bool from_back) {
  uint64_t now = range.word.load(std::memory_order_acquire);
  while (true) {
    const uint64_t front = now >> kBoundBits & kBoundMask, back = now & kBoundMask;
    if ((now >> (2 * kBoundBits)) != (tag & kTagMask) || front >= back) return {0, 0};
    const uint64_t count = std::min<uint64_t>(grain, back - front);
    const uint64_t next = from_back ? pack(tag, front, back - count) : pack(tag, front + count, back);
    if (range.word.compare_exchange_weak(now, next, std::memory_order_acq_rel, std::memory_order_acquire)) {
      const int64_t begin = static_cast<int64_t>(from_back ? back - count : front);
      return {begin, begin + static_cast<int64_t>(count)};
    }
  }
}

using Body = void (*)(const void* fn, int64_t begin, int64_t end);

inline thread_local bool in_loop = false;  // a worker, or the calling thread inside a loop: nested loops run serially
inline thread_local int pooled_threads = 0; // the calling thread's loops run on this many threads of the pool (0: OpenMP)

class Pool {
 public:
  Pool() = default;
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // body(fn, begin, end) over [0, n) in pieces of at most `grain`, on `threads` threads (this one and
  // threads - 1 workers); each item once. Returns when every item is done; rethrows a body's exception.
  // False, having done nothing, while another thread runs a loop (the caller then runs it another way).
  bool try_run(int64_t n, int64_t grain, int threads, Body body, const void* fn) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    ensure_workers(threads - 1);
    const uint64_t tag = tag_ + 1;
    body_.store(body, std::memory_order_relaxed);
    fn_.store(fn, std::memory_order_relaxed);
    grain_.store(grain, std::memory_order_relaxed);
    threads_.store(threads, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    for (int t = 0; t < threads; ++t)
      ranges_[t].word.store(pack(tag, t * n / threads, (t + 1) * n / threads), std::memory_order_relaxed);
    tag_ = tag;
    generation_.store(tag, std::memory_order_seq_cst);  // publishes the loop to the workers
    if (sleepers_.load(std::memory_order_seq_cst) > 0) wake_all();
    work(0, tag);
    for (int spins = 0; done_.load(std::memory_order_acquire) < n;) {
      _mm_pause();
      if (++spins % kSpinsPerYield == 0) sched_yield();
    }
    if (error_) std::rethrow_exception(error_);
    return true;
  }

 private:
  // Its own range from the front, then the others' from the back; each piece counted once done.
  void work(int own, uint64_t tag) {
    const int threads = threads_.load(std::memory_order_relaxed);
    const int64_t grain = grain_.load(std::memory_order_relaxed);
    const Body body = body_.load(std::memory_order_relaxed);
    const void* fn = fn_.load(std::memory_order_relaxed);
    if (own >= threads) return;
    for (int k = 0; k < threads; ++k) {
      Range& range = ranges_[(own + k) % threads];
      for (auto piece = take(range, tag, grain, k > 0); piece.first < piece.second;
           piece = take(range, tag, grain, k > 0)) {
        try {
          body(fn, piece.first, piece.second);
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mutex_);
          if (!error_) error_ = std::current_exception();
        }
        done_.fetch_add(piece.second - piece.first, std::memory_order_acq_rel);
      }
    }
  }

  void worker_loop(int own) {
    in_loop = true;
    uint64_t seen = generation_.load(std::memory_order_acquire);
    auto idle_since = std::chrono::steady_clock::now();
    for (int spins = 0;;) {
      const uint64_t now = generation_.load(std::memory_order_acquire);
      if (now != seen) {
        seen = now;
        work(own, now);
        idle_since = std::chrono::steady_clock::now();
        spins = 0;
        continue;
      }
      _mm_pause();
      if (++spins % kSpinsPerYield != 0) continue;
      sched_yield();
      if (std::chrono::steady_clock::now() - idle_since < kIdleBeforeSleep) continue;
      std::unique_lock<std::mutex> lock(sleep_mutex_);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      wake_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  void wake_all() {
    { std::lock_guard<std::mutex> lock(sleep_mutex_); }
    wake_.notify_all();
  }

  void ensure_workers(int count) {
    while (static_cast<int>(workers_.size()) < count) {
      const int own = static_cast<int>(workers_.size()) + 1;
      workers_.emplace_back([this, own] { worker_loop(own); });
      // Named here, not by the worker: a worker that has not run yet is already counted by its name.
      pthread_setname_np(workers_.back().native_handle(), "tritonllm-kern");
    }
  }

  Range ranges_[kMaxThreads];
  alignas(64) std::atomic<uint64_t> generation_{0};
  alignas(64) std::atomic<int64_t> done_{0};
  alignas(64) std::atomic<int> sleepers_{0};
  std::atomic<Body> body_{nullptr};
  std::atomic<const void*> fn_{nullptr};
  std::atomic<int64_t> grain_{1};
  std::atomic<int> threads_{1};
  uint64_t tag_ = 0;  // the last loop's number (the calling thread's)
  std::exception_ptr error_;
  std::mutex busy_, error_mutex_, sleep_mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> workers_;  // never joined: the pool lives as long as the process
};

// The process's pool, made on first use; a forked child (whose copy has no threads) makes its own.
inline std::atomic<bool> forked{false};

inline Pool& pool() {
  static Pool* current = [] {
    pthread_atfork(nullptr, nullptr, [] { forked.store(true); });
    return new Pool();  // never destroyed: its workers may still run during static destruction at exit
  }();
  if (forked.exchange(false)) current = new Pool();
  return *current;
}

// fn(begin, end) over [0, n) on `threads` threads, as above; false (nothing done) where the pool cannot take
// the loop: too many items or threads, or another thread's loop running. A loop inside a loop never gets here
// (work_split::for_each runs it serially on the thread that reached it).
template <typename F>
bool try_run(int64_t n, int64_t grain, int threads, const F& fn) {
  if (n > kMaxItems || threads > kMaxThreads) return false;
  struct Flag {
    Flag() { in_loop = true; }
    ~Flag() { in_loop = false; }
  } flag;
  return pool().try_run(n, grain, threads, [](const void* f, int64_t b, int64_t e) { (*static_cast<const F*>(f))(b, e); }, &fn);
}

// From now on the calling thread's kernel loops run on `n` threads of the pool (itself and n - 1 workers) and its
// PyTorch ops on itself alone: OpenMP's threads spin for milliseconds after each region, and beside the pool's
// workers they would take the cores from them. 0: back to OpenMP's threads, as PyTorch's setting says.
inline void use(int64_t n) {
  TORCH_CHECK(n >= 0 && n <= kMaxThreads, "use_thread_pool takes 0 to ", kMaxThreads, " threads, got ", n);
  at::get_num_threads();  // PyTorch sets a thread's OpenMP threads lazily, once: now, so that it cannot undo ours
  pooled_threads = static_cast<int>(n);
  if (n > 0) {
    omp_set_num_threads(1);
  } else {
    at::init_num_threads();
  }
}

}  // namespace thread_pool
