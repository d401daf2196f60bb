// Work split between the calling thread and XLA:CPU's intra-op pool, for the native kernels.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace {

// Runs fn(u) once for every u in [0, total), on the calling thread and, when `spread`, on XLA's pool
// threads too. Units are claimed from a counter; the caller works as well and then waits only for
// units already claimed (running, never queued), so the call cannot deadlock whether or not the pool
// ever runs the helper tasks, and a helper that starts after the call returned claims nothing and
// touches no buffer. Which thread runs a unit never changes its result.
template <typename F>
void for_units(xla::ffi::ThreadPool& pool, int64_t total, bool spread, const F& fn) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    int64_t total;
    F fn;
    State(int64_t t, const F& f) : total(t), fn(f) {}
  };
  auto state = std::make_shared<State>(total, fn);
  auto body = [](State* s) {
    for (int64_t u; (u = s->next.fetch_add(1)) < s->total;) {
      s->fn(u);
      s->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = spread ? std::min<int64_t>(pool.num_threads(), total) - 1 : 0;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([state, body] { body(state.get()); });
  body(state.get());
  while (state->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
}

// Waking a pool thread costs microseconds: below this many multiply-adds (a small model's step) the
// calling thread does the whole call.
constexpr int64_t kSpreadMin = 1 << 20;

}  // namespace
