// Fixed-size thread pool (contract in kdn/thread_pool.h).
#include "kdn/thread_pool.h"

#include "kdn/common.h"

#include <algorithm>
#include <string>
#include <system_error>

namespace kdn {

ThreadPool::ThreadPool(int num_threads) {
  try {
    for (int i = 0; i < std::max(1, num_threads); ++i) workers_.emplace_back([this] { work(); });
  } catch (const std::system_error& e) {  // a thread limit: stop what started, report it
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    throw Error("cannot start " + std::to_string(num_threads) + " threads (" + e.what() + ")", __FILE__, __LINE__);
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::work() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

void ThreadPool::run(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 1) {
    if (n == 1) fn(0);
    return;
  }
  std::mutex done_mutex;
  std::condition_variable done_cv;
  int64_t remaining = n;
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int64_t i = 0; i < n; ++i)
      tasks_.emplace_back([&, i] {
        std::exception_ptr e;
        try {
          fn(i);
        } catch (...) {
          e = std::current_exception();
        }
        std::lock_guard<std::mutex> done_lock(done_mutex);
        if (e && !error) error = e;
        if (--remaining == 0) done_cv.notify_one();
      });
  }
  cv_.notify_all();
  std::unique_lock<std::mutex> lock(done_mutex);
  done_cv.wait(lock, [&] { return remaining == 0; });
  if (error) std::rethrow_exception(error);
}

}  // namespace kdn
