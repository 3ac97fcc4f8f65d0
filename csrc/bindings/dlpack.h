// The DLPack (v0.8, unversioned capsule "dltensor") structs, written from the public spec.
#pragma once

#include <cstdint>

extern "C" {

enum KdnDLDeviceType : int32_t { kKdnDLCPU = 1, kKdnDLCUDA = 2, kKdnDLCUDAHost = 3 };
enum KdnDLDataTypeCode : uint8_t { kKdnDLInt = 0, kKdnDLUInt = 1, kKdnDLFloat = 2, kKdnDLBfloat = 4 };

struct KdnDLDevice {
  int32_t device_type;
  int32_t device_id;
};

struct KdnDLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

struct KdnDLTensor {
  void* data;
  KdnDLDevice device;
  int32_t ndim;
  KdnDLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; NULL means compact row-major
  uint64_t byte_offset;
};

struct KdnDLManagedTensor {
  KdnDLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(KdnDLManagedTensor* self);
};
}
