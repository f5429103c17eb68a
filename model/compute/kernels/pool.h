// Dealing a custom call's work items to every thread of XLA's intra-op pool (shared by
// cpu_attention.cc and cpu_matmul.cc; model/compute/kernels/build.py rebuilds both when this changes).
//
// Items 0..n-1 are dealt from an atomic counter to the calling thread and to helpers scheduled
// on the pool; the caller waits for the items, not for the helpers (a helper that starts late
// finds nothing left and returns), so a busy pool never deadlocks it. The shared state lives in
// a shared_ptr: a late helper may still touch it after the caller has returned.
//
// XLA's caller is often not one of the pool's threads (a thread of its runtime's own), and a
// task scheduled on the pool may start a few microseconds later or only after the caller is
// done. `limit` - 1 helpers are scheduled (the caller makes `limit`), no more: a helper that
// finds the work taken still wakes a pool thread, which then spins for more work beside the
// caller and the helper that joined, three threads on two cores (2 Zen 3 cores: a pass over
// SmolLM2's int8 projections at one row, bench/cpu_matmul.py, 13.6-16.5 ms with as many
// helpers as the pool has threads, 10.1-12.7 with one; its helper joined 2 us after the call
// began on average, in every call; the whole f32 decode step 35.9 -> 32.8 ms, alternating).
//
// With a helper scheduled per pool thread, on 2 Zen 4 cores, SmolLM2's decode calls at M=1 ran
// as fast on 1 thread as on 2 (the surplus helper's spinning may be why: not re-measured
// there). RINGSERVE_POOL_SPIN_US > 0 replaces the pool's helpers with one thread of the
// library's own that spins that long after each job before it sleeps: the step's calls then
// find it awake (Zen 4: f32 pass 29.9 -> 21.2 ms, bench/cpu_matmul.py; in the server on Zen 3
// its int8 single stream was slower, 13.2 -> 15.4-15.6 ms a token), at the
// cost of a core spinning through the gaps (and up to that long after the last call). Off by
// default: it is a thread XLA does not know about; callers and helpers are then 2 at most.
// Also tried on 2 Zen 3 cores: helpers from XLA's pool lingering 50 us after a job for the next
// one (a caller then scheduled only the helpers not lingering: Schedule's wake cost the caller
// 11.5 us a call in f32 steps): SmolLM2's whole decode step, toggled in one process and
// alternated 30 times, f32 27.57 -> 27.50 ms (faster in 14 of 30), bf16 + int8 10.76 -> 11.74.

#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "xla_call.h"

namespace ringserve {

// At most this many threads per call, from the environment variable `name` (tests and
// benchmarks); unset: no cap. Read once per kernel: keep the answer in a static.
inline int64_t thread_cap(const char* name) {
  const char* e = std::getenv(name);
  return e && *e ? std::max<int64_t>(1, std::atoll(e)) : INT64_MAX;
}

namespace pool_detail {

struct Job {
  std::function<void(int64_t)> run;
  int64_t n = 0, limit = 1;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<int64_t> joined{1};  // threads working on it (the caller first)
  std::mutex mu;
  std::condition_variable cv;
};

constexpr int64_t kWaitSpinUs = 500;  // the most a caller spins for its helpers' last items

inline void pause() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

inline void work(Job& s) {
  int64_t finished = 0;
  for (int64_t i; (i = s.next.fetch_add(1)) < s.n;) {
    s.run(i);
    ++finished;
  }
  if (finished && s.done.fetch_add(finished) + finished == s.n) {
    std::lock_guard<std::mutex> lock(s.mu);
    s.cv.notify_all();
  }
}

// Opt-in (RINGSERVE_POOL_SPIN_US > 0): one helper thread of this library's own that spins that
// long after each job for the next before it sleeps, instead of helpers from XLA's pool (a
// job then runs on the caller and this thread: 2 threads).
struct Spinner {
  std::mutex mu;
  std::condition_variable cv;
  std::shared_ptr<Job> job;
  std::atomic<uint64_t> gen{0};
  int64_t spin_us;
  explicit Spinner(int64_t us) : spin_us(us) { std::thread([this] { loop(); }).detach(); }
  void post(std::shared_ptr<Job> j) {
    {
      std::lock_guard<std::mutex> lock(mu);
      job = std::move(j);
      gen.fetch_add(1);
    }
    cv.notify_one();
  }
  void loop() {
    using clock = std::chrono::steady_clock;
    uint64_t seen = 0;
    for (;;) {
      const auto until = clock::now() + std::chrono::microseconds(spin_us);
      for (int i = 0; gen.load(std::memory_order_acquire) == seen; ++i) {
        pause();
        if (i % 64 == 0 && clock::now() > until) break;
      }
      std::shared_ptr<Job> j;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return gen.load() != seen; });
        seen = gen.load();
        j = std::move(job);
      }
      if (j && j->joined.fetch_add(1) < j->limit) work(*j);
    }
  }
};

inline Spinner* spinner() {
  static Spinner* s = [] {
    const char* e = std::getenv("RINGSERVE_POOL_SPIN_US");
    const int64_t us = e && *e ? std::atoll(e) : 0;
    return us > 0 ? new Spinner(us) : nullptr;
  }();
  return s;
}

}  // namespace pool_detail

// run(i) for every i in [0, n), on the caller and helpers, at most min(pool threads, cap)
// threads at once; returns once every item has run.
inline void deal(const ThreadPool& pool, int64_t n, int64_t cap, std::function<void(int64_t)> run) {
  using namespace pool_detail;
  if (n <= 0) return;
  auto sh = std::make_shared<Job>();
  sh->run = std::move(run);
  sh->n = n;
  sh->limit = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), cap);
  const int64_t helpers = std::min<int64_t>(sh->limit - 1, n - 1);
  if (helpers > 0 && spinner() != nullptr) {
    sh->limit = 2;
    spinner()->post(sh);
  } else {
    for (int64_t i = 0; i < helpers; ++i)
      pool.Schedule([sh] {
        if (sh->joined.fetch_add(1) < sh->limit) work(*sh);
      });
  }
  work(*sh);
  // The items left run on helpers, each at most one item long: wait for them spinning, and only
  // past kWaitSpinUs on the condition variable (a caller asleep on it was woken tens of us after
  // the last item in a VM: most of a 1-row int8 projection's call)
  using clock = std::chrono::steady_clock;
  const auto until = clock::now() + std::chrono::microseconds(kWaitSpinUs);
  for (int i = 1; sh->done.load(std::memory_order_acquire) != n; ++i) {
    pause();
    if (i % 64 == 0 && clock::now() > until) {
      std::unique_lock<std::mutex> lock(sh->mu);
      sh->cv.wait(lock, [&] { return sh->done.load() == n; });
      break;
    }
  }
}

}  // namespace ringserve
