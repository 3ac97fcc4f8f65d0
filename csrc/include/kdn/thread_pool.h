// A small fixed-size thread pool (disk reads) with a run-many-and-wait helper.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kdn {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Runs fn(i) for i in [0, n) on the pool and waits; rethrows the first exception.
  void run(int64_t n, const std::function<void(int64_t)>& fn);
  int size() const { return static_cast<int>(workers_.size()); }

 private:
  void work();
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  std::vector<std::thread> workers_;
  bool stop_ = false;
};

}  // namespace kdn
