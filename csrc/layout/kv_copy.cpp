// CPU copy between per-layer KV tensors and the canonical chunk layout (oracle of the CUDA twin).
#include <cstring>

#include "kdn/kv_copy.h"
#include "kdn/parallel.h"

namespace kdn {

void kv_copy_cpu(const KvShape& shape, const KvTable& table, void* chunk, int64_t elem_size,
                 int64_t cache_start, int64_t count, CopyDirection dir, int num_threads) {
  KDN_CHECK(count >= 0 && count <= shape.tokens, "kv_copy: token count out of range");
  const int64_t row_bytes = shape.head_dim * elem_size;
  const int64_t chunk_step = shape.kv_heads * row_bytes;
  auto* chunk_bytes = static_cast<uint8_t*>(chunk);
  // One work item per (tensor, head): each copies `count` rows of head_dim elements. The copy is
  // bound by memory bandwidth (a constant row size or another loop order measured no faster).
  parallel_for(shape.layers * 2 * shape.kv_heads, num_threads, [&](int64_t item) {
    const int64_t tensor = item / shape.kv_heads, head = item % shape.kv_heads;
    const int64_t cache_step = table.strides[2 * tensor + 1] * elem_size;
    uint8_t* c = chunk_bytes + canonical_offset(shape, tensor / 2, tensor % 2, 0, head, 0) * elem_size;
    uint8_t* m = static_cast<uint8_t*>(table.ptrs[tensor]) + cache_offset(table, tensor, cache_start, head, 0) * elem_size;
    for (int64_t t = 0; t < count; ++t, c += chunk_step, m += cache_step) {
      if (dir == CopyDirection::kCacheToChunk)
        std::memcpy(c, m, row_bytes);
      else
        std::memcpy(m, c, row_bytes);
    }
  });
}

}  // namespace kdn
