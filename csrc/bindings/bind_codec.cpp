// Python bindings of the KV codecs: parameter checks and blob transcoding (with the coder's report).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "kdn/cachegen.h"
#include "kdn/codec.h"
#include "kdn/kvtc.h"
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

// Decodes blobs[i] into outs[i] on the GPU (codec_decode_cuda_many), after checking each pair. The
// checksums (skipped for Buffers already verified) are checked by the host's threads, a blob each.
static void decode_on_device(const std::vector<py::handle>& blobs, const std::vector<py::handle>& outs, uintptr_t stream) {
  KDN_CHECK_INPUT(blobs.size() == outs.size(), "codec_decode_cuda: one output tensor per blob");
  const size_t n = blobs.size();
  std::vector<ByteSpan> spans;
  std::vector<HeldView> views;
  std::vector<char> hash(n);
  for (size_t i = 0; i < n; ++i) {
    spans.push_back(bytes_from_object(blobs[i], "blob"));
    views.push_back(view_from_object(outs[i], "out"));
    hash[i] = !(py::isinstance<Buffer>(blobs[i]) && blobs[i].cast<Buffer&>().verified());
  }
  std::vector<BlobHeader> headers(n);
  std::vector<Status> parsed(n);
  {
    py::gil_scoped_release release;
    parallel_for(static_cast<int64_t>(n), default_num_threads(),
                 [&](int64_t i) { parsed[i] = blob_parse(spans[i].data, spans[i].size, hash[i], &headers[i]); });
  }
  std::vector<DecodeJob> jobs;
  for (size_t i = 0; i < n; ++i) {
    if (!parsed[i].ok) throw BlobError(parsed[i].message, __FILE__, __LINE__);
    const BlobHeader& h = headers[i];
    const TensorView& dst = views[i].view;
    KDN_CHECK_INPUT(dst.device == DeviceType::kCUDA && dst.is_contiguous() && dst.writable,
                    "codec_decode_cuda: out must be a contiguous writable CUDA tensor");
    KDN_CHECK_INPUT(dst.dtype == h.dtype && static_cast<uint64_t>(dst.numel() * dtype_size(h.dtype)) == raw_payload_bytes(h),
                    "codec_decode_cuda: out must hold [layers, 2, tokens, kv_heads, head_dim] in the blob dtype");
    jobs.push_back(DecodeJob{&h, spans[i].data + kBlobHeaderBytes, h.payload_bytes, dst.data});
  }
  Status st;
  {
    py::gil_scoped_release release;
    st = codec_decode_cuda_many(jobs, stream);
  }
  if (!st.ok) throw BlobError("codec_decode_cuda: " + st.message, __FILE__, __LINE__);
}

void bind_codec(py::module_& m) {
  m.def(
      "codec_table",
      [] {
        py::list rows;
        for (const CodecOps& ops : kCodecs) {
          py::list options;
          for (const CodecOption& o : ops.options)
            if (o.name) options.append(py::make_tuple(o.name, o.shift, o.bits, o.fallback));
          py::dict row;
          row["id"] = ops.id;
          row["name"] = ops.name;
          row["spellings"] = ops.spellings ? std::string(ops.spellings) : std::string(ops.name);
          row["lossy"] = ops.lossy;
          row["device_decoded"] = ops.device_decoded;
          row["calibrated"] = ops.prepare != nullptr;  // encodes under per-model state (kdn.<name>.STATE)
          row["options"] = options;
          rows.append(row);
        }
        return rows;
      },
      "The codecs this build knows, one dict per codec: id, name, spellings (its spec names, "
      "space-separated), lossy, device_decoded, calibrated (per-model state: kdn.<name>.STATE), "
      "options [(name, shift, bits, default)].");
  m.def(
      "codec_check",
      [](int codec, uint32_t params) { codec_require(codec, params); },
      py::arg("codec"), py::arg("params"), "Raise InvalidInputError unless (codec, params) is valid.");

  m.def(
      "codec_decode_cuda",
      [](py::handle blob, py::handle out, uintptr_t stream) { decode_on_device({blob}, {out}, stream); },
      py::arg("blob"), py::arg("out"), py::arg("stream") = 0,
      "Decode an int*/cachegen/kvtc blob on the GPU into `out` (a CUDA tensor [layers, 2, tokens, kv_heads, head_dim]).");
  m.def(
      "codec_decode_cuda_many",
      [](const std::vector<py::handle>& blobs, const std::vector<py::handle>& outs, uintptr_t stream) {
        decode_on_device(blobs, outs, stream);
      },
      py::arg("blobs"), py::arg("outs"), py::arg("stream") = 0,
      "codec_decode_cuda for many blobs on one stream; the kvtc ones decode together in one pair of launches.");

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
      "kvtc_load",
      [](py::handle data) {
        ByteSpan span = bytes_from_object(data, "calibration");
        const Key128 id = kvtc_load(span.data, span.size);
        return py::bytes(reinterpret_cast<const char*>(id.data()), 16);
      },
      py::arg("calibration"),
      "Load kvtc calibration bytes into the process (encoders of its model and decoders of its id\n"
      "use it); returns its id. Raises InvalidInputError when the bytes are not a calibration.");
  m.def(
      "kvtc_pack",
      [](py::handle fingerprint, py::handle key, py::handle data) {
        ByteSpan span = bytes_from_object(data, "calibration");
        return kvtc_pack(key_arg(fingerprint, "fingerprint"), key_arg(key, "key"), span.data, span.size);
      },
      py::arg("fingerprint"), py::arg("key"), py::arg("calibration"),
      "A sealed calibration blob filed under `key` (InvalidInputError unless it is a calibration of this model).");
  m.def(
      "kvtc_load_blob",
      [](py::handle blob, py::handle fingerprint, py::handle key) {
        ByteSpan span = bytes_from_object(blob, "blob");
        const Key128 fp = key_arg(fingerprint, "fingerprint"), k = key_arg(key, "key");
        Key128 id;
        Status st;
        {
          py::gil_scoped_release release;
          st = kvtc_load_blob(span.data, span.size, fp, k, &id);
        }
        if (!st.ok) throw BlobError("calibration: " + st.message, __FILE__, __LINE__);
        return py::bytes(reinterpret_cast<const char*>(id.data()), 16);
      },
      py::arg("blob"), py::arg("fingerprint"), py::arg("key"),
      "Verify a calibration blob (checksum, kind, model, key) and load it; returns its id. BlobError if unusable.");
  m.def(
      "kvtc_loaded", [](py::handle id) { return kvtc_by_id(key_arg(id, "id")) != nullptr; }, py::arg("id"),
      "Whether the calibration with this id is loaded.");
  m.def(
      "kvtc_model_calibration",
      [](py::handle fingerprint) -> py::object {
        auto cal = kvtc_for_model(key_arg(fingerprint, "fingerprint"));
        if (!cal) return py::none();
        py::dict d;
        d["id"] = py::bytes(reinterpret_cast<const char*>(cal->id.data()), 16);
        py::list ratios;
        for (uint32_t r : cal->ratios) ratios.append(r);
        d["ratios"] = ratios;
        d["per_head"] = cal->per_head;
        d["components"] = cal->components;
        d["prerope"] = cal->prerope;
        return d;
      },
      py::arg("fingerprint"), "The calibration loaded for a model (id, ratios, components, prerope), or None.");
  m.def("kvtc_unload_all", &kvtc_unload_all, "Forget every loaded kvtc calibration (tests).");
  m.def(
      "kvtc_blob_calibration",
      [](py::handle blob) -> py::object {
        ByteSpan span = bytes_from_object(blob, "blob");
        BlobHeader h;
        Status st = blob_parse(span.data, span.size, false, &h);
        if (!st.ok) throw BlobError(st.message, __FILE__, __LINE__);
        const uint8_t* payload = span.data + kBlobHeaderBytes;
        const size_t table = 8 * static_cast<size_t>(h.layers);  // u32 per plane
        Key128 id;
        if (h.codec != kCodecKvtc || h.payload_bytes < table ||
            !kvtc_plane_calibration(payload + table, h.payload_bytes - table, &id))
          return py::none();
        return py::bytes(reinterpret_cast<const char*>(id.data()), 16);
      },
      py::arg("blob"), "The calibration id a kvtc blob was coded under (its first plane's), else None.");

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
