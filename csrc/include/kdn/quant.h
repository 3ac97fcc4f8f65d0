// Element access and (de)quantization math shared by the CPU codecs and the CUDA decode kernels.
#pragma once

#include <cstdint>

#include "kdn/common.h"
#include "kdn/half.h"

namespace kdn {

KDN_HD float load_float(const uint8_t* base, DType dtype, int64_t i) {
  if (dtype == DType::kFloat32) {
    float f;
    memcpy(&f, base + 4 * i, 4);
    return f;
  }
  uint16_t h;
  memcpy(&h, base + 2 * i, 2);
  return dtype == DType::kFloat16 ? fp16_to_float(h) : bf16_to_float(h);
}

KDN_HD void store_float(uint8_t* base, DType dtype, int64_t i, float f) {
  if (dtype == DType::kFloat32) {
    memcpy(base + 4 * i, &f, 4);
    return;
  }
  const uint16_t h = dtype == DType::kFloat16 ? float_to_fp16(f) : float_to_bf16(f);
  memcpy(base + 2 * i, &h, 2);
}

// The i-th `bits`-wide unsigned integer of a little-endian bit-packed array (bits in 2, 4, 8).
KDN_HD uint32_t unpack_bits(const uint8_t* packed, int bits, int64_t i) {
  const int64_t bit = i * bits;
  return (packed[bit >> 3] >> (bit & 7)) & ((1u << bits) - 1u);
}

// KIVI: asymmetric dequantization with a scale and a zero point (both stored as fp16).
KDN_HD float kivi_dequant(uint32_t q, float scale, float zero) { return static_cast<float>(q) * scale + zero; }

// KIVI grouping: keys share (scale, zero) per channel over `group` tokens, values per token over
// `group` channels. Returns the index of element (t, c)'s scale/zero in the plane's arrays.
KDN_HD int64_t kivi_group_index(bool values, int64_t t, int64_t c, int64_t channels, int64_t group) {
  if (values) return t * ((channels + group - 1) / group) + c / group;
  return (t / group) * channels + c;
}

// CacheGen: symbol q back to a normalized value: q steps of `step` * the token vector's scale,
// added to the value it was coded against (the group's anchor, or 0).
KDN_HD float cachegen_normalized(int q, float step, float token_scale, float reference) {
  return reference + static_cast<float>(q) * (step * token_scale);
}

// CacheGen: a normalized value back to the channel's units.
KDN_HD float cachegen_denormalize(float u, float offset, float channel_scale) { return offset + channel_scale * u; }

}  // namespace kdn
