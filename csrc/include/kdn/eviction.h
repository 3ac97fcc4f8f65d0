// Eviction policies of the tiers: the order in which evictable entries leave a full tier.
//
// A policy only sees evictable entries: a tier removes an entry from its policy when it is
// pinned, removed or replaced, and inserts it again when unpinned. Policies are not thread-safe;
// the tier calls them under its own mutex.
//   lru     least recently used out first (default).
//   s3fifo  S3-FIFO (Yang et al., SOSP'23): a small FIFO (10% of the bytes) admits new entries;
//           entries hit while there move to the main FIFO, the others leave and are remembered
//           in a ghost FIFO (keys only) so that a quick re-insert goes straight to main; main is
//           a FIFO with reinsertion (a 2-bit hit counter, decremented on each pass). One pass
//           over many new keys (a scan) only churns the small queue: scan-resistant.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kdn/hash.h"

namespace kdn {

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  virtual void insert(const Key128& key, uint64_t bytes) = 0;  // a new evictable entry
  virtual void touch(const Key128& key) = 0;                   // a hit; unknown keys are ignored
  virtual void erase(const Key128& key) = 0;                   // no longer evictable (removed, pinned)
  virtual bool pop_victim(Key128* victim) = 0;                 // next to evict; false if none
  virtual void clear() = 0;
};

// "lru" or "s3fifo"; throws InputError naming the valid choices otherwise.
std::unique_ptr<EvictionPolicy> make_eviction_policy(const std::string& name, uint64_t capacity_bytes);
std::vector<std::string> eviction_policy_names();

}  // namespace kdn
