// Hashing against published vectors: BLAKE3 (hash and keyed modes, the official test inputs
// i % 251 and key "whats the Elvish word for friend"), XXH64, and chained prefix keys.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "kdn/hash.h"
#include "kdn/keys.h"

namespace kdn {
namespace {

std::vector<uint8_t> input(size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i % 251);
  return v;
}

std::string hex(const uint8_t* p, size_t n) {
  std::string s;
  char b[3];
  for (size_t i = 0; i < n; ++i) {
    std::snprintf(b, sizeof(b), "%02x", p[i]);
    s += b;
  }
  return s;
}

struct Vector {
  size_t len;
  const char* hash;
  const char* keyed;
  uint64_t xxh64;
};

const Vector kVectors[] = {
    {0, "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262",
     "92b2b75604ed3c761f9d6f62392c8a9227ad0ea3f09573e783f1498a4ed60d26", 0xef46db3751d8e999ull},
    {1, "2d3adedff11b61f14c886e35afa036736dcd87a74d27b5c1510225d0f592e213",
     "6d7878dfff2f485635d39013278ae14f1454b8c0a3a2d34bc1ab38228a80c95b", 0xe934a84adb052768ull},
    {1023, "10108970eeda3eb932baac1428c7a2163b0e924c9a9e25b35bba72b28f70bd11",
     "c951ecdf03288d0fcc96ee3413563d8a6d3589547f2c2fb36d9786470f1b9d6e", 0xd66738f081c25cf4ull},
    {1024, "42214739f095a406f3fc83deb889744ac00df831c10daa55189b5d121c855af7",
     "75c46f6f3d9eb4f55ecaaee480db732e6c2105546f1e675003687c31719c7ba4", 0x138e26c65048ce29ull},
    {1025, "d00278ae47eb27b34faecf67b4fe263f82d5412916c1ffd97c8cb7fb814b8444",
     "357dc55de0c7e382c900fd6e320acc04146be01db6a8ce7210b7189bd664ea69", 0xcfd73aedd2d6a39dull},
    {2048, "e776b6028c7cd22a4d0ba182a8bf62205d2ef576467e838ed6f2529b85fba24a",
     "879cf1fa2ea0e79126cb1063617a05b6ad9d0b696d0d757cf053439f60a99dd1", 0xa69e05a7eff57800ull},
    {3072, "b98cb0ff3623be03326b373de6b9095218513e64f1ee2edd2525c7ad1e5cffd2",
     "044a0e7b172a312dc02a4c9a818c036ffa2776368d7f528268d2e6b5df191770", 0x278f56bcf5b542feull},
    {31744, "62b6960e1a44bcc1eb1a611a8d6235b6b4b78f32e7abc4fb4c6cdcce94895c47",
     "efa53b389ab67c593dba624d898d0f7353ab99e4ac9d42302ee64cbf9939a419", 0x5fd04299cacedf8aull},
};

TEST(Blake3, MatchesThePublishedVectorsInHashAndKeyedMode) {
  const auto* key = reinterpret_cast<const uint8_t*>("whats the Elvish word for friend");
  for (const Vector& v : kVectors) {
    const std::vector<uint8_t> in = input(v.len);
    uint8_t out[32];
    Blake3 h;
    h.update(in.data(), in.size());
    h.finalize(out, 32);
    EXPECT_EQ(hex(out, 32), v.hash) << "length " << v.len;
    Blake3 k(key);
    k.update(in.data(), in.size());
    k.finalize(out, 32);
    EXPECT_EQ(hex(out, 32), v.keyed) << "length " << v.len;
  }
}

TEST(Blake3, IncrementalUpdatesEqualOneShot) {
  const std::vector<uint8_t> in = input(5000);
  uint8_t whole[32], parts[32];
  Blake3 a;
  a.update(in.data(), in.size());
  a.finalize(whole, 32);
  Blake3 b;
  for (size_t i = 0; i < in.size(); i += 77) b.update(in.data() + i, std::min<size_t>(77, in.size() - i));
  b.finalize(parts, 32);
  EXPECT_EQ(hex(whole, 32), hex(parts, 32));
}

TEST(Xxh64, MatchesTheReference) {
  for (const Vector& v : kVectors) {
    const std::vector<uint8_t> in = input(v.len);
    EXPECT_EQ(xxh64(in.data(), in.size()), v.xxh64) << "length " << v.len;
  }
}

TEST(PrefixKeys, AreChainedAndDependOnEveryEarlierToken) {
  Key128 fp{};
  fp[0] = 7;
  std::vector<uint32_t> tokens(64);
  for (uint32_t i = 0; i < tokens.size(); ++i) tokens[i] = i * 3;
  const auto keys = prefix_chunk_keys(fp, tokens.data(), tokens.size(), 16, false);
  ASSERT_EQ(keys.size(), 4u);
  tokens[1] ^= 1;  // a change in chunk 0 changes every later key
  const auto changed = prefix_chunk_keys(fp, tokens.data(), tokens.size(), 16, false);
  for (size_t i = 0; i < keys.size(); ++i) EXPECT_NE(keys[i], changed[i]);
  fp[0] = 8;  // another model: other keys
  EXPECT_NE(prefix_chunk_keys(fp, tokens.data(), tokens.size(), 16, false)[0], changed[0]);
}

TEST(PrefixKeys, ProbesOfSharedTokensAgreeAndChunkKeyIsOneLink) {
  Key128 fp{};
  std::vector<uint32_t> a(40), b(40);
  for (uint32_t i = 0; i < a.size(); ++i) a[i] = b[i] = i + 100;
  b[21] = 5;  // b leaves a after 21 tokens
  const auto keys = prefix_chunk_keys(fp, a.data(), a.size(), 16, true);
  ASSERT_EQ(keys.size(), 3u);
  EXPECT_EQ(chunk_key(fp, keys[0], a.data() + 16, 16), keys[1]);
  EXPECT_EQ(chunk_key(fp, keys[1], a.data() + 32, 8), keys[2]);  // a trailing partial chunk
  const auto pa = probe_keys(fp, keys[0], a.data() + 16, 24, 4);
  const auto pb = probe_keys(fp, keys[0], b.data() + 16, 24, 4);
  ASSERT_EQ(pa.size(), 6u);
  for (size_t j = 0; j < pa.size(); ++j) EXPECT_EQ(pa[j] == pb[j], (j + 1) * 4 <= 5) << "probe " << j;
  EXPECT_NE(probe_keys(fp, keys[1], a.data() + 16, 4, 4)[0], pa[0]);  // another parent
  EXPECT_NE(pa[3], keys[1]);  // probes never alias chunk keys
}

}  // namespace
}  // namespace kdn
