// Row conversion float -> fp32 / fp16 / bf16 for the CPU decoders: F16C (chosen at run time when
// the CPU has it) or the portable KDN_HD conversion, which gives the same bits for finite values.
#pragma once

#include <cstdint>

#include "kdn/common.h"

namespace kdn {

// Writes n floats as `dtype` elements at out + index * dtype_size.
void store_floats(uint8_t* out, DType dtype, int64_t index, const float* values, int64_t n);

// "f16c" when the x86 F16C path is compiled in and this CPU has it, else "portable".
const char* fp16_conversion();

}  // namespace kdn
