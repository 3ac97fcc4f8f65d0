// Process-wide pool of freed large host blocks (contract in kdn/buffer_pool.h).
#include "kdn/buffer_pool.h"

#include <cstdlib>
#include <map>
#include <mutex>
#include <new>

namespace kdn {
namespace {

constexpr size_t kGranule = 64u << 10;

struct Pool {
  std::mutex mutex;
  std::multimap<size_t, uint8_t*> idle;  // capacity -> block
  BufferPoolStats stats;
  Pool() {
    const char* env = std::getenv("KDN_BUFFER_POOL_BYTES");
    stats.limit_bytes = env ? std::strtoull(env, nullptr, 10) : (1ull << 30);
  }
  void shrink_to(uint64_t limit) {  // caller holds mutex; frees the largest blocks first
    while (stats.idle_bytes > limit && !idle.empty()) {
      auto it = std::prev(idle.end());
      stats.idle_bytes -= it->first;
      --stats.idle_blocks;
      std::free(it->second);
      idle.erase(it);
    }
  }
};

Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: buffers may be freed during interpreter shutdown
  return *p;
}

}  // namespace

uint8_t* pool_acquire(size_t size, size_t* capacity) {
  if (size < kMinPooledBytes) {
    void* p = std::malloc(size ? size : 1);
    if (!p) throw std::bad_alloc();
    *capacity = size;
    return static_cast<uint8_t*>(p);
  }
  size_t rounded = (size + kGranule - 1) / kGranule * kGranule;
  Pool& P = pool();
  {
    std::lock_guard<std::mutex> lock(P.mutex);
    auto it = P.idle.lower_bound(rounded);
    if (it != P.idle.end() && it->first <= rounded + rounded / 4) {
      *capacity = it->first;
      uint8_t* block = it->second;
      P.stats.idle_bytes -= it->first;
      --P.stats.idle_blocks;
      ++P.stats.reused;
      P.idle.erase(it);
      return block;
    }
    ++P.stats.allocated;
  }
  void* p = std::malloc(rounded);
  if (!p) throw std::bad_alloc();
  *capacity = rounded;
  return static_cast<uint8_t*>(p);
}

void pool_release(uint8_t* block, size_t capacity) {
  if (capacity >= kMinPooledBytes) {
    Pool& P = pool();
    std::lock_guard<std::mutex> lock(P.mutex);
    if (P.stats.idle_bytes + capacity <= P.stats.limit_bytes) {
      P.idle.emplace(capacity, block);
      P.stats.idle_bytes += capacity;
      ++P.stats.idle_blocks;
      return;
    }
  }
  std::free(block);
}

void buffer_pool_set_limit(uint64_t bytes) {
  Pool& P = pool();
  std::lock_guard<std::mutex> lock(P.mutex);
  P.stats.limit_bytes = bytes;
  P.shrink_to(bytes);
}

void buffer_pool_trim() {
  Pool& P = pool();
  std::lock_guard<std::mutex> lock(P.mutex);
  P.shrink_to(0);
}

BufferPoolStats buffer_pool_stats() {
  Pool& P = pool();
  std::lock_guard<std::mutex> lock(P.mutex);
  return P.stats;
}

}  // namespace kdn
