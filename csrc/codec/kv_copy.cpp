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

namespace {

// Row copy with the row size as a compile-time constant where it is a common one, so the compiler
// inlines the move instead of calling memcpy once per (token, head) row.
template <int64_t kRowBytes>
void copy_rows(const KvShape& shape, const KvTable& table, uint8_t* chunk, int64_t elem_size,
               int64_t cache_start, int64_t count, CopyDirection dir, int64_t tensor, int64_t head,
               int64_t row_bytes) {
  auto* cache_bytes = static_cast<uint8_t*>(table.ptrs[tensor]);
  const int64_t chunk_step = shape.kv_heads * shape.head_dim * elem_size;
  const int64_t cache_step = table.strides[2 * tensor + 1] * elem_size;
  uint8_t* c = chunk + canonical_offset(shape, tensor / 2, tensor % 2, 0, head, 0) * elem_size;
  uint8_t* m = cache_bytes + cache_offset(table, tensor, cache_start, head, 0) * elem_size;
  const int64_t n = kRowBytes > 0 ? kRowBytes : row_bytes;
  for (int64_t t = 0; t < count; ++t, c += chunk_step, m += cache_step) {
    if (dir == CopyDirection::kCacheToChunk)
      std::memcpy(c, m, n);
    else
      std::memcpy(m, c, n);
  }
}

}  // namespace

void kv_copy_cpu(const KvShape& shape, const KvTable& table, void* chunk, int64_t elem_size,
                 int64_t cache_start, int64_t count, CopyDirection dir, int num_threads) {
  KDN_CHECK(count >= 0 && count <= shape.tokens, "kv_copy: token count out of range");
  const int64_t row_bytes = shape.head_dim * elem_size;
  auto* chunk_bytes = static_cast<uint8_t*>(chunk);
  auto rows = &copy_rows<0>;
  switch (row_bytes) {
    case 64: rows = &copy_rows<64>; break;
    case 128: rows = &copy_rows<128>; break;
    case 256: rows = &copy_rows<256>; break;
    case 512: rows = &copy_rows<512>; break;
    default: break;
  }
  // One work item per tensor; heads inner so each item reads (or writes) the chunk sequentially.
  parallel_for(shape.layers * 2, num_threads, [&](int64_t tensor) {
    for (int64_t head = 0; head < shape.kv_heads; ++head)
      rows(shape, table, chunk_bytes, elem_size, cache_start, count, dir, tensor, head, row_bytes);
  });
}

}  // namespace kdn
