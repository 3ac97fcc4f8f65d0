// Copies between a model's per-layer KV tensors and a canonical chunk (CPU; CUDA twin in kernels/).
#pragma once

#include "kdn/kv_layout.h"

namespace kdn {

enum class CopyDirection : uint8_t { kCacheToChunk = 0, kChunkToCache = 1 };

// Copies `count` tokens: cache positions [cache_start, cache_start+count) <-> canonical tokens
// [0, count) of `chunk` (whose shape.tokens may be larger than count). Element size in bytes.
void kv_copy_cpu(const KvShape& shape, const KvTable& table, void* chunk, int64_t elem_size,
                 int64_t cache_start, int64_t count, CopyDirection dir, int num_threads);

// CUDA twin (compiled only with nvcc). `table` is in host memory and is uploaded on `stream`;
// the tensors and `chunk` are device memory. A failed Status carries the CUDA error text.
Status kv_copy_cuda(const KvShape& shape, const KvTable& table, void* chunk, int64_t elem_size, int64_t cache_start,
                    int64_t count, CopyDirection dir, uintptr_t stream);

bool cuda_compiled();
const char* cuda_architectures();

}  // namespace kdn
