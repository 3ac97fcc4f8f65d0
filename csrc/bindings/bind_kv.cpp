// Python bindings that move KV between a model's per-layer tensors and blobs (pack / verify / unpack).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>

#include "kdn/blob.h"
#include "kdn/codec.h"
#include "kdn/kv_copy.h"
#include "kdn/parallel.h"
#include "tensor.h"

namespace py = pybind11;

namespace kdn {

Key128 key_arg(py::handle obj, const char* what);
BufferPtr buffer_from_object(py::handle obj);

namespace {

// Validated views of a flat list [k0, v0, k1, v1, ...] of [1, heads, seq, dim] (or 3-D) tensors.
struct KvViews {
  std::vector<HeldView> held;
  std::vector<void*> ptrs;
  std::vector<int64_t> strides;
  DType dtype = DType::kFloat32;
  DeviceType device = DeviceType::kCPU;
  int64_t layers = 0, heads = 0, seq = 0, dim = 0;
  KvTable table() const { return KvTable{ptrs.data(), strides.data()}; }
};

KvViews kv_views(const py::sequence& kv, bool need_writable) {
  KvViews out;
  const size_t n = py::len(kv);
  KDN_CHECK_INPUT(n > 0 && n % 2 == 0, "kv must be a flat list [k0, v0, k1, v1, ...] of even length, got " + std::to_string(n));
  out.layers = static_cast<int64_t>(n / 2);
  for (size_t i = 0; i < n; ++i) {
    const std::string what = "kv[" + std::to_string(i) + "] (layer " + std::to_string(i / 2) + (i % 2 ? " values)" : " keys)");
    out.held.push_back(view_from_object(kv[i], what));
    const TensorView& v = out.held.back().view;
    KDN_CHECK_INPUT(v.ndim == 3 || (v.ndim == 4 && v.shape[0] == 1),
                    what + ": expected shape [1, kv_heads, seq, head_dim] (batch 1), got " + v.shape_str());
    const int off = v.ndim - 3;
    if (i == 0) {
      out.dtype = v.dtype;
      out.device = v.device;
      out.heads = v.shape[off];
      out.seq = v.shape[off + 1];
      out.dim = v.shape[off + 2];
    }
    KDN_CHECK_INPUT(v.dtype == out.dtype, what + ": dtype " + dtype_name(v.dtype) + " differs from kv[0] (" + dtype_name(out.dtype) + ")");
    KDN_CHECK_INPUT(v.device == out.device, what + ": device differs from kv[0]");
    KDN_CHECK_INPUT(v.shape[off] == out.heads && v.shape[off + 1] == out.seq && v.shape[off + 2] == out.dim,
                    what + ": shape " + v.shape_str() + " differs from kv[0]");
    KDN_CHECK_INPUT(v.strides[off + 2] == 1 || out.dim == 1, what + ": head_dim must be contiguous (stride 1)");
    KDN_CHECK_INPUT(!need_writable || v.writable, what + ": tensor is read-only");
    out.ptrs.push_back(v.data);
    out.strides.push_back(v.strides[off]);
    out.strides.push_back(v.strides[off + 1]);
  }
  return out;
}

struct Expect {
  Key128 fingerprint;
  DType dtype;
  uint32_t layers, kv_heads, head_dim, chunk_tokens;
};

Status check_header(const BlobHeader& h, const Expect& e, const Key128& key, uint32_t position) {
  if (h.fingerprint != e.fingerprint) return Status::Fail("blob belongs to another model (fingerprint mismatch)");
  if (h.key != key) return Status::Fail("blob was stored under another key");
  if (h.dtype != e.dtype) return Status::Fail(std::string("blob dtype ") + dtype_name(h.dtype) + " != model dtype " + dtype_name(e.dtype));
  if (h.layers != e.layers || h.kv_heads != e.kv_heads || h.head_dim != e.head_dim)
    return Status::Fail("blob layout [" + std::to_string(h.layers) + " layers, " + std::to_string(h.kv_heads) + " heads, " +
                        std::to_string(h.head_dim) + " dim] does not match the model");
  if (h.tokens != e.chunk_tokens) return Status::Fail("blob holds " + std::to_string(h.tokens) + " tokens, expected " + std::to_string(e.chunk_tokens));
  if (h.position != position) return Status::Fail("blob position " + std::to_string(h.position) + " != " + std::to_string(position));
  return Status::Ok();
}

}  // namespace

void bind_kv(py::module_& m) {
  m.def(
      "pack_chunk",
      [](const py::sequence& kv, int64_t start, int64_t count, py::handle fingerprint, py::handle key) {
        KvViews v = kv_views(kv, false);
        KDN_CHECK_INPUT(v.device == DeviceType::kCPU, "pack_chunk: tensors must be on the CPU (move them, or use the CUDA copy)");
        KDN_CHECK_INPUT(start >= 0 && count > 0 && start + count <= v.seq,
                        "pack_chunk: tokens [" + std::to_string(start) + ", " + std::to_string(start + count) +
                            ") are outside the cache (" + std::to_string(v.seq) + " tokens)");
        BlobHeader h;
        h.dtype = v.dtype;
        h.layers = static_cast<uint32_t>(v.layers);
        h.kv_heads = static_cast<uint32_t>(v.heads);
        h.head_dim = static_cast<uint32_t>(v.dim);
        h.tokens = static_cast<uint32_t>(count);
        h.position = static_cast<uint32_t>(start);
        h.fingerprint = key_arg(fingerprint, "fingerprint");
        h.key = key_arg(key, "key");
        h.payload_bytes = raw_payload_bytes(h);
        KDN_CHECK_INPUT(h.payload_bytes > 0, "pack_chunk: dimensions out of range");
        const size_t size = kBlobHeaderBytes + h.payload_bytes + kBlobTrailerBytes;
        auto blob = std::make_shared<Buffer>(size);
        {
          py::gil_scoped_release release;
          blob_write_header(h, blob->data());
          KvShape shape{v.layers, count, v.heads, v.dim};
          kv_copy_cpu(shape, v.table(), blob->data() + kBlobHeaderBytes, dtype_size(v.dtype), start, count,
                      CopyDirection::kCacheToChunk, default_num_threads());
          blob_seal(blob->data(), size);
          blob->mark_verified();
        }
        return blob;
      },
      py::arg("kv"), py::arg("start"), py::arg("count"), py::arg("fingerprint"), py::arg("key"),
      "Pack tokens [start, start+count) of a per-layer KV list into one raw blob.");

  m.def(
      "verify_chunks",
      [](const py::list& blobs, const py::list& keys, py::handle fingerprint, const std::string& dtype,
         uint32_t layers, uint32_t kv_heads, uint32_t head_dim, uint32_t chunk_tokens) {
        KDN_CHECK_INPUT(py::len(blobs) == py::len(keys), "verify_chunks: blobs and keys differ in length");
        Expect e{key_arg(fingerprint, "fingerprint"), DType::kFloat32, layers, kv_heads, head_dim, chunk_tokens};
        if (dtype == "float16") e.dtype = DType::kFloat16;
        else if (dtype == "bfloat16") e.dtype = DType::kBFloat16;
        else KDN_CHECK_INPUT(dtype == "float32", "verify_chunks: unsupported dtype " + dtype);
        std::vector<ByteSpan> spans;
        std::vector<Key128> ks;
        std::vector<Buffer*> buffers(py::len(blobs), nullptr);  // kdn Buffers remember a verified checksum
        for (size_t i = 0; i < py::len(blobs); ++i) {
          spans.push_back(bytes_from_object(blobs[i], "blob"));
          ks.push_back(key_arg(keys[i], "key"));
          if (py::isinstance<Buffer>(blobs[i])) buffers[i] = &blobs[i].cast<Buffer&>();
        }
        std::vector<Status> status(spans.size());
        {
          py::gil_scoped_release release;
          parallel_for(static_cast<int64_t>(spans.size()), default_num_threads(), [&](int64_t i) {
            BlobHeader h;
            bool hash = !(buffers[i] && buffers[i]->verified());
            status[i] = blob_parse(spans[i].data, spans[i].size, hash, &h);
            if (status[i].ok && hash && buffers[i]) buffers[i]->mark_verified();
            if (status[i].ok) status[i] = check_header(h, e, ks[i], static_cast<uint32_t>(i * chunk_tokens));
          });
        }
        for (size_t i = 0; i < status.size(); ++i)
          if (!status[i].ok) return py::make_tuple(py::int_(i), "chunk " + std::to_string(i) + ": " + status[i].message);
        return py::make_tuple(py::int_(status.size()), std::string());
      },
      py::arg("blobs"), py::arg("keys"), py::arg("fingerprint"), py::arg("dtype"), py::arg("layers"),
      py::arg("kv_heads"), py::arg("head_dim"), py::arg("chunk_tokens"),
      "Validate consecutive prefix-chunk blobs; returns (number of leading valid blobs, first error).");

  m.def(
      "unpack_chunks",
      [](const py::list& blobs, const py::sequence& kv, int64_t count) {
        KvViews v = kv_views(kv, true);
        KDN_CHECK_INPUT(v.device == DeviceType::kCPU, "unpack_chunks: tensors must be on the CPU");
        KDN_CHECK_INPUT(count >= 0 && count <= v.seq, "unpack_chunks: count exceeds the destination length");
        std::vector<ByteSpan> spans;
        std::vector<BlobHeader> headers;
        int64_t available = 0;
        for (size_t i = 0; i < py::len(blobs); ++i) {
          spans.push_back(bytes_from_object(blobs[i], "blob"));
          BlobHeader h;
          Status st = blob_parse(spans.back().data, spans.back().size, false, &h);
          if (!st.ok) throw BlobError(st.message, __FILE__, __LINE__);
          KDN_CHECK_INPUT(h.dtype == v.dtype && h.layers == v.layers && h.kv_heads == v.heads && h.head_dim == v.dim,
                          "unpack_chunks: blob " + std::to_string(i) + " layout does not match the destination");
          headers.push_back(h);
          available += h.tokens;
        }
        KDN_CHECK_INPUT(available >= count, "unpack_chunks: blobs hold " + std::to_string(available) +
                                                " tokens, fewer than count=" + std::to_string(count));
        py::gil_scoped_release release;
        // Parallelism is inside each chunk's copy (over layers x heads), chunks run in order.
        int64_t pos = 0;
        for (size_t i = 0; i < spans.size() && pos < count; ++i) {
          const int64_t n = std::min<int64_t>(headers[i].tokens, count - pos);
          KvShape shape{v.layers, headers[i].tokens, v.heads, v.dim};
          uint8_t* chunk = const_cast<uint8_t*>(spans[i].data) + kBlobHeaderBytes;
          BufferPtr decoded;  // coded blobs are decoded into a pooled buffer, then copied like raw ones
          if (headers[i].codec != kCodecRaw) {
            decoded = std::make_shared<Buffer>(raw_payload_bytes(headers[i]));
            Status st = codec_decode(headers[i], chunk, headers[i].payload_bytes, decoded->data(), default_num_threads());
            if (!st.ok) throw BlobError("unpack_chunks: blob " + std::to_string(i) + ": " + st.message, __FILE__, __LINE__);
            chunk = decoded->data();
          }
          kv_copy_cpu(shape, v.table(), chunk, dtype_size(v.dtype), pos, n, CopyDirection::kChunkToCache,
                      default_num_threads());
          pos += n;
        }
      },
      py::arg("blobs"), py::arg("kv"), py::arg("count"),
      "Copy the first `count` tokens held by consecutive blobs into per-layer KV tensors.");

  // kv_copy_cpu / kv_copy_cuda: the same checks, then the CPU oracle or its CUDA twin.
  auto bind_copy = [&m](const char* name, DeviceType device, const char* doc) {
    m.def(
        name,
        [name, device](const py::sequence& kv, py::handle chunk, int64_t chunk_tokens, int64_t cache_start,
                       int64_t count, bool to_chunk, uintptr_t stream) {
          const std::string fn(name);
          const bool cuda = device == DeviceType::kCUDA;
          KvViews v = kv_views(kv, true);
          HeldView c = view_from_object(chunk, "chunk");
          KDN_CHECK_INPUT(v.device == device && c.view.device == device,
                          fn + (cuda ? ": kv tensors and chunk must be CUDA tensors" : ": CPU tensors only"));
          KDN_CHECK_INPUT(c.view.dtype == v.dtype && c.view.is_contiguous(),
                          fn + ": chunk must be contiguous with the kv dtype");
          KDN_CHECK_INPUT(c.view.numel() == v.layers * 2 * chunk_tokens * v.heads * v.dim,
                          fn + ": chunk size does not match [layers, 2, chunk_tokens, kv_heads, head_dim]");
          KDN_CHECK_INPUT(count >= 0 && count <= chunk_tokens && cache_start >= 0 && cache_start + count <= v.seq,
                          fn + ": token range out of bounds");
          const KvShape shape{v.layers, chunk_tokens, v.heads, v.dim};
          const CopyDirection dir = to_chunk ? CopyDirection::kCacheToChunk : CopyDirection::kChunkToCache;
          std::string err;
          {
            py::gil_scoped_release release;
            if (cuda)
              err = kv_copy_cuda(shape, v.table(), c.view.data, dtype_size(v.dtype), cache_start, count, dir, stream);
            else
              kv_copy_cpu(shape, v.table(), c.view.data, dtype_size(v.dtype), cache_start, count, dir,
                          default_num_threads());
          }
          if (!err.empty()) throw Error(fn + ": " + err, __FILE__, __LINE__);
        },
        py::arg("kv"), py::arg("chunk"), py::arg("chunk_tokens"), py::arg("cache_start"), py::arg("count"),
        py::arg("to_chunk"), py::arg("stream") = 0, doc);
  };
  bind_copy("kv_copy_cpu", DeviceType::kCPU,
            "CPU copy between per-layer KV tensors and a canonical chunk tensor (oracle of kv_copy_cuda).");
  bind_copy("kv_copy_cuda", DeviceType::kCUDA,
            "CUDA copy between per-layer KV tensors and a canonical chunk tensor on the device (stream: cudaStream_t "
            "as an int).");
}

}  // namespace kdn
