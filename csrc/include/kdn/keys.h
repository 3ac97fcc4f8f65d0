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
// One link of that chain: the key of a chunk of `n` tokens behind the chunk keyed `parent`.
Key128 chunk_key(const Key128& fingerprint, const Key128& parent, const uint32_t* tokens, int64_t n);

// Probe keys of a chunk's leading tokens, for a reader whose tokens leave the stored chain inside
// a chunk: for each n = step, 2*step, ... <= num_tokens,
//   BLAKE3("kdn/probe" | version | fingerprint | parent | tokens[:n] as u32 LE)[:16].
// A writer files a pointer to its chunk (kdn/chunk.h) under each probe of the chunk's tokens; a
// reader computes the probes of its own tokens, and the longest one held names a stored chunk
// that shares at least that many tokens with it.
std::vector<Key128> probe_keys(const Key128& fingerprint, const Key128& parent, const uint32_t* tokens,
                               int64_t num_tokens, int64_t step);

std::vector<Key128> prefix_chunk_keys(const Key128& fingerprint, const uint32_t* tokens,
                                      int64_t num_tokens, int64_t chunk_size,
                                      bool include_partial);

}  // namespace kdn
