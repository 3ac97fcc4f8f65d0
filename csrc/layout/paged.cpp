// CPU copies between canonical chunks and paged KV blocks (kdn/paged.h); the oracle of kernels/paged.cu.
#include "kdn/paged.h"

#include <cstring>
#include <string>

#include "kdn/parallel.h"

namespace kdn {
namespace {

// One token's K (head_dim values, contiguous in the chunk at byte offset c) <-> its column of the
// block's transposed K.
template <typename T>
void copy_column(uint8_t* base, const PagedShape& paged, int64_t block, int64_t offset, int64_t head, void* chunk,
                 int64_t c, int64_t dim, CopyDirection dir) {
  T* column = reinterpret_cast<T*>(base) + paged_offset(paged, block, 0, offset, head, 0);
  T* row = reinterpret_cast<T*>(static_cast<uint8_t*>(chunk) + c);
  if (dir == CopyDirection::kChunkToCache)
    for (int64_t d = 0; d < dim; ++d) column[d * paged.block_size] = row[d];
  else
    for (int64_t d = 0; d < dim; ++d) row[d] = column[d * paged.block_size];
}

}  // namespace

void paged_copy_cpu(const KvShape& chunk_shape, const PagedShape& paged, void* const* layers, const int64_t* block_ids,
                    int64_t num_block_ids, void* chunk, int64_t elem_size, int64_t from,
                    int64_t position, int64_t count, CopyDirection dir, int threads) {
  KDN_CHECK_INPUT(elem_size == 2 || elem_size == 4, "paged_copy: element size must be 2 or 4");
  KDN_CHECK_INPUT(from >= 0 && count >= 0 && from + count <= chunk_shape.tokens && position >= 0,
                  "paged_copy: token range outside the chunk");
  KDN_CHECK_INPUT(count == 0 || (position + count - 1) / paged.block_size < num_block_ids,
                  "paged_copy: positions up to " + std::to_string(position + count) + " need more than the " +
                      std::to_string(num_block_ids) + " blocks given");
  for (int64_t b = position / paged.block_size; count && b <= (position + count - 1) / paged.block_size; ++b)
    KDN_CHECK_INPUT(block_ids[b] >= 0 && block_ids[b] < paged.num_blocks,
                    "paged_copy: block id " + std::to_string(block_ids[b]) + " outside [0, " +
                        std::to_string(paged.num_blocks) + ")");
  const int64_t dim = chunk_shape.head_dim, row_bytes = dim * elem_size;
  // one work item per (layer, K/V, head): its `count` token rows
  parallel_for(chunk_shape.layers * 2 * chunk_shape.kv_heads, threads, [&](int64_t item) {
    const int64_t tensor = item / chunk_shape.kv_heads, head = item % chunk_shape.kv_heads;
    const int64_t layer = tensor / 2, kv = tensor % 2;
    auto* base = static_cast<uint8_t*>(layers[layer]);
    for (int64_t t = 0; t < count; ++t) {
      const int64_t p = position + t;
      const int64_t block = block_ids[p / paged.block_size], offset = p % paged.block_size;
      const int64_t c = canonical_offset(chunk_shape, layer, kv, from + t, head, 0) * elem_size;
      if (kv == 1) {  // V rows are contiguous on both sides
        uint8_t* m = base + paged_offset(paged, block, 1, offset, head, 0) * elem_size;
        if (dir == CopyDirection::kChunkToCache)
          std::memcpy(m, static_cast<const uint8_t*>(chunk) + c, row_bytes);
        else
          std::memcpy(static_cast<uint8_t*>(chunk) + c, m, row_bytes);
        continue;
      }
      // K is transposed in the block: one column per token (typed copies, not a memcpy call each)
      if (elem_size == 4)
        copy_column<uint32_t>(base, paged, block, offset, head, chunk, c, dim, dir);
      else
        copy_column<uint16_t>(base, paged, block, offset, head, chunk, c, dim, dir);
    }
  });
}

}  // namespace kdn
