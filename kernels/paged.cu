// CUDA twin of paged_copy_cpu, on the same KDN_HD index math (kdn/paged.h): one thread per 16-byte
// piece of a head's row wherever both sides keep head_dim contiguous and 16-byte aligned (every GPU
// layout of vLLM), else one thread per element (the CPU 'vec' layout's transposed K, tiled
// layouts, odd shapes).
#include <cuda_runtime.h>

#include <cstdint>

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

// `piece` elements (16 bytes) at a time; the caller checked every row start is 16-byte aligned. The
// flat index is taken apart in `Index` (32-bit where it fits: a 64-bit division costs ~20x more).
template <typename Index>
__global__ void paged_copy_rows_kernel(KvShape chunk_shape, PagedLayout paged, void* const* layers,
                                       const int64_t* block_ids, uint8_t* chunk, int64_t elem_size, int64_t from,
                                       int64_t position, int64_t count, CopyDirection dir) {
  const Index piece = Index(16 / elem_size), pieces = Index(chunk_shape.head_dim) / piece;
  const Index heads = Index(chunk_shape.kv_heads), tokens = Index(count), block_size = Index(paged.block_size);
  const int64_t total = chunk_shape.layers * 2 * count * chunk_shape.kv_heads * pieces;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    Index row = Index(i) / pieces;
    const Index dim = (Index(i) - row * pieces) * piece;
    const Index head = row % heads;
    row /= heads;
    const Index token = row % tokens, tensor = row / tokens, p = Index(position) + token;
    auto* m = reinterpret_cast<uint4*>(static_cast<uint8_t*>(layers[tensor / 2]) +
                                       elem_size * paged_offset(paged, block_ids[p / block_size], tensor % 2,
                                                                p % block_size, head, dim));
    auto* c = reinterpret_cast<uint4*>(
        chunk + elem_size * canonical_offset(chunk_shape, tensor / 2, tensor % 2, from + token, head, dim));
    if (dir == CopyDirection::kChunkToCache)
      *m = *c;
    else
      *c = *m;
  }
}

// Rows of head_dim elements contiguous and every row start 16-byte aligned on both sides.
bool rows_aligned(const KvShape& chunk_shape, const PagedLayout& paged, void* const* layers, const void* chunk,
                  int64_t elem_size) {
  auto aligned = [&](int64_t elements) { return (elements * elem_size) % 16 == 0; };
  for (const PlaneStrides* s : {&paged.k, &paged.v})
    if (s->dim != 1 || s->dim_tile != 0 || !aligned(s->base) || !aligned(s->block) || !aligned(s->head) ||
        !aligned(s->token) || !aligned(s->token_tile_stride))
      return false;
  if (!aligned(chunk_shape.head_dim) || reinterpret_cast<uintptr_t>(chunk) % 16) return false;
  for (int64_t l = 0; l < paged.layers; ++l)
    if (reinterpret_cast<uintptr_t>(layers[l]) % 16) return false;
  return true;
}

}  // namespace

namespace {

// Checks one copy's positions against the blocks (on the host: the kernel trusts them) and queues its
// kernel on `s`; `dev_layers` and `dev_ids` are the uploaded copies of `layers` and `block_ids`.
Status launch_paged_copy(const KvShape& chunk_shape, const PagedLayout& paged, void* const* layers,
                         void* const* dev_layers, const int64_t* block_ids, const int64_t* dev_ids,
                         int64_t num_block_ids, void* chunk, int64_t elem_size, int64_t from, int64_t position,
                         int64_t count, CopyDirection dir, cudaStream_t s) {
  if (count == 0) return Status::Ok();
  if ((position + count - 1) / paged.block_size >= num_block_ids)
    return Status::Fail("paged_copy_cuda: positions beyond the blocks given");
  for (int64_t b = position / paged.block_size; b <= (position + count - 1) / paged.block_size; ++b)
    if (block_ids[b] < 0 || block_ids[b] >= paged.num_blocks)
      return Status::Fail("paged_copy_cuda: block id " + std::to_string(block_ids[b]) + " outside [0, " +
                          std::to_string(paged.num_blocks) + ")");
  const int64_t total = chunk_shape.layers * 2 * count * chunk_shape.kv_heads * chunk_shape.head_dim;
  const int threads = 256;
  if (rows_aligned(chunk_shape, paged, layers, chunk, elem_size)) {
    const int64_t pieces = total * elem_size / 16;
    auto* kernel = pieces < (int64_t(1) << 31) && position + count < (int64_t(1) << 31)
                       ? paged_copy_rows_kernel<uint32_t>
                       : paged_copy_rows_kernel<int64_t>;
    kernel<<<grid_for(pieces, threads), threads, 0, s>>>(chunk_shape, paged, dev_layers, dev_ids,
                                                         static_cast<uint8_t*>(chunk), elem_size, from, position,
                                                         count, dir);
  } else if (elem_size == 4) {
    paged_copy_kernel<uint32_t><<<grid_for(total, threads), threads, 0, s>>>(
        chunk_shape, paged, dev_layers, dev_ids, static_cast<uint32_t*>(chunk), from, position, count, dir);
  } else {
    paged_copy_kernel<uint16_t><<<grid_for(total, threads), threads, 0, s>>>(
        chunk_shape, paged, dev_layers, dev_ids, static_cast<uint16_t*>(chunk), from, position, count, dir);
  }
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? Status::Ok() : failed(err, "paged_copy_cuda");
}

}  // namespace

Status paged_copy_cuda(const KvShape& chunk_shape, const PagedLayout& paged, void* const* layers,
                       const int64_t* block_ids, int64_t num_block_ids, void* chunk, int64_t elem_size, int64_t from,
                       int64_t position, int64_t count, CopyDirection dir, uintptr_t stream) {
  return paged_copy_many_cuda(paged, layers, block_ids, num_block_ids, {{chunk_shape, chunk, from, position, count}},
                              elem_size, dir, stream);
}

Status paged_copy_many_cuda(const PagedLayout& paged, void* const* layers, const int64_t* block_ids,
                            int64_t num_block_ids, const std::vector<PagedCopy>& copies, int64_t elem_size,
                            CopyDirection dir, uintptr_t stream) {
  if (elem_size != 4 && elem_size != 2) return Status::Fail("paged_copy_cuda: unsupported element size");
  bool any = false;
  for (const PagedCopy& c : copies) any |= c.count > 0;
  if (!any) return Status::Ok();
  auto s = reinterpret_cast<cudaStream_t>(stream);
  DeviceStaging staged(s, {{layers, size_t(paged.layers) * sizeof(void*)},
                           {block_ids, size_t(num_block_ids) * sizeof(int64_t)}});
  if (staged.error() != cudaSuccess) return failed(staged.error(), "paged_copy_cuda");
  for (const PagedCopy& c : copies) {
    const Status st = launch_paged_copy(c.chunk_shape, paged, layers, staged.part<void* const>(0), block_ids,
                                        staged.part<const int64_t>(1), num_block_ids, c.chunk, elem_size, c.from,
                                        c.position, c.count, dir, s);
    if (!st.ok) return st;  // the copies queued before it still run; the staging is freed after them
  }
  return finish(s, "paged_copy_cuda");
}

}  // namespace kdn
