// A minimal parallel-for over [0, n) on short-lived std::threads (the core has no global pool).
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

namespace kdn {

int default_num_threads();

template <typename Fn>
void parallel_for(int64_t n, int num_threads, Fn&& fn) {
  int workers = static_cast<int>(std::min<int64_t>(n, std::max(1, num_threads)));
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(workers);
  threads.reserve(workers - 1);
  auto run = [&](int w) {
    try {
      for (int64_t i = w; i < n; i += workers) fn(i);
    } catch (...) {
      errors[w] = std::current_exception();
    }
  };
  for (int w = 1; w < workers; ++w) threads.emplace_back(run, w);
  run(0);
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace kdn
