// KV codecs: encode a canonical chunk [layers, 2, tokens, kv_heads, head_dim] into a blob payload
// and decode it back into a caller-provided buffer. The codec id and its parameters travel in the
// blob header (kdn/blob.h), so any tier can hold any codec.
//
// Every codec writes the same outer structure: u32 plane_bytes[layers * 2], then the planes
// (plane p = layer p / 2, keys if p is even, values if odd), each decodable on its own: decoders
// run planes on parallel threads and check every length against the input first.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kdn/blob.h"
#include "kdn/common.h"

namespace kdn {

// Codec ids as written in blob headers (0 is raw, kdn/blob.h); each codec is one row of kCodecs below.
enum CodecId : uint8_t {
  kCodecLossless = 1,  // bit-exact: byte planes + rANS (params 0)
  kCodecKivi = 2,      // KIVI integers: params = bits (2, 4, 8) | group << 16
  kCodecCacheGen = 3,  // CacheGen-style: params = level (1..3) | flags << 8 (bit 0: anchor/delta)
  kCodecKvtc = 4,      // transform coding under a model calibration (kdn/kvtc.h): ratio | sink << 8 | recent << 16
};

// What an encoder spent its bits on; for the physical-limit report.
struct CodecReport {
  uint64_t symbols = 0;         // entropy-coded symbols
  double model_bits = 0;        // sum of -log2 p(symbol) under the codec's own (transmitted) model
  double empirical_bits = 0;    // sum of -log2 of each context's empirical symbol frequency
  uint64_t coded_bytes = 0;     // bytes of the rANS sections (lane headers included)
  uint64_t table_bytes = 0;     // bytes describing the models (frequency tables, table choices)
  uint64_t side_bytes = 0;      // scales, offsets and planes stored without entropy coding
  void add(const CodecReport& o);
};

// OK if `codec` is known and `params` are valid for it; otherwise a readable reason.
Status codec_check(uint8_t codec, uint32_t params);

// The same for a caller's choice, raw included (params 0): throws InputError otherwise.
void codec_require(int64_t codec, uint32_t params);

// Encodes raw canonical KV (raw_payload_bytes(h) bytes, dims and dtype from h) with h.codec and
// h.codec_params. Throws InputError for parameters or data the codec cannot take (NaN, inf).
std::vector<uint8_t> codec_encode(const BlobHeader& h, const uint8_t* raw, int threads, CodecReport* report);

// Decodes a payload into `out` (raw_payload_bytes(h) bytes). Never reads outside the payload or
// writes outside `out`; a malformed payload is a failed Status, never a crash.
Status codec_decode(const BlobHeader& h, const uint8_t* payload, size_t size, uint8_t* out, int threads);

// Decodes planes [first, last) only (plane p = layer p / 2, K or V) into `out`, which holds
// (last - first) planes: what layer-wise delivery decodes while the rest is still arriving. The
// payload's plane table and the planes asked for must be at hand; other planes are not read.
Status codec_decode_planes(const BlobHeader& h, const uint8_t* payload, size_t size, uint8_t* out, int64_t first,
                           int64_t last, int threads);

// The geometry of one plane, what the per-codec functions below see.
struct Plane {
  int64_t tokens, channels;  // channels = kv_heads * head_dim
  int layer, layers;
  bool values;               // false: keys
  DType dtype;
  int64_t head_dim = 0, position = 0;  // the chunk's first token position
  int64_t count() const { return tokens * channels; }
};

// One option of a codec's spec, packed into the header's params at bit `shift`, `bits` wide.
struct CodecOption {
  const char* name = nullptr;  // nullptr: no option
  uint8_t shift = 0, bits = 0;
  uint32_t fallback = 0;       // its value when a spec leaves it out
};

// One codec: all that kdn knows of it, in its own file (csrc/codec/<name>.cpp) and its row below;
// Python reads the rows (_core.codec_table: kdn.codecs, the engine's device path). `check`
// validates params; `prepare` (may be null) returns state every plane of one blob shares while
// encoding (kvtc: the model's calibration) and throws InputError when there is none; `encode` and
// `decode` code one plane (decode: false for a malformed plane, never a crash).
struct CodecOps {
  uint8_t id;
  const char* name;       // as in specs and blob reports (KIVI's widths share "int")
  const char* spellings;  // the spec names, space-separated: one longer than `name` sets the first
                          // option to its digits ("int4": bits 4); nullptr: `name` alone
  bool lossy;             // decode is not bit-exact
  bool device_decoded;    // a CUDA device is sent it coded and decodes it (kernels/codec.cu)
  CodecOption options[3];
  Status (*check)(uint32_t params);
  std::shared_ptr<const void> (*prepare)(const BlobHeader& h);
  std::vector<uint8_t> (*encode)(const Plane& p, uint32_t params, const uint8_t* raw, const void* state,
                                 CodecReport* report);
  bool (*decode)(const Plane& p, uint32_t params, const uint8_t* in, size_t size, uint8_t* out);
};

#define KDN_DECLARE_CODEC(name)                                                                                \
  Status name##_check(uint32_t params);                                                                        \
  std::vector<uint8_t> name##_encode(const Plane& p, uint32_t params, const uint8_t* raw, const void* state,  \
                                     CodecReport* report);                                                     \
  bool name##_decode(const Plane& p, uint32_t params, const uint8_t* in, size_t size, uint8_t* out)
KDN_DECLARE_CODEC(lossless);
KDN_DECLARE_CODEC(kivi);
KDN_DECLARE_CODEC(cachegen);
KDN_DECLARE_CODEC(kvtc);
#undef KDN_DECLARE_CODEC
std::shared_ptr<const void> kvtc_prepare(const BlobHeader& h);

// The codec registry: adding a codec is its file, its id above and a row here. Device decoding:
// cachegen has a CUDA decoder too, but its rANS lanes decode one chunk at a time and ran 1.3x
// slower than the host threads on an H100 machine (benchmarks/results/gpu), so it is not sent coded.
inline constexpr CodecOps kCodecs[] = {
    {kCodecLossless, "lossless", nullptr, false, false, {}, lossless_check, nullptr, lossless_encode, lossless_decode},
    {kCodecKivi, "int", "int8 int4 int2", true, true, {{"bits", 0, 8, 4}, {"group", 16, 16, 32}}, kivi_check, nullptr,
     kivi_encode, kivi_decode},
    {kCodecCacheGen, "cachegen", nullptr, true, false, {{"level", 0, 8, 2}, {"anchor", 8, 8, 0}}, cachegen_check,
     nullptr, cachegen_encode, cachegen_decode},
    {kCodecKvtc, "kvtc", nullptr, true, false, {{"ratio", 0, 8, 8}, {"sink", 8, 8, 4}, {"recent", 16, 8, 0}},
     kvtc_check, kvtc_prepare, kvtc_encode, kvtc_decode},
};

// The row of codec id `codec`, or nullptr (raw, or unknown).
inline const CodecOps* codec_ops(uint8_t codec) {
  for (const CodecOps& ops : kCodecs)
    if (ops.id == codec) return &ops;
  return nullptr;
}

}  // namespace kdn

namespace kdn {

// True for codecs whose decode is not bit-exact (int*, cachegen, kvtc); raw and lossless are exact.
inline bool codec_is_lossy(uint8_t codec) {
  const CodecOps* ops = codec_ops(codec);
  return ops && ops->lossy;
}

// Where lossy KV is filed: BLAKE3("kdn/lossy-key" | key | codec | params LE)[:16]. A chunk coded
// with a lossy codec never lives under its exact key, so a reader that wants exact KV can never be
// served lossy KV by a key lookup, and the fidelity a reader accepts is a set of key variants.
Key128 lossy_key(const Key128& key, uint8_t codec, uint32_t params);

// The key of the blob (h) once coded with (codec, params): unchanged when the codec is the blob's
// own or exact, else lossy_key(h.key, ...) (every lossy coding step re-addresses the chunk).
// Blobs that are not KV (pointers) are never coded: their key never changes.
Key128 coded_key(const BlobHeader& h, uint8_t codec, uint32_t params);

// A new sealed blob holding the chunk of the parsed blob (h, blob) coded with (codec, params):
// decodes first unless the input is raw; its key is coded_key(h, codec, params). A blob that is not
// KV comes back as an unchanged copy. Throws BlobError for a corrupt payload, InputError for data
// the target codec cannot take.
BufferPtr blob_transcode(const BlobHeader& h, const uint8_t* blob, uint8_t codec, uint32_t params, int threads,
                         CodecReport* report);

}  // namespace kdn

namespace kdn {

// CUDA twin of codec_decode for `int*`, `cachegen` and `kvtc` payloads (compiled with nvcc only): the
// payload is in host memory (validated here, then uploaded on `stream`), `out` is device memory of
// raw_payload_bytes(h). A failed Status says why (corrupt payload, CUDA error).
Status codec_decode_cuda(const BlobHeader& h, const uint8_t* payload, size_t size, void* out, uintptr_t stream);
// A chunk for codec_decode_cuda_many: its parsed header, payload (host memory) and output (device).
struct DecodeJob {
  const BlobHeader* header;
  const uint8_t* payload;
  size_t size;
  void* out;
};
// Decodes every job on the stream: the kvtc chunks in one batch, the others one by one.
Status codec_decode_cuda_many(const std::vector<DecodeJob>& jobs, uintptr_t stream);

}  // namespace kdn
