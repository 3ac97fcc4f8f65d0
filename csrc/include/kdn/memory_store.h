// Host-memory blob store: byte capacity, LRU eviction, thread-safe.
//
// Contract: every method is thread-safe (one internal mutex, never held during copies of blob
// bytes). `get` hands out a shared reference, so an entry evicted or removed while a reader still
// copies from it stays alive until the reader drops it. `put` of a blob larger than the capacity
// is refused (returns false) and counted; otherwise least-recently-used entries are evicted until
// the new one fits, so used_bytes() never exceeds capacity().
#pragma once

#include <list>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "kdn/blob.h"

namespace kdn {

struct Key128Hash {
  size_t operator()(const Key128& k) const {
    uint64_t v;
    static_assert(sizeof(v) <= sizeof(Key128), "key too short");
    __builtin_memcpy(&v, k.data(), sizeof(v));
    return static_cast<size_t>(v);
  }
};

struct MemoryStoreStats {
  uint64_t hits = 0, misses = 0, puts = 0, evictions = 0, rejected = 0;
  uint64_t entries = 0, used_bytes = 0, capacity_bytes = 0;
};

class MemoryStore {
 public:
  explicit MemoryStore(uint64_t capacity_bytes);

  bool put(const Key128& key, BufferPtr blob);
  BufferPtr get(const Key128& key);  // nullptr on miss; refreshes recency on hit
  bool contains(const Key128& key) const;
  // Number of leading keys present (stops at the first missing one); does not count as hits.
  int64_t count_prefix(const std::vector<Key128>& keys) const;
  bool remove(const Key128& key);
  void clear();
  MemoryStoreStats stats() const;
  uint64_t capacity() const { return capacity_; }

 private:
  struct Entry {
    Key128 key;
    BufferPtr blob;
  };
  void evict_until_fits(uint64_t incoming);  // caller holds mutex_

  const uint64_t capacity_;
  mutable std::mutex mutex_;
  std::list<Entry> lru_;  // front = most recently used
  std::unordered_map<Key128, std::list<Entry>::iterator, Key128Hash> index_;
  MemoryStoreStats stats_;
};

}  // namespace kdn
