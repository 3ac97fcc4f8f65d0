// Python bindings of the blending kernels: RoPE re-rotation of cached keys (CPU, or its CUDA twin).
#include <pybind11/pybind11.h>

#include <vector>

#include "kdn/parallel.h"
#include "kdn/rope.h"
#include "tensor.h"

namespace py = pybind11;

namespace kdn {

void bind_blend(py::module_& m) {
  m.def(
      "rope_shift",
      [](const py::sequence& keys, py::handle inv_freq, py::handle deltas, const std::string& style,
         uintptr_t stream) {
        const size_t n = py::len(keys);
        KDN_CHECK_INPUT(n > 0, "rope_shift: no key tensors");
        KDN_CHECK_INPUT(style == "rotate_half" || style == "interleaved",
                        "rope_shift: style must be 'rotate_half' or 'interleaved', got '" + style + "'");
        std::vector<HeldView> held;
        std::vector<void*> ptrs;
        std::vector<int64_t> strides;
        RopeShift shape{static_cast<int64_t>(n), 0, 0, 0,
                        style == "rotate_half" ? RopeStyle::kRotateHalf : RopeStyle::kInterleaved};
        for (size_t i = 0; i < n; ++i) {
          const std::string what = "keys[" + std::to_string(i) + "]";
          held.push_back(view_from_object(keys[i], what));
          const TensorView& v = held.back().view;
          KDN_CHECK_INPUT(v.ndim == 3 || (v.ndim == 4 && v.shape[0] == 1),
                          what + ": expected [1, kv_heads, tokens, head_dim], got " + v.shape_str());
          const int off = v.ndim - 3;
          if (i == 0) {
            shape.heads = v.shape[off];
            shape.tokens = v.shape[off + 1];
            shape.head_dim = v.shape[off + 2];
          }
          const TensorView& first = held.front().view;
          KDN_CHECK_INPUT(v.dtype == first.dtype && v.device == first.device, what + ": dtype/device differ from keys[0]");
          KDN_CHECK_INPUT(v.shape[off] == shape.heads && v.shape[off + 1] == shape.tokens &&
                              v.shape[off + 2] == shape.head_dim, what + ": shape differs from keys[0]");
          KDN_CHECK_INPUT(v.strides[off + 2] == 1, what + ": head_dim must be contiguous");
          KDN_CHECK_INPUT(v.writable, what + ": tensor is read-only");
          ptrs.push_back(v.data);
          strides.push_back(v.strides[off]);
          strides.push_back(v.strides[off + 1]);
        }
        KDN_CHECK_INPUT(shape.head_dim % 2 == 0, "rope_shift: head_dim must be even, got " + std::to_string(shape.head_dim));
        HeldView f = view_from_object(inv_freq, "inv_freq");
        KDN_CHECK_INPUT(f.view.device == DeviceType::kCPU && f.view.dtype == DType::kFloat32 && f.view.is_contiguous() &&
                            f.view.numel() == shape.head_dim / 2,
                        "rope_shift: inv_freq must be a contiguous CPU float32 tensor of head_dim/2 = " +
                            std::to_string(shape.head_dim / 2) + " values");
        std::vector<int64_t> delta_values;
        if (py::isinstance<py::int_>(deltas)) {
          delta_values.assign(static_cast<size_t>(shape.tokens), deltas.cast<int64_t>());
        } else {
          for (auto d : py::iter(deltas)) delta_values.push_back(d.cast<int64_t>());
          KDN_CHECK_INPUT(static_cast<int64_t>(delta_values.size()) == shape.tokens,
                          "rope_shift: need one delta per token (" + std::to_string(shape.tokens) + "), got " +
                              std::to_string(delta_values.size()));
        }
        const bool cuda = held.front().view.device == DeviceType::kCUDA;
        KDN_CHECK_INPUT(cuda || held.front().view.device == DeviceType::kCPU, "rope_shift: CPU or CUDA tensors only");
        Status st;
        {
          py::gil_scoped_release release;
          std::vector<float> table(static_cast<size_t>(shape.tokens * (shape.head_dim / 2) * 2));
          rope_angle_table(shape, static_cast<const float*>(f.view.data), delta_values.data(), table.data());
          if (cuda)
            st = rope_shift_cuda(shape, ptrs.data(), strides.data(), held.front().view.dtype, table.data(), stream);
          else
            rope_shift_cpu(shape, ptrs.data(), strides.data(), held.front().view.dtype, table.data(),
                           default_num_threads());
        }
        if (!st.ok) throw Error("rope_shift: " + st.message, __FILE__, __LINE__);
      },
      py::arg("keys"), py::arg("inv_freq"), py::arg("deltas"), py::arg("style") = "rotate_half", py::arg("stream") = 0,
      "Re-rotate cached keys in place: token t of every tensor moves by deltas[t] positions (an int: all tokens).\n"
      "keys: [1, kv_heads, tokens, head_dim] tensors (CPU, or CUDA for the CUDA twin); inv_freq: the model's\n"
      "RoPE inverse frequencies (CPU float32, head_dim/2).");
}

}  // namespace kdn
