// Python bindings of the blob Buffer, blob parsing and the host-memory store.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>

#include "kdn/memory_store.h"
#include "tensor.h"

namespace py = pybind11;

namespace kdn {

Key128 key_arg(py::handle obj, const char* what);

BufferPtr buffer_from_object(py::handle obj) {
  if (py::isinstance<Buffer>(obj)) return obj.cast<BufferPtr>();
  ByteSpan span = bytes_from_object(obj, "blob");
  auto buf = std::make_shared<Buffer>(span.size);
  py::gil_scoped_release release;
  std::memcpy(buf->data(), span.data, span.size);
  return buf;
}

py::dict header_to_dict(const BlobHeader& h) {
  py::dict d;
  d["codec"] = h.codec;
  d["dtype"] = dtype_name(h.dtype);
  d["layers"] = h.layers;
  d["kv_heads"] = h.kv_heads;
  d["head_dim"] = h.head_dim;
  d["tokens"] = h.tokens;
  d["position"] = h.position;
  d["fingerprint"] = py::bytes(reinterpret_cast<const char*>(h.fingerprint.data()), 16);
  d["key"] = py::bytes(reinterpret_cast<const char*>(h.key.data()), 16);
  d["payload_bytes"] = h.payload_bytes;
  return d;
}

void bind_store(py::module_& m) {
  py::class_<Buffer, BufferPtr>(m, "Buffer", py::buffer_protocol(),
                                "Immutable reference-counted bytes (a blob); supports memoryview().")
      .def(py::init([](py::handle data) { return buffer_from_object(data); }), py::arg("data"))
      .def("__len__", &Buffer::size)
      .def("tobytes", [](const Buffer& b) { return py::bytes(reinterpret_cast<const char*>(b.data()), b.size()); })
      .def_buffer([](Buffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<ssize_t>(b.size())}, {1}, /*readonly=*/true);
      });

  m.def(
      "blob_parse",
      [](py::handle blob, bool verify_checksum) {
        ByteSpan span = bytes_from_object(blob, "blob");
        BlobHeader h;
        Status st;
        {
          py::gil_scoped_release release;
          st = blob_parse(span.data, span.size, verify_checksum, &h);
        }
        if (!st.ok) throw BlobError(st.message, __FILE__, __LINE__);
        return header_to_dict(h);
      },
      py::arg("blob"), py::arg("verify_checksum") = true,
      "Validate a blob and return its header as a dict; raises BlobError.");

  py::class_<MemoryStore>(m, "MemoryStore", "Host-memory LRU blob store (thread-safe).")
      .def(py::init<uint64_t>(), py::arg("capacity_bytes"))
      .def("put", [](MemoryStore& s, py::handle key, py::handle blob) {
            Key128 k = key_arg(key, "key");
            BufferPtr buf = buffer_from_object(blob);
            py::gil_scoped_release release;
            return s.put(k, std::move(buf));
          }, py::arg("key"), py::arg("blob"))
      .def("get", [](MemoryStore& s, py::handle key) -> py::object {
            BufferPtr buf = s.get(key_arg(key, "key"));
            if (!buf) return py::none();
            return py::cast(buf);
          }, py::arg("key"))
      .def("contains", [](const MemoryStore& s, py::handle key) { return s.contains(key_arg(key, "key")); })
      .def("__contains__", [](const MemoryStore& s, py::handle key) { return s.contains(key_arg(key, "key")); })
      .def("count_prefix", [](const MemoryStore& s, const py::list& keys) {
            std::vector<Key128> ks;
            for (auto k : keys) ks.push_back(key_arg(k, "key"));
            return s.count_prefix(ks);
          }, py::arg("keys"))
      .def("remove", [](MemoryStore& s, py::handle key) { return s.remove(key_arg(key, "key")); })
      .def("clear", &MemoryStore::clear)
      .def("__len__", [](const MemoryStore& s) { return s.stats().entries; })
      .def_property_readonly("capacity", &MemoryStore::capacity)
      .def_property_readonly("used_bytes", [](const MemoryStore& s) { return s.stats().used_bytes; })
      .def("stats", [](const MemoryStore& s) {
        MemoryStoreStats st = s.stats();
        py::dict d;
        d["hits"] = st.hits;
        d["misses"] = st.misses;
        d["puts"] = st.puts;
        d["evictions"] = st.evictions;
        d["rejected"] = st.rejected;
        d["entries"] = st.entries;
        d["used_bytes"] = st.used_bytes;
        d["capacity_bytes"] = st.capacity_bytes;
        return d;
      });
}

}  // namespace kdn
