// Portable BLAKE3 (hash and keyed-hash modes) written from the published specification.
#include <cstring>

#include "kdn/hash.h"

namespace kdn {
namespace {

constexpr uint32_t kIV[8] = {0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A,
                             0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19};
constexpr uint32_t kChunkStart = 1, kChunkEnd = 2, kParent = 4, kRoot = 8, kKeyedHash = 16;
constexpr size_t kBlockLen = 64, kChunkLen = 1024;

inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

inline void g(uint32_t* s, int a, int b, int c, int d, uint32_t mx, uint32_t my) {
  s[a] = s[a] + s[b] + mx;
  s[d] = rotr(s[d] ^ s[a], 16);
  s[c] = s[c] + s[d];
  s[b] = rotr(s[b] ^ s[c], 12);
  s[a] = s[a] + s[b] + my;
  s[d] = rotr(s[d] ^ s[a], 8);
  s[c] = s[c] + s[d];
  s[b] = rotr(s[b] ^ s[c], 7);
}

// Message word order of each of the 7 rounds (the permutation applied 0..6 times), precomputed.
constexpr uint8_t kSchedule[7][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8},
    {3, 4, 10, 12, 13, 2, 7, 14, 6, 5, 9, 0, 11, 15, 8, 1}, {10, 7, 12, 9, 14, 3, 13, 15, 4, 0, 11, 2, 5, 8, 1, 6},
    {12, 13, 9, 11, 15, 10, 14, 8, 7, 2, 5, 3, 0, 1, 6, 4}, {9, 14, 11, 5, 8, 12, 15, 1, 13, 3, 0, 10, 2, 6, 4, 7},
    {11, 15, 5, 0, 1, 9, 8, 6, 14, 10, 2, 12, 3, 4, 7, 13}};

void compress(const uint32_t cv[8], const uint32_t m[16], uint64_t counter,
              uint32_t block_len, uint32_t flags, uint32_t out[16]) {
  uint32_t s[16] = {cv[0], cv[1], cv[2], cv[3], cv[4], cv[5], cv[6], cv[7],
                    kIV[0], kIV[1], kIV[2], kIV[3], static_cast<uint32_t>(counter),
                    static_cast<uint32_t>(counter >> 32), block_len, flags};
  for (int round = 0; round < 7; ++round) {
    const uint8_t* w = kSchedule[round];
    g(s, 0, 4, 8, 12, m[w[0]], m[w[1]]);
    g(s, 1, 5, 9, 13, m[w[2]], m[w[3]]);
    g(s, 2, 6, 10, 14, m[w[4]], m[w[5]]);
    g(s, 3, 7, 11, 15, m[w[6]], m[w[7]]);
    g(s, 0, 5, 10, 15, m[w[8]], m[w[9]]);
    g(s, 1, 6, 11, 12, m[w[10]], m[w[11]]);
    g(s, 2, 7, 8, 13, m[w[12]], m[w[13]]);
    g(s, 3, 4, 9, 14, m[w[14]], m[w[15]]);
  }
  for (int i = 0; i < 8; ++i) {
    out[i] = s[i] ^ s[i + 8];
    out[i + 8] = s[i + 8] ^ cv[i];
  }
}

void words_from_le_bytes(const uint8_t* bytes, uint32_t words[16]) {
  for (int i = 0; i < 16; ++i) {
    words[i] = uint32_t(bytes[4 * i]) | uint32_t(bytes[4 * i + 1]) << 8 |
               uint32_t(bytes[4 * i + 2]) << 16 | uint32_t(bytes[4 * i + 3]) << 24;
  }
}

// The last compression of a node, kept unevaluated until we know whether it is the root.
struct Output {
  uint32_t input_cv[8];
  uint32_t block[16];
  uint64_t counter;
  uint32_t block_len;
  uint32_t flags;

  void chaining_value(uint32_t cv[8]) const {
    uint32_t out[16];
    compress(input_cv, block, counter, block_len, flags, out);
    std::memcpy(cv, out, 8 * sizeof(uint32_t));
  }
};

Output parent_output(const uint32_t key[8], uint32_t mode, const uint32_t left[8], const uint32_t right[8]) {
  Output o;
  std::memcpy(o.input_cv, key, 8 * sizeof(uint32_t));
  std::memcpy(o.block, left, 32);
  std::memcpy(o.block + 8, right, 32);
  o.counter = 0;
  o.block_len = kBlockLen;
  o.flags = kParent | mode;
  return o;
}

}  // namespace

Blake3::Blake3() {
  std::memcpy(key_, kIV, sizeof(kIV));
  chunk_reset(0);
}

Blake3::Blake3(const uint8_t key[32]) : mode_(kKeyedHash) {
  for (int i = 0; i < 8; ++i)
    key_[i] = uint32_t(key[4 * i]) | uint32_t(key[4 * i + 1]) << 8 | uint32_t(key[4 * i + 2]) << 16 |
              uint32_t(key[4 * i + 3]) << 24;
  chunk_reset(0);
}

void Blake3::chunk_reset(uint64_t counter) {
  std::memcpy(chunk_.cv, key_, sizeof(key_));
  chunk_.chunk_counter = counter;
  chunk_.block_len = 0;
  chunk_.blocks_compressed = 0;
  std::memset(chunk_.block, 0, sizeof(chunk_.block));
}

void Blake3::push_cv(const uint32_t cv_in[8], uint64_t total_chunks) {
  uint32_t cv[8];
  std::memcpy(cv, cv_in, sizeof(cv));
  while ((total_chunks & 1) == 0) {
    --cv_stack_len_;
    parent_output(key_, mode_, cv_stack_[cv_stack_len_], cv).chaining_value(cv);
    total_chunks >>= 1;
  }
  std::memcpy(cv_stack_[cv_stack_len_++], cv, sizeof(cv));
}

void Blake3::update(const void* data, size_t len) {
  const auto* in = static_cast<const uint8_t*>(data);
  while (len > 0) {
    size_t chunk_len = kBlockLen * chunk_.blocks_compressed + chunk_.block_len;
    if (chunk_len == kChunkLen) {
      uint32_t words[16], cv[8];
      words_from_le_bytes(chunk_.block, words);
      Output o;
      std::memcpy(o.input_cv, chunk_.cv, sizeof(o.input_cv));
      std::memcpy(o.block, words, sizeof(words));
      o.counter = chunk_.chunk_counter;
      o.block_len = chunk_.block_len;
      o.flags = kChunkEnd | (chunk_.blocks_compressed == 0 ? kChunkStart : 0) | mode_;
      o.chaining_value(cv);
      uint64_t total = chunk_.chunk_counter + 1;
      push_cv(cv, total);
      chunk_reset(total);
      continue;
    }
    if (chunk_.block_len == kBlockLen) {
      uint32_t words[16], out[16];
      words_from_le_bytes(chunk_.block, words);
      uint32_t flags = (chunk_.blocks_compressed == 0 ? kChunkStart : 0) | mode_;
      compress(chunk_.cv, words, chunk_.chunk_counter, kBlockLen, flags, out);
      std::memcpy(chunk_.cv, out, 8 * sizeof(uint32_t));
      ++chunk_.blocks_compressed;
      chunk_.block_len = 0;
      std::memset(chunk_.block, 0, sizeof(chunk_.block));
    }
    size_t take = kBlockLen - chunk_.block_len;
    size_t room = kChunkLen - (kBlockLen * chunk_.blocks_compressed + chunk_.block_len);
    if (take > room) take = room;
    if (take > len) take = len;
    std::memcpy(chunk_.block + chunk_.block_len, in, take);
    chunk_.block_len = static_cast<uint8_t>(chunk_.block_len + take);
    in += take;
    len -= take;
  }
}

void Blake3::finalize(uint8_t* out, size_t out_len) const {
  Output o;
  std::memcpy(o.input_cv, chunk_.cv, sizeof(o.input_cv));
  words_from_le_bytes(chunk_.block, o.block);
  o.counter = chunk_.chunk_counter;
  o.block_len = chunk_.block_len;
  o.flags = kChunkEnd | (chunk_.blocks_compressed == 0 ? kChunkStart : 0) | mode_;
  for (int i = cv_stack_len_ - 1; i >= 0; --i) {
    uint32_t cv[8];
    o.chaining_value(cv);
    o = parent_output(key_, mode_, cv_stack_[i], cv);
  }
  uint64_t block_counter = 0;
  size_t written = 0;
  while (written < out_len) {
    uint32_t words[16];
    compress(o.input_cv, o.block, block_counter++, o.block_len, o.flags | kRoot, words);
    for (int i = 0; i < 16 && written < out_len; ++i) {
      for (int b = 0; b < 4 && written < out_len; ++b) out[written++] = uint8_t(words[i] >> (8 * b));
    }
  }
}

Key128 blake3_128(const void* data, size_t len) {
  Blake3 h;
  h.update(data, len);
  Key128 key;
  h.finalize(key.data(), key.size());
  return key;
}

}  // namespace kdn
