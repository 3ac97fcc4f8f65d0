// Page-locked host memory for the buffer pool, and the direct uploads it makes possible
// (contract in kdn/host_memory.h).
#include <cuda_runtime.h>

#include <string>

#include "kdn/blob.h"
#include "kdn/host_memory.h"

namespace kdn {

bool host_memory_lock(void* p, size_t bytes) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    return false;
  }
  if (cudaHostRegister(p, bytes, cudaHostRegisterPortable) != cudaSuccess) {
    cudaGetLastError();  // refused (limits, no device): the block stays pageable
    return false;
  }
  return true;
}

void host_memory_unlock(void* p) {
  if (cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();
}

bool host_memory_locked(const void* p) {
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeHost;
}

Status upload_raw_chunks_cuda(const std::vector<ChunkBytes>& blobs, const std::vector<uint64_t>& offsets, void* out,
                              uintptr_t stream, std::vector<uint8_t>* uploaded) {
  if (offsets.size() != blobs.size()) return Status::Fail("upload_raw_chunks_cuda: one offset per blob");
  auto s = reinterpret_cast<cudaStream_t>(stream);
  uploaded->assign(blobs.size(), 0);
  for (size_t i = 0; i < blobs.size(); ++i) {
    BlobHeader h;
    Status st = blob_parse(blobs[i].data, blobs[i].size, false, &h);  // the reader verified it already
    if (!st.ok) return st;
    if (h.kind != kBlobKindKV || h.codec != kCodecRaw || !host_memory_locked(blobs[i].data)) continue;
    cudaError_t err = cudaMemcpyAsync(static_cast<uint8_t*>(out) + offsets[i], blobs[i].data + kBlobHeaderBytes,
                                      h.payload_bytes, cudaMemcpyHostToDevice, s);
    if (err != cudaSuccess) return Status::Fail(std::string("upload_raw_chunks_cuda: ") + cudaGetErrorString(err));
    (*uploaded)[i] = 1;
  }
  return Status::Ok();
}

}  // namespace kdn
