// Re-encoding a blob with another codec (what tiers with different codecs hand each other).
#include <cstring>

#include "kdn/codec.h"
#include "kdn/hash.h"

namespace kdn {

Key128 lossy_key(const Key128& key, uint8_t codec, uint32_t params) {
  static constexpr char kTag[] = "kdn/lossy-key";
  uint8_t msg[sizeof(kTag) - 1 + 16 + 1 + 4];
  std::memcpy(msg, kTag, sizeof(kTag) - 1);
  std::memcpy(msg + sizeof(kTag) - 1, key.data(), 16);
  msg[sizeof(kTag) - 1 + 16] = codec;
  for (int i = 0; i < 4; ++i) msg[sizeof(kTag) - 1 + 17 + i] = static_cast<uint8_t>(params >> (8 * i));
  return blake3_128(msg, sizeof(msg));
}

Key128 coded_key(const BlobHeader& h, uint8_t codec, uint32_t params) {
  if ((codec == h.codec && params == h.codec_params) || !codec_is_lossy(codec) || h.kind != kBlobKindKV) return h.key;
  return lossy_key(h.key, codec, params);
}

BufferPtr blob_transcode(const BlobHeader& h, const uint8_t* blob, uint8_t codec, uint32_t params, int threads,
                         CodecReport* report) {
  codec_require(codec, params);
  if (h.kind != kBlobKindKV) {  // only KV is coded: other kinds are copied as they are
    auto copy = std::make_shared<Buffer>(blob_total_bytes(h));
    std::memcpy(copy->data(), blob, copy->size());
    return copy;
  }
  BlobHeader out = h;
  out.version = kBlobVersion;  // a version-1 blob is re-sealed in the current format
  out.key = coded_key(h, codec, params);
  out.codec = codec;
  out.codec_params = params;
  const uint64_t raw_bytes = raw_payload_bytes(h);
  const uint8_t* payload = blob + kBlobHeaderBytes;
  if (codec == kCodecRaw) {  // decode straight into the new blob
    out.payload_bytes = raw_bytes;
    auto result = std::make_shared<Buffer>(blob_total_bytes(out));
    Status st = codec_decode(h, payload, h.payload_bytes, result->data() + kBlobHeaderBytes, threads);
    if (!st.ok) throw BlobError(st.message, __FILE__, __LINE__);
    blob_write_header(out, result->data());
    blob_seal(result->data(), result->size());
    result->mark_verified();
    return result;
  }
  BufferPtr decoded;
  if (h.codec != kCodecRaw) {
    decoded = std::make_shared<Buffer>(raw_bytes);
    Status st = codec_decode(h, payload, h.payload_bytes, decoded->data(), threads);
    if (!st.ok) throw BlobError(st.message, __FILE__, __LINE__);
    payload = decoded->data();
  }
  const std::vector<uint8_t> coded = codec_encode(out, payload, threads, report);
  out.payload_bytes = coded.size();
  auto result = std::make_shared<Buffer>(blob_total_bytes(out));
  blob_write_header(out, result->data());
  std::memcpy(result->data() + kBlobHeaderBytes, coded.data(), coded.size());
  blob_seal(result->data(), result->size());
  result->mark_verified();
  return result;
}

}  // namespace kdn
