// The blob format: a sealed chunk parses back, and every kind of damage is a failed Status.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kdn/blob.h"
#include "kdn/chunk.h"
#include "kdn/codec.h"

namespace kdn {
namespace {

// Four float tensors [1, heads=2, seq, dim=8] (2 layers) with values that name their position.
struct Cache {
  explicit Cache(int64_t seq) : seq(seq), data(4, std::vector<float>(2 * seq * 8)) {
    for (size_t t = 0; t < data.size(); ++t)
      for (size_t i = 0; i < data[t].size(); ++i) data[t][i] = static_cast<float>(t * 1000 + i) / 64.0f;  // distinct, within fp16 range
    for (size_t t = 0; t < data.size(); ++t) {
      ptrs.push_back(data[t].data());
      strides.push_back(seq * 8);  // head stride (elements)
      strides.push_back(8);        // seq stride
    }
  }
  KvShape shape() const { return KvShape{2, seq, 2, 8}; }
  KvTable table() const { return KvTable{ptrs.data(), strides.data()}; }
  int64_t seq;
  std::vector<std::vector<float>> data;
  std::vector<void*> ptrs;
  std::vector<int64_t> strides;
};

Key128 key_of(uint8_t b) {
  Key128 k{};
  k.fill(b);
  return k;
}

TEST(Blob, PackedChunksParseVerifyAndUnpackBackToTheSameValues) {
  Cache cache(40);
  std::vector<BufferPtr> blobs;
  std::vector<ChunkBytes> spans;
  std::vector<Key128> keys;
  for (int i = 0; i < 2; ++i) {
    keys.push_back(key_of(static_cast<uint8_t>(i + 1)));
    blobs.push_back(pack_chunk(cache.shape(), cache.table(), DType::kFloat32, i * 16, 16, key_of(9), keys.back(), 2));
    spans.push_back(ChunkBytes{blobs.back()->data(), blobs.back()->size(), blobs.back().get()});
  }
  BlobHeader h;
  ASSERT_TRUE(blob_parse(blobs[1]->data(), blobs[1]->size(), true, &h).ok);
  EXPECT_EQ(h.tokens, 16u);
  EXPECT_EQ(h.position, 16u);
  EXPECT_EQ(h.fingerprint, key_of(9));
  const ChunkExpect expect{key_of(9), DType::kFloat32, 2, 2, 8, 16};
  std::string error;
  EXPECT_EQ(verify_chunks(spans, keys, expect, 0, 2, &error), 2);
  // a prefix read from its second chunk on: that chunk sits at 16, not at 0
  const std::vector<ChunkBytes> tail{spans[1]};
  EXPECT_EQ(verify_chunks(tail, {keys[1]}, expect, 0, 2, &error, 1), 1);
  EXPECT_EQ(verify_chunks(tail, {keys[1]}, expect, 0, 2, &error, 0), 0);
  EXPECT_NE(error.find("chunk 0: blob position 16 != 0"), std::string::npos) << error;
  // unpack the first 20 tokens into a fresh cache: they equal the source
  Cache out(20);
  for (auto& t : out.data) std::fill(t.begin(), t.end(), -1.0f);
  unpack_chunks(spans, out.shape(), out.table(), DType::kFloat32, 20, 2);
  for (size_t t = 0; t < 4; ++t)
    for (int64_t head = 0; head < 2; ++head)
      for (int64_t s = 0; s < 20; ++s)
        for (int64_t d = 0; d < 8; ++d)
          ASSERT_EQ(out.data[t][head * 20 * 8 + s * 8 + d], cache.data[t][head * 40 * 8 + s * 8 + d]);
}

TEST(Blob, EveryKindOfDamageIsAFailedStatus) {
  Cache cache(16);
  BufferPtr blob = pack_chunk(cache.shape(), cache.table(), DType::kFloat32, 0, 16, key_of(9), key_of(1), 1);
  std::vector<uint8_t> bytes(blob->data(), blob->data() + blob->size());
  BlobHeader h;
  for (size_t at : {size_t{0}, size_t{4}, size_t{9}, size_t{12}, size_t{70}, size_t{200}, bytes.size() - 1}) {
    std::vector<uint8_t> bad = bytes;
    bad[at] ^= 0x40;
    EXPECT_FALSE(blob_parse(bad.data(), bad.size(), true, &h).ok) << "flip at " << at;
  }
  EXPECT_FALSE(blob_parse(bytes.data(), bytes.size() / 2, true, &h).ok);
  EXPECT_FALSE(blob_parse(bytes.data(), 10, true, &h).ok);
  EXPECT_FALSE(blob_parse(nullptr, 0, true, &h).ok);
  // header-first reads: the header alone states the total size
  ASSERT_TRUE(blob_parse_header(bytes.data(), kBlobHeaderBytes, &h).ok);
  EXPECT_EQ(blob_total_bytes(h), bytes.size());
}

TEST(Blob, AReaderRejectsAnotherModelKeyPositionOrLayout) {
  Cache cache(16);
  BufferPtr blob = pack_chunk(cache.shape(), cache.table(), DType::kFloat32, 0, 16, key_of(9), key_of(1), 1);
  BlobHeader h;
  ASSERT_TRUE(blob_parse(blob->data(), blob->size(), true, &h).ok);
  const ChunkExpect ok{key_of(9), DType::kFloat32, 2, 2, 8, 16};
  EXPECT_TRUE(check_chunk_header(h, ok, key_of(1), 0, 16).ok);
  EXPECT_FALSE(check_chunk_header(h, ok, key_of(2), 0, 16).ok);
  EXPECT_FALSE(check_chunk_header(h, ok, key_of(1), 16, 16).ok);
  EXPECT_FALSE(check_chunk_header(h, ok, key_of(1), 0, 8).ok);
  ChunkExpect other = ok;
  other.fingerprint = key_of(8);
  EXPECT_FALSE(check_chunk_header(h, other, key_of(1), 0, 16).ok);
  other = ok;
  other.dtype = DType::kFloat16;
  EXPECT_FALSE(check_chunk_header(h, other, key_of(1), 0, 16).ok);
}

TEST(Blob, LossyCodingReaddressesTheChunkAndExactCodingDoesNot) {
  Cache cache(16);
  BufferPtr blob = pack_chunk(cache.shape(), cache.table(), DType::kFloat32, 0, 16, key_of(9), key_of(1), 1);
  BlobHeader h;
  ASSERT_TRUE(blob_parse(blob->data(), blob->size(), true, &h).ok);
  EXPECT_EQ(coded_key(h, kCodecLossless, 0), h.key);
  const uint32_t int8 = 8u | (32u << 16);
  EXPECT_EQ(coded_key(h, kCodecKivi, int8), lossy_key(h.key, kCodecKivi, int8));
  EXPECT_NE(lossy_key(h.key, kCodecKivi, int8), h.key);
  EXPECT_NE(lossy_key(h.key, kCodecKivi, int8), lossy_key(h.key, kCodecKivi, 4u | (32u << 16)));
  BufferPtr coded = blob_transcode(h, blob->data(), kCodecKivi, int8, 1, nullptr);
  BlobHeader c;
  ASSERT_TRUE(blob_parse(coded->data(), coded->size(), true, &c).ok);
  EXPECT_EQ(c.key, lossy_key(h.key, kCodecKivi, int8));
  BufferPtr back = blob_transcode(c, coded->data(), kCodecRaw, 0, 1, nullptr);  // decoding keeps the lossy key
  ASSERT_TRUE(blob_parse(back->data(), back->size(), true, &c).ok);
  EXPECT_EQ(c.key, lossy_key(h.key, kCodecKivi, int8));
}

}  // namespace
TEST(Blob, APointerRoundTripsAndNeverReadsAsKV) {
  const uint32_t tokens[5] = {7, 8, 9, 10, 11};
  BufferPtr blob = pack_pointer(key_of(9), key_of(3), key_of(4), 256, tokens, 5);
  const ChunkBytes bytes{blob->data(), blob->size(), nullptr};
  Pointer p;
  ASSERT_TRUE(read_pointer(bytes, key_of(9), key_of(3), &p).ok);
  EXPECT_EQ(p.target, key_of(4));
  EXPECT_EQ(p.position, 256u);
  EXPECT_EQ(p.tokens, std::vector<uint32_t>(tokens, tokens + 5));
  EXPECT_FALSE(read_pointer(bytes, key_of(8), key_of(3), &p).ok);  // another model
  EXPECT_FALSE(read_pointer(bytes, key_of(9), key_of(2), &p).ok);  // filed under another key
  std::vector<uint8_t> bad(blob->data(), blob->data() + blob->size());
  bad[kBlobHeaderBytes + 17] ^= 1;  // a token changed in transit
  EXPECT_FALSE(read_pointer(ChunkBytes{bad.data(), bad.size(), nullptr}, key_of(9), key_of(3), &p).ok);
  BlobHeader h;
  ASSERT_TRUE(blob_parse(blob->data(), blob->size(), true, &h).ok);
  EXPECT_EQ(h.kind, kBlobKindPointer);
  const ChunkExpect expect{key_of(9), DType::kFloat32, 2, 2, 8, 16};
  EXPECT_FALSE(check_chunk_header(h, expect, key_of(3), 256, 5).ok);
  // coding never touches a pointer: same key, same bytes
  EXPECT_EQ(coded_key(h, kCodecKivi, 8u | (32u << 16)), h.key);
  BufferPtr copy = blob_transcode(h, blob->data(), kCodecLossless, 0, 1, nullptr);
  ASSERT_EQ(copy->size(), blob->size());
  EXPECT_EQ(std::memcmp(copy->data(), blob->data(), blob->size()), 0);
  // a KV chunk is not a pointer
  Cache cache(16);
  BufferPtr chunk = pack_chunk(cache.shape(), cache.table(), DType::kFloat32, 0, 16, key_of(9), key_of(3), 1);
  EXPECT_FALSE(read_pointer(ChunkBytes{chunk->data(), chunk->size(), nullptr}, key_of(9), key_of(3), &p).ok);
}

TEST(Paged, ChunksLandWhereVllmsCpuKernelReadsThemAndComeBackTheSame) {
  // 2 layers, 2 heads, dim 8; 40 tokens into blocks of 16 scattered over a pool of 5
  Cache cache(40);
  BufferPtr blob = pack_chunk(cache.shape(), cache.table(), DType::kFloat32, 0, 40, key_of(9), key_of(1), 1);
  const PagedLayout paged = vec_layout(2, 2, 8, 16, 5);
  std::vector<std::vector<float>> layers(2, std::vector<float>(5 * 2 * 2 * 16 * 8, -1.0f));
  std::vector<void*> ptrs{layers[0].data(), layers[1].data()};
  const int64_t block_ids[3] = {4, 0, 2};
  unpack_chunks_paged({ChunkBytes{blob->data(), blob->size(), blob.get()}}, paged, ptrs.data(), block_ids, 3,
                      DType::kFloat32, 3, 40, 2);
  for (int64_t layer = 0; layer < 2; ++layer)
    for (int64_t kv = 0; kv < 2; ++kv)
      for (int64_t head = 0; head < 2; ++head)
        for (int64_t p = 0; p < 40; ++p)
          for (int64_t d = 0; d < 8; ++d) {
            const float got = layers[layer][paged_offset(paged, block_ids[p / 16], kv, p % 16, head, d)];
            const float want = p < 3 ? -1.0f : cache.data[layer * 2 + kv][head * 40 * 8 + p * 8 + d];
            ASSERT_EQ(got, want) << "layer " << layer << " kv " << kv << " head " << head << " token " << p;
          }
  // and back out: the canonical chunk of tokens [3, 40)
  std::vector<float> chunk(2 * 2 * 37 * 2 * 8);
  paged_copy_cpu(KvShape{2, 37, 2, 8}, paged, ptrs.data(), block_ids, 3, chunk.data(), 4, 0, 3, 37,
                 CopyDirection::kCacheToChunk, 2);
  const float* raw = reinterpret_cast<const float*>(blob->data() + kBlobHeaderBytes);
  for (int64_t layer = 0; layer < 2; ++layer)
    for (int64_t kv = 0; kv < 2; ++kv)
      for (int64_t t = 0; t < 37; ++t)
        for (int64_t i = 0; i < 16; ++i)  // heads x dim
          ASSERT_EQ(chunk[((layer * 2 + kv) * 37 + t) * 16 + i], raw[((layer * 2 + kv) * 40 + t + 3) * 16 + i]);
}

TEST(Paged, TiledPlanesReachEveryElementOfTheirPagesOnceAndNoFurther) {
  // vLLM's CPU 'amx' pages (python/kdn/engine/paged.py): 3 blocks of 32 tokens, 2 heads, dim 32
  const int64_t B = 32, D = 32, H = 2, N = 3, page = 2 * B * D;
  const PagedLayout p{1, H, D, B, N, PlaneStrides{0, H * page, page, 2, 1, 16, 16 * D, 2, 32},
                      PlaneStrides{B * D, H * page, page, 1, 2, 2, 32, 16, 16 * B}};
  std::vector<int> seen(N * H * page, 0);
  for (int64_t block = 0; block < N; ++block)
    for (int64_t kv = 0; kv < 2; ++kv)
      for (int64_t head = 0; head < H; ++head)
        for (int64_t t = 0; t < B; ++t)
          for (int64_t d = 0; d < D; ++d) ++seen[paged_offset(p, block, kv, t, head, d)];
  EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), N * H * page);
  EXPECT_EQ(paged_extent(p), N * H * page - 1);
  // K's first token: dims in pairs 32 elements apart; V's first dim: tokens in pairs 32 apart
  EXPECT_EQ(paged_offset(p, 0, 0, 0, 0, 3), 33);
  EXPECT_EQ(paged_offset(p, 0, 1, 3, 0, 0), B * D + 33);
}

TEST(Blob, Format2VerifiesOneLayerGroupAloneAndFormat1IsStillRead) {
  Cache cache(16);
  BufferPtr blob = pack_chunk(cache.shape(), cache.table(), DType::kFloat32, 0, 16, key_of(9), key_of(1), 2);
  BlobHeader h;
  ASSERT_TRUE(blob_parse(blob->data(), blob->size(), true, &h).ok);
  EXPECT_EQ(h.version, 2);
  EXPECT_EQ(blob->size(), kBlobHeaderBytes + h.payload_bytes + 8 * (1 + 2 * 2) + 8);
  const auto ranges = blob_section_ranges(h, blob->data() + kBlobHeaderBytes, h.payload_bytes);
  ASSERT_EQ(ranges.size(), 5u);
  // only the header, layer 1 (sections 3, 4) and the trailer arrived
  std::vector<uint8_t> partial(blob->size(), 0);
  auto copy = [&](uint64_t b, uint64_t e) { std::memcpy(partial.data() + b, blob->data() + b, e - b); };
  copy(ranges[0].first, ranges[0].second);
  copy(ranges[3].first, ranges[4].second);
  copy(kBlobHeaderBytes + h.payload_bytes, blob->size());
  EXPECT_TRUE(blob_verify_sections(partial.data(), partial.size(), 3, 4).ok);
  EXPECT_FALSE(blob_verify_sections(partial.data(), partial.size(), 1, 2).ok);
  partial[ranges[3].first] ^= 1;
  EXPECT_FALSE(blob_verify_sections(partial.data(), partial.size(), 3, 4).ok);
  // the same chunk as a format-1 writer sealed it: one checksum over everything
  std::vector<uint8_t> old(blob->data(), blob->data() + kBlobHeaderBytes + h.payload_bytes + kBlobTrailerBytes);
  old[4] = 1;
  blob_seal(old.data(), old.size());
  BlobHeader h1;
  ASSERT_TRUE(blob_parse(old.data(), old.size(), true, &h1).ok);
  EXPECT_EQ(h1.version, 1);
  EXPECT_FALSE(blob_verify_sections(old.data(), old.size(), 1, 1).ok);
  old[kBlobHeaderBytes + 3] ^= 1;
  EXPECT_FALSE(blob_parse(old.data(), old.size(), true, &h1).ok);
}

}  // namespace kdn
