// Codec dispatch through the registry (kCodecs in kdn/codec.h) and the plane structure every codec shares.
#include "kdn/codec.h"

#include <cstring>

#include "kdn/byte_io.h"
#include "kdn/parallel.h"

namespace kdn {

void CodecReport::add(const CodecReport& o) {
  symbols += o.symbols;
  model_bits += o.model_bits;
  empirical_bits += o.empirical_bits;
  coded_bytes += o.coded_bytes;
  table_bytes += o.table_bytes;
  side_bytes += o.side_bytes;
}

Status codec_check(uint8_t codec, uint32_t params) {
  const CodecOps* ops = codec_ops(codec);
  return ops ? ops->check(params) : Status::Fail("unknown codec id " + std::to_string(codec));
}

void codec_require(int64_t codec, uint32_t params) {
  if (codec == kCodecRaw) {
    if (params != 0) throw InputError("raw codec takes no parameters", __FILE__, __LINE__);
    return;
  }
  Status st = codec >= 0 && codec < 256 ? codec_check(static_cast<uint8_t>(codec), params)
                                        : Status::Fail("unknown codec id " + std::to_string(codec));
  if (!st.ok) throw InputError(st.message, __FILE__, __LINE__);
}

namespace {

Plane plane_of(const BlobHeader& h, int64_t p) {
  return Plane{h.tokens, static_cast<int64_t>(h.kv_heads) * h.head_dim, static_cast<int>(p / 2),
               static_cast<int>(h.layers), (p & 1) != 0, h.dtype, h.head_dim, h.position};
}

}  // namespace

std::vector<uint8_t> codec_encode(const BlobHeader& h, const uint8_t* raw, int threads, CodecReport* report) {
  codec_require(h.codec, h.codec_params);
  KDN_CHECK_INPUT(h.codec != kCodecRaw, "codec_encode: raw is not an encoding");
  const int64_t planes = 2 * static_cast<int64_t>(h.layers);
  const size_t plane_raw = raw_payload_bytes(h) / planes;
  const CodecOps& ops = *codec_ops(h.codec);
  const std::shared_ptr<const void> state = ops.prepare ? ops.prepare(h) : nullptr;
  std::vector<std::vector<uint8_t>> coded(planes);
  std::vector<CodecReport> reports(planes);
  parallel_for(planes, threads, [&](int64_t p) {
    coded[p] = ops.encode(plane_of(h, p), h.codec_params, raw + p * plane_raw, state.get(), &reports[p]);
  });
  ByteWriter out;
  size_t total = 4 * planes;
  for (const auto& c : coded) total += c.size();
  out.out.reserve(total);
  for (const auto& c : coded) out.put<uint32_t>(static_cast<uint32_t>(c.size()));
  for (const auto& c : coded) out.append(c.data(), c.size());
  if (report) {
    for (const auto& r : reports) report->add(r);
    report->side_bytes += 4 * planes;
  }
  return std::move(out.out);
}

Status codec_decode(const BlobHeader& h, const uint8_t* payload, size_t size, uint8_t* out, int threads) {
  return codec_decode_planes(h, payload, size, out, 0, 2 * static_cast<int64_t>(h.layers), threads);
}

Status codec_decode_planes(const BlobHeader& h, const uint8_t* payload, size_t size, uint8_t* out, int64_t first,
                           int64_t last, int threads) {
  const int64_t planes = 2 * static_cast<int64_t>(h.layers);
  if (first < 0 || first >= last || last > planes) return Status::Fail("codec_decode: no such planes");
  const size_t plane_raw = raw_payload_bytes(h) / planes;
  if (h.codec == kCodecRaw) {
    if (size != raw_payload_bytes(h)) return Status::Fail("raw payload size does not match its header");
    std::memcpy(out, payload + first * plane_raw, (last - first) * plane_raw);
    return Status::Ok();
  }
  Status st = codec_check(h.codec, h.codec_params);
  if (!st.ok) return st;
  ByteReader reader(payload, size);
  std::vector<const uint8_t*> starts(planes);
  std::vector<uint32_t> sizes(planes);
  for (auto& s : sizes) s = reader.get<uint32_t>();
  for (int64_t p = 0; p < planes; ++p) starts[p] = reader.take(sizes[p]);
  if (!reader.ok() || reader.remaining() != 0) return Status::Fail("codec payload: plane sizes do not match the payload");
  const CodecOps& ops = *codec_ops(h.codec);
  std::vector<char> ok(planes, 1);
  parallel_for(last - first, threads, [&](int64_t i) {
    const int64_t p = first + i;
    ok[p] = ops.decode(plane_of(h, p), h.codec_params, starts[p], sizes[p], out + i * plane_raw);
  });
  for (int64_t p = first; p < last; ++p)
    if (!ok[p])
      return Status::Fail("codec payload: plane " + std::to_string(p) + " (layer " + std::to_string(p / 2) +
                          (p & 1 ? " values" : " keys") + ") is corrupt");
  return Status::Ok();
}

}  // namespace kdn
