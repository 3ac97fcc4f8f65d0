// fp16 / bf16 <-> fp32 conversions on bits (KDN_HD: the same code on the CPU and in CUDA kernels).
#pragma once

#include <cstdint>
#include <cstring>

#include "kdn/common.h"

namespace kdn {

KDN_HD float bits_to_float(uint32_t bits) {
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

KDN_HD uint32_t float_to_bits(float f) {
  uint32_t bits;
  memcpy(&bits, &f, 4);
  return bits;
}

KDN_HD float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; NaN stays NaN.
KDN_HD uint16_t float_to_bf16(float f) {
  uint32_t bits = float_to_bits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

KDN_HD float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (mant << 13));  // inf / nan
  if (exp == 0) {
    if (mant == 0) return bits_to_float(sign);
    while (!(mant & 0x400u)) {  // subnormal: normalize
      mant <<= 1;
      --exp;
    }
    ++exp;
    mant &= 0x3ffu;
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

// Round to nearest even, with overflow to inf and subnormals.
KDN_HD uint16_t float_to_fp16(float f) {
  const uint32_t bits = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // nan
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    const float scaled = bits_to_float(abs) * 16777216.0f;  // * 2^24: the subnormal's integer mantissa
    const uint32_t m = static_cast<uint32_t>(scaled);
    const float rest = scaled - static_cast<float>(m);
    uint32_t rounded = m + ((rest > 0.5f || (rest == 0.5f && (m & 1u))) ? 1u : 0u);
    return static_cast<uint16_t>(sign | rounded);
  }
  uint32_t v = abs - 0x38000000u;  // rebias exponent 127 -> 15
  v += 0xfffu + ((v >> 13) & 1u);
  return static_cast<uint16_t>(sign | (v >> 13));
}

// Element types as distinct C++ types so that overloads pick the conversion.
struct Fp16 { uint16_t bits; };
struct Bf16 { uint16_t bits; };
KDN_HD float to_float(float x) { return x; }
KDN_HD float to_float(Fp16 x) { return fp16_to_float(x.bits); }
KDN_HD float to_float(Bf16 x) { return bf16_to_float(x.bits); }
KDN_HD void from_float(float v, float* out) { *out = v; }
KDN_HD void from_float(float v, Fp16* out) { out->bits = float_to_fp16(v); }
KDN_HD void from_float(float v, Bf16* out) { out->bits = float_to_bf16(v); }

// The one place a DType becomes a C++ element type: calls f(T{}) with T = float, Fp16 or Bf16.
// Example: dispatch_dtype(dtype, [&](auto tag) { run<decltype(tag)>(...); });
template <typename F>
decltype(auto) dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat16: return f(Fp16{});
    case DType::kBFloat16: return f(Bf16{});
    case DType::kFloat32: break;
  }
  return f(float{});
}

}  // namespace kdn
