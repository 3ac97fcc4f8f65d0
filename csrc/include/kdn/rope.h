// RoPE re-rotation: move cached keys from the positions they were computed at to new positions.
//
// RoPE turns each pair of a key's channels by angle position * inv_freq[i], so a key computed at
// position p becomes the key at p + delta by one more rotation of delta * inv_freq[i] (exact up to
// rounding; scaled variants that only change inv_freq, such as linear, llama3 and yarn, stay pure
// rotations: the caller passes the model's own inv_freq). Pairs are (i, i + dim/2) in the
// rotate-half convention of HF Llama/Mistral/Qwen2, (2i, 2i+1) in the interleaved (GPT-J) one.
#pragma once

#include <cmath>

#include "kdn/common.h"
#include "kdn/half.h"

namespace kdn {

enum class RopeStyle : uint8_t { kRotateHalf = 0, kInterleaved = 1 };

// Channels of pair i of a head_dim-sized vector.
KDN_HD void rope_pair(RopeStyle style, int64_t head_dim, int64_t i, int64_t* a, int64_t* b) {
  if (style == RopeStyle::kRotateHalf) {
    *a = i;
    *b = i + head_dim / 2;
  } else {
    *a = 2 * i;
    *b = 2 * i + 1;
  }
}

// (x_a, x_b) turned by the angle whose cosine and sine are given (HF: x*cos + rotate_half(x)*sin).
KDN_HD void rope_turn(float* xa, float* xb, float c, float s) {
  const float a = *xa, b = *xb;
  *xa = a * c - b * s;
  *xb = b * c + a * s;
}

// Rotates pair `pair` of the key at (head, token) of one [heads, tokens, head_dim] tensor.
template <typename T>
KDN_HD void rope_shift_one(T* keys, int64_t stride_head, int64_t stride_seq, int64_t head_dim, int64_t head,
                           int64_t token, int64_t pair, float c, float s, RopeStyle style) {
  int64_t a, b;
  rope_pair(style, head_dim, pair, &a, &b);
  T* row = keys + head * stride_head + token * stride_seq;
  float xa = to_float(row[a]), xb = to_float(row[b]);
  rope_turn(&xa, &xb, c, s);
  from_float(xa, &row[a]);
  from_float(xb, &row[b]);
}

// Shape of a batch of key tensors to re-rotate: `tensors` of [heads, tokens, head_dim] (any
// head/token strides, head_dim contiguous), token t moved by deltas[t] positions.
struct RopeShift {
  int64_t tensors, heads, tokens, head_dim;
  RopeStyle style;
};

// cos/sin of every (token, pair) angle deltas[t] * inv_freq[i], computed in double precision on the
// host: out[2 * (t * pairs + i)] = cos, out[... + 1] = sin. Both the CPU and CUDA paths use this table.
void rope_angle_table(const RopeShift& shape, const float* inv_freq, const int64_t* deltas, float* out);

// CPU, threads over (tensor, head). strides: per tensor (head stride, token stride) in elements.
void rope_shift_cpu(const RopeShift& shape, void* const* ptrs, const int64_t* strides, DType dtype,
                    const float* angle_table, int num_threads);

// CUDA twin: ptrs/strides/angle_table in host memory (uploaded on `stream`), keys on the device.
// A failed Status carries the CUDA error text.
Status rope_shift_cuda(const RopeShift& shape, void* const* ptrs, const int64_t* strides, DType dtype,
                       const float* angle_table, uintptr_t stream);

}  // namespace kdn
