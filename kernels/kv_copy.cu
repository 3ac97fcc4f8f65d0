// CUDA twin of kv_copy_cpu: one thread per element, same KDN_HD index math as the CPU path.
#include <cuda_runtime.h>

#include "kdn/kv_copy.h"
#include "launch.cuh"

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

Status kv_copy_cuda(const KvShape& shape, const KvTable& table, void* chunk, int64_t elem_size, int64_t cache_start,
                    int64_t count, CopyDirection dir, uintptr_t stream) {
  if (elem_size != 4 && elem_size != 2) return Status::Fail("kv_copy_cuda: unsupported element size");
  const int64_t total = shape.layers * 2 * count * shape.kv_heads * shape.head_dim;
  if (total == 0) return Status::Ok();
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const size_t n_tensors = static_cast<size_t>(shape.layers * 2);
  DeviceStaging staged(s, {{table.ptrs, n_tensors * sizeof(void*)}, {table.strides, n_tensors * 2 * sizeof(int64_t)}});
  if (staged.error() != cudaSuccess) return failed(staged.error(), "kv_copy_cuda");
  const KvTable device_table{staged.part<void* const>(0), staged.part<const int64_t>(1)};
  const int threads = 256, blocks = grid_for(total, threads);
  if (elem_size == 4)
    kv_copy_kernel<uint32_t><<<blocks, threads, 0, s>>>(shape, device_table, static_cast<uint32_t*>(chunk),
                                                        cache_start, count, dir);
  else
    kv_copy_kernel<uint16_t><<<blocks, threads, 0, s>>>(shape, device_table, static_cast<uint16_t*>(chunk),
                                                        cache_start, count, dir);
  return finish(s, "kv_copy_cuda");
}

bool cuda_compiled() { return true; }
const char* cuda_architectures() { return KDN_CUDA_ARCHS; }

}  // namespace kdn
