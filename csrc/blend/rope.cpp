// RoPE re-rotation on the CPU (contract in kdn/rope.h); the oracle of kernels/rope.cu.
#include "kdn/rope.h"

#include "kdn/parallel.h"

namespace kdn {

void rope_angle_table(const RopeShift& shape, const float* inv_freq, const int64_t* deltas, float* out) {
  const int64_t pairs = shape.head_dim / 2;
  for (int64_t t = 0; t < shape.tokens; ++t)
    for (int64_t i = 0; i < pairs; ++i) {
      const double angle = static_cast<double>(deltas[t]) * static_cast<double>(inv_freq[i]);
      out[2 * (t * pairs + i)] = static_cast<float>(std::cos(angle));
      out[2 * (t * pairs + i) + 1] = static_cast<float>(std::sin(angle));
    }
}

namespace {

template <typename T>
void shift_all(const RopeShift& shape, void* const* ptrs, const int64_t* strides, const float* table,
               int num_threads) {
  const int64_t pairs = shape.head_dim / 2;
  parallel_for(shape.tensors * shape.heads, num_threads, [&](int64_t job) {
    const int64_t tensor = job / shape.heads, head = job % shape.heads;
    T* keys = static_cast<T*>(ptrs[tensor]);
    for (int64_t t = 0; t < shape.tokens; ++t)
      for (int64_t i = 0; i < pairs; ++i) {
        const float* cs = table + 2 * (t * pairs + i);
        rope_shift_one(keys, strides[2 * tensor], strides[2 * tensor + 1], shape.head_dim, head, t, i, cs[0], cs[1],
                       shape.style);
      }
  });
}

}  // namespace

void rope_shift_cpu(const RopeShift& shape, void* const* ptrs, const int64_t* strides, DType dtype,
                    const float* angle_table, int num_threads) {
  dispatch_dtype(dtype, [&](auto tag) { shift_all<decltype(tag)>(shape, ptrs, strides, angle_table, num_threads); });
}

}  // namespace kdn
