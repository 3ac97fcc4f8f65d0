// Host-memory blob store: byte capacity, pluggable eviction (lru, s3fifo), pins with TTL.
//
// Contract: every method is thread-safe (one internal mutex, never held while blob bytes are
// copied or while the spill callback runs). `get` hands out a shared reference, so an entry
// evicted or removed while a reader still copies from it stays alive until the reader drops it;
// the bytes return to the allocator when the last reference goes (Buffer::live_bytes tells).
// `put` of a blob that cannot fit beside the pinned entries is refused (returns false, counted
// as rejected) without evicting anything; otherwise unpinned entries are evicted in policy order
// until it fits, so used_bytes() never exceeds capacity(). Evicted entries are handed to the
// spill callback (if set), e.g. a disk tier's write-behind queue for write-back.
#pragma once

#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "kdn/blob.h"
#include "kdn/tier_index.h"

namespace kdn {

using SpillFn = std::function<void(const Key128&, const BufferPtr&)>;

class MemoryStore {
 public:
  explicit MemoryStore(uint64_t capacity_bytes, const std::string& policy = "lru");

  bool put(const Key128& key, BufferPtr blob);  // replaces an existing value (keeping its pin)
  BufferPtr get(const Key128& key);             // nullptr on miss; a hit informs the policy
  bool contains(const Key128& key) const;
  // Number of leading keys present (stops at the first missing one); does not count as hits.
  int64_t count_prefix(const std::vector<Key128>& keys) const;
  bool remove(const Key128& key);
  bool pin(const Key128& key, double ttl_seconds);
  bool unpin(const Key128& key);
  bool set_priority(const Key128& key, int priority);  // TierIndex::set_priority
  void set_quota(uint64_t owner, uint64_t bytes);  // TierIndex::set_quota (0: none)
  void record_events(bool on);                      // TierIndex::record_events
  std::vector<TierIndex::Event> take_events();
  void clear();
  void set_spill(SpillFn spill);
  std::vector<std::pair<Key128, BufferPtr>> entries() const;  // a snapshot (write-back's flush at exit)
  TierStats stats() const;
  uint64_t capacity() const { return index_.capacity(); }
  const std::string& policy() const { return policy_; }

 private:
  const std::string policy_;
  mutable std::mutex mutex_;
  TierIndex index_;
  std::unordered_map<Key128, BufferPtr, Key128Hash> blobs_;
  SpillFn spill_;
  TierStats stats_;
};

}  // namespace kdn
