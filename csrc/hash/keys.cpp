// Chained prefix chunk keys (see kdn/keys.h for the derivation).
#include "kdn/keys.h"

#include "kdn/common.h"

namespace kdn {

std::vector<Key128> prefix_chunk_keys(const Key128& fingerprint, const uint32_t* tokens,
                                      int64_t num_tokens, int64_t chunk_size,
                                      bool include_partial) {
  KDN_CHECK_INPUT(chunk_size > 0, "chunk_size must be positive, got " + std::to_string(chunk_size));
  KDN_CHECK_INPUT(num_tokens >= 0, "num_tokens must be non-negative");
  static const char kDomain[] = "kdn/prefix";
  std::vector<Key128> keys;
  Key128 parent{};
  for (int64_t start = 0; start < num_tokens; start += chunk_size) {
    int64_t n = num_tokens - start < chunk_size ? num_tokens - start : chunk_size;
    if (n < chunk_size && !include_partial) break;
    Blake3 h;
    h.update(kDomain, sizeof(kDomain) - 1);
    uint8_t version[4] = {uint8_t(kKeyFormatVersion), uint8_t(kKeyFormatVersion >> 8),
                          uint8_t(kKeyFormatVersion >> 16), uint8_t(kKeyFormatVersion >> 24)};
    h.update(version, 4);
    h.update(fingerprint.data(), fingerprint.size());
    h.update(parent.data(), parent.size());
    h.update(tokens + start, static_cast<size_t>(n) * sizeof(uint32_t));  // x86-64: little endian
    h.finalize(parent.data(), parent.size());
    keys.push_back(parent);
  }
  return keys;
}

}  // namespace kdn
