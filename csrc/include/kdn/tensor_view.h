// A framework-free view of a strided tensor (pointer, dtype, shape, element strides, device).
#pragma once

#include <string>

#include "kdn/common.h"

namespace kdn {

enum class DeviceType : int32_t { kCPU = 1, kCUDA = 2 };

struct TensorView {
  static constexpr int kMaxDims = 8;
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  DeviceType device = DeviceType::kCPU;
  int32_t device_id = 0;
  int32_t ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements, not bytes
  bool writable = true;

  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  bool is_contiguous() const {
    int64_t expected = 1;
    for (int i = ndim - 1; i >= 0; --i) {
      if (shape[i] != 1 && strides[i] != expected) return false;
      expected *= shape[i];
    }
    return true;
  }
  std::string shape_str() const {
    std::string s = "[";
    for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
  }
};

}  // namespace kdn
