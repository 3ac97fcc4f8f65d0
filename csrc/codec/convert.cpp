// Row conversions of decoded values into the blob dtype (kdn/convert.h).
#include "kdn/convert.h"

#include <cstring>

// The F16C path is x86-only; KDN_NO_F16C (CMake -DKDN_F16C=OFF) forces the portable conversion,
// which is what aarch64 and every other target compile.
#if (defined(__x86_64__) || defined(__i386__)) && !defined(KDN_NO_F16C)
#define KDN_HAVE_F16C_PATH 1
#include <immintrin.h>
#else
#define KDN_HAVE_F16C_PATH 0
#endif

#include "kdn/quant.h"

namespace kdn {
namespace {

#if KDN_HAVE_F16C_PATH
__attribute__((target("avx,f16c"))) void to_fp16_f16c(uint16_t* out, const float* v, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(v + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) out[i] = float_to_fp16(v[i]);
}

bool has_f16c() {
  static const bool yes = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
  return yes;
}
#else
void to_fp16_f16c(uint16_t*, const float*, int64_t) {}
bool has_f16c() { return false; }
#endif

}  // namespace

const char* fp16_conversion() { return has_f16c() ? "f16c" : "portable"; }

void store_floats(uint8_t* out, DType dtype, int64_t index, const float* v, int64_t n) {
  if (dtype == DType::kFloat32) {
    std::memcpy(out + 4 * index, v, 4 * n);
    return;
  }
  uint16_t* dst = reinterpret_cast<uint16_t*>(out + 2 * index);  // blob payloads are 2-byte aligned
  if (dtype == DType::kBFloat16) {
    for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(v[i]);
  } else if (has_f16c()) {
    to_fp16_f16c(dst, v, n);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = float_to_fp16(v[i]);
  }
}

}  // namespace kdn
