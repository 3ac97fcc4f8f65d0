// Buffer-protocol and DLPack conversion with dtype/shape/stride checks and readable errors.
#include "tensor.h"

#include "dlpack.h"

namespace py = pybind11;

namespace kdn {
namespace {

DType dtype_from_dlpack(const KdnDLDataType& t, const std::string& what) {
  if (t.lanes == 1 && t.code == kKdnDLFloat && t.bits == 32) return DType::kFloat32;
  if (t.lanes == 1 && t.code == kKdnDLFloat && t.bits == 16) return DType::kFloat16;
  if (t.lanes == 1 && t.code == kKdnDLBfloat && t.bits == 16) return DType::kBFloat16;
  throw InputError(what + ": unsupported dtype (code " + std::to_string(t.code) + ", " +
                       std::to_string(t.bits) + " bits); kdn handles float32, float16 and bfloat16",
                   __FILE__, __LINE__);
}

DType dtype_from_format(const std::string& fmt, ssize_t itemsize, const std::string& what) {
  if (fmt == "f" && itemsize == 4) return DType::kFloat32;
  if (fmt == "e" && itemsize == 2) return DType::kFloat16;
  throw InputError(what + ": unsupported buffer format '" + fmt +
                       "'; kdn handles float32 and float16 arrays (bfloat16 through torch)",
                   __FILE__, __LINE__);
}

}  // namespace

HeldView view_from_object(py::handle obj, const std::string& what) {
  HeldView held;
  held.owner = py::reinterpret_borrow<py::object>(obj);
  TensorView& v = held.view;
  if (PyObject_CheckBuffer(obj.ptr())) {
    py::buffer_info info;
    try {
      info = py::reinterpret_borrow<py::buffer>(obj).request(/*writable=*/false);
    } catch (py::error_already_set& e) {
      throw InputError(what + ": cannot read buffer: " + e.what(), __FILE__, __LINE__);
    }
    KDN_CHECK_INPUT(info.ndim <= TensorView::kMaxDims, what + ": too many dimensions");
    v.data = info.ptr;
    v.dtype = dtype_from_format(info.format, info.itemsize, what);
    v.ndim = static_cast<int32_t>(info.ndim);
    v.writable = !info.readonly;
    for (int i = 0; i < v.ndim; ++i) {
      KDN_CHECK_INPUT(info.strides[i] % info.itemsize == 0, what + ": strides not a multiple of the item size");
      v.shape[i] = info.shape[i];
      v.strides[i] = info.strides[i] / info.itemsize;
    }
    return held;
  }
  if (!py::hasattr(obj, "__dlpack__"))
    throw InputError(what + ": expected a torch tensor or numpy array, got " +
                         std::string(py::str(obj.get_type().attr("__name__"))),
                     __FILE__, __LINE__);
  try {
    held.capsule = obj.attr("__dlpack__")();
  } catch (py::error_already_set& e) {
    throw InputError(what + ": __dlpack__ failed: " + e.what(), __FILE__, __LINE__);
  }
  auto* managed = static_cast<KdnDLManagedTensor*>(PyCapsule_GetPointer(held.capsule.ptr(), "dltensor"));
  if (managed == nullptr) {
    PyErr_Clear();
    throw InputError(what + ": __dlpack__ did not return a 'dltensor' capsule", __FILE__, __LINE__);
  }
  const KdnDLTensor& t = managed->dl_tensor;
  KDN_CHECK_INPUT(t.ndim <= TensorView::kMaxDims, what + ": too many dimensions");
  if (t.device.device_type == kKdnDLCUDA)
    v.device = DeviceType::kCUDA;
  else if (t.device.device_type == kKdnDLCPU || t.device.device_type == kKdnDLCUDAHost)
    v.device = DeviceType::kCPU;
  else
    throw InputError(what + ": unsupported device type " + std::to_string(t.device.device_type),
                     __FILE__, __LINE__);
  v.device_id = t.device.device_id;
  v.dtype = dtype_from_dlpack(t.dtype, what);
  v.data = static_cast<uint8_t*>(t.data) + t.byte_offset;
  v.ndim = t.ndim;
  int64_t expected = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    v.shape[i] = t.shape[i];
    v.strides[i] = t.strides ? t.strides[i] : expected;
    expected *= t.shape[i];
  }
  return held;
}

ByteSpan bytes_from_object(py::handle obj, const std::string& what) {
  if (!PyObject_CheckBuffer(obj.ptr()))
    throw InputError(what + ": expected a bytes-like object, got " +
                         std::string(py::str(obj.get_type().attr("__name__"))),
                     __FILE__, __LINE__);
  py::buffer_info info = py::reinterpret_borrow<py::buffer>(obj).request(false);
  bool contiguous = true;
  ssize_t expected = info.itemsize;
  for (ssize_t i = info.ndim - 1; i >= 0; --i) {
    if (info.shape[i] != 1 && info.strides[i] != expected) contiguous = false;
    expected *= info.shape[i];
  }
  KDN_CHECK_INPUT(contiguous, what + ": buffer must be contiguous");
  return ByteSpan{static_cast<const uint8_t*>(info.ptr), static_cast<size_t>(info.size * info.itemsize),
                  py::reinterpret_borrow<py::object>(obj)};
}

}  // namespace kdn
