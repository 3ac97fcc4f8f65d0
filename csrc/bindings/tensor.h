// Turns Python objects (numpy arrays via the buffer protocol, torch tensors via DLPack) into views.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "kdn/tensor_view.h"

namespace kdn {

// A TensorView plus the Python objects that keep its memory alive while the view is used.
struct HeldView {
  TensorView view;
  pybind11::object owner;    // the original object
  pybind11::object capsule;  // DLPack capsule, released (and its deleter run) with this holder
};

// `what` names the argument in error messages, e.g. "past_key_values[3].keys".
HeldView view_from_object(pybind11::handle obj, const std::string& what);

// A read-only view of raw bytes (bytes, bytearray, memoryview, numpy, kdn Buffer).
struct ByteSpan {
  const uint8_t* data;
  size_t size;
  pybind11::object owner;
};
ByteSpan bytes_from_object(pybind11::handle obj, const std::string& what);

}  // namespace kdn
