// Python bindings of the hash functions and chunk-key derivation.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "kdn/keys.h"
#include "tensor.h"

namespace py = pybind11;

namespace kdn {

Key128 key_arg(py::handle obj, const char* what) {
  ByteSpan span = bytes_from_object(obj, what);
  KDN_CHECK_INPUT(span.size == 16, std::string(what) + " must be 16 bytes, got " + std::to_string(span.size));
  Key128 k;
  std::memcpy(k.data(), span.data, 16);
  return k;
}

namespace {

struct TokenSpan {
  const uint32_t* data;
  int64_t size;
};

TokenSpan token_span(py::handle tokens) {
  py::buffer_info info = py::reinterpret_borrow<py::buffer>(tokens).request(false);
  KDN_CHECK_INPUT(info.ndim == 1 && info.itemsize == 4 && (info.format == "I" || info.format == "=I" || info.format == "<I"),
                  "tokens must be a 1-D contiguous uint32 array");
  KDN_CHECK_INPUT(info.shape[0] == 0 || info.strides[0] == 4, "tokens must be contiguous");
  return TokenSpan{static_cast<const uint32_t*>(info.ptr), static_cast<int64_t>(info.shape[0])};
}

py::list key_list(const std::vector<Key128>& keys) {
  py::list out;
  for (const auto& k : keys) out.append(py::bytes(reinterpret_cast<const char*>(k.data()), 16));
  return out;
}

}  // namespace

void bind_hash(py::module_& m) {
  m.def(
      "blake3",
      [](py::handle data, size_t out_len, py::handle key) {
        KDN_CHECK_INPUT(out_len >= 1 && out_len <= 1024, "out_len must be in [1, 1024]");
        ByteSpan span = bytes_from_object(data, "data");
        std::string mac_key;
        if (!key.is_none()) {
          ByteSpan k = bytes_from_object(key, "key");
          KDN_CHECK_INPUT(k.size == 32, "blake3: a key must be 32 bytes");
          mac_key.assign(reinterpret_cast<const char*>(k.data), 32);
        }
        std::string out(out_len, '\0');
        {
          py::gil_scoped_release release;
          Blake3 h = mac_key.empty() ? Blake3() : Blake3(reinterpret_cast<const uint8_t*>(mac_key.data()));
          h.update(span.data, span.size);
          h.finalize(reinterpret_cast<uint8_t*>(&out[0]), out_len);
        }
        return py::bytes(out);
      },
      py::arg("data"), py::arg("out_len") = 32, py::arg("key") = py::none(),
      "BLAKE3 hash of a bytes-like object (keyed-hash mode with a 32-byte key).");
  m.def(
      "xxh64",
      [](py::handle data, uint64_t seed) {
        ByteSpan span = bytes_from_object(data, "data");
        py::gil_scoped_release release;
        return xxh64(span.data, span.size, seed);
      },
      py::arg("data"), py::arg("seed") = 0, "XXH64 of a bytes-like object.");
  m.def(
      "prefix_chunk_keys",
      [](py::handle fingerprint, py::handle tokens, int64_t chunk_size, bool include_partial) {
        const Key128 fp = key_arg(fingerprint, "fingerprint");
        const TokenSpan t = token_span(tokens);
        std::vector<Key128> keys;
        {
          py::gil_scoped_release release;
          keys = prefix_chunk_keys(fp, t.data, t.size, chunk_size, include_partial);
        }
        return key_list(keys);
      },
      py::arg("fingerprint"), py::arg("tokens"), py::arg("chunk_size"), py::arg("include_partial") = false,
      "Chained 16-byte prefix keys, one per full chunk of `tokens` (uint32), and one for a trailing partial "
      "chunk with include_partial.");
  m.def(
      "chunk_key",
      [](py::handle fingerprint, py::handle parent, py::handle tokens) {
        const TokenSpan t = token_span(tokens);
        const Key128 k = chunk_key(key_arg(fingerprint, "fingerprint"), key_arg(parent, "parent"), t.data, t.size);
        return py::bytes(reinterpret_cast<const char*>(k.data()), 16);
      },
      py::arg("fingerprint"), py::arg("parent"), py::arg("tokens"),
      "The key of one chunk of `tokens` (uint32) behind the chunk keyed `parent` (16 zero bytes: the first).");
  m.def(
      "probe_keys",
      [](py::handle fingerprint, py::handle parent, py::handle tokens, int64_t step) {
        const TokenSpan t = token_span(tokens);
        return key_list(probe_keys(key_arg(fingerprint, "fingerprint"), key_arg(parent, "parent"), t.data, t.size, step));
      },
      py::arg("fingerprint"), py::arg("parent"), py::arg("tokens"), py::arg("step"),
      "Probe keys of the first step, 2*step, ... tokens of a chunk behind `parent` (see kdn/keys.h).");
}

}  // namespace kdn
