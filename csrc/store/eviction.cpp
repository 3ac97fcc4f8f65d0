// LRU and S3-FIFO eviction policies (contract in kdn/eviction.h).
#include "kdn/eviction.h"

#include <algorithm>
#include <list>
#include <unordered_map>

#include "kdn/common.h"

namespace kdn {
namespace {

class LruPolicy final : public EvictionPolicy {
 public:
  void insert(const Key128& key, uint64_t) override {
    erase(key);
    order_.push_front(key);
    where_[key] = order_.begin();
  }
  void touch(const Key128& key) override {
    auto it = where_.find(key);
    if (it != where_.end()) order_.splice(order_.begin(), order_, it->second);
  }
  void erase(const Key128& key) override {
    auto it = where_.find(key);
    if (it == where_.end()) return;
    order_.erase(it->second);
    where_.erase(it);
  }
  bool pop_victim(Key128* victim) override {
    if (order_.empty()) return false;
    *victim = order_.back();
    where_.erase(order_.back());
    order_.pop_back();
    return true;
  }
  void clear() override {
    order_.clear();
    where_.clear();
  }

 private:
  std::list<Key128> order_;  // front = most recent
  std::unordered_map<Key128, std::list<Key128>::iterator, Key128Hash> where_;
};

class S3FifoPolicy final : public EvictionPolicy {
 public:
  explicit S3FifoPolicy(uint64_t capacity)
      : small_target_(std::max<uint64_t>(1, capacity / 10)), ghost_limit_(capacity - capacity / 10) {}

  void insert(const Key128& key, uint64_t bytes) override {
    erase(key);
    bool was_ghost = ghost_seq_.erase(key) != 0;
    Queue q = was_ghost ? kMain : kSmall;
    list(q).push_front(Node{key, bytes, 0, q});
    where_[key] = list(q).begin();
    bytes_[q] += bytes;
  }
  void touch(const Key128& key) override {
    auto it = where_.find(key);
    if (it != where_.end() && it->second->freq < 3) ++it->second->freq;
  }
  void erase(const Key128& key) override {
    auto it = where_.find(key);
    if (it == where_.end()) return;
    Node& n = *it->second;
    bytes_[n.queue] -= n.bytes;
    list(n.queue).erase(it->second);
    where_.erase(it);
  }
  bool pop_victim(Key128* victim) override {
    for (;;) {
      if (!small_.empty() && (bytes_[kSmall] >= small_target_ || main_.empty())) {
        Node n = small_.back();
        small_.pop_back();
        bytes_[kSmall] -= n.bytes;
        if (n.freq > 0) {  // hit while in the small queue: promote to main
          n.freq = 0;
          n.queue = kMain;
          main_.push_front(n);
          where_[n.key] = main_.begin();
          bytes_[kMain] += n.bytes;
          continue;
        }
        where_.erase(n.key);
        remember_ghost(n.key, n.bytes);
        *victim = n.key;
        return true;
      }
      if (main_.empty()) return false;
      Node& tail = main_.back();
      if (tail.freq > 0) {  // reinsert with one less credit
        --tail.freq;
        main_.splice(main_.begin(), main_, std::prev(main_.end()));
        continue;
      }
      *victim = tail.key;
      bytes_[kMain] -= tail.bytes;
      where_.erase(tail.key);
      main_.pop_back();
      return true;
    }
  }
  void clear() override {
    small_.clear();
    main_.clear();
    where_.clear();
    ghost_.clear();
    ghost_seq_.clear();
    bytes_[kSmall] = bytes_[kMain] = ghost_bytes_ = 0;
  }

 private:
  enum Queue { kSmall = 0, kMain = 1 };
  struct Node {
    Key128 key;
    uint64_t bytes;
    uint8_t freq;
    Queue queue;
  };
  std::list<Node>& list(Queue q) { return q == kSmall ? small_ : main_; }

  // The ghost FIFO holds up to ghost_limit_ bytes' worth of evicted keys. A key may have stale
  // records (re-inserted since); ghost_seq_ holds its newest one, which alone makes it a ghost.
  void remember_ghost(const Key128& key, uint64_t bytes) {
    ghost_.push_front(Ghost{key, bytes, ++ghost_counter_});
    ghost_seq_[key] = ghost_counter_;
    ghost_bytes_ += bytes;
    while (ghost_bytes_ > ghost_limit_ && !ghost_.empty()) {
      const Ghost& old = ghost_.back();
      auto it = ghost_seq_.find(old.key);
      if (it != ghost_seq_.end() && it->second == old.seq) ghost_seq_.erase(it);
      ghost_bytes_ -= old.bytes;
      ghost_.pop_back();
    }
  }

  const uint64_t small_target_, ghost_limit_;
  std::list<Node> small_, main_;  // front = newest
  std::unordered_map<Key128, std::list<Node>::iterator, Key128Hash> where_;
  struct Ghost {
    Key128 key;
    uint64_t bytes, seq;
  };
  std::list<Ghost> ghost_;
  std::unordered_map<Key128, uint64_t, Key128Hash> ghost_seq_;
  uint64_t ghost_counter_ = 0;
  uint64_t bytes_[2] = {0, 0};
  uint64_t ghost_bytes_ = 0;
};

}  // namespace

std::vector<std::string> eviction_policy_names() { return {"lru", "s3fifo"}; }

std::unique_ptr<EvictionPolicy> make_eviction_policy(const std::string& name, uint64_t capacity_bytes) {
  if (name == "lru") return std::make_unique<LruPolicy>();
  if (name == "s3fifo") return std::make_unique<S3FifoPolicy>(capacity_bytes);
  throw InputError("unknown eviction policy '" + name + "' (choose lru or s3fifo)", __FILE__, __LINE__);
}

}  // namespace kdn
