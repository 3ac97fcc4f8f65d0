// Deterministic chunk keys: chained prefix keys over token ids.
#pragma once

#include <cstdint>
#include <vector>

#include "kdn/hash.h"

namespace kdn {

// Version of the key derivation; part of every key so a format change never aliases old entries.
constexpr uint32_t kKeyFormatVersion = 1;

// key_i = BLAKE3("kdn/prefix" | version | fingerprint | key_{i-1} | tokens of chunk i as u32 LE)[:16]
// with key_{-1} = 16 zero bytes. Only full chunks get keys unless include_partial is set, in which
// case a trailing partial chunk gets one too.
std::vector<Key128> prefix_chunk_keys(const Key128& fingerprint, const uint32_t* tokens,
                                      int64_t num_tokens, int64_t chunk_size,
                                      bool include_partial);

}  // namespace kdn
