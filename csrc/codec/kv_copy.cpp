// CPU copy between per-layer KV tensors and the canonical chunk layout (oracle of the CUDA twin).
#include <cstring>
#include <thread>

#include "kdn/kv_copy.h"
#include "kdn/parallel.h"

namespace kdn {

int default_num_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n > 8 ? 8 : n);
}

void kv_copy_cpu(const KvShape& shape, const KvTable& table, void* chunk, int64_t elem_size,
                 int64_t cache_start, int64_t count, CopyDirection dir, int num_threads) {
  KDN_CHECK(count >= 0 && count <= shape.tokens, "kv_copy: token count out of range");
  const int64_t row_bytes = shape.head_dim * elem_size;
  auto* chunk_bytes = static_cast<uint8_t*>(chunk);
  // One work item per (tensor, head): each copies `count` rows of head_dim elements.
  parallel_for(shape.layers * 2 * shape.kv_heads, num_threads, [&](int64_t item) {
    const int64_t tensor = item / shape.kv_heads, head = item % shape.kv_heads;
    auto* cache_bytes = static_cast<uint8_t*>(table.ptrs[tensor]);
    for (int64_t t = 0; t < count; ++t) {
      uint8_t* c = chunk_bytes + canonical_offset(shape, tensor / 2, tensor % 2, t, head, 0) * elem_size;
      uint8_t* m = cache_bytes + cache_offset(table, tensor, cache_start + t, head, 0) * elem_size;
      if (dir == CopyDirection::kCacheToChunk)
        std::memcpy(c, m, row_bytes);
      else
        std::memcpy(m, c, row_bytes);
    }
  });
}

}  // namespace kdn
