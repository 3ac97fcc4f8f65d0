// Blob header encoding, sealing and bounds-checked parsing (format in kdn/blob.h).
#include "kdn/blob.h"

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
  put_le<uint16_t>(out, 4, kBlobVersion);
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

void blob_seal(uint8_t* blob, size_t size) {
  put_le<uint64_t>(blob, size - kBlobTrailerBytes, xxh64(blob, size - kBlobTrailerBytes));
}

Status blob_parse_header(const uint8_t* data, size_t size, BlobHeader* out) {
  if (data == nullptr || size < kBlobHeaderBytes)
    return Status::Fail("blob truncated: " + std::to_string(size) + " bytes, header alone needs " +
                        std::to_string(kBlobHeaderBytes + kBlobTrailerBytes));
  if (std::memcmp(data, kMagic, 4) != 0) return Status::Fail("not a kdn blob (bad magic)");
  uint16_t version = get_le<uint16_t>(data, 4);
  if (version != kBlobVersion)
    return Status::Fail("unsupported blob format version " + std::to_string(version));
  if (get_le<uint16_t>(data, 6) != kBlobHeaderBytes) return Status::Fail("bad blob header size");
  BlobHeader h;
  h.kind = get_le<uint16_t>(data, 10);
  if (h.kind != kBlobKindKV && h.kind != kBlobKindPointer) return Status::Fail("unknown blob kind " + std::to_string(h.kind));
  h.codec = data[8];
  if (h.kind == kBlobKindPointer && h.codec != kCodecRaw) return Status::Fail("a pointer blob must be raw");
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
  if (size != kBlobHeaderBytes + h.payload_bytes + kBlobTrailerBytes)
    return Status::Fail("blob size " + std::to_string(size) + " does not match its header (" +
                        std::to_string(kBlobHeaderBytes + h.payload_bytes + kBlobTrailerBytes) + ")");
  if (verify_checksum &&
      get_le<uint64_t>(data, size - kBlobTrailerBytes) != xxh64(data, size - kBlobTrailerBytes))
    return Status::Fail("blob checksum mismatch");
  *out = h;
  return Status::Ok();
}

}  // namespace kdn
