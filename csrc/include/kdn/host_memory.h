// Page-locked host memory (CUDA builds; the stand-ins in runtime/cuda_stub.cpp say no): the buffer
// pool locks its blocks when asked (kdn/buffer_pool.h), and a hit's raw chunks then go to the
// device straight from the blobs a tier holds, one DMA each, at the link's full speed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kdn/chunk.h"
#include "kdn/common.h"

namespace kdn {

// Page-lock [p, p + bytes) for the device (p page-aligned, bytes a page multiple, not yet locked).
// False where there is no CUDA device or the driver refuses (the memory stays usable, pageable).
bool host_memory_lock(void* p, size_t bytes);
void host_memory_unlock(void* p);  // before the memory is freed
bool host_memory_locked(const void* p);  // page-locked, by kdn or anyone (cudaHostAlloc, torch)

// Copies the raw payload of each blob whose bytes are page-locked to device address
// out + offsets[i] on `stream` (asynchronous: the blobs must stay alive until the stream passes
// this point); uploaded[i] says which were. Coded or pageable blobs are left to the caller.
Status upload_raw_chunks_cuda(const std::vector<ChunkBytes>& blobs, const std::vector<uint64_t>& offsets, void* out,
                              uintptr_t stream, std::vector<uint8_t>* uploaded);

}  // namespace kdn
