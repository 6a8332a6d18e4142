// The extension's own thread team: fork-join over persistent workers, callable from any thread.
//
// Why not OpenMP: libgomp keeps one worker pool per calling thread, and as soon as the threads it
// manages outnumber the CPUs (the main thread's pool plus one more thread's — a server's worker
// thread, a notebook's executor) it stops spinning between parallel regions (its "throttled" spin
// count, 100 iterations) and every region pays a futex sleep and wake. Measured on a 2-vCPU Xeon:
// a SmolLM2 decode ran at 263 tok/s in the main thread and 109 tok/s in a threading.Thread; an idle
// pool left in another live thread made the main thread's F.linear(1x576, 1536x576) go 31 -> 134 us.
// This team spins for a bounded time after each region whoever calls it (pause, then sched_yield so
// a runnable thread on the same core still runs), then sleeps on a condition variable.
//
// Reference: bitmtp.ops.reference.w2a8_linear_q_reference (the regions split rows; results equal it exactly)
// Test: tests/ops/backends/test_cpu_pool.py
#pragma once

#include <type_traits>

namespace bitmtp_cpu {

// A region's body: fn(ctx, t, nt). A plain function pointer, not std::function: the ISA translation
// units (compiled with AVX2 / AVX-512 target pragmas) must not emit shared inline template code that
// the linker could pick for a CPU without that ISA.
using RegionFn = void (*)(void* ctx, int t, int nt);

// Runs fn(ctx, t, nt) for every t in [0, nt) with nt = max(threads, 1), the caller as t = 0 and the
// team's workers as the rest, and returns when all have returned. One region runs at a time: a
// second caller waits for the first region to end (its own region then gets the whole team). Called
// from inside a region it runs every t in order on the calling thread. An exception thrown by any
// fn is rethrown here (the first one) after every t has finished.
void parallel_for_threads_raw(int threads, RegionFn fn, void* ctx);

// parallel_for_threads(threads, [&](int t, int nt) { ... }): the same with a lambda.
template <typename F>
inline void parallel_for_threads(int threads, F&& body) {
  using Body = typename std::remove_reference<F>::type;
  parallel_for_threads_raw(
      threads, [](void* ctx, int t, int nt) { (*static_cast<Body*>(ctx))(t, nt); },
      const_cast<void*>(static_cast<const void*>(&body)));
}

// The team's state for tests and `cpu_features()`: how many workers exist, how many regions ran,
// and how many times a worker had to be woken from sleep.
struct PoolStats {
  int workers;
  long long regions;
  long long wakeups;
};
PoolStats pool_stats();

}  // namespace bitmtp_cpu
