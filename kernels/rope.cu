// CUDA twin of rope_shift_cpu: one thread per (tensor, head, token, pair), same KDN_HD rotation.
#include <cuda_runtime.h>

#include "kdn/rope.h"
#include "launch.cuh"

namespace kdn {
namespace {

template <typename T>
__global__ void rope_shift_kernel(RopeShift shape, void* const* ptrs, const int64_t* strides, const float* table) {
  const int64_t pairs = shape.head_dim / 2;
  const int64_t total = shape.tensors * shape.heads * shape.tokens * pairs;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t pair = i % pairs, token = (i / pairs) % shape.tokens;
    const int64_t head = (i / (pairs * shape.tokens)) % shape.heads, tensor = i / (pairs * shape.tokens * shape.heads);
    const float* cs = table + 2 * (token * pairs + pair);
    rope_shift_one(static_cast<T*>(ptrs[tensor]), strides[2 * tensor], strides[2 * tensor + 1], shape.head_dim, head,
                   token, pair, cs[0], cs[1], shape.style);
  }
}

}  // namespace

Status rope_shift_cuda(const RopeShift& shape, void* const* ptrs, const int64_t* strides, DType dtype,
                       const float* angle_table, uintptr_t stream) {
  const int64_t pairs = shape.head_dim / 2, total = shape.tensors * shape.heads * shape.tokens * pairs;
  if (total == 0) return Status::Ok();
  auto s = reinterpret_cast<cudaStream_t>(stream);
  DeviceStaging staged(s, {{ptrs, shape.tensors * sizeof(void*)},
                           {strides, shape.tensors * 2 * sizeof(int64_t)},
                           {angle_table, shape.tokens * pairs * 2 * sizeof(float)}});
  if (staged.error() != cudaSuccess) return failed(staged.error(), "rope_shift_cuda");
  auto d_ptrs = staged.part<void* const>(0);
  auto d_strides = staged.part<const int64_t>(1);
  auto d_table = staged.part<const float>(2);
  const int threads = 256, blocks = grid_for(total, threads);
  dispatch_dtype(dtype, [&](auto tag) {
    rope_shift_kernel<decltype(tag)><<<blocks, threads, 0, s>>>(shape, d_ptrs, d_strides, d_table);
  });
  return finish(s, "rope_shift_cuda");
}

}  // namespace kdn
