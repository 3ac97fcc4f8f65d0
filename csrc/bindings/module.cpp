// The one PYBIND11_MODULE of kdn._core: exceptions, build info and the per-domain bindings.
#include <pybind11/pybind11.h>

#include "kdn/common.h"
#include "kdn/convert.h"
#include "kdn/kv_copy.h"
#include "kdn/parallel.h"

namespace py = pybind11;

namespace kdn {
void bind_hash(py::module_& m);
void bind_store(py::module_& m);
void bind_kv(py::module_& m);
void bind_blend(py::module_& m);
void bind_codec(py::module_& m);
}  // namespace kdn

PYBIND11_MODULE(_core, m) {
  m.doc() = "kdn C++ core: hashing, blob format, tiers, KV layout copies, codecs and RoPE re-rotation.";
  // Exception classes live as long as the interpreter (deliberately never released).
  static PyObject* kdn_error = PyErr_NewExceptionWithDoc(
      "kdn._core.KDNError", "Base class of errors raised by the kdn core.", PyExc_RuntimeError, nullptr);
  py::tuple input_bases = py::make_tuple(py::handle(kdn_error), py::handle(PyExc_ValueError));
  static PyObject* input_error = PyErr_NewExceptionWithDoc(
      "kdn._core.InvalidInputError", "A bad argument (dtype, shape, device, range).", input_bases.ptr(), nullptr);
  static PyObject* blob_error = PyErr_NewExceptionWithDoc(
      "kdn._core.BlobError", "A blob failed validation (corrupt, truncated, foreign).", kdn_error, nullptr);
  if (!kdn_error || !input_error || !blob_error) throw py::error_already_set();
  m.attr("KDNError") = py::handle(kdn_error);
  m.attr("InvalidInputError") = py::handle(input_error);
  m.attr("BlobError") = py::handle(blob_error);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const kdn::BlobError& e) {
      PyErr_SetString(blob_error, e.what());
    } catch (const kdn::InputError& e) {
      PyErr_SetString(input_error, e.what());
    } catch (const kdn::Error& e) {
      PyErr_SetString(kdn_error, e.what());
    }
  });
  m.def("cuda_compiled", &kdn::cuda_compiled, "True when the CUDA kernels were compiled in.");
  m.def("cuda_architectures", &kdn::cuda_architectures, "CUDA architectures compiled for ('' without CUDA).");
  m.def("fp16_conversion", &kdn::fp16_conversion, "'f16c' (x86 F16C compiled in and present) or 'portable'.");
  m.def("default_num_threads", &kdn::default_num_threads, "Threads the core uses for copies.");
  kdn::bind_hash(m);
  kdn::bind_store(m);
  kdn::bind_kv(m);
  kdn::bind_blend(m);
  kdn::bind_codec(m);
}
