// Copies between canonical chunks and a serving engine's paged KV blocks (CPU; CUDA twin in kernels/paged.cu).
//
// Paged layout of vLLM's CPU attention kernel 'vec' (measured against HF's cache, tests/test_vllm.py):
// one tensor per layer, [num_blocks, kv_heads, 2 * block_size * head_dim]; per (block, head), K
// transposed, [head_dim, block_size], then V, [block_size, head_dim]. Sequence position p of a
// request lives in block block_ids[p / block_size] at offset p % block_size.
#pragma once

#include "kdn/kv_copy.h"
#include "kdn/kv_layout.h"

namespace kdn {

struct PagedShape {
  int64_t layers;
  int64_t kv_heads;
  int64_t head_dim;
  int64_t block_size;
  int64_t num_blocks;
};

KDN_HD int64_t paged_offset(const PagedShape& p, int64_t block, int64_t kv, int64_t offset, int64_t head,
                            int64_t dim) {
  const int64_t base = (block * p.kv_heads + head) * 2 * p.block_size * p.head_dim;
  return kv == 0 ? base + dim * p.block_size + offset : base + (p.block_size + offset) * p.head_dim + dim;
}

// Copies `count` tokens: canonical chunk tokens [from, from + count) <-> sequence positions
// [position, position + count) of the paged `layers` (layer pointers, host memory). The chunk's
// shape.tokens may exceed from + count. Element size 2 or 4. Throws InputError when a position's
// block is outside block_ids or a block id outside [0, num_blocks).
void paged_copy_cpu(const KvShape& chunk_shape, const PagedShape& paged, void* const* layers, const int64_t* block_ids,
                    int64_t num_block_ids, void* chunk, int64_t elem_size, int64_t from,
                    int64_t position, int64_t count, CopyDirection dir, int threads);

// CUDA twin: `layers` and `block_ids` are host arrays (uploaded), the tensors and the chunk device memory.
Status paged_copy_cuda(const KvShape& chunk_shape, const PagedShape& paged, void* const* layers,
                       const int64_t* block_ids, int64_t num_block_ids, void* chunk, int64_t elem_size, int64_t from,
                       int64_t position, int64_t count, CopyDirection dir, uintptr_t stream);

}  // namespace kdn
