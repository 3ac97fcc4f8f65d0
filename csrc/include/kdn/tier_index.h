// The bookkeeping every tier shares: which keys it holds, their sizes, pins and eviction order.
//
// Not thread-safe: a tier calls it under its own mutex. Capacity is a hard bound: make_room
// either frees enough unpinned bytes or refuses (without evicting anything) when the entry could
// never fit beside the pinned ones. Pins may carry a time-to-live; an expired pin is released
// (the entry becomes evictable again, as if newly inserted) the next time room is made.
//
// Fair sharing: every entry has an owner (a tenant: the first 8 bytes of its blob's fingerprint,
// owner_of_blob), each owner its own eviction order. Room is made by evicting from the owner
// furthest over its fair share (capacity / owners holding entries) first, so one tenant streaming
// new prompts evicts its own entries, not another's working set within its share. One owner: the
// policy's order, as before.
//
// Quotas: an owner may be given a byte quota (set_quota). It is a hard bound on that owner's bytes
// (an insert over it evicts the owner's own entries first, or is refused when its pinned bytes
// leave no room) and its share in the eviction order; owners without one share what the quotas
// of the owners present leave.
//
// Priorities: an entry may be given a priority (set_priority; 0 by default). An owner's entries of
// a lower priority leave before its higher ones, each level in the policy's order. A priority
// orders its owner's own entries only: which owner gives up bytes is the fair-share rule's, so no
// tenant's priorities evict another's entries. Unlike a pin, an entry of any priority stays
// evictable.
//
// Events: while recording (record_events), every insert and every removal (evicted, erased,
// cleared) is logged in order for take_events: what a KV event stream announces. At most
// kMaxEvents wait; beyond that the oldest are dropped and counted.
#pragma once

#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "kdn/eviction.h"

namespace kdn {

// Counters every tier reports (a tier's own counters plus its index's sizes).
struct TierStats {
  uint64_t hits = 0, misses = 0, puts = 0, evictions = 0, rejected = 0;
  uint64_t entries = 0, used_bytes = 0, capacity_bytes = 0, pinned_entries = 0, pinned_bytes = 0;
  uint64_t tenants = 0;  // owners holding entries (TierIndex: fair sharing)
};

class TierIndex {
 public:
  TierIndex(uint64_t capacity_bytes, const std::string& policy);

  bool contains(const Key128& key) const { return sizes_.count(key) != 0; }
  void touch(const Key128& key);
  // Frees unpinned entries until `bytes` more of `owner` fit (victims are removed and appended to
  // `victims`): the owner's own first while it would be over its quota, then the tier's. Refuses
  // without evicting anything when they could never fit beside the pinned ones. No owner: no quota.
  bool make_room(uint64_t bytes, std::vector<Key128>* victims, std::optional<uint64_t> owner = std::nullopt);
  void insert(const Key128& key, uint64_t bytes, uint64_t owner = 0);  // the key absent, room made
  bool erase(const Key128& key);
  // Pins a present key (ttl_seconds <= 0: until unpinned; pinning again resets the ttl).
  bool pin(const Key128& key, double ttl_seconds);
  bool unpin(const Key128& key);
  bool is_pinned(const Key128& key) const { return pins_.count(key) != 0; }
  // Moves a present key to `priority` among its owner's entries (lower leaves first); false if absent.
  bool set_priority(const Key128& key, int priority);
  int priority_of(const Key128& key) const;  // 0 when never set (or absent)
  void expire_pins();
  void clear();

  uint64_t capacity() const { return capacity_; }
  uint64_t used_bytes() const { return used_; }
  uint64_t entries() const { return sizes_.size(); }
  uint64_t pinned_entries() const { return pins_.size(); }
  uint64_t pinned_bytes() const { return pinned_bytes_; }
  uint64_t owners() const { return owners_.size(); }
  uint64_t owner_bytes(uint64_t owner) const;
  // A byte quota for `owner` (0: none), kept while it holds nothing; applies from its next insert.
  void set_quota(uint64_t owner, uint64_t bytes);
  std::vector<Key128> keys() const;
  struct Event {
    bool stored;  // inserted; else removed
    Key128 key;
  };
  static constexpr size_t kMaxEvents = 1 << 20;
  void record_events(bool on);  // off (the default): nothing logged, what was logged dropped
  std::vector<Event> take_events();
  uint64_t events_dropped() const { return events_dropped_; }
  void fill_sizes(TierStats* stats) const;  // entries, used/capacity/pinned bytes

 private:
  using Clock = std::chrono::steady_clock;
  struct Owner {
    // the owner's evictable entries by priority (lowest first), each level in eviction order
    std::map<int, std::unique_ptr<EvictionPolicy>> levels;
    uint64_t used = 0;    // its bytes, pinned ones included
    uint64_t pinned = 0;  // of which pinned
    bool pop_victim(Key128* victim);  // from its lowest level holding an evictable entry
  };
  int64_t unquoted_share() const;  // what the quotas of the owners present leave, per owner without one
  EvictionPolicy& policy_of(const Key128& key);  // its owner's level of its priority (made if new)
  bool pop_fair_victim(Key128* victim, std::optional<uint64_t> incoming, uint64_t bytes);
  void forget(const Key128& key, uint64_t bytes);  // drop a removed entry's size and owner
  const uint64_t capacity_;
  const std::string policy_name_;
  std::unordered_map<uint64_t, Owner> owners_;
  std::unordered_map<uint64_t, uint64_t> quotas_;
  std::unordered_map<Key128, uint64_t, Key128Hash> owner_of_;
  std::unordered_map<Key128, uint64_t, Key128Hash> sizes_;
  std::unordered_map<Key128, Clock::time_point, Key128Hash> pins_;  // deadline (max = none)
  std::unordered_map<Key128, int, Key128Hash> priorities_;          // the entries not at 0
  uint64_t used_ = 0, pinned_bytes_ = 0;
  void log(bool stored, const Key128& key);
  bool recording_ = false;
  std::deque<Event> events_;
  uint64_t events_dropped_ = 0;
};

// The owner of a blob (the first 8 bytes of its header's fingerprint: its tenant and model); 0 for
// bytes that are not a blob.
uint64_t owner_of_blob(const uint8_t* data, size_t size);

}  // namespace kdn
