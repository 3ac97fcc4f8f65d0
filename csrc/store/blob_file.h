// The disk tier's blob files (csrc/store/disk_store.cpp's): names from keys, keyed tags, whole writes
// and checked reads that never follow a symlink. Internal to the store; the contract is kdn/disk_store.h.
#pragma once

#include "kdn/blob.h"
#include "kdn/hash.h"

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kdn {
namespace blob_file {

constexpr const char* kSuffix = ".kdnb";
constexpr uint64_t kMaxBlobFileBytes = 1ull << 36;
constexpr size_t kMacBytes = 32;

std::string key_hex(const Key128& key);
bool key_from_hex(const std::string& hex, Key128* key);
std::string errno_text(const std::string& what, const std::string& path);
bool write_all(int fd, const uint8_t* data, size_t size);
// BLAKE3 keyed with the tenant's mac key over a blob: the tag a keyed store writes after it
void mac_of(const std::string& mac_key, const uint8_t* data, size_t size, uint8_t out[kMacBytes]);
bool mac_matches(const std::string& mac_key, const uint8_t* data, size_t size, const uint8_t tag[kMacBytes]);
bool read_at(int fd, uint8_t* data, size_t size, size_t offset, const std::string& path, std::string* error);
// Reads a blob file: its header first, so a file whose size disagrees with its header (a foreign,
// sparse or truncated file) is rejected before anything is allocated for it. Never follows a
// symlink. nullptr with *missing set if it does not exist, or with *error set.
// *bad is set when the file exists but is damaged (size or header wrong); *foreign when it is a
// well-formed blob file of another key (tagged without a key here, untagged or failing the tag with one).
// With `sections` (inclusive ranges [first, last] of a version-2 KV blob's sections; the file not
// keyed): only the header, section 0, those sections and the trailer are read, each range verified
// by its section sums, and the buffer (the blob's size) is marked partial and verified; a blob that
// cannot be read in part (version 1, keyed, coded, not KV) is read whole.
using SectionSpans = std::vector<std::pair<uint64_t, uint64_t>>;
BufferPtr read_file(const std::string& path, const std::string& mac_key, bool group_shared, bool* missing, bool* bad,
                   bool* foreign, std::string* error, const SectionSpans* sections = nullptr,
                   uint64_t* read_bytes = nullptr);

}  // namespace blob_file
}  // namespace kdn
