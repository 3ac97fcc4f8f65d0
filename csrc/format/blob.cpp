// Blob header encoding, sealing and bounds-checked parsing (format in kdn/blob.h).
#include "kdn/blob.h"

#include <algorithm>
#include <cstring>

#include "kdn/codec.h"

namespace kdn {
namespace {

constexpr char kMagic[4] = {'K', 'D', 'N', 'B'};
constexpr uint32_t kMaxDim = 1u << 16;
constexpr uint32_t kMaxTokens = 1u << 22;

template <typename T>
void put_le(uint8_t* out, size_t offset, T value) {
  std::memcpy(out + offset, &value, sizeof(T));
}
template <typename T>
T get_le(const uint8_t* in, size_t offset) {
  T value;
  std::memcpy(&value, in + offset, sizeof(T));
  return value;
}

}  // namespace

uint64_t raw_payload_bytes(const BlobHeader& h) {
  if (h.kind == kBlobKindPointer) {
    if (h.layers || h.kv_heads || h.head_dim || h.tokens == 0 || h.tokens > kMaxTokens) return 0;
    return 16 + 4 * uint64_t(h.tokens);
  }
  if (h.kind == kBlobKindCalibration || h.kind == kBlobKindSidecar)
    return h.layers || h.kv_heads || h.head_dim || h.tokens || h.payload_bytes > (1ull << 30) ? 0 : h.payload_bytes;
  if (h.layers == 0 || h.kv_heads == 0 || h.head_dim == 0 || h.tokens == 0) return 0;
  if (h.layers > kMaxDim || h.kv_heads > kMaxDim || h.head_dim > kMaxDim || h.tokens > kMaxTokens)
    return 0;
  unsigned __int128 n = (unsigned __int128)h.layers * 2 * h.tokens * h.kv_heads * h.head_dim *
                        (uint64_t)dtype_size(h.dtype);
  if (n > (unsigned __int128)(1ULL << 40)) return 0;  // 1 TiB per chunk is not a chunk
  return static_cast<uint64_t>(n);
}

void blob_write_header(const BlobHeader& h, uint8_t* out) {
  std::memset(out, 0, kBlobHeaderBytes);
  std::memcpy(out, kMagic, 4);
  put_le<uint16_t>(out, 4, h.version);
  put_le<uint16_t>(out, 6, static_cast<uint16_t>(kBlobHeaderBytes));
  out[8] = h.codec;
  out[9] = static_cast<uint8_t>(h.dtype);
  put_le<uint16_t>(out, 10, h.kind);
  put_le<uint32_t>(out, 12, h.layers);
  put_le<uint32_t>(out, 16, h.kv_heads);
  put_le<uint32_t>(out, 20, h.head_dim);
  put_le<uint32_t>(out, 24, h.tokens);
  put_le<uint32_t>(out, 28, h.position);
  put_le<uint32_t>(out, 32, h.codec_params);
  std::memcpy(out + 36, h.fingerprint.data(), 16);
  std::memcpy(out + 52, h.key.data(), 16);
  put_le<uint64_t>(out, 68, h.payload_bytes);
}

std::vector<std::pair<uint64_t, uint64_t>> blob_section_ranges(const BlobHeader& h, const uint8_t* payload,
                                                               uint64_t available) {
  const uint64_t end = kBlobHeaderBytes + h.payload_bytes;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  if (h.kind != kBlobKindKV) return {{0, end}};
  const uint64_t planes = 2 * uint64_t(h.layers);
  const uint64_t table = std::min(blob_table_bytes(h), h.payload_bytes);
  ranges.reserve(planes + 1);
  ranges.push_back({0, kBlobHeaderBytes + table});
  uint64_t at = kBlobHeaderBytes + table;
  const uint64_t plane_raw = h.codec == kCodecRaw ? raw_payload_bytes(h) / std::max<uint64_t>(planes, 1) : 0;
  for (uint64_t p = 0; p < planes; ++p) {
    uint64_t size = plane_raw;
    if (h.codec != kCodecRaw) size = 4 * p + 4 <= std::min(table, available) ? get_le<uint32_t>(payload, 4 * p) : 0;
    const uint64_t next = p + 1 == planes ? end : std::min(end, at + size);
    ranges.push_back({at, next});
    at = next;
  }
  return ranges;
}

namespace {

// The section sums of a version-2 blob whose bytes are all at hand.
void section_sums(const BlobHeader& h, const uint8_t* blob, uint64_t* sums) {
  const auto ranges = blob_section_ranges(h, blob + kBlobHeaderBytes, h.payload_bytes);
  for (size_t i = 0; i < ranges.size(); ++i)
    sums[i] = xxh64(blob + ranges[i].first, static_cast<size_t>(ranges[i].second - ranges[i].first));
}

}  // namespace

void blob_seal(uint8_t* blob, size_t size) {
  BlobHeader h;
  if (size >= kBlobHeaderBytes && blob_parse_header(blob, size, &h).ok && h.version >= 2 &&
      blob_total_bytes(h) == size) {
    uint8_t* sums = blob + kBlobHeaderBytes + h.payload_bytes;
    std::vector<uint64_t> values(blob_sections(h));
    section_sums(h, blob, values.data());
    std::memcpy(sums, values.data(), 8 * values.size());
    put_le<uint64_t>(blob, size - kBlobTrailerBytes, xxh64(sums, 8 * values.size()));
    return;
  }
  // version 1, or bytes that are not a well-formed header (tests reseal corrupted blobs)
  put_le<uint64_t>(blob, size - kBlobTrailerBytes, xxh64(blob, size - kBlobTrailerBytes));
}

Status blob_verify_sections(const uint8_t* data, size_t size, uint64_t first, uint64_t last) {
  BlobHeader h;
  Status st = blob_parse_header(data, size, &h);
  if (!st.ok) return st;
  if (h.version < 2) return Status::Fail("a version-1 blob can only be verified whole");
  if (blob_total_bytes(h) != size) return Status::Fail("blob size does not match its header");
  const uint64_t n = blob_sections(h);
  if (first > last || last >= n) return Status::Fail("blob_verify_sections: no such sections");
  const uint8_t* sums = data + kBlobHeaderBytes + h.payload_bytes;
  if (get_le<uint64_t>(data, size - kBlobTrailerBytes) != xxh64(sums, 8 * n))
    return Status::Fail("blob section sums do not match their checksum");
  const auto ranges = blob_section_ranges(h, data + kBlobHeaderBytes, h.payload_bytes);
  auto check = [&](uint64_t i) {
    return get_le<uint64_t>(sums, 8 * i) ==
           xxh64(data + ranges[i].first, static_cast<size_t>(ranges[i].second - ranges[i].first));
  };
  if (!check(0)) return Status::Fail("blob checksum mismatch (header section)");
  for (uint64_t i = std::max<uint64_t>(first, 1); i <= last; ++i)
    if (!check(i)) return Status::Fail("blob checksum mismatch (section " + std::to_string(i) + ")");
  return Status::Ok();
}

Status blob_parse_header(const uint8_t* data, size_t size, BlobHeader* out) {
  if (data == nullptr || size < kBlobHeaderBytes)
    return Status::Fail("blob truncated: " + std::to_string(size) + " bytes, header alone needs " +
                        std::to_string(kBlobHeaderBytes + kBlobTrailerBytes));
  if (std::memcmp(data, kMagic, 4) != 0) return Status::Fail("not a kdn blob (bad magic)");
  uint16_t version = get_le<uint16_t>(data, 4);
  if (version < kBlobVersionMin || version > kBlobVersion)
    return Status::Fail("unsupported blob format version " + std::to_string(version));
  if (get_le<uint16_t>(data, 6) != kBlobHeaderBytes) return Status::Fail("bad blob header size");
  BlobHeader h;
  h.version = version;
  h.kind = get_le<uint16_t>(data, 10);
  if (h.kind > kBlobKindSidecar) return Status::Fail("unknown blob kind " + std::to_string(h.kind));
  h.codec = data[8];
  if (h.kind != kBlobKindKV && h.codec != kCodecRaw) return Status::Fail("only a KV blob may be coded");
  h.codec_params = get_le<uint32_t>(data, 32);
  if (h.codec == kCodecRaw && h.codec_params != 0) return Status::Fail("raw blob with codec parameters");
  if (h.codec != kCodecRaw) {
    Status st = codec_check(h.codec, h.codec_params);
    if (!st.ok) return st;
  }
  if (!dtype_is_valid(data[9])) return Status::Fail("unknown dtype code " + std::to_string(data[9]));
  h.dtype = static_cast<DType>(data[9]);
  h.layers = get_le<uint32_t>(data, 12);
  h.kv_heads = get_le<uint32_t>(data, 16);
  h.head_dim = get_le<uint32_t>(data, 20);
  h.tokens = get_le<uint32_t>(data, 24);
  h.position = get_le<uint32_t>(data, 28);
  std::memcpy(h.fingerprint.data(), data + 36, 16);
  std::memcpy(h.key.data(), data + 52, 16);
  h.payload_bytes = get_le<uint64_t>(data, 68);
  uint64_t expected = raw_payload_bytes(h);
  if (expected == 0) return Status::Fail("blob dimensions out of range");
  if (h.codec == kCodecRaw ? h.payload_bytes != expected
                           : h.payload_bytes > expected * kMaxCodedRatio || h.payload_bytes * kMaxDecodedRatio < expected)
    return Status::Fail("payload size " + std::to_string(h.payload_bytes) +
                        " does not match dimensions (" + std::to_string(expected) + ")");
  *out = h;
  return Status::Ok();
}

Status blob_parse(const uint8_t* data, size_t size, bool verify_checksum, BlobHeader* out) {
  if (data == nullptr || size < kBlobHeaderBytes + kBlobTrailerBytes)
    return Status::Fail("blob truncated: " + std::to_string(size) + " bytes, header alone needs " +
                        std::to_string(kBlobHeaderBytes + kBlobTrailerBytes));
  BlobHeader h;
  Status st = blob_parse_header(data, size, &h);
  if (!st.ok) return st;
  if (size != blob_total_bytes(h))
    return Status::Fail("blob size " + std::to_string(size) + " does not match its header (" +
                        std::to_string(blob_total_bytes(h)) + ")");
  if (verify_checksum && h.version >= 2) {
    std::vector<uint64_t> sums(blob_sections(h));
    section_sums(h, data, sums.data());
    const uint8_t* stored = data + kBlobHeaderBytes + h.payload_bytes;
    if (std::memcmp(stored, sums.data(), 8 * sums.size()) != 0 ||
        get_le<uint64_t>(data, size - kBlobTrailerBytes) != xxh64(stored, 8 * sums.size()))
      return Status::Fail("blob checksum mismatch");
  } else if (verify_checksum &&
             get_le<uint64_t>(data, size - kBlobTrailerBytes) != xxh64(data, size - kBlobTrailerBytes)) {
    return Status::Fail("blob checksum mismatch");
  }
  *out = h;
  return Status::Ok();
}

BufferPtr pack_bytes_blob(uint16_t kind, const Key128& fingerprint, const Key128& key, const uint8_t* data,
                          size_t size) {
  KDN_CHECK_INPUT(kind == kBlobKindCalibration || kind == kBlobKindSidecar, "pack_bytes_blob: not a bytes kind");
  KDN_CHECK_INPUT(size <= (1ull << 30), "pack_bytes_blob: more than 1 GiB");
  BlobHeader h;
  h.kind = kind;
  h.fingerprint = fingerprint;
  h.key = key;
  h.payload_bytes = size;
  auto blob = std::make_shared<Buffer>(blob_total_bytes(h));
  blob_write_header(h, blob->data());
  if (size) std::memcpy(blob->data() + kBlobHeaderBytes, data, size);
  blob_seal(blob->data(), blob->size());
  blob->mark_verified();
  return blob;
}

Status read_bytes_blob(const uint8_t* blob, size_t size, uint16_t kind, const Key128& fingerprint,
                       const Key128& key, size_t* offset, size_t* bytes) {
  BlobHeader h;
  Status st = blob_parse(blob, size, true, &h);
  if (!st.ok) return st;
  if (h.kind != kind) return Status::Fail("blob of kind " + std::to_string(h.kind) + ", not " + std::to_string(kind));
  if (h.fingerprint != fingerprint || h.key != key) return Status::Fail("blob of another model or key");
  *offset = kBlobHeaderBytes;
  *bytes = h.payload_bytes;
  return Status::Ok();
}

}  // namespace kdn
