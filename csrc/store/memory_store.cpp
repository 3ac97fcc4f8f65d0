// Host-memory LRU blob store (contract in kdn/memory_store.h).
#include "kdn/memory_store.h"

namespace kdn {

MemoryStore::MemoryStore(uint64_t capacity_bytes) : capacity_(capacity_bytes) {
  stats_.capacity_bytes = capacity_bytes;
}

void MemoryStore::evict_until_fits(uint64_t incoming) {
  while (!lru_.empty() && stats_.used_bytes + incoming > capacity_) {
    Entry& victim = lru_.back();
    stats_.used_bytes -= victim.blob->size();
    index_.erase(victim.key);
    lru_.pop_back();
    ++stats_.evictions;
  }
}

bool MemoryStore::put(const Key128& key, BufferPtr blob) {
  KDN_CHECK(blob != nullptr, "MemoryStore.put: blob is null");
  std::lock_guard<std::mutex> lock(mutex_);
  ++stats_.puts;
  auto it = index_.find(key);
  if (it != index_.end()) {  // overwrite: drop the old value first
    stats_.used_bytes -= it->second->blob->size();
    lru_.erase(it->second);
    index_.erase(it);
  }
  if (blob->size() > capacity_) {
    ++stats_.rejected;
    stats_.entries = index_.size();
    return false;
  }
  evict_until_fits(blob->size());
  lru_.push_front(Entry{key, std::move(blob)});
  index_[key] = lru_.begin();
  stats_.used_bytes += lru_.front().blob->size();
  stats_.entries = index_.size();
  return true;
}

BufferPtr MemoryStore::get(const Key128& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = index_.find(key);
  if (it == index_.end()) {
    ++stats_.misses;
    return nullptr;
  }
  lru_.splice(lru_.begin(), lru_, it->second);
  ++stats_.hits;
  return it->second->blob;
}

bool MemoryStore::contains(const Key128& key) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return index_.count(key) != 0;
}

int64_t MemoryStore::count_prefix(const std::vector<Key128>& keys) const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t n = 0;
  while (n < static_cast<int64_t>(keys.size()) && index_.count(keys[n])) ++n;
  return n;
}

bool MemoryStore::remove(const Key128& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = index_.find(key);
  if (it == index_.end()) return false;
  stats_.used_bytes -= it->second->blob->size();
  lru_.erase(it->second);
  index_.erase(it);
  stats_.entries = index_.size();
  return true;
}

void MemoryStore::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  lru_.clear();
  index_.clear();
  stats_.used_bytes = 0;
  stats_.entries = 0;
}

MemoryStoreStats MemoryStore::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

}  // namespace kdn
