// Copies between canonical chunks and a serving engine's paged KV blocks (CPU; CUDA twin in kernels/paged.cu).
//
// A paged layout is described by numbers, not named (FlashInfer's paged_kv_t is the model): one
// tensor per layer; sequence position p of a request lives in block block_ids[p / block_size] at
// offset p % block_size; element (block, head, offset, dim) of K sits at
//   k.base + block * k.block + head * k.head + offset * k.token + dim * k.dim
// elements from the layer's data pointer, and the same for V with v's strides. Every engine layout
// kdn serves is one set of these numbers (python/kdn/engine/paged.py derives them from vLLM's tensors):
//   vLLM CPU 'vec' kernel, [blocks, heads, block_size, 2 * head_dim] reinterpreted per (block, head)
//     as K transposed [head_dim, block_size] then V [block_size, head_dim]  (vec_layout below);
//   vLLM GPU, [blocks, heads, block_size, K||V] viewed over any physical stride order;
//   older vLLM, (2, blocks, block_size, heads, dim) and (blocks, 2, block_size, heads, dim);
//   vLLM CPU 'amx' kernel (bf16), tiled: a token index t counts as (t / token_tile, t % token_tile)
//     with strides (token_tile_stride, token), a dim index likewise (dim_tile, dim_tile_stride, dim).
#pragma once

#include <vector>

#include "kdn/kv_copy.h"
#include "kdn/kv_layout.h"

namespace kdn {

struct PlaneStrides {  // in elements
  int64_t base, block, head, token, dim;
  // Tiles, 0 for none: token t sits at (t / token_tile) * token_tile_stride + (t % token_tile) * token.
  int64_t token_tile = 0, token_tile_stride = 0, dim_tile = 0, dim_tile_stride = 0;
};

struct PagedLayout {
  int64_t layers;
  int64_t kv_heads;
  int64_t head_dim;
  int64_t block_size;
  int64_t num_blocks;
  PlaneStrides k, v;
};

// Index i along an axis of `stride`, cut in tiles of `tile` elements `tile_stride` apart (tile 0: none).
KDN_HD int64_t tiled_offset(int64_t i, int64_t stride, int64_t tile, int64_t tile_stride) {
  return tile ? (i / tile) * tile_stride + (i % tile) * stride : i * stride;
}

KDN_HD int64_t paged_offset(const PagedLayout& p, int64_t block, int64_t kv, int64_t offset, int64_t head,
                            int64_t dim) {
  const PlaneStrides& s = kv == 0 ? p.k : p.v;
  return s.base + block * s.block + head * s.head + tiled_offset(offset, s.token, s.token_tile, s.token_tile_stride) +
         tiled_offset(dim, s.dim, s.dim_tile, s.dim_tile_stride);
}

// vLLM's CPU 'vec' kernel layout (measured against HF's cache, tests/test_vllm.py).
inline PagedLayout vec_layout(int64_t layers, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                              int64_t num_blocks) {
  const int64_t page = 2 * block_size * head_dim;
  return PagedLayout{layers, kv_heads, head_dim, block_size, num_blocks,
                     PlaneStrides{0, kv_heads * page, page, 1, block_size},
                     PlaneStrides{block_size * head_dim, kv_heads * page, page, head_dim, 1}};
}

// The largest element offset the layout addresses in one layer (for bounds checks), or -1 when a
// stride is negative.
int64_t paged_extent(const PagedLayout& p);

// Copies `count` tokens: canonical chunk tokens [from, from + count) <-> sequence positions
// [position, position + count) of the paged `layers` (layer pointers, host memory). The chunk's
// shape.tokens may exceed from + count. Element size 2 or 4. Throws InputError when a position's
// block is outside block_ids or a block id outside [0, num_blocks).
void paged_copy_cpu(const KvShape& chunk_shape, const PagedLayout& paged, void* const* layers, const int64_t* block_ids,
                    int64_t num_block_ids, void* chunk, int64_t elem_size, int64_t from,
                    int64_t position, int64_t count, CopyDirection dir, int threads);

// CUDA twin: `layers` and `block_ids` are host arrays (uploaded), the tensors and the chunk device memory.
// Returns once the copy has run on `stream`.
Status paged_copy_cuda(const KvShape& chunk_shape, const PagedLayout& paged, void* const* layers,
                       const int64_t* block_ids, int64_t num_block_ids, void* chunk, int64_t elem_size, int64_t from,
                       int64_t position, int64_t count, CopyDirection dir, uintptr_t stream);

// One copy of a batch: tokens [from, from + count) of a canonical chunk <-> positions [position, ...).
struct PagedCopy {
  KvShape chunk_shape;
  void* chunk;
  int64_t from, position, count;
};

// paged_copy_cuda for many chunks (a load's): the layer pointers and block ids uploaded once, one
// kernel per copy, one wait for them all at the end (not one per chunk).
Status paged_copy_many_cuda(const PagedLayout& paged, void* const* layers, const int64_t* block_ids,
                            int64_t num_block_ids, const std::vector<PagedCopy>& copies, int64_t elem_size,
                            CopyDirection dir, uintptr_t stream);

}  // namespace kdn
