// The disk store's reads in part: of a raw blob only the sections asked (with its header and
// trailer) are read, each verified by its sum; a damaged section that is read is a miss (the file
// dropped), one that is not read changes nothing; a blob read in part is never stored by a tier.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "kdn/blob.h"
#include "kdn/chunk.h"
#include "kdn/disk_store.h"
#include "kdn/memory_store.h"

namespace kdn {
namespace {

constexpr int64_t kLayers = 3, kTokens = 8, kHeads = 2, kDim = 4;

struct Chunk {
  std::vector<std::vector<float>> planes;  // 2 * layers tensors [heads, tokens, dim]
  BufferPtr blob;
  Key128 key{};
};

Chunk make_chunk() {
  Chunk c;
  c.key[0] = 7;
  std::vector<void*> ptrs;
  std::vector<int64_t> strides;
  for (int64_t p = 0; p < 2 * kLayers; ++p) {
    c.planes.emplace_back(kHeads * kTokens * kDim);
    for (size_t i = 0; i < c.planes.back().size(); ++i) c.planes.back()[i] = float(p * 1000 + int64_t(i));
    ptrs.push_back(c.planes.back().data());
    strides.push_back(kTokens * kDim);
    strides.push_back(kDim);
  }
  Key128 fingerprint{};
  c.blob = pack_chunk(KvShape{kLayers, kTokens, kHeads, kDim}, KvTable{ptrs.data(), strides.data()}, DType::kFloat32,
                      0, kTokens, fingerprint, c.key, 1);
  return c;
}

struct TempDir {  // a folder of its own, removed with everything in it
  std::string path;
  TempDir() {
    char name[] = "/tmp/kdn-disk-test-XXXXXX";
    path = mkdtemp(name);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
};

std::string file_of(const std::string& dir, const Key128& key) {
  static const char* hex = "0123456789abcdef";
  std::string name;
  for (uint8_t b : key) name += std::string{hex[b >> 4], hex[b & 15]};
  return dir + "/" + name.substr(0, 2) + "/" + name + ".kdnb";
}

void flip(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char byte = 0;
  f.read(&byte, 1);
  f.seekp(static_cast<std::streamoff>(offset));
  byte = static_cast<char>(byte ^ 0x5a);
  f.write(&byte, 1);
}

DiskStoreOptions options_in(const TempDir& dir, const std::string& mac_key = "") {
  DiskStoreOptions options;
  options.dir = dir.path;
  options.capacity_bytes = 1 << 20;
  options.fsync = false;
  options.mac_key = mac_key;
  return options;
}

TEST(DiskStore, AReadInPartReadsTheSectionsAskedEachVerifiedAndNoTierStoresIt) {
  TempDir dir;
  const DiskStoreOptions options = options_in(dir);
  DiskStore store(options);
  Chunk c = make_chunk();
  ASSERT_TRUE(store.put(c.key, c.blob));
  BlobHeader h;
  ASSERT_TRUE(blob_parse(c.blob->data(), c.blob->size(), true, &h).ok);
  const auto ranges = blob_section_ranges(h, c.blob->data() + kBlobHeaderBytes, 0);
  const uint64_t plane = ranges[1].second - ranges[1].first;

  // layer 1's K and V alone (sections 3 and 4): those bytes are the chunk's, the read counted
  const uint64_t before = store.stats().read_bytes;
  BufferPtr part = store.get_many({c.key}, {{{3, 4}}})[0];
  ASSERT_TRUE(part && part->partial() && part->verified());
  EXPECT_EQ(0, std::memcmp(part->data() + ranges[3].first, c.blob->data() + ranges[3].first, 2 * plane));
  EXPECT_EQ(store.stats().read_bytes - before, c.blob->size() - 4 * plane);  // all but layers 0 and 2
  BufferPtr whole = store.get(c.key);
  ASSERT_TRUE(whole && !whole->partial());
  EXPECT_EQ(0, std::memcmp(whole->data(), c.blob->data(), c.blob->size()));

  // no tier keeps a blob read in part
  Chunk other = make_chunk();
  other.key[0] = 8;
  EXPECT_FALSE(store.put(other.key, part));
  EXPECT_FALSE(store.put_async(other.key, part));
  MemoryStore memory(1 << 20);
  EXPECT_FALSE(memory.put(c.key, part));

  // a damaged plane that is not read changes nothing; one that is read is a miss, its file dropped
  const std::string path = file_of(options.dir, c.key);
  flip(path, ranges[1].first + 3);  // layer 0's K
  EXPECT_TRUE(store.get_many({c.key}, {{{3, 4}}})[0]);
  EXPECT_FALSE(store.get_many({c.key}, {{{1, 2}}})[0]);
  EXPECT_NE(0, ::access(path.c_str(), F_OK));
  EXPECT_EQ(store.stats().corrupt, 1u);
}

TEST(DiskStore, AKeyedStoreReadsWhole) {
  TempDir dir;
  DiskStore store(options_in(dir, std::string(32, 'k')));
  Chunk c = make_chunk();
  ASSERT_TRUE(store.put(c.key, c.blob));
  BufferPtr got = store.get_many({c.key}, {{{3, 4}}})[0];
  ASSERT_TRUE(got && !got->partial());  // its tag covers the whole blob: read and checked whole
  EXPECT_EQ(0, std::memcmp(got->data(), c.blob->data(), c.blob->size()));
}

}  // namespace
}  // namespace kdn
