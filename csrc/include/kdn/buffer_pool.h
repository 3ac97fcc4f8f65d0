// A process-wide cache of freed large host blocks, so that new blobs and KV tensors reuse warm pages.
//
// Filling freshly mapped memory costs a page fault per 4 KiB, which on the machines measured is
// several times the cost of the copy itself (benchmarks/bench_tiers.py: packing 94 MB of KV into
// fresh pages 63 ms, into pooled ones 24 ms). Blocks of at least kMinPooledBytes are rounded up to a
// 64 KiB multiple and, when freed, kept for reuse up to an idle-byte cap (default 1 GiB, set by
// KDN_BUFFER_POOL_BYTES or buffer_pool_set_limit); a request reuses the smallest idle block that
// is at least as large and at most 25% larger. Blocks are page-aligned (those of 2 MiB or more on
// transparent huge pages where the kernel gives them, unless buffer_pool_huge_pages(false));
// page-locked on request (buffer_pool_lock_pages). Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kdn {

constexpr size_t kMinPooledBytes = 256u << 10;

struct BufferPoolStats {
  uint64_t idle_bytes = 0, idle_blocks = 0, limit_bytes = 0, reused = 0, allocated = 0;
  uint64_t locked_bytes = 0, locked_blocks = 0, lock_failures = 0;  // page-locked for the device
  bool huge_pages = true, lock_pages = false;  // what new blocks get
};

// Returns a block of at least `size` bytes and its real size in *capacity; throws std::bad_alloc.
uint8_t* pool_acquire(size_t size, size_t* capacity);
void pool_release(uint8_t* block, size_t capacity);
void buffer_pool_set_limit(uint64_t bytes);  // also frees idle blocks above the new limit
void buffer_pool_trim();                     // frees every idle block
// From now on, page-lock every pooled block handed out (kdn/host_memory.h: a CUDA build with a
// device), so that blobs and host arrays upload to the device by DMA straight from where they are;
// a block stays locked until freed. A refusal (no device, a lock limit) turns it off again
// (stats: lock_failures). Costs the driver's time once per block, not per use.
void buffer_pool_lock_pages(bool on);
// Whether new blocks of 2 MiB or more ask for huge pages (default true; KDN_BUFFER_POOL_HUGE_PAGES=0: no).
void buffer_pool_huge_pages(bool on);
BufferPoolStats buffer_pool_stats();

}  // namespace kdn
