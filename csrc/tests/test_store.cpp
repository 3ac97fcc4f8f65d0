// The tier index and eviction: LRU order against a reference, S3-FIFO keeps the hot set through a
// scan, pins (also for ever: ttl = inf) survive eviction pressure, priorities order an owner's
// own entries, capacity is never exceeded.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <list>
#include <random>

#include "kdn/memory_store.h"
#include "kdn/tier_index.h"

namespace kdn {
namespace {

Key128 key(uint32_t i) {
  Key128 k{};
  std::memcpy(k.data(), &i, sizeof(i));
  return k;
}

bool put(TierIndex* index, uint32_t i, uint64_t bytes, std::vector<Key128>* victims) {
  if (index->contains(key(i))) {
    index->touch(key(i));
    return true;
  }
  if (!index->make_room(bytes, victims)) return false;
  index->insert(key(i), bytes);
  return true;
}

TEST(TierIndex, LruEvictsInReferenceOrder) {
  TierIndex index(10 * 100, "lru");
  std::list<uint32_t> reference;  // front = most recent
  std::mt19937 rng(5);
  for (int step = 0; step < 2000; ++step) {
    const uint32_t i = rng() % 25;
    std::vector<Key128> victims;
    ASSERT_TRUE(put(&index, i, 100, &victims));
    reference.remove(i);
    reference.push_front(i);
    std::vector<Key128> expected;
    while (reference.size() > 10) {
      expected.push_back(key(reference.back()));
      reference.pop_back();
    }
    ASSERT_EQ(victims, expected) << "step " << step;
    ASSERT_LE(index.used_bytes(), index.capacity());
  }
}

class TierIndexFairness : public ::testing::TestWithParam<const char*> {};

// A tenant (owner 2) streaming never-repeated entries evicts its own, not the working set another
// tenant (owner 1) keeps within its fair share; with room to spare nothing of either is evicted.
TEST_P(TierIndexFairness, AFloodingOwnerEvictsItsOwnEntriesFirst) {
  TierIndex index(10 * 100, GetParam());
  std::vector<Key128> victims;
  for (uint32_t i = 0; i < 4; ++i) {
    ASSERT_TRUE(index.make_room(100, &victims));
    index.insert(key(i), 100, /*owner=*/1);
  }
  for (uint32_t i = 1000; i < 1500; ++i) {  // owner 2's flood
    ASSERT_TRUE(index.make_room(100, &victims));
    index.insert(key(i), 100, /*owner=*/2);
    for (uint32_t hot = 0; hot < 4; ++hot) ASSERT_TRUE(index.contains(key(hot))) << "flood entry " << i;
    ASSERT_LE(index.used_bytes(), index.capacity());
  }
  EXPECT_EQ(index.owners(), 2u);
  EXPECT_EQ(index.owner_bytes(1), 400u);
  EXPECT_EQ(index.owner_bytes(2), 600u);
  for (const auto& v : victims) EXPECT_GE(v[0] | (v[1] << 8), 1000) << "an owner-1 entry was evicted";
  victims.clear();
  // owner 1 growing past its share meets owner 2 at the fair split: each keeps about half
  for (uint32_t i = 4; i < 9; ++i) {
    ASSERT_TRUE(index.make_room(100, &victims));
    index.insert(key(i), 100, /*owner=*/1);
  }
  EXPECT_EQ(index.owner_bytes(1) + index.owner_bytes(2), 1000u);
  EXPECT_GE(index.owner_bytes(1), 500u);
  EXPECT_GE(index.owner_bytes(2), 400u);
}

// An owner with a quota never holds more than it, however much room the tier has (its own least
// wanted go first), and is allowed exactly its quota in the eviction order: owners without one
// share what it leaves. Pins count against the quota; a blob the pins leave no room for is refused
// without evicting anything.
TEST_P(TierIndexFairness, AQuotaBoundsItsOwnerAndTheOthersShareTheRest) {
  TierIndex index(10 * 100, GetParam());
  index.set_quota(2, 300);
  std::vector<Key128> victims;
  for (uint32_t i = 1000; i < 1020; ++i) {  // owner 2 alone in an empty tier: still 300 bytes at most
    ASSERT_TRUE(index.make_room(100, &victims, 2u));
    index.insert(key(i), 100, 2);
    ASSERT_LE(index.owner_bytes(2), 300u);
  }
  for (const auto& v : victims) EXPECT_LT(v[0] | (v[1] << 8), 1017) << "a recent owner-2 entry was evicted";
  victims.clear();
  for (uint32_t i = 0; i < 7; ++i) {  // owner 1 fills what the quota leaves, evicting nothing
    ASSERT_TRUE(index.make_room(100, &victims, 1u));
    index.insert(key(i), 100, 1);
  }
  EXPECT_TRUE(victims.empty());
  ASSERT_TRUE(index.make_room(100, &victims, 1u));  // the tier is full: owner 2 is at its quota, owner 1 over
  index.insert(key(7), 100, 1);
  EXPECT_EQ(index.owner_bytes(2), 300u);
  EXPECT_EQ(index.owner_bytes(1), 700u);
  victims.clear();
  for (uint32_t i = 1017; i < 1020; ++i) ASSERT_TRUE(index.pin(key(i), 0));
  EXPECT_FALSE(index.make_room(100, &victims, 2u)) << "the pins fill owner 2's quota";
  EXPECT_TRUE(victims.empty());
  index.set_quota(2, 0);  // no quota: owner 2 may grow again (its fair share is half the tier)
  EXPECT_TRUE(index.make_room(100, &victims, 2u));
}

// An owner's low-priority entries leave before its default ones, whatever the policy's order, and
// its high ones last; a priority survives a pin and its release, and orders only its owner's own
// entries: a flooding owner's high priorities do not evict another owner within its fair share.
TEST_P(TierIndexFairness, LowerPrioritiesLeaveFirstWithinTheirOwner) {
  TierIndex index(10 * 100, GetParam());
  std::vector<Key128> victims;
  for (uint32_t i = 0; i < 10; ++i) {
    ASSERT_TRUE(index.make_room(100, &victims));
    index.insert(key(i), 100, 1);
  }
  ASSERT_TRUE(index.set_priority(key(7), -1));  // the newest ones asked to leave first
  ASSERT_TRUE(index.set_priority(key(8), -1));
  ASSERT_TRUE(index.set_priority(key(0), 5));   // the oldest asked to stay
  ASSERT_TRUE(index.pin(key(8), 0));            // pinned while low: stays until unpinned
  EXPECT_FALSE(index.set_priority(key(99), 1)) << "an absent key";
  for (uint32_t hot = 0; hot < 10; ++hot) index.touch(key(hot));
  ASSERT_TRUE(index.make_room(100, &victims));
  ASSERT_EQ(victims, std::vector<Key128>{key(7)});
  index.insert(key(10), 100, 1);
  ASSERT_TRUE(index.unpin(key(8)));
  EXPECT_EQ(index.priority_of(key(8)), -1);
  victims.clear();
  ASSERT_TRUE(index.make_room(100, &victims));
  ASSERT_EQ(victims, std::vector<Key128>{key(8)});
  index.insert(key(11), 100, 1);
  victims.clear();
  for (uint32_t i = 12; i < 21; ++i) {  // nine more: every default entry leaves before key(0)
    ASSERT_TRUE(index.make_room(100, &victims));
    index.insert(key(i), 100, 1);
  }
  EXPECT_TRUE(index.contains(key(0)));
  EXPECT_EQ(index.priority_of(key(0)), 5);
  ASSERT_TRUE(index.erase(key(0)));
  EXPECT_EQ(index.priority_of(key(0)), 0) << "forgotten with its entry";
  // owner 2 floods with its entries at the highest priority: owner 1 keeps its fair half
  for (uint32_t i = 1000; i < 1030; ++i) {
    ASSERT_TRUE(index.make_room(100, &victims, 2u));
    index.insert(key(i), 100, 2);
    ASSERT_TRUE(index.set_priority(key(i), 100));
  }
  EXPECT_EQ(index.owner_bytes(1), 500u);
}

INSTANTIATE_TEST_SUITE_P(Policies, TierIndexFairness, ::testing::Values("lru", "s3fifo"));

// While recording, every insert and removal (evicted, erased, cleared) is logged in order, once.
TEST(TierIndex, EventsLogEveryInsertAndRemovalInOrder) {
  TierIndex index(3 * 100, "lru");
  std::vector<Key128> victims;
  put(&index, 0, 100, &victims);  // not recording yet: not logged
  index.record_events(true);
  for (uint32_t i = 1; i < 5; ++i) put(&index, i, 100, &victims);  // 1, 2 fit; 3 evicts 0, 4 evicts 1
  index.erase(key(2));
  index.clear();  // 3 and 4
  std::vector<std::pair<bool, uint32_t>> got;
  for (const auto& e : index.take_events()) got.emplace_back(e.stored, e.key[0]);
  const std::vector<std::pair<bool, uint32_t>> want = {{true, 1},  {true, 2},  {false, 0}, {true, 3}, {false, 1},
                                                       {true, 4},  {false, 2}};
  ASSERT_GE(got.size(), want.size() + 2);
  const std::vector<std::pair<bool, uint32_t>> head(got.begin(), got.begin() + want.size());
  EXPECT_EQ(head, want);
  EXPECT_FALSE(got[want.size()].first);  // the clear's two removals, in the index's order
  EXPECT_FALSE(got[want.size() + 1].first);
  EXPECT_TRUE(index.take_events().empty());
  index.record_events(false);
  put(&index, 9, 100, &victims);
  EXPECT_TRUE(index.take_events().empty());
}

TEST(TierIndex, S3FifoKeepsTheHotSetThroughAScan) {
  TierIndex index(20 * 100, "s3fifo");
  std::vector<Key128> victims;
  for (int round = 0; round < 5; ++round)
    for (uint32_t i = 0; i < 10; ++i) put(&index, i, 100, &victims);  // hot, reused
  for (uint32_t i = 1000; i < 1200; ++i) put(&index, i, 100, &victims);  // a one-shot scan
  int hot_kept = 0;
  for (uint32_t i = 0; i < 10; ++i) hot_kept += index.contains(key(i));
  EXPECT_GE(hot_kept, 8);
}

TEST(TierIndex, PinsHoldUnderPressureEvenForEver) {
  for (double ttl : {0.0, 3600.0, 1e10, 1e30, std::numeric_limits<double>::infinity()}) {
    TierIndex index(5 * 100, "lru");
    std::vector<Key128> victims;
    put(&index, 0, 100, &victims);
    ASSERT_TRUE(index.pin(key(0), ttl));
    for (uint32_t i = 1; i < 50; ++i) put(&index, i, 100, &victims);
    EXPECT_TRUE(index.contains(key(0))) << "ttl " << ttl;
    EXPECT_EQ(index.pinned_bytes(), 100u);
  }
}

TEST(MemoryStore, ABlobLargerThanTheTierIsRefusedAndCapacityHolds) {
  MemoryStore store(1000);
  auto blob = [](size_t n) { return std::make_shared<Buffer>(n); };
  EXPECT_FALSE(store.put(key(1), blob(2000)));
  for (uint32_t i = 0; i < 30; ++i) ASSERT_TRUE(store.put(key(i), blob(300)));
  EXPECT_LE(store.stats().used_bytes, 1000u);
  EXPECT_EQ(store.stats().rejected, 1u);
  EXPECT_TRUE(store.contains(key(29)));
  EXPECT_FALSE(store.contains(key(0)));
}

}  // namespace
}  // namespace kdn
