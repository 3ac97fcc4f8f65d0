// Key, size, pin and eviction-order bookkeeping shared by the tiers (contract in kdn/tier_index.h).
#include "kdn/tier_index.h"

#include <algorithm>
#include <cstring>

#include "kdn/blob.h"
#include "kdn/common.h"

namespace kdn {

TierIndex::TierIndex(uint64_t capacity_bytes, const std::string& policy)
    : capacity_(capacity_bytes), policy_name_(policy) {
  make_eviction_policy(policy, capacity_bytes);  // an unknown policy name throws here, not at the first insert
}

EvictionPolicy& TierIndex::policy_of(const Key128& key) {
  auto& level = owners_.at(owner_of_.at(key)).levels[priority_of(key)];
  if (!level) level = make_eviction_policy(policy_name_, capacity_);
  return *level;
}

int TierIndex::priority_of(const Key128& key) const {
  auto it = priorities_.find(key);
  return it == priorities_.end() ? 0 : it->second;
}

bool TierIndex::Owner::pop_victim(Key128* victim) {
  for (auto& [priority, policy] : levels)
    if (policy->pop_victim(victim)) return true;
  return false;
}

void TierIndex::touch(const Key128& key) {
  if (owner_of_.count(key) && !pins_.count(key)) policy_of(key).touch(key);
}

bool TierIndex::set_priority(const Key128& key, int priority) {
  auto it = sizes_.find(key);
  if (it == sizes_.end()) return false;
  if (priority == priority_of(key)) return true;
  const bool evictable = !pins_.count(key);
  if (evictable) policy_of(key).erase(key);
  if (priority == 0) priorities_.erase(key);
  else priorities_[key] = priority;
  if (evictable) policy_of(key).insert(key, it->second);
  return true;
}

int64_t TierIndex::unquoted_share() const {
  uint64_t reserved = 0, sharing = 0;  // the quotas of the owners present, and how many have none
  for (const auto& [id, o] : owners_) {
    auto q = quotas_.find(id);
    if (q != quotas_.end()) reserved += q->second;
    else ++sharing;
  }
  return static_cast<int64_t>((capacity_ - std::min(capacity_, reserved)) / std::max<uint64_t>(1, sharing));
}

bool TierIndex::pop_fair_victim(Key128* victim, std::optional<uint64_t> incoming, uint64_t bytes) {
  // owners by how far over their allowance (a quota, else the share the quotas leave) they are, the
  // incoming owner's new bytes counted, furthest first; the first with an evictable entry gives it
  const int64_t share = unquoted_share();
  std::vector<std::pair<int64_t, Owner*>> order;
  for (auto& [id, owner] : owners_) {
    const uint64_t used = owner.used + (incoming == id ? bytes : 0);
    auto quota = quotas_.find(id);
    order.emplace_back(static_cast<int64_t>(used) - (quota != quotas_.end() ? static_cast<int64_t>(quota->second) : share),
                       &owner);
  }
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (auto& [over, owner] : order)
    if (owner->pop_victim(victim)) return true;
  return false;
}

void TierIndex::forget(const Key128& key, uint64_t bytes) {
  auto it = owner_of_.find(key);
  auto owner = owners_.find(it->second);
  owner->second.used -= bytes;
  if (owner->second.used == 0) owners_.erase(owner);  // holds nothing: no longer shares the tier
  owner_of_.erase(it);
  used_ -= bytes;
  sizes_.erase(key);
  priorities_.erase(key);
  log(false, key);
}

void TierIndex::log(bool stored, const Key128& key) {
  if (!recording_) return;
  if (events_.size() >= kMaxEvents) {
    events_.pop_front();
    ++events_dropped_;
  }
  events_.push_back({stored, key});
}

void TierIndex::record_events(bool on) {
  recording_ = on;
  if (!on) events_.clear();
}

std::vector<TierIndex::Event> TierIndex::take_events() {
  std::vector<Event> out(events_.begin(), events_.end());
  events_.clear();
  return out;
}

bool TierIndex::make_room(uint64_t bytes, std::vector<Key128>* victims, std::optional<uint64_t> owner) {
  expire_pins();
  if (bytes > capacity_ - pinned_bytes_) return false;
  Key128 victim;
  auto quota = owner ? quotas_.find(*owner) : quotas_.end();
  if (quota != quotas_.end()) {
    auto it = owners_.find(*owner);
    const uint64_t pinned = it == owners_.end() ? 0 : it->second.pinned;
    if (bytes > quota->second - std::min(quota->second, pinned)) return false;
    while (it != owners_.end() && it->second.used + bytes > quota->second && it->second.pop_victim(&victim)) {
      forget(victim, sizes_.at(victim));  // the owner's own, least wanted first
      victims->push_back(victim);
      it = owners_.find(*owner);
    }
  }
  while (used_ + bytes > capacity_ && pop_fair_victim(&victim, owner, bytes)) {
    forget(victim, sizes_.at(victim));
    victims->push_back(victim);
  }
  return used_ + bytes <= capacity_;
}

void TierIndex::insert(const Key128& key, uint64_t bytes, uint64_t owner) {
  KDN_CHECK(!contains(key), "TierIndex.insert: key already present");
  sizes_[key] = bytes;
  used_ += bytes;
  owner_of_[key] = owner;
  owners_[owner].used += bytes;
  policy_of(key).insert(key, bytes);
  log(true, key);
}

bool TierIndex::erase(const Key128& key) {
  auto it = sizes_.find(key);
  if (it == sizes_.end()) return false;
  if (pins_.erase(key)) {
    pinned_bytes_ -= it->second;
    owners_.at(owner_of_.at(key)).pinned -= it->second;
  } else {
    policy_of(key).erase(key);
  }
  forget(key, it->second);
  return true;
}

void TierIndex::set_quota(uint64_t owner, uint64_t bytes) {
  if (bytes == 0) quotas_.erase(owner);
  else quotas_[owner] = std::min(bytes, capacity_);
}

uint64_t TierIndex::owner_bytes(uint64_t owner) const {
  auto it = owners_.find(owner);
  return it == owners_.end() ? 0 : it->second.used;
}

bool TierIndex::pin(const Key128& key, double ttl_seconds) {
  auto it = sizes_.find(key);
  if (it == sizes_.end()) return false;
  auto deadline = Clock::time_point::max();
  const auto now = Clock::now();
  // Saturate: a TTL beyond what the clock can hold (inf, 1e30 s) pins until unpinned, never "already expired".
  const double room = std::chrono::duration<double>(Clock::time_point::max() - now).count();
  if (ttl_seconds > 0 && ttl_seconds < room * 0.5)
    deadline = now + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(ttl_seconds));
  if (!pins_.count(key)) {
    policy_of(key).erase(key);
    pinned_bytes_ += it->second;
    owners_.at(owner_of_.at(key)).pinned += it->second;
  }
  pins_[key] = deadline;
  return true;
}

bool TierIndex::unpin(const Key128& key) {
  auto it = pins_.find(key);
  if (it == pins_.end()) return false;
  pins_.erase(it);
  uint64_t bytes = sizes_.at(key);
  pinned_bytes_ -= bytes;
  owners_.at(owner_of_.at(key)).pinned -= bytes;
  policy_of(key).insert(key, bytes);
  return true;
}

void TierIndex::expire_pins() {
  if (pins_.empty()) return;
  auto now = Clock::now();
  std::vector<Key128> expired;
  for (const auto& [key, deadline] : pins_)
    if (deadline <= now) expired.push_back(key);
  for (const auto& key : expired) unpin(key);
}

void TierIndex::clear() {
  for (const auto& [key, bytes] : sizes_) log(false, key);
  owners_.clear();
  owner_of_.clear();
  sizes_.clear();
  pins_.clear();
  priorities_.clear();
  used_ = pinned_bytes_ = 0;
}

void TierIndex::fill_sizes(TierStats* s) const {
  s->entries = entries();
  s->used_bytes = used_bytes();
  s->capacity_bytes = capacity();
  s->pinned_entries = pinned_entries();
  s->pinned_bytes = pinned_bytes();
  s->tenants = owners();
}

std::vector<Key128> TierIndex::keys() const {
  std::vector<Key128> out;
  out.reserve(sizes_.size());
  for (const auto& kv : sizes_) out.push_back(kv.first);
  return out;
}

uint64_t owner_of_blob(const uint8_t* data, size_t size) {
  BlobHeader h;
  if (!blob_parse_header(data, size, &h).ok) return 0;
  uint64_t owner;
  std::memcpy(&owner, h.fingerprint.data(), sizeof(owner));
  return owner;
}

}  // namespace kdn
