// CPU copies between canonical chunks and paged KV blocks of any strided layout (kdn/paged.h); the oracle of kernels/paged.cu.
#include "kdn/paged.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "kdn/parallel.h"

namespace kdn {
namespace {

// Where each of a plane's within-block token positions and each head_dim index lands (elements from
// the (block, head) base): computed once per copy, so the per-token work is a table lookup.
struct PlaneTables {
  std::vector<int64_t> token, dim;
  bool rows;        // a token's dims are one contiguous row
  bool dim_pairs;   // dims 2i, 2i+1 adjacent (and even): 16-bit values move as 32-bit pairs (e.g. 'amx' K)
  bool token_pairs; // tokens 2i, 2i+1 adjacent at every dim, pairs aligned (e.g. 'amx' V): two rows interleave
};

PlaneTables plane_tables(const PlaneStrides& s, int64_t block_size, int64_t dim) {
  PlaneTables t;
  for (int64_t o = 0; o < block_size; ++o) t.token.push_back(tiled_offset(o, s.token, s.token_tile, s.token_tile_stride));
  for (int64_t d = 0; d < dim; ++d) t.dim.push_back(tiled_offset(d, s.dim, s.dim_tile, s.dim_tile_stride));
  t.rows = s.dim == 1 && s.dim_tile == 0;
  t.dim_pairs = dim % 2 == 0;
  for (int64_t d = 0; d + 1 < dim && t.dim_pairs; d += 2) t.dim_pairs = t.dim[d] % 2 == 0 && t.dim[d + 1] == t.dim[d] + 1;
  t.token_pairs = block_size % 2 == 0;
  for (int64_t o = 0; o + 1 < block_size && t.token_pairs; o += 2)
    t.token_pairs = t.token[o] % 2 == 0 && t.token[o + 1] == t.token[o] + 1;
  for (int64_t d = 0; d < dim && t.token_pairs; ++d) t.token_pairs = t.dim[d] % 2 == 0;
  return t;
}

// One token's head_dim values between its chunk row and its place in a block (`paged`: the token's
// position, offsets from t.dim).
template <typename T>
void copy_row(T* paged, const PlaneTables& t, T* row, int64_t dim, CopyDirection dir) {
  if (dir == CopyDirection::kChunkToCache)
    for (int64_t d = 0; d < dim; ++d) paged[t.dim[d]] = row[d];
  else
    for (int64_t d = 0; d < dim; ++d) row[d] = paged[t.dim[d]];
}

// 16-bit values whose dims sit in adjacent pairs: one 32-bit move per pair.
void copy_row_pairs(uint16_t* paged, const PlaneTables& t, uint16_t* row, int64_t dim, CopyDirection dir) {
  for (int64_t d = 0; d < dim; d += 2) {
    uint32_t* m = reinterpret_cast<uint32_t*>(paged + t.dim[d]);
    uint32_t* c = reinterpret_cast<uint32_t*>(row + d);
    if (dir == CopyDirection::kChunkToCache)
      std::memcpy(m, c, 4);
    else
      std::memcpy(c, m, 4);
  }
}

// Two tokens' 16-bit rows interleaved at every dim (token pairs adjacent): one 32-bit move per dim.
void copy_two_rows(uint16_t* paged, const PlaneTables& t, uint16_t* first, uint16_t* second, int64_t dim,
                   CopyDirection dir) {
  for (int64_t d = 0; d < dim; ++d) {
    uint16_t* m = paged + t.dim[d];
    if (dir == CopyDirection::kChunkToCache) {
      const uint32_t both = static_cast<uint32_t>(first[d]) | static_cast<uint32_t>(second[d]) << 16;
      std::memcpy(m, &both, 4);
    } else {
      uint32_t both;
      std::memcpy(&both, m, 4);
      first[d] = static_cast<uint16_t>(both);
      second[d] = static_cast<uint16_t>(both >> 16);
    }
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
  const PlaneTables tables[2] = {plane_tables(paged.k, paged.block_size, dim),
                                 plane_tables(paged.v, paged.block_size, dim)};
  const int64_t row_stride = chunk_shape.kv_heads * dim * elem_size;  // bytes between a head's token rows
  // one work item per (layer, K/V, head): its `count` token rows, a block at a time
  parallel_for(chunk_shape.layers * 2 * chunk_shape.kv_heads, threads, [&](int64_t item) {
    const int64_t tensor = item / chunk_shape.kv_heads, head = item % chunk_shape.kv_heads;
    const int64_t layer = tensor / 2, kv = tensor % 2;
    const PlaneTables& t = tables[kv];
    auto* base = static_cast<uint8_t*>(layers[layer]);
    uint8_t* c = static_cast<uint8_t*>(chunk) + canonical_offset(chunk_shape, layer, kv, from, head, 0) * elem_size;
    for (int64_t p = position, end = position + count; p < end;) {
      const int64_t o0 = p % paged.block_size, n = std::min(paged.block_size - o0, end - p);
      uint8_t* block = base + paged_offset(paged, block_ids[p / paged.block_size], kv, 0, head, 0) * elem_size;
      for (int64_t o = o0; o < o0 + n; ++o, c += row_stride) {
        uint8_t* m = block + t.token[o] * elem_size;
        if (t.rows) {  // a row on both sides
          if (dir == CopyDirection::kChunkToCache)
            std::memcpy(m, c, row_bytes);
          else
            std::memcpy(c, m, row_bytes);
        } else if (elem_size == 4) {  // e.g. the 'vec' kernel's transposed K: one column per token
          copy_row(reinterpret_cast<uint32_t*>(m), t, reinterpret_cast<uint32_t*>(c), dim, dir);
        } else if (t.dim_pairs) {  // the 'amx' kernel's K: dims in pairs
          copy_row_pairs(reinterpret_cast<uint16_t*>(m), t, reinterpret_cast<uint16_t*>(c), dim, dir);
        } else if (t.token_pairs && o % 2 == 0 && o + 1 < o0 + n) {  // its V: tokens in pairs, both here
          copy_two_rows(reinterpret_cast<uint16_t*>(m), t, reinterpret_cast<uint16_t*>(c),
                        reinterpret_cast<uint16_t*>(c + row_stride), dim, dir);
          ++o;
          c += row_stride;
        } else {
          copy_row(reinterpret_cast<uint16_t*>(m), t, reinterpret_cast<uint16_t*>(c), dim, dir);
        }
      }
      p += n;
    }
  });
}

}  // namespace kdn
