// Key, size, pin and eviction-order bookkeeping shared by the tiers (contract in kdn/tier_index.h).
#include "kdn/tier_index.h"

#include "kdn/common.h"

namespace kdn {

TierIndex::TierIndex(uint64_t capacity_bytes, const std::string& policy)
    : capacity_(capacity_bytes), policy_(make_eviction_policy(policy, capacity_bytes)) {}

void TierIndex::touch(const Key128& key) { policy_->touch(key); }

bool TierIndex::make_room(uint64_t bytes, std::vector<Key128>* victims) {
  expire_pins();
  if (bytes > capacity_ - pinned_bytes_) return false;
  Key128 victim;
  while (used_ + bytes > capacity_ && policy_->pop_victim(&victim)) {
    used_ -= sizes_.at(victim);
    sizes_.erase(victim);
    victims->push_back(victim);
  }
  return used_ + bytes <= capacity_;
}

void TierIndex::insert(const Key128& key, uint64_t bytes) {
  KDN_CHECK(!contains(key), "TierIndex.insert: key already present");
  sizes_[key] = bytes;
  used_ += bytes;
  policy_->insert(key, bytes);
}

bool TierIndex::erase(const Key128& key) {
  auto it = sizes_.find(key);
  if (it == sizes_.end()) return false;
  if (pins_.erase(key)) pinned_bytes_ -= it->second;
  else policy_->erase(key);
  used_ -= it->second;
  sizes_.erase(it);
  return true;
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
    policy_->erase(key);
    pinned_bytes_ += it->second;
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
  policy_->insert(key, bytes);
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
  policy_->clear();
  sizes_.clear();
  pins_.clear();
  used_ = pinned_bytes_ = 0;
}

void TierIndex::fill_sizes(TierStats* s) const {
  s->entries = entries();
  s->used_bytes = used_bytes();
  s->capacity_bytes = capacity();
  s->pinned_entries = pinned_entries();
  s->pinned_bytes = pinned_bytes();
}

std::vector<Key128> TierIndex::keys() const {
  std::vector<Key128> out;
  out.reserve(sizes_.size());
  for (const auto& kv : sizes_) out.push_back(kv.first);
  return out;
}

}  // namespace kdn
