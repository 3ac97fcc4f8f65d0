// The one way kdn's CUDA entry points upload host arrays and launch: a DeviceStaging block holds
// every host array a launch needs in one stream-ordered allocation (freed on scope exit, whatever
// happens), grid_for sizes a grid-stride launch, and finish() turns launch and stream errors into
// the core's Status.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "kdn/common.h"

namespace kdn {

// Blocks for a grid-stride loop over `total` items (at most 65535 blocks).
inline int grid_for(int64_t total, int threads) {
  return static_cast<int>(std::min<int64_t>((total + threads - 1) / threads, 65535));
}

class DeviceStaging {
 public:
  struct Part {
    const void* host;  // nullptr: device scratch of `bytes`, zeroed
    size_t bytes;
  };
  // One cudaMallocAsync for all parts (16-byte aligned), then one upload (or memset) per part.
  DeviceStaging(cudaStream_t stream, std::initializer_list<Part> parts)
      : DeviceStaging(stream, std::vector<Part>(parts)) {}
  DeviceStaging(cudaStream_t stream, const std::vector<Part>& parts) : stream_(stream) {
    size_t total = 0;
    for (const Part& p : parts) {
      offsets_.push_back(total);
      total += (p.bytes + 15) & ~size_t(15);
    }
    error_ = cudaMallocAsync(reinterpret_cast<void**>(&base_), std::max<size_t>(total, 16), stream_);
    if (error_ != cudaSuccess) {
      base_ = nullptr;
      return;
    }
    size_t i = 0;
    for (const Part& p : parts) {
      cudaError_t e = p.host ? cudaMemcpyAsync(base_ + offsets_[i], p.host, p.bytes, cudaMemcpyHostToDevice, stream_)
                             : cudaMemsetAsync(base_ + offsets_[i], 0, p.bytes, stream_);
      if (error_ == cudaSuccess) error_ = e;
      ++i;
    }
  }
  ~DeviceStaging() {
    if (base_) cudaFreeAsync(base_, stream_);
  }
  DeviceStaging(const DeviceStaging&) = delete;
  DeviceStaging& operator=(const DeviceStaging&) = delete;

  cudaError_t error() const { return error_; }
  template <typename T>
  T* part(size_t i) const {
    return reinterpret_cast<T*>(base_ + offsets_[i]);
  }

 private:
  cudaStream_t stream_;
  uint8_t* base_ = nullptr;
  std::vector<size_t> offsets_;
  cudaError_t error_ = cudaSuccess;
};

// After the launches: the launch error, else waits for the stream (host arrays uploaded from the
// caller's memory must outlive the copies) and reports its error.
inline Status finish(cudaStream_t stream, const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  return err == cudaSuccess ? Status::Ok() : Status::Fail(std::string(what) + ": " + cudaGetErrorString(err));
}

inline Status failed(cudaError_t err, const char* what) {
  return Status::Fail(std::string(what) + ": " + cudaGetErrorString(err));
}

}  // namespace kdn
