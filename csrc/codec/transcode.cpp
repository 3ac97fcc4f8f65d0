// Re-encoding a blob with another codec (what tiers with different codecs hand each other).
#include <cstring>

#include "kdn/codec.h"

namespace kdn {

BufferPtr blob_transcode(const BlobHeader& h, const uint8_t* blob, uint8_t codec, uint32_t params, int threads,
                         CodecReport* report) {
  codec_require(codec, params);
  BlobHeader out = h;
  out.codec = codec;
  out.codec_params = params;
  const uint64_t raw_bytes = raw_payload_bytes(h);
  const uint8_t* payload = blob + kBlobHeaderBytes;
  if (codec == kCodecRaw) {  // decode straight into the new blob
    out.payload_bytes = raw_bytes;
    auto result = std::make_shared<Buffer>(kBlobHeaderBytes + raw_bytes + kBlobTrailerBytes);
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
  auto result = std::make_shared<Buffer>(kBlobHeaderBytes + coded.size() + kBlobTrailerBytes);
  blob_write_header(out, result->data());
  std::memcpy(result->data() + kBlobHeaderBytes, coded.data(), coded.size());
  blob_seal(result->data(), result->size());
  result->mark_verified();
  return result;
}

}  // namespace kdn
