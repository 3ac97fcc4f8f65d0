// `int8` / `int4` / `int2` codecs in the KIVI style: asymmetric integers with an fp16 scale and
// zero point per group; keys grouped per channel over `group` tokens (their outliers live in
// channels), values per token over `group` channels.
//
// Plane payload: fp16 scale[groups], fp16 zero[groups], then the integers, `bits` each, packed
// little-endian in [tokens, channels] order. Its size follows from the header and is checked.
#include <algorithm>
#include <cmath>

#include "kdn/byte_io.h"
#include "kdn/codec.h"
#include "kdn/convert.h"
#include "kdn/quant.h"

namespace kdn {
namespace {

struct Layout {
  int bits;
  int64_t group, groups, packed;
};

Layout layout_of(const Plane& p, uint32_t params) {
  Layout l;
  l.bits = static_cast<int>(params & 0xff);
  l.group = params >> 16;
  l.groups = p.values ? p.tokens * ((p.channels + l.group - 1) / l.group)
                      : ((p.tokens + l.group - 1) / l.group) * p.channels;
  l.packed = (p.count() * l.bits + 7) / 8;
  return l;
}

}  // namespace

Status kivi_check(uint32_t params) {
  const uint32_t bits = params & 0xff, group = params >> 16;
  if (bits != 2 && bits != 4 && bits != 8) return Status::Fail("int codec bits must be 2, 4 or 8, got " + std::to_string(bits));
  if ((params >> 8 & 0xff) != 0) return Status::Fail("int codec: reserved parameter bits set");
  if (group < 4 || group > 4096) return Status::Fail("int codec group must be in [4, 4096], got " + std::to_string(group));
  return Status::Ok();
}

std::vector<uint8_t> kivi_encode(const Plane& p, uint32_t params, const uint8_t* raw, const void*, CodecReport* report) {
  const Layout l = layout_of(p, params);
  std::vector<float> lo(l.groups, INFINITY), hi(l.groups, -INFINITY);
  for (int64_t t = 0; t < p.tokens; ++t)
    for (int64_t c = 0; c < p.channels; ++c) {
      const float x = load_float(raw, p.dtype, t * p.channels + c);
      KDN_CHECK_INPUT(std::isfinite(x) && std::fabs(x) < 60000.f,
                      "int codecs need finite KV within the fp16 range (use lossless or raw)");
      const int64_t g = kivi_group_index(p.values, t, c, p.channels, l.group);
      lo[g] = std::min(lo[g], x);
      hi[g] = std::max(hi[g], x);
    }
  const float levels = static_cast<float>((1 << l.bits) - 1);
  std::vector<uint16_t> scale(l.groups), zero(l.groups);
  for (int64_t g = 0; g < l.groups; ++g) {
    zero[g] = float_to_fp16(lo[g]);
    // round the scale up so that the group's maximum stays within the top level
    float s = std::max(0.f, (hi[g] - fp16_to_float(zero[g])) / levels);
    uint16_t sh = float_to_fp16(s);
    if (fp16_to_float(sh) < s) ++sh;
    scale[g] = sh;
  }
  ByteWriter w;
  w.out.reserve(4 * l.groups + l.packed);
  w.append(reinterpret_cast<const uint8_t*>(scale.data()), 2 * l.groups);
  w.append(reinterpret_cast<const uint8_t*>(zero.data()), 2 * l.groups);
  const size_t at = w.out.size();
  w.out.resize(at + l.packed, 0);
  uint8_t* packed = w.out.data() + at;
  for (int64_t t = 0; t < p.tokens; ++t)
    for (int64_t c = 0; c < p.channels; ++c) {
      const int64_t i = t * p.channels + c, g = kivi_group_index(p.values, t, c, p.channels, l.group);
      const float s = fp16_to_float(scale[g]);
      const float q = s > 0 ? std::nearbyint((load_float(raw, p.dtype, i) - fp16_to_float(zero[g])) / s) : 0.f;
      const uint32_t v = static_cast<uint32_t>(std::clamp(q, 0.f, levels));
      packed[(i * l.bits) >> 3] |= static_cast<uint8_t>(v << ((i * l.bits) & 7));
    }
  report->side_bytes += w.out.size();
  return std::move(w.out);
}

bool kivi_decode(const Plane& p, uint32_t params, const uint8_t* in, size_t size, uint8_t* out) {
  const Layout l = layout_of(p, params);
  if (size != static_cast<size_t>(4 * l.groups + l.packed)) return false;
  std::vector<float> scale(l.groups), zero(l.groups), row(p.channels);
  for (int64_t g = 0; g < l.groups; ++g) {
    uint16_t h;
    std::memcpy(&h, in + 2 * g, 2);
    scale[g] = fp16_to_float(h);
    std::memcpy(&h, in + 2 * (l.groups + g), 2);
    zero[g] = fp16_to_float(h);
  }
  const uint8_t* packed = in + 4 * l.groups;
  for (int64_t t = 0; t < p.tokens; ++t) {
    const int64_t first = t * p.channels;
    for (int64_t c = 0; c < p.channels; ++c) {
      const int64_t g = kivi_group_index(p.values, t, c, p.channels, l.group);
      row[c] = kivi_dequant(unpack_bits(packed, l.bits, first + c), scale[g], zero[g]);
    }
    store_floats(out, p.dtype, first, row.data(), p.channels);
  }
  return true;
}

}  // namespace kdn
