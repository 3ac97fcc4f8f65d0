// CUDA twin of paged_copy_cpu: one thread per element, the same KDN_HD index math (kdn/paged.h).
#include <cuda_runtime.h>

#include <string>

#include "kdn/paged.h"
#include "launch.cuh"

namespace kdn {
namespace {

template <typename T>
__global__ void paged_copy_kernel(KvShape chunk_shape, PagedLayout paged, void* const* layers, const int64_t* block_ids,
                                  T* chunk, int64_t from, int64_t position, int64_t count, CopyDirection dir) {
  const KvShape span{chunk_shape.layers, count, chunk_shape.kv_heads, chunk_shape.head_dim};
  const int64_t total = span.layers * 2 * count * span.kv_heads * span.head_dim;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t tensor, token, head, dim;
    canonical_unravel(span, i, &tensor, &token, &head, &dim);
    const int64_t p = position + token;
    T* m = static_cast<T*>(layers[tensor / 2]) +
           paged_offset(paged, block_ids[p / paged.block_size], tensor % 2, p % paged.block_size, head, dim);
    T* c = chunk + canonical_offset(chunk_shape, tensor / 2, tensor % 2, from + token, head, dim);
    if (dir == CopyDirection::kChunkToCache)
      *m = *c;
    else
      *c = *m;
  }
}

}  // namespace

Status paged_copy_cuda(const KvShape& chunk_shape, const PagedLayout& paged, void* const* layers,
                       const int64_t* block_ids, int64_t num_block_ids, void* chunk, int64_t elem_size, int64_t from,
                       int64_t position, int64_t count, CopyDirection dir, uintptr_t stream) {
  if (elem_size != 4 && elem_size != 2) return Status::Fail("paged_copy_cuda: unsupported element size");
  if (count == 0) return Status::Ok();
  if ((position + count - 1) / paged.block_size >= num_block_ids)
    return Status::Fail("paged_copy_cuda: positions beyond the blocks given");
  for (int64_t b = position / paged.block_size; b <= (position + count - 1) / paged.block_size; ++b)
    if (block_ids[b] < 0 || block_ids[b] >= paged.num_blocks)  // checked on the host: the kernel trusts them
      return Status::Fail("paged_copy_cuda: block id " + std::to_string(block_ids[b]) + " outside [0, " +
                          std::to_string(paged.num_blocks) + ")");
  auto s = reinterpret_cast<cudaStream_t>(stream);
  DeviceStaging staged(s, {{layers, size_t(paged.layers) * sizeof(void*)},
                           {block_ids, size_t(num_block_ids) * sizeof(int64_t)}});
  if (staged.error() != cudaSuccess) return failed(staged.error(), "paged_copy_cuda");
  const int64_t total = chunk_shape.layers * 2 * count * chunk_shape.kv_heads * chunk_shape.head_dim;
  const int threads = 256, blocks = grid_for(total, threads);
  if (elem_size == 4)
    paged_copy_kernel<uint32_t><<<blocks, threads, 0, s>>>(chunk_shape, paged, staged.part<void* const>(0),
                                                           staged.part<const int64_t>(1),
                                                           static_cast<uint32_t*>(chunk), from, position, count, dir);
  else
    paged_copy_kernel<uint16_t><<<blocks, threads, 0, s>>>(chunk_shape, paged, staged.part<void* const>(0),
                                                           staged.part<const int64_t>(1),
                                                           static_cast<uint16_t*>(chunk), from, position, count, dir);
  return finish(s, "paged_copy_cuda");
}

}  // namespace kdn
