// Hash functions of the core: BLAKE3 (keys, fingerprints) and XXH64 (blob checksums).
#pragma once

#include <array>
#include <cstdint>
#include <cstddef>

namespace kdn {

using Key128 = std::array<uint8_t, 16>;

// Keys are uniform hashes already: their first 8 bytes make a good hash-table hash.
struct Key128Hash {
  size_t operator()(const Key128& k) const {
    uint64_t v;
    __builtin_memcpy(&v, k.data(), sizeof(v));
    return static_cast<size_t>(v);
  }
};

// Incremental BLAKE3 (portable implementation of the published spec): hash mode, or keyed-hash
// mode (a MAC) with a 32-byte key.
class Blake3 {
 public:
  Blake3();
  explicit Blake3(const uint8_t key[32]);
  void update(const void* data, size_t len);
  // Writes out_len bytes of the extendable output (out_len <= 64 is all kdn needs).
  void finalize(uint8_t* out, size_t out_len) const;

 private:
  struct ChunkState {
    uint32_t cv[8];
    uint64_t chunk_counter;
    uint8_t block[64];
    uint8_t block_len;
    uint8_t blocks_compressed;
  };
  void chunk_reset(uint64_t counter);
  void push_cv(const uint32_t cv[8], uint64_t total_chunks);

  uint32_t key_[8];     // the IV in hash mode
  uint32_t mode_ = 0;   // kKeyedHash in keyed mode
  ChunkState chunk_;
  uint32_t cv_stack_[54][8];
  uint8_t cv_stack_len_ = 0;
};

// BLAKE3 truncated to 128 bits.
Key128 blake3_128(const void* data, size_t len);

// XXH64 of a buffer (reference algorithm, seed configurable).
uint64_t xxh64(const void* data, size_t len, uint64_t seed = 0);

}  // namespace kdn
