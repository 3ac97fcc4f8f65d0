// CUDA twin of rope_shift_cpu: one thread per (tensor, head, token, pair), same KDN_HD rotation.
#include <cuda_runtime.h>

#include "kdn/rope.h"

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

const char* rope_shift_cuda(const RopeShift& shape, void* const* ptrs, const int64_t* strides, DType dtype,
                            const float* angle_table, uintptr_t stream) {
  const int64_t pairs = shape.head_dim / 2, total = shape.tensors * shape.heads * shape.tokens * pairs;
  if (total == 0) return "";
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const size_t ptr_bytes = shape.tensors * sizeof(void*), stride_bytes = shape.tensors * 2 * sizeof(int64_t);
  const size_t table_bytes = shape.tokens * pairs * 2 * sizeof(float);
  uint8_t* device = nullptr;
  cudaError_t err = cudaMallocAsync(reinterpret_cast<void**>(&device), ptr_bytes + stride_bytes + table_bytes, s);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  cudaMemcpyAsync(device, ptrs, ptr_bytes, cudaMemcpyHostToDevice, s);
  cudaMemcpyAsync(device + ptr_bytes, strides, stride_bytes, cudaMemcpyHostToDevice, s);
  cudaMemcpyAsync(device + ptr_bytes + stride_bytes, angle_table, table_bytes, cudaMemcpyHostToDevice, s);
  auto d_ptrs = reinterpret_cast<void* const*>(device);
  auto d_strides = reinterpret_cast<const int64_t*>(device + ptr_bytes);
  auto d_table = reinterpret_cast<const float*>(device + ptr_bytes + stride_bytes);
  const int threads = 256;
  const int blocks = static_cast<int>((total + threads - 1) / threads > 65535 ? 65535 : (total + threads - 1) / threads);
  if (dtype == DType::kFloat32)
    rope_shift_kernel<float><<<blocks, threads, 0, s>>>(shape, d_ptrs, d_strides, d_table);
  else if (dtype == DType::kFloat16)
    rope_shift_kernel<Fp16><<<blocks, threads, 0, s>>>(shape, d_ptrs, d_strides, d_table);
  else
    rope_shift_kernel<Bf16><<<blocks, threads, 0, s>>>(shape, d_ptrs, d_strides, d_table);
  err = cudaGetLastError();
  cudaFreeAsync(device, s);
  if (err == cudaSuccess) err = cudaStreamSynchronize(s);  // the host arrays must outlive the upload
  return err == cudaSuccess ? "" : cudaGetErrorString(err);
}

}  // namespace kdn
