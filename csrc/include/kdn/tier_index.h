// The bookkeeping every tier shares: which keys it holds, their sizes, pins and eviction order.
//
// Not thread-safe: a tier calls it under its own mutex. Capacity is a hard bound: make_room
// either frees enough unpinned bytes or refuses (without evicting anything) when the entry could
// never fit beside the pinned ones. Pins may carry a time-to-live; an expired pin is released
// (the entry becomes evictable again, as if newly inserted) the next time room is made.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "kdn/eviction.h"

namespace kdn {

// Counters every tier reports (a tier's own counters plus its index's sizes).
struct TierStats {
  uint64_t hits = 0, misses = 0, puts = 0, evictions = 0, rejected = 0;
  uint64_t entries = 0, used_bytes = 0, capacity_bytes = 0, pinned_entries = 0, pinned_bytes = 0;
};

class TierIndex {
 public:
  TierIndex(uint64_t capacity_bytes, const std::string& policy);

  bool contains(const Key128& key) const { return sizes_.count(key) != 0; }
  void touch(const Key128& key);
  // Frees unpinned entries until `bytes` more fit (victims are removed and appended to `victims`).
  bool make_room(uint64_t bytes, std::vector<Key128>* victims);
  void insert(const Key128& key, uint64_t bytes);  // the key must be absent and room made
  bool erase(const Key128& key);
  // Pins a present key (ttl_seconds <= 0: until unpinned; pinning again resets the ttl).
  bool pin(const Key128& key, double ttl_seconds);
  bool unpin(const Key128& key);
  bool is_pinned(const Key128& key) const { return pins_.count(key) != 0; }
  void expire_pins();
  void clear();

  uint64_t capacity() const { return capacity_; }
  uint64_t used_bytes() const { return used_; }
  uint64_t entries() const { return sizes_.size(); }
  uint64_t pinned_entries() const { return pins_.size(); }
  uint64_t pinned_bytes() const { return pinned_bytes_; }
  std::vector<Key128> keys() const;
  void fill_sizes(TierStats* stats) const;  // entries, used/capacity/pinned bytes

 private:
  using Clock = std::chrono::steady_clock;
  const uint64_t capacity_;
  std::unique_ptr<EvictionPolicy> policy_;
  std::unordered_map<Key128, uint64_t, Key128Hash> sizes_;
  std::unordered_map<Key128, Clock::time_point, Key128Hash> pins_;  // deadline (max = none)
  uint64_t used_ = 0, pinned_bytes_ = 0;
};

}  // namespace kdn
