// The disk tier's blob files (contract in blob_file.h).
#include "blob_file.h"

#include "kdn/blob.h"
#include "kdn/hash.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

namespace kdn {
namespace blob_file {

std::string key_hex(const Key128& key) {
  static const char digits[] = "0123456789abcdef";
  std::string out(32, '0');
  for (int i = 0; i < 16; ++i) {
    out[2 * i] = digits[key[i] >> 4];
    out[2 * i + 1] = digits[key[i] & 15];
  }
  return out;
}

bool key_from_hex(const std::string& hex, Key128* key) {
  if (hex.size() != 32) return false;
  for (int i = 0; i < 32; ++i) {
    char c = hex[i];
    int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (v < 0) return false;
    (*key)[i / 2] = static_cast<uint8_t>(i % 2 == 0 ? v << 4 : ((*key)[i / 2] | v));
  }
  return true;
}

std::string errno_text(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

bool write_all(int fd, const uint8_t* data, size_t size) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}


void mac_of(const std::string& mac_key, const uint8_t* data, size_t size, uint8_t out[kMacBytes]) {
  Blake3 h(reinterpret_cast<const uint8_t*>(mac_key.data()));
  h.update(data, size);
  h.finalize(out, kMacBytes);
}

bool mac_matches(const std::string& mac_key, const uint8_t* data, size_t size, const uint8_t tag[kMacBytes]) {
  uint8_t want[kMacBytes];
  mac_of(mac_key, data, size, want);
  uint8_t diff = 0;  // constant time
  for (size_t i = 0; i < kMacBytes; ++i) diff |= static_cast<uint8_t>(want[i] ^ tag[i]);
  return diff == 0;
}

bool read_at(int fd, uint8_t* data, size_t size, size_t offset, const std::string& path, std::string* error) {
  size_t done = 0;
  while (done < size) {
    ssize_t n = ::pread(fd, data + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      *error = n == 0 ? "blob file " + path + " shrank while being read" : errno_text("cannot read", path);
      return false;
    }
    done += static_cast<size_t>(n);
  }
  return true;
}

namespace {

// Sections `spans` of the blob whose header `h` heads `buf` (the blob's size), read from `fd` with
// section 0 and the trailer, then verified: false with *error set (and *bad for a failed sum).
bool read_sections(int fd, Buffer& buf, const BlobHeader& h, const SectionSpans& spans, const std::string& path,
                   bool* bad, std::string* error, uint64_t* read_bytes) {
  uint8_t* data = buf.data();
  const uint64_t table = blob_table_bytes(h), trailer = kBlobHeaderBytes + h.payload_bytes;
  if (table > h.payload_bytes || !read_at(fd, data + kBlobHeaderBytes, table, kBlobHeaderBytes, path, error) ||
      !read_at(fd, data + trailer, buf.size() - trailer, trailer, path, error))
    return false;
  *read_bytes = kBlobHeaderBytes + table + (buf.size() - trailer);
  const auto ranges = blob_section_ranges(h, data + kBlobHeaderBytes, table);
  for (const auto& [first, last] : spans) {
    if (first < 1 || first > last || last >= ranges.size()) {
      *bad = true;
      *error = "blob file " + path + " has no sections " + std::to_string(first) + "-" + std::to_string(last);
      return false;
    }
    const uint64_t begin = ranges[first].first, end = ranges[last].second;
    if (!read_at(fd, data + begin, end - begin, begin, path, error)) return false;
    *read_bytes += end - begin;
  }
  for (const auto& [first, last] : spans) {
    if (Status st = blob_verify_sections(data, buf.size(), first, last); !st.ok) {
      *bad = true;
      *error = "blob file " + path + ": " + st.message;
      return false;
    }
  }
  buf.mark_partial();
  buf.mark_verified();
  return true;
}

}  // namespace

BufferPtr read_file(const std::string& path, const std::string& mac_key, bool group_shared, bool* missing, bool* bad,
                   bool* foreign, std::string* error, const SectionSpans* sections, uint64_t* read_bytes) {
  const uint64_t tag_bytes = mac_key.empty() ? 0 : kMacBytes;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    if (errno == ENOENT || errno == ENOTDIR) *missing = true;
    else if (errno == ELOOP) *bad = true, *error = "blob file " + path + " is a symlink (not followed)";
    else *error = errno_text("cannot open", path);
    return nullptr;
  }
  struct stat st;
  BufferPtr buf;
  uint8_t head[kBlobHeaderBytes];
  BlobHeader h;
  if (::fstat(fd, &st) != 0) {
    *error = errno_text("cannot stat", path);
  } else if ((st.st_mode & S_IWOTH) || (!group_shared && (st.st_uid != ::geteuid() || (st.st_mode & S_IWGRP)))) {
    *foreign = true;  // another local user's file (or one others may rewrite): not this store's to read or delete
    *error = "blob file " + path + " belongs to uid " + std::to_string(st.st_uid) + " or is writable by others (not read)";
  } else if (!S_ISREG(st.st_mode) || st.st_size <= 0 || static_cast<uint64_t>(st.st_size) > kMaxBlobFileBytes ||
             static_cast<uint64_t>(st.st_size) < kBlobHeaderBytes) {
    *bad = true;
    *error = "blob file " + path + " is not a regular file of a possible size (" + std::to_string(st.st_size) + ")";
  } else if (!read_at(fd, head, kBlobHeaderBytes, 0, path, error)) {
    // I/O error (or shrank meanwhile): reported as such
  } else if (Status hs = blob_parse_header(head, kBlobHeaderBytes, &h); !hs.ok) {
    *bad = true;
    *error = "blob file " + path + ": " + hs.message;
  } else if (blob_total_bytes(h) + (tag_bytes ? 0 : kMacBytes) == static_cast<uint64_t>(st.st_size)) {
    *foreign = true;
    *error = "blob file " + path + (tag_bytes ? " has no keyed tag (written without a secret)"
                                              : " carries a keyed tag (a tenant with a secret wrote it)");
  } else if (blob_total_bytes(h) + tag_bytes != static_cast<uint64_t>(st.st_size)) {
    *bad = true;
    *error = "blob file " + path + " has " + std::to_string(st.st_size) + " bytes, its header says " +
             std::to_string(blob_total_bytes(h)) + (tag_bytes ? " + a 32-byte tag (keyed mode)" : "");
  } else {
    buf = std::make_shared<Buffer>(static_cast<size_t>(blob_total_bytes(h)));
    std::memcpy(buf->data(), head, kBlobHeaderBytes);
    uint8_t tag[kMacBytes];
    if (sections && !sections->empty() && !tag_bytes && h.kind == kBlobKindKV && h.codec == kCodecRaw &&
        blob_sections(h) > 0) {
      uint64_t got = 0;
      if (!read_sections(fd, *buf, h, *sections, path, bad, error, &got)) buf.reset();
      else if (read_bytes) *read_bytes = got;
    } else if (!read_at(fd, buf->data() + kBlobHeaderBytes, buf->size() - kBlobHeaderBytes, kBlobHeaderBytes, path, error) ||
        (tag_bytes && !read_at(fd, tag, kMacBytes, buf->size(), path, error))) {
      buf.reset();
    } else if (tag_bytes && !mac_matches(mac_key, buf->data(), buf->size(), tag)) {
      *foreign = true;
      *error = "blob file " + path + " fails its keyed tag (written without the secret, or altered)";
      buf.reset();
    } else if (read_bytes) {
      *read_bytes = buf->size() + tag_bytes;
    }
  }
  ::close(fd);
  return buf;
}

}  // namespace blob_file
}  // namespace kdn
