// CPU copies between canonical chunks and paged KV blocks of any strided layout (kdn/paged.h); the oracle of kernels/paged.cu.
#include "kdn/paged.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "kdn/parallel.h"

namespace kdn {
namespace {

// One token's head_dim values: contiguous in the chunk, `s.dim` elements apart in the block (in
// tiles of s.dim_tile, s.dim_tile_stride apart, when the plane is tiled; tiles divide head_dim).
template <typename T>
void copy_strided(T* paged, const PlaneStrides& s, T* row, int64_t dim, CopyDirection dir) {
  const int64_t tile = s.dim_tile ? s.dim_tile : dim;
  for (int64_t first = 0; first < dim; first += tile, paged += s.dim_tile_stride) {
    if (dir == CopyDirection::kChunkToCache)
      for (int64_t d = 0; d < tile; ++d) paged[d * s.dim] = row[first + d];
    else
      for (int64_t d = 0; d < tile; ++d) row[first + d] = paged[d * s.dim];
  }
}

// The largest offset indices [0, n) reach along a (possibly tiled) axis.
int64_t axis_extent(int64_t n, int64_t stride, int64_t tile, int64_t tile_stride) {
  return tile ? (n - 1) / tile * tile_stride + (std::min(tile, n) - 1) * stride : (n - 1) * stride;
}

}  // namespace

int64_t paged_extent(const PagedLayout& p) {
  int64_t most = 0;
  for (const PlaneStrides& s : {p.k, p.v}) {
    if (s.base < 0 || s.block < 0 || s.head < 0 || s.token < 0 || s.dim < 0 || s.token_tile < 0 ||
        s.token_tile_stride < 0 || s.dim_tile < 0 || s.dim_tile_stride < 0)
      return -1;
    most = std::max(most, s.base + (p.num_blocks - 1) * s.block + (p.kv_heads - 1) * s.head +
                              axis_extent(p.block_size, s.token, s.token_tile, s.token_tile_stride) +
                              axis_extent(p.head_dim, s.dim, s.dim_tile, s.dim_tile_stride));
  }
  return most;
}

void paged_copy_cpu(const KvShape& chunk_shape, const PagedLayout& paged, void* const* layers, const int64_t* block_ids,
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
    const PlaneStrides& plane = kv == 0 ? paged.k : paged.v;
    const bool rows = plane.dim == 1 && plane.dim_tile == 0;
    auto* base = static_cast<uint8_t*>(layers[layer]);
    for (int64_t t = 0; t < count; ++t) {
      const int64_t p = position + t;
      uint8_t* m = base + paged_offset(paged, block_ids[p / paged.block_size], kv, p % paged.block_size, head, 0) *
                              elem_size;
      uint8_t* c = static_cast<uint8_t*>(chunk) + canonical_offset(chunk_shape, layer, kv, from + t, head, 0) * elem_size;
      if (rows) {  // a row on both sides
        if (dir == CopyDirection::kChunkToCache)
          std::memcpy(m, c, row_bytes);
        else
          std::memcpy(c, m, row_bytes);
      } else if (elem_size == 4) {  // e.g. the 'vec' kernel's transposed K: one column per token
        copy_strided(reinterpret_cast<uint32_t*>(m), plane, reinterpret_cast<uint32_t*>(c), dim, dir);
      } else {  // or the 'amx' kernel's tiles
        copy_strided(reinterpret_cast<uint16_t*>(m), plane, reinterpret_cast<uint16_t*>(c), dim, dir);
      }
    }
  });
}

}  // namespace kdn
