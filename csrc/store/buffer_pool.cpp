// Process-wide pool of freed large host blocks (contract in kdn/buffer_pool.h).
#include "kdn/buffer_pool.h"

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <unordered_set>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "kdn/host_memory.h"

namespace kdn {
namespace {

constexpr size_t kGranule = 64u << 10;
constexpr size_t kHugePage = 2u << 20;

struct Pool {
  std::mutex mutex;
  std::multimap<size_t, uint8_t*> idle;  // capacity -> block
  std::unordered_set<uint8_t*> locked;    // blocks page-locked for the device
  BufferPoolStats stats;                  // also what new blocks get: huge_pages, lock_pages
  Pool() {
    // Read once, leniently: a value that is not a plain byte count keeps the default (kdn's engines check
    // both variables and apply sizes such as "512MiB" themselves, with a typed error for a bad one).
    stats.limit_bytes = 1ull << 30;
    const char* env = std::getenv("KDN_BUFFER_POOL_BYTES");
    if (env && *env && std::strspn(env, "0123456789") == std::strlen(env) && std::strlen(env) <= 18)
      stats.limit_bytes = std::strtoull(env, nullptr, 10);
    const char* huge = std::getenv("KDN_BUFFER_POOL_HUGE_PAGES");  // 0/false/no/off: 4 KiB pages only
    std::string off = huge ? huge : "";
    for (auto& c : off) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    stats.huge_pages = !(off == "0" || off == "false" || off == "no" || off == "off");
  }
  void shrink_to(uint64_t limit) {  // caller holds mutex; frees the largest blocks first
    while (stats.idle_bytes > limit && !idle.empty()) {
      auto it = std::prev(idle.end());
      stats.idle_bytes -= it->first;
      --stats.idle_blocks;
      free_block(it->second, it->first);
      idle.erase(it);
    }
  }
  void free_block(uint8_t* block, size_t capacity) {  // caller holds mutex
    if (locked.erase(block)) {
      host_memory_unlock(block);
      --stats.locked_blocks;
      stats.locked_bytes -= capacity;
    }
    std::free(block);
  }
};

Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: buffers may be freed during interpreter shutdown
  return *p;
}

// Page-locks a pooled block when the pool is asked to and it is not yet (outside the mutex: it takes
// the driver a while); a refusal leaves it pageable, and the pool stops asking.
uint8_t* lock_if_asked(uint8_t* block, size_t capacity) {
  Pool& P = pool();
  {
    std::lock_guard<std::mutex> lock(P.mutex);
    if (!P.stats.lock_pages || P.locked.count(block)) return block;
  }
  const bool ok = host_memory_lock(block, capacity);
  std::lock_guard<std::mutex> lock(P.mutex);
  if (!ok) {
    P.stats.lock_pages = false;
    ++P.stats.lock_failures;
    return block;
  }
  P.locked.insert(block);
  ++P.stats.locked_blocks;
  P.stats.locked_bytes += capacity;
  return block;
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
  uint8_t* reused = nullptr;
  bool huge = false;
  {
    std::lock_guard<std::mutex> lock(P.mutex);
    auto it = P.idle.lower_bound(rounded);
    if (it != P.idle.end() && it->first <= rounded + rounded / 4) {
      *capacity = it->first;
      reused = it->second;
      P.stats.idle_bytes -= it->first;
      --P.stats.idle_blocks;
      ++P.stats.reused;
      P.idle.erase(it);
    } else {
      ++P.stats.allocated;
      huge = P.stats.huge_pages && rounded >= kHugePage;
    }
  }
  if (reused) return lock_if_asked(reused, *capacity);
  // page-aligned, so that no two blocks share a page (page-locking works by pages); a block of
  // huge pages' size or more is aligned to them and asks for them: a fresh block is filled with a
  // page fault per 2 MiB instead of per 4 KiB (benchmarks/bench_fresh_pages.py)
  void* p = nullptr;
  if (posix_memalign(&p, huge ? kHugePage : 4096, rounded) != 0 || !p) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (huge) madvise(p, rounded / kHugePage * kHugePage, MADV_HUGEPAGE);  // advice: refused is fine
#endif
  *capacity = rounded;
  return lock_if_asked(static_cast<uint8_t*>(p), rounded);
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
    P.free_block(block, capacity);
    return;
  }
  std::free(block);
}

void buffer_pool_huge_pages(bool on) {
  Pool& P = pool();
  std::lock_guard<std::mutex> lock(P.mutex);
  P.stats.huge_pages = on;
}

void buffer_pool_lock_pages(bool on) {
  Pool& P = pool();
  std::lock_guard<std::mutex> lock(P.mutex);
  P.stats.lock_pages = on;
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
