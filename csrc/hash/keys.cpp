// Chained prefix chunk keys (see kdn/keys.h for the derivation).
#include "kdn/keys.h"

#include "kdn/common.h"

namespace kdn {

namespace {

Blake3 keyed_by(const char* domain, size_t domain_len, const Key128& fingerprint, const Key128& parent) {
  Blake3 h;
  h.update(domain, domain_len);
  const uint8_t version[4] = {uint8_t(kKeyFormatVersion), uint8_t(kKeyFormatVersion >> 8),
                              uint8_t(kKeyFormatVersion >> 16), uint8_t(kKeyFormatVersion >> 24)};
  h.update(version, 4);
  h.update(fingerprint.data(), fingerprint.size());
  h.update(parent.data(), parent.size());
  return h;
}

}  // namespace

Key128 chunk_key(const Key128& fingerprint, const Key128& parent, const uint32_t* tokens, int64_t n) {
  static const char kDomain[] = "kdn/prefix";
  Blake3 h = keyed_by(kDomain, sizeof(kDomain) - 1, fingerprint, parent);
  h.update(tokens, static_cast<size_t>(n) * sizeof(uint32_t));  // x86-64 and aarch64: little endian
  Key128 key;
  h.finalize(key.data(), key.size());
  return key;
}

std::vector<Key128> probe_keys(const Key128& fingerprint, const Key128& parent, const uint32_t* tokens,
                               int64_t num_tokens, int64_t step) {
  KDN_CHECK_INPUT(step > 0, "probe step must be positive, got " + std::to_string(step));
  static const char kDomain[] = "kdn/probe";
  std::vector<Key128> keys;
  for (int64_t n = step; n <= num_tokens; n += step) {
    Blake3 h = keyed_by(kDomain, sizeof(kDomain) - 1, fingerprint, parent);
    h.update(tokens, static_cast<size_t>(n) * sizeof(uint32_t));
    keys.emplace_back();
    h.finalize(keys.back().data(), keys.back().size());
  }
  return keys;
}

std::vector<Key128> prefix_chunk_keys(const Key128& fingerprint, const uint32_t* tokens, int64_t num_tokens,
                                      int64_t chunk_size, bool include_partial) {
  KDN_CHECK_INPUT(chunk_size > 0, "chunk_size must be positive, got " + std::to_string(chunk_size));
  KDN_CHECK_INPUT(num_tokens >= 0, "num_tokens must be non-negative");
  std::vector<Key128> keys;
  Key128 parent{};
  for (int64_t start = 0; start < num_tokens; start += chunk_size) {
    const int64_t n = num_tokens - start < chunk_size ? num_tokens - start : chunk_size;
    if (n < chunk_size && !include_partial) break;
    parent = chunk_key(fingerprint, parent, tokens + start, n);
    keys.push_back(parent);
  }
  return keys;
}

}  // namespace kdn
