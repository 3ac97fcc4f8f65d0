// Host-memory blob store (contract in kdn/memory_store.h).
#include "kdn/memory_store.h"

namespace kdn {

MemoryStore::MemoryStore(uint64_t capacity_bytes, const std::string& policy)
    : policy_(policy), index_(capacity_bytes, policy) {}

bool MemoryStore::put(const Key128& key, BufferPtr blob) {
  KDN_CHECK(blob != nullptr, "MemoryStore.put: blob is null");
  if (blob->partial()) return false;  // a blob read in part is never kept
  std::vector<std::pair<Key128, BufferPtr>> spilled;
  SpillFn spill;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.puts;
    const bool was_pinned = index_.is_pinned(key);
    const int priority = index_.priority_of(key);
    if (index_.erase(key)) blobs_.erase(key);  // replace: drop the old value first
    std::vector<Key128> victims;
    const uint64_t owner = owner_of_blob(blob->data(), blob->size());
    if (!index_.make_room(blob->size(), &victims, owner)) {
      ++stats_.rejected;
      return false;
    }
    for (const auto& v : victims) {
      auto it = blobs_.find(v);
      if (spill_) spilled.emplace_back(v, std::move(it->second));
      blobs_.erase(it);
    }
    stats_.evictions += victims.size();
    index_.insert(key, blob->size(), owner);
    if (was_pinned) index_.pin(key, 0);
    index_.set_priority(key, priority);
    blobs_[key] = std::move(blob);
    spill = spill_;
  }
  for (const auto& [k, b] : spilled) spill(k, b);  // outside the lock; drops our references after
  return true;
}

void MemoryStore::set_quota(uint64_t owner, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  index_.set_quota(owner, bytes);
}

void MemoryStore::record_events(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  index_.record_events(on);
}

std::vector<TierIndex::Event> MemoryStore::take_events() {
  std::lock_guard<std::mutex> lock(mutex_);
  return index_.take_events();
}

BufferPtr MemoryStore::get(const Key128& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = blobs_.find(key);
  if (it == blobs_.end()) {
    ++stats_.misses;
    return nullptr;
  }
  index_.touch(key);
  ++stats_.hits;
  return it->second;
}

bool MemoryStore::contains(const Key128& key) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return index_.contains(key);
}

int64_t MemoryStore::count_prefix(const std::vector<Key128>& keys) const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t n = 0;
  while (n < static_cast<int64_t>(keys.size()) && index_.contains(keys[n])) ++n;
  return n;
}

bool MemoryStore::remove(const Key128& key) {
  BufferPtr dropped;  // released after the lock
  std::lock_guard<std::mutex> lock(mutex_);
  if (!index_.erase(key)) return false;
  auto it = blobs_.find(key);
  dropped = std::move(it->second);
  blobs_.erase(it);
  return true;
}

bool MemoryStore::pin(const Key128& key, double ttl_seconds) {
  std::lock_guard<std::mutex> lock(mutex_);
  return index_.pin(key, ttl_seconds);
}

bool MemoryStore::unpin(const Key128& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  return index_.unpin(key);
}

bool MemoryStore::set_priority(const Key128& key, int priority) {
  std::lock_guard<std::mutex> lock(mutex_);
  return index_.set_priority(key, priority);
}

void MemoryStore::clear() {
  std::unordered_map<Key128, BufferPtr, Key128Hash> dropped;
  std::lock_guard<std::mutex> lock(mutex_);
  index_.clear();
  dropped.swap(blobs_);
}

std::vector<std::pair<Key128, BufferPtr>> MemoryStore::entries() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {blobs_.begin(), blobs_.end()};
}

void MemoryStore::set_spill(SpillFn spill) {
  std::lock_guard<std::mutex> lock(mutex_);
  spill_ = std::move(spill);
}

TierStats MemoryStore::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  TierStats s = stats_;
  index_.fill_sizes(&s);
  return s;
}

}  // namespace kdn
