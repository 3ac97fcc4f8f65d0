// Stand-ins for the CUDA entry points when kdn is built without nvcc (KDN_CUDA=OFF or not found).
#include "kdn/codec.h"
#include "kdn/host_memory.h"
#include "kdn/kv_copy.h"
#include "kdn/paged.h"
#include "kdn/rope.h"

namespace kdn {

Status kv_copy_cuda(const KvShape&, const KvTable&, void*, int64_t, int64_t, int64_t, CopyDirection, uintptr_t) {
  return Status::Fail("kdn was built without CUDA");
}
Status paged_copy_cuda(const KvShape&, const PagedLayout&, void* const*, const int64_t*, int64_t, void*, int64_t, int64_t,
                       int64_t, int64_t, CopyDirection, uintptr_t) {
  return Status::Fail("kdn was built without CUDA");
}
Status paged_copy_many_cuda(const PagedLayout&, void* const*, const int64_t*, int64_t, const std::vector<PagedCopy>&,
                            int64_t, CopyDirection, uintptr_t) {
  return Status::Fail("kdn was built without CUDA");
}
Status rope_shift_cuda(const RopeShift&, void* const*, const int64_t*, DType, const float*, uintptr_t) {
  return Status::Fail("kdn was built without CUDA");
}
Status codec_decode_cuda(const BlobHeader&, const uint8_t*, size_t, void*, uintptr_t) {
  return Status::Fail("kdn was built without CUDA");
}
Status codec_decode_cuda_many(const std::vector<DecodeJob>&, uintptr_t) {
  return Status::Fail("kdn was built without CUDA");
}
bool host_memory_lock(void*, size_t) { return false; }
void host_memory_unlock(void*) {}
bool host_memory_locked(const void*) { return false; }
Status upload_raw_chunks_cuda(const std::vector<ChunkBytes>&, const std::vector<uint64_t>&, void*, uintptr_t,
                              std::vector<uint8_t>*) {
  return Status::Fail("kdn was built without CUDA");
}
bool cuda_compiled() { return false; }
const char* cuda_architectures() { return ""; }

}  // namespace kdn
