// CUDA twin of kv_copy_cpu: one thread per element, same KDN_HD index math as the CPU path.
#include <cuda_runtime.h>

#include "kdn/kv_copy.h"

#ifndef KDN_CUDA_ARCHS
#define KDN_CUDA_ARCHS "unknown"
#endif

namespace kdn {
namespace {

template <typename T>
__global__ void kv_copy_kernel(KvShape shape, KvTable table, T* chunk, int64_t cache_start,
                               int64_t count, CopyDirection dir) {
  const KvShape span{shape.layers, count, shape.kv_heads, shape.head_dim};
  const int64_t total = span.layers * 2 * count * span.kv_heads * span.head_dim;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t tensor, token, head, dim;
    canonical_unravel(span, i, &tensor, &token, &head, &dim);
    T* c = chunk + canonical_offset(shape, tensor / 2, tensor % 2, token, head, dim);
    T* m = static_cast<T*>(table.ptrs[tensor]) + cache_offset(table, tensor, cache_start + token, head, dim);
    if (dir == CopyDirection::kCacheToChunk)
      *c = *m;
    else
      *m = *c;
  }
}

}  // namespace

const char* kv_copy_cuda(const KvShape& shape, const KvTable& table, void* chunk,
                         int64_t elem_size, int64_t cache_start, int64_t count,
                         CopyDirection dir, uintptr_t stream) {
  const int64_t total = shape.layers * 2 * count * shape.kv_heads * shape.head_dim;
  if (total == 0) return "";
  const int threads = 256;
  const int blocks = static_cast<int>((total + threads - 1) / threads > 65535 ? 65535 : (total + threads - 1) / threads);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  // Upload the pointer/stride table next to each other in one device allocation.
  const size_t n_tensors = static_cast<size_t>(shape.layers * 2);
  const size_t ptr_bytes = n_tensors * sizeof(void*), stride_bytes = n_tensors * 2 * sizeof(int64_t);
  void* device_table = nullptr;
  cudaError_t err = cudaMallocAsync(&device_table, ptr_bytes + stride_bytes, s);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  cudaMemcpyAsync(device_table, table.ptrs, ptr_bytes, cudaMemcpyHostToDevice, s);
  cudaMemcpyAsync(static_cast<uint8_t*>(device_table) + ptr_bytes, table.strides, stride_bytes,
                  cudaMemcpyHostToDevice, s);
  const KvTable table_device{static_cast<void* const*>(device_table),
                             reinterpret_cast<const int64_t*>(static_cast<uint8_t*>(device_table) + ptr_bytes)};
  if (elem_size != 4 && elem_size != 2) return "unsupported element size";
  if (elem_size == 4)
    kv_copy_kernel<uint32_t><<<blocks, threads, 0, s>>>(shape, table_device, static_cast<uint32_t*>(chunk), cache_start, count, dir);
  else if (elem_size == 2)
    kv_copy_kernel<uint16_t><<<blocks, threads, 0, s>>>(shape, table_device, static_cast<uint16_t*>(chunk), cache_start, count, dir);
  err = cudaGetLastError();
  cudaFreeAsync(device_table, s);
  if (err == cudaSuccess) err = cudaStreamSynchronize(s);  // the host table must outlive the copy
  return err == cudaSuccess ? "" : cudaGetErrorString(err);
}

bool cuda_compiled() { return true; }
const char* cuda_architectures() { return KDN_CUDA_ARCHS; }

}  // namespace kdn
