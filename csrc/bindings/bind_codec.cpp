// Python bindings of the KV codecs: parameter checks and blob transcoding (with the coder's report).
#include <pybind11/pybind11.h>

#include "kdn/cachegen.h"
#include "kdn/codec.h"
#include "kdn/parallel.h"
#include "tensor.h"

namespace py = pybind11;

namespace kdn {

Key128 key_arg(py::handle obj, const char* what);

py::dict report_to_dict(const CodecReport& r) {
  py::dict d;
  d["symbols"] = r.symbols;
  d["model_bits"] = r.model_bits;
  d["empirical_bits"] = r.empirical_bits;
  d["coded_bytes"] = r.coded_bytes;
  d["table_bytes"] = r.table_bytes;
  d["side_bytes"] = r.side_bytes;
  return d;
}

void bind_codec(py::module_& m) {
  m.def(
      "codec_check",
      [](int codec, uint32_t params) { codec_require(codec, params); },
      py::arg("codec"), py::arg("params"), "Raise InvalidInputError unless (codec, params) is valid.");

  m.def(
      "codec_decode_cuda",
      [](py::handle blob, py::handle out, uintptr_t stream) {
        ByteSpan span = bytes_from_object(blob, "blob");
        HeldView dst = view_from_object(out, "out");
        BlobHeader h;
        Status st = blob_parse(span.data, span.size, true, &h);
        if (!st.ok) throw BlobError(st.message, __FILE__, __LINE__);
        KDN_CHECK_INPUT(dst.view.device == DeviceType::kCUDA && dst.view.is_contiguous() && dst.view.writable,
                        "codec_decode_cuda: out must be a contiguous writable CUDA tensor");
        KDN_CHECK_INPUT(dst.view.dtype == h.dtype && static_cast<uint64_t>(dst.view.numel() * dtype_size(h.dtype)) ==
                                                         raw_payload_bytes(h),
                        "codec_decode_cuda: out must hold [layers, 2, tokens, kv_heads, head_dim] in the blob dtype");
        {
          py::gil_scoped_release release;
          st = codec_decode_cuda(h, span.data + kBlobHeaderBytes, h.payload_bytes, dst.view.data, stream);
        }
        if (!st.ok) throw BlobError("codec_decode_cuda: " + st.message, __FILE__, __LINE__);
      },
      py::arg("blob"), py::arg("out"), py::arg("stream") = 0,
      "Decode an int*/cachegen blob on the GPU into `out` (a CUDA tensor [layers, 2, tokens, kv_heads, head_dim]).");

  m.def(
      "blob_reseal",
      [](py::buffer blob) {
        py::buffer_info info = blob.request(true);
        const size_t size = static_cast<size_t>(info.size * info.itemsize);
        KDN_CHECK_INPUT(size >= kBlobHeaderBytes + kBlobTrailerBytes, "blob_reseal: too short for a blob");
        blob_seal(static_cast<uint8_t*>(info.ptr), size);
      },
      py::arg("blob"), "Recompute the checksum of a writable blob in place (tests: reach a decoder past the checksum).");

  m.def(
      "cachegen_step",
      [](int level, int layer, int layers, bool values) {
        KDN_CHECK_INPUT(level >= 1 && level <= 3 && layer >= 0 && layer < layers, "cachegen_step: bad level or layer");
        const CacheGenStep st = cachegen_step(level, layer, layers, values);
        return py::make_tuple(st.step, st.range);
      },
      py::arg("level"), py::arg("layer"), py::arg("layers"), py::arg("values"),
      "(step, range) of cachegen at a level for a layer's keys or values: the quantization its decoder inverts.");

  m.def(
      "lossy_key",
      [](py::handle key, int codec, uint32_t params) {
        codec_require(codec, params);
        const Key128 k = lossy_key(key_arg(key, "key"), static_cast<uint8_t>(codec), params);
        return codec_is_lossy(static_cast<uint8_t>(codec)) ? py::bytes(reinterpret_cast<const char*>(k.data()), 16)
                                                           : py::reinterpret_borrow<py::object>(key);
      },
      py::arg("key"), py::arg("codec"), py::arg("params") = 0,
      "Where a chunk coded with a lossy (codec, params) is filed; the key itself for raw and lossless.");
  m.def(
      "coded_key",
      [](py::handle blob, int codec, uint32_t params) {
        codec_require(codec, params);
        ByteSpan span = bytes_from_object(blob, "blob");
        BlobHeader h;
        Status st = blob_parse(span.data, span.size, false, &h);
        if (!st.ok) throw BlobError(st.message, __FILE__, __LINE__);
        const Key128 k = coded_key(h, static_cast<uint8_t>(codec), params);
        return py::bytes(reinterpret_cast<const char*>(k.data()), 16);
      },
      py::arg("blob"), py::arg("codec"), py::arg("params") = 0,
      "The key the blob will carry once coded with (codec, params) (see transcode).");
  m.def(
      "transcode",
      [](py::handle blob, int codec, uint32_t params, bool report, bool verify_checksum) -> py::object {
        codec_require(codec, params);
        ByteSpan span = bytes_from_object(blob, "blob");
        const bool is_buffer = py::isinstance<Buffer>(blob);
        const bool hash = verify_checksum && !(is_buffer && blob.cast<Buffer&>().verified());
        BlobHeader h;
        CodecReport rep;
        BufferPtr out;
        {
          py::gil_scoped_release release;
          Status st = blob_parse(span.data, span.size, hash, &h);
          if (!st.ok) throw BlobError(st.message, __FILE__, __LINE__);
          if (!(h.codec == codec && h.codec_params == params && is_buffer && !report))
            out = blob_transcode(h, span.data, static_cast<uint8_t>(codec), params, default_num_threads(), &rep);
        }
        py::object result = out ? py::cast(out) : py::reinterpret_borrow<py::object>(blob);
        if (report) return py::make_tuple(result, report_to_dict(rep));
        return result;
      },
      py::arg("blob"), py::arg("codec"), py::arg("params") = 0, py::arg("report") = false,
      py::arg("verify_checksum") = true,
      "The blob coded with (codec, params): the same Buffer if it already is, else a new sealed Buffer\n"
      "(decoded first when needed). With report=True returns (blob, coder report dict). Raises BlobError\n"
      "for a corrupt blob (checksum skipped with verify_checksum=False: the decoder's own checks remain).");
}

}  // namespace kdn
