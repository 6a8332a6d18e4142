// The extension's thread team (see pool.h for why it is not OpenMP).
//
// A region: the caller publishes the job (fn, nt), bumps `generation_` and runs t = 0; worker i runs
// t = i + 1 when i + 1 < nt, then decrements `pending_`; the caller waits for `pending_` to reach 0.
// Workers wait for the next generation spinning (kTightSpin with the pause instruction, then
// sched_yield up to kSpin), then on a condition variable. The lost-wakeup race between a worker
// going to sleep and a caller publishing is closed by sequentially consistent atomics on both sides
// (a worker counts itself in `sleepers_` and then re-reads `generation_`; a caller bumps
// `generation_` and then reads `sleepers_`): at least one of the two sees the other.
//
// Reference: bitmtp.ops.reference.w2a8_linear_q_reference (the regions split rows; results equal it exactly)
// Test: tests/ops/backends/test_cpu_pool.py
#include "pool.h"

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace bitmtp_cpu {

namespace {

using Clock = std::chrono::steady_clock;

// Between two kernel calls of a decode step the caller runs Python glue for tens of microseconds; a
// worker still spinning then picks the next region up in well under a microsecond. After kTightSpin
// a spinning worker yields its core on every turn, so a runnable thread (torch's own OpenMP team, the
// caller's other work) is not kept off that core; after kSpin it sleeps.
constexpr auto kTightSpin = std::chrono::microseconds(50);
constexpr auto kSpin = std::chrono::microseconds(2000);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

thread_local bool tl_in_region = false;

// generation_ = (region counter << kNtBits) | the region's team size
constexpr int kNtBits = 8;
constexpr unsigned long long kNtMask = (1ull << kNtBits) - 1;
constexpr int kMaxTeam = static_cast<int>(kNtMask);

class Pool {
 public:
  void run(int nt, RegionFn fn, void* ctx) {
    std::lock_guard<std::mutex> region(region_mu_);
    grow(nt - 1);
    job_ = fn;
    job_ctx_ = ctx;
    error_ = nullptr;
    pending_.store(nt - 1, std::memory_order_seq_cst);
    regions_.fetch_add(1, std::memory_order_relaxed);
    // the team size travels in the same word as the generation, so a worker that takes no part in
    // this region never reads `job_`, which the next region may already be rewriting
    const unsigned long long next = ((generation_.load(std::memory_order_relaxed) >> kNtBits) + 1) << kNtBits;
    generation_.store(next | static_cast<unsigned long long>(nt), std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(sleep_mu_);
      sleep_cv_.notify_all();
    }
    tl_in_region = true;
    try {
      fn(ctx, 0, nt);
    } catch (...) {
      record_error();
    }
    tl_in_region = false;
    wait_until([&] { return pending_.load(std::memory_order_acquire) == 0; });
    job_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

  PoolStats stats() {
    std::lock_guard<std::mutex> region(region_mu_);
    return {static_cast<int>(workers_.size()), regions_.load(), wakeups_.load()};
  }

 private:
  template <typename Pred>
  static bool spin_until(Pred done) {
    const auto start = Clock::now();
    for (unsigned turn = 1;; ++turn) {
      if (done()) return true;
      if ((turn & 63) == 0) {
        const auto spent = Clock::now() - start;
        if (spent > kSpin) return false;
        if (spent > kTightSpin) sched_yield();
      }
      cpu_relax();
    }
  }

  // The caller's wait for its workers: spin, then yield for as long as it takes (a worker that was
  // descheduled finishes on its own; there is nothing to sleep on).
  template <typename Pred>
  static void wait_until(Pred done) {
    if (spin_until(done)) return;
    while (!done()) sched_yield();
  }

  void record_error() {
    std::lock_guard<std::mutex> lk(error_mu_);
    if (!error_) error_ = std::current_exception();
  }

  void grow(int want) {
    while (static_cast<int>(workers_.size()) < want) {
      const int index = static_cast<int>(workers_.size());
      // Started at the current generation, so a new worker does not run a region it was not part of.
      workers_.emplace_back(&Pool::work, this, index, generation_.load());
      workers_.back().detach();  // the team lives as long as the process (see reset_after_fork)
    }
  }

  void work(int index, unsigned long long seen) {
    for (;;) {
      unsigned long long now = generation_.load(std::memory_order_acquire);
      if (now == seen) {
        if (!spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; })) {
          std::unique_lock<std::mutex> lk(sleep_mu_);
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          sleep_cv_.wait(lk, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
          wakeups_.fetch_add(1, std::memory_order_relaxed);
        }
        now = generation_.load(std::memory_order_acquire);
      }
      seen = now;
      const int t = index + 1, nt = static_cast<int>(now & kNtMask);
      if (t < nt) {
        tl_in_region = true;
        try {
          job_(job_ctx_, t, nt);
        } catch (...) {
          record_error();
        }
        tl_in_region = false;
        pending_.fetch_sub(1, std::memory_order_release);
      }
    }
  }

  std::mutex region_mu_;  // one region at a time
  std::vector<std::thread> workers_;
  RegionFn job_ = nullptr;
  void* job_ctx_ = nullptr;
  std::atomic<unsigned long long> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> sleepers_{0};
  std::mutex sleep_mu_;
  std::condition_variable sleep_cv_;
  std::mutex error_mu_;
  std::exception_ptr error_;
  std::atomic<long long> regions_{0};
  std::atomic<long long> wakeups_{0};
};

std::atomic<Pool*> g_pool{nullptr};
std::once_flag g_atfork_once;

// A forked child has none of the parent's workers (fork copies the calling thread only), and a
// mutex the parent held mid-region would stay locked: the child starts a new team and leaks the old
// object (its memory is the parent's copy; the parent's workers are not touched).
void reset_after_fork() { g_pool.store(nullptr); }

Pool& pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p) return *p;
  std::call_once(g_atfork_once, [] { pthread_atfork(nullptr, nullptr, reset_after_fork); });
  static std::mutex create_mu;
  std::lock_guard<std::mutex> lk(create_mu);
  p = g_pool.load(std::memory_order_acquire);
  if (!p) {
    p = new Pool();  // never deleted: detached workers use it until the process ends
    g_pool.store(p, std::memory_order_release);
  }
  return *p;
}

}  // namespace

void parallel_for_threads_raw(int threads, RegionFn fn, void* ctx) {
  const int nt = threads > 1 ? (threads < kMaxTeam ? threads : kMaxTeam) : 1;
  if (nt == 1 || tl_in_region) {
    for (int t = 0; t < nt; ++t) fn(ctx, t, nt);
    return;
  }
  pool().run(nt, fn, ctx);
}

PoolStats pool_stats() { return pool().stats(); }

}  // namespace bitmtp_cpu
