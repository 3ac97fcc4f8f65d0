// Python bindings of the chunk layout (kdn/chunk.h, kdn/kv_copy.h): convert arguments, release the GIL, call.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <tuple>

#include "kdn/blob.h"
#include "kdn/chunk.h"
#include "kdn/host_memory.h"
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

// An engine's paged KV tensors, one per layer, and the layout they are read and written by
// (kdn/paged.h): `layout` None is vLLM's CPU 'vec' layout of contiguous [blocks, kv_heads,
// block_size, 2 * head_dim] tensors; otherwise a dict {"kv_heads", "head_dim", "block_size",
// "num_blocks", "k": (base, block, head, token, dim[, token_tile, token_tile_stride, dim_tile,
// dim_tile_stride]), "v": (...)} of element strides
// (python/kdn/engine/paged.py derives it from an engine's tensors).
struct PagedLayers {
  std::vector<HeldView> held;
  std::vector<void*> ptrs;
  PagedLayout layout{};
  DType dtype = DType::kFloat32;
};

PlaneStrides plane_arg(const py::handle& value, const char* name) {
  const auto t = value.cast<std::vector<int64_t>>();
  KDN_CHECK_INPUT(t.size() == 5 || t.size() == 9,
                  std::string("paged layout: ") + name +
                      " must be (base, block, head, token, dim) or that and (token_tile, token_tile_stride, "
                      "dim_tile, dim_tile_stride)");
  if (t.size() == 5) return PlaneStrides{t[0], t[1], t[2], t[3], t[4]};
  return PlaneStrides{t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8]};
}

// The largest element offset a tensor view can address (strides must be non-negative).
int64_t view_extent(const TensorView& v) {
  int64_t most = 0;
  for (int i = 0; i < v.ndim; ++i) {
    KDN_CHECK_INPUT(v.strides[i] >= 0, "paged layers: negative strides are not supported");
    most += (v.shape[i] - 1) * v.strides[i];
  }
  return most;
}

PagedLayers paged_layers(const py::sequence& layers, const py::object& layout,
                         DeviceType device = DeviceType::kCPU) {
  PagedLayers out;
  const size_t n = py::len(layers);
  KDN_CHECK_INPUT(n > 0, "paged layers: none given");
  for (size_t i = 0; i < n; ++i) {
    out.held.push_back(view_from_object(layers[i], "layers[" + std::to_string(i) + "]"));
    const TensorView& v = out.held.back().view;
    KDN_CHECK_INPUT(v.device == device && v.writable, std::string("paged layers must be writable ") +
                                                          (device == DeviceType::kCUDA ? "CUDA" : "CPU") + " tensors");
    if (i == 0) {
      out.dtype = v.dtype;
      if (layout.is_none()) {
        KDN_CHECK_INPUT(v.ndim == 4 && v.is_contiguous() && v.shape[3] % 2 == 0,
                        "paged layers in vLLM's CPU layout must be contiguous [blocks, kv_heads, block_size, "
                        "2 * head_dim], got " + v.shape_str());
        out.layout = vec_layout(static_cast<int64_t>(n), v.shape[1], v.shape[3] / 2, v.shape[2], v.shape[0]);
      } else {
        const py::dict d = layout.cast<py::dict>();
        out.layout = PagedLayout{static_cast<int64_t>(n), d["kv_heads"].cast<int64_t>(), d["head_dim"].cast<int64_t>(),
                                 d["block_size"].cast<int64_t>(), d["num_blocks"].cast<int64_t>(),
                                 plane_arg(d["k"], "k"), plane_arg(d["v"], "v")};
        const PagedLayout& l = out.layout;
        KDN_CHECK_INPUT(l.kv_heads > 0 && l.head_dim > 0 && l.block_size > 0 && l.num_blocks > 0,
                        "paged layout: kv_heads, head_dim, block_size and num_blocks must be positive");
        for (const PlaneStrides& s : {l.k, l.v})
          KDN_CHECK_INPUT((s.token_tile <= 0 || l.block_size % s.token_tile == 0) &&
                              (s.dim_tile <= 0 || l.head_dim % s.dim_tile == 0),
                          "paged layout: a token tile must divide block_size and a dim tile head_dim");
      }
      KDN_CHECK_INPUT(paged_extent(out.layout) >= 0, "paged layout: strides must be non-negative");
    }
    KDN_CHECK_INPUT(v.dtype == out.dtype, "paged layers differ in dtype");
    KDN_CHECK_INPUT(paged_extent(out.layout) <= view_extent(v),
                    "paged layout addresses elements beyond layers[" + std::to_string(i) + "] " + v.shape_str());
    out.ptrs.push_back(v.data);
  }
  return out;
}

// (start, count, key) tuples as chunk spans; `fn` names the caller in errors.
std::vector<ChunkSpan> chunk_spans(const py::list& chunks, const std::string& fn) {
  std::vector<ChunkSpan> out;
  for (const py::handle item : chunks) {
    const auto t = item.cast<py::tuple>();
    KDN_CHECK_INPUT(t.size() == 3, fn + ": each chunk is (start, count, key)");
    out.push_back({t[0].cast<int64_t>(), t[1].cast<int64_t>(), key_arg(t[2], "key")});
  }
  return out;
}

// The paged copies of one paged_copy_* call: each (chunk, start, position, count) of `copies` checked,
// then all run with the GIL released once (kdn/paged.h).
void paged_copies(const std::string& fn, DeviceType device, const py::sequence& layers,
                  const py::array_t<int64_t, py::array::c_style>& block_ids, const py::list& copies, bool to_chunk,
                  const py::object& layout, uintptr_t stream) {
  PagedLayers paged = paged_layers(layers, layout, device);
  KDN_CHECK_INPUT(block_ids.ndim() == 1, fn + ": block_ids must be 1-D");
  std::vector<HeldView> chunks;
  std::vector<PagedCopy> todo;
  for (const py::handle item : copies) {
    const auto t = item.cast<py::tuple>();
    KDN_CHECK_INPUT(t.size() == 4, fn + ": each copy is (chunk, start, position, count)");
    chunks.push_back(view_from_object(t[0], "chunk"));
    const TensorView& v = chunks.back().view;
    KDN_CHECK_INPUT(v.device == device && v.is_contiguous() && v.writable && v.dtype == paged.dtype && v.ndim == 5 &&
                        v.shape[0] == paged.layout.layers && v.shape[1] == 2 && v.shape[3] == paged.layout.kv_heads &&
                        v.shape[4] == paged.layout.head_dim,
                    fn + ": chunk must be a contiguous writable tensor [layers, 2, tokens, kv_heads, head_dim] "
                         "on the blocks' device in their dtype, got " + v.shape_str());
    const auto from = t[1].cast<int64_t>(), position = t[2].cast<int64_t>(), count = t[3].cast<int64_t>();
    KDN_CHECK_INPUT(from >= 0 && count >= 0 && from + count <= v.shape[2] && position >= 0,
                    fn + ": token range outside the chunk");
    todo.push_back({KvShape{paged.layout.layers, v.shape[2], paged.layout.kv_heads, paged.layout.head_dim}, v.data,
                    from, position, count});
  }
  const CopyDirection dir = to_chunk ? CopyDirection::kCacheToChunk : CopyDirection::kChunkToCache;
  const int64_t elem = dtype_size(paged.dtype);
  Status st;
  {
    py::gil_scoped_release release;
    if (device == DeviceType::kCUDA)
      st = paged_copy_many_cuda(paged.layout, paged.ptrs.data(), block_ids.data(), block_ids.shape(0), todo, elem,
                                dir, stream);
    else
      for (const PagedCopy& c : todo)
        paged_copy_cpu(c.chunk_shape, paged.layout, paged.ptrs.data(), block_ids.data(), block_ids.shape(0), c.chunk,
                       elem, c.from, c.position, c.count, dir, default_num_threads());
  }
  if (!st.ok) throw Error(fn + ": " + st.message, __FILE__, __LINE__);
}

DType dtype_arg(const std::string& dtype) {
  if (dtype == "float16") return DType::kFloat16;
  if (dtype == "bfloat16") return DType::kBFloat16;
  KDN_CHECK_INPUT(dtype == "float32", "unsupported dtype " + dtype);
  return DType::kFloat32;
}

std::vector<ChunkBytes> chunk_bytes(const py::list& blobs, std::vector<ByteSpan>* keep) {
  std::vector<ChunkBytes> out;
  for (size_t i = 0; i < py::len(blobs); ++i) {
    keep->push_back(bytes_from_object(blobs[i], "blob"));
    Buffer* buffer = py::isinstance<Buffer>(blobs[i]) ? &blobs[i].cast<Buffer&>() : nullptr;
    out.push_back(ChunkBytes{keep->back().data, keep->back().size, buffer});
  }
  return out;
}

}  // namespace

void bind_kv(py::module_& m) {
  m.def(
      "pack_chunk",
      [](const py::sequence& kv, int64_t start, int64_t count, py::handle fingerprint, py::handle key,
         int64_t position) {
        KvViews v = kv_views(kv, false);
        KDN_CHECK_INPUT(v.device == DeviceType::kCPU, "pack_chunk: tensors must be on the CPU (move them, or use the CUDA copy)");
        const Key128 fp = key_arg(fingerprint, "fingerprint"), k = key_arg(key, "key");
        py::gil_scoped_release release;
        return pack_chunk(KvShape{v.layers, v.seq, v.heads, v.dim}, v.table(), v.dtype, start, count, fp, k,
                          default_num_threads(), position);
      },
      py::arg("kv"), py::arg("start"), py::arg("count"), py::arg("fingerprint"), py::arg("key"),
      py::arg("position") = -1,
      "Pack tokens [start, start+count) of a per-layer KV list into one raw blob at sequence position "
      "`position` (default: start; a list that begins later in the sequence names where).");

  m.def(
      "pack_chunks",
      [](const py::sequence& kv, const py::list& chunks, py::handle fingerprint, int64_t first) {
        KvViews v = kv_views(kv, false);
        KDN_CHECK_INPUT(v.device == DeviceType::kCPU, "pack_chunks: tensors must be on the CPU");
        const Key128 fp = key_arg(fingerprint, "fingerprint");
        const std::vector<ChunkSpan> todo = chunk_spans(chunks, "pack_chunks");
        // one release for every chunk: a thread that takes the GIL back once per chunk waits a
        // switch interval (5 ms) each time while another thread runs Python (vLLM's engine loop)
        py::gil_scoped_release release;
        return pack_chunks(KvShape{v.layers, v.seq, v.heads, v.dim}, v.table(), v.dtype, todo, fp, first,
                           default_num_threads());
      },
      py::arg("kv"), py::arg("chunks"), py::arg("fingerprint"), py::arg("first") = 0,
      "Sealed raw blobs of `chunks` ((start, count, key) each: sequence positions [start, start + count)) of a\n"
      "per-layer KV list holding positions [first, ...): pack_chunk for each, in one call.");

  m.def(
      "verify_chunks",
      [](const py::list& blobs, const py::list& keys, py::handle fingerprint, const std::string& dtype,
         uint32_t layers, uint32_t kv_heads, uint32_t head_dim, uint32_t chunk_tokens, uint32_t last_tokens,
         uint32_t first_chunk) {
        KDN_CHECK_INPUT(py::len(blobs) == py::len(keys), "verify_chunks: blobs and keys differ in length");
        const ChunkExpect e{key_arg(fingerprint, "fingerprint"), dtype_arg(dtype), layers, kv_heads, head_dim,
                            chunk_tokens};
        std::vector<ByteSpan> keep;
        const std::vector<ChunkBytes> spans = chunk_bytes(blobs, &keep);
        std::vector<Key128> ks;
        for (size_t i = 0; i < py::len(keys); ++i) ks.push_back(key_arg(keys[i], "key"));
        std::string error;
        int64_t n_ok;
        {
          py::gil_scoped_release release;
          n_ok = verify_chunks(spans, ks, e, last_tokens, default_num_threads(), &error, first_chunk);
        }
        return py::make_tuple(py::int_(n_ok), error);
      },
      py::arg("blobs"), py::arg("keys"), py::arg("fingerprint"), py::arg("dtype"), py::arg("layers"),
      py::arg("kv_heads"), py::arg("head_dim"), py::arg("chunk_tokens"), py::arg("last_tokens") = 0,
      py::arg("first_chunk") = 0,
      "Validate consecutive prefix-chunk blobs, the first being chunk `first_chunk` of its prefix (the last\n"
      "holding `last_tokens` when not 0); returns (number of leading valid blobs, first error).");

  m.def(
      "unpack_chunks_paged",
      [](const py::list& blobs, const py::sequence& layers, py::array_t<int64_t, py::array::c_style> block_ids,
         int64_t from, int64_t count, int64_t first_layer, int64_t total_layers, const py::object& layout) {
        PagedLayers paged = paged_layers(layers, layout);
        KDN_CHECK_INPUT(block_ids.ndim() == 1, "unpack_chunks_paged: block_ids must be 1-D");
        std::vector<ByteSpan> keep;
        const std::vector<ChunkBytes> spans = chunk_bytes(blobs, &keep);
        py::gil_scoped_release release;
        unpack_chunks_paged(spans, paged.layout, paged.ptrs.data(), block_ids.data(), block_ids.shape(0), paged.dtype,
                            from, count, default_num_threads(), first_layer, total_layers);
      },
      py::arg("blobs"), py::arg("layers"), py::arg("block_ids"), py::arg("start"), py::arg("count"),
      py::arg("first_layer") = 0, py::arg("total_layers") = -1, py::arg("layout") = py::none(),
      "Copy tokens [start, count) of consecutive blobs into an engine's paged CPU KV blocks (`layout`: a strides\n"
      "dict, None for vLLM's CPU 'vec' layout; kdn/paged.h); `layers` may hold layers [first_layer, ...) of the\n"
      "blobs' `total_layers` only (layer-wise delivery).");

  m.def(
      "unpack_chunks_paged_runs",
      [](const py::list& blobs, const py::sequence& layers, const py::list& runs, int64_t count, int64_t total_layers,
         const py::object& layout) {
        // one call, the GIL released once, for every run (a thread that waits for the GIL once per run
        // waits a switch interval each time while another thread runs Python)
        std::vector<PagedLayers> paged;
        std::vector<py::array_t<int64_t, py::array::c_style | py::array::forcecast>> tables;
        std::vector<std::pair<int64_t, int64_t>> firsts;  // (first layer, first position) per run
        for (const py::handle run : runs) {
          const py::tuple r = run.cast<py::tuple>();
          KDN_CHECK_INPUT(r.size() == 4, "unpack_chunks_paged_runs: each run is (first, end, block_ids, start)");
          const int64_t lo = r[0].cast<int64_t>(), hi = r[1].cast<int64_t>();
          KDN_CHECK_INPUT(0 <= lo && lo < hi && hi <= static_cast<int64_t>(py::len(layers)),
                          "unpack_chunks_paged_runs: a run's layers are outside the layers given");
          py::list sub;
          for (int64_t i = lo; i < hi; ++i) sub.append(layers[static_cast<size_t>(i)]);
          paged.push_back(paged_layers(sub, layout));
          tables.push_back(r[2].cast<py::array_t<int64_t, py::array::c_style | py::array::forcecast>>());
          KDN_CHECK_INPUT(tables.back().ndim() == 1, "unpack_chunks_paged_runs: block_ids must be 1-D");
          firsts.emplace_back(lo, r[3].cast<int64_t>());
        }
        std::vector<ByteSpan> keep;
        const std::vector<ChunkBytes> spans = chunk_bytes(blobs, &keep);
        py::gil_scoped_release release;
        for (size_t i = 0; i < paged.size(); ++i) {
          if (firsts[i].second >= count) continue;
          unpack_chunks_paged(spans, paged[i].layout, paged[i].ptrs.data(), tables[i].data(), tables[i].shape(0),
                              paged[i].dtype, firsts[i].second, count, default_num_threads(), firsts[i].first,
                              total_layers);
        }
      },
      py::arg("blobs"), py::arg("layers"), py::arg("runs"), py::arg("count"), py::arg("total_layers"),
      py::arg("layout") = py::none(),
      "unpack_chunks_paged over runs of consecutive layers, each with its own block table and first position\n"
      "(`runs`: (first layer, end layer, block_ids, start); an engine's KV cache groups), in one call.");

  m.def(
      "gather_paged",
      [](const py::sequence& layers, py::array_t<int64_t, py::array::c_style> block_ids, py::handle out,
         const py::object& layout) {
        PagedLayers paged = paged_layers(layers, layout);
        HeldView dst = view_from_object(out, "out");
        const TensorView& v = dst.view;
        KDN_CHECK_INPUT(v.device == DeviceType::kCPU && v.is_contiguous() && v.writable && v.dtype == paged.dtype &&
                            v.ndim == 5 && v.shape[0] == paged.layout.layers && v.shape[1] == 2 &&
                            v.shape[3] == paged.layout.kv_heads && v.shape[4] == paged.layout.head_dim,
                        "gather_paged: out must be a contiguous CPU tensor [layers, 2, tokens, kv_heads, head_dim] "
                        "in the layers' dtype, got " + v.shape_str());
        KDN_CHECK_INPUT(block_ids.ndim() == 1, "gather_paged: block_ids must be 1-D");
        const KvShape shape{paged.layout.layers, v.shape[2], paged.layout.kv_heads, paged.layout.head_dim};
        py::gil_scoped_release release;
        paged_copy_cpu(shape, paged.layout, paged.ptrs.data(), block_ids.data(), block_ids.shape(0), v.data,
                       dtype_size(paged.dtype), 0, 0, shape.tokens, CopyDirection::kCacheToChunk, default_num_threads());
      },
      py::arg("layers"), py::arg("block_ids"), py::arg("out"), py::arg("layout") = py::none(),
      "Copy a request's first out.shape[2] tokens out of an engine's paged CPU KV blocks (`layout` as in\n"
      "unpack_chunks_paged) into a canonical chunk `out`.");

  m.def(
      "pack_chunks_paged",
      [](const py::sequence& layers, py::array_t<int64_t, py::array::c_style> block_ids, const py::list& chunks,
         py::handle fingerprint, const py::object& layout) {
        PagedLayers paged = paged_layers(layers, layout);
        KDN_CHECK_INPUT(block_ids.ndim() == 1, "pack_chunks_paged: block_ids must be 1-D");
        const Key128 fp = key_arg(fingerprint, "fingerprint");
        const std::vector<ChunkSpan> todo = chunk_spans(chunks, "pack_chunks_paged");
        py::gil_scoped_release release;
        return pack_chunks_paged(paged.layout, paged.ptrs.data(), block_ids.data(), block_ids.shape(0), paged.dtype,
                                 todo, fp, default_num_threads());
      },
      py::arg("layers"), py::arg("block_ids"), py::arg("chunks"), py::arg("fingerprint"), py::arg("layout") = py::none(),
      "Sealed raw blobs of `chunks` ((start, count, key) each: sequence positions [start, start + count)) gathered\n"
      "straight out of an engine's paged CPU KV blocks (`layout` as in unpack_chunks_paged): one copy per chunk.");

  m.def(
      "decode_chunks",
      [](const py::list& blobs, py::handle out) {
        HeldView dst = view_from_object(out, "out");
        KDN_CHECK_INPUT(dst.view.device == DeviceType::kCPU && dst.view.is_contiguous() && dst.view.writable,
                        "decode_chunks: out must be a contiguous writable CPU tensor or array");
        std::vector<ByteSpan> keep;
        const std::vector<ChunkBytes> spans = chunk_bytes(blobs, &keep);
        const size_t bytes = static_cast<size_t>(dst.view.numel()) * dtype_size(dst.view.dtype);
        py::gil_scoped_release release;
        decode_chunks(spans, static_cast<uint8_t*>(dst.view.data), bytes, default_num_threads());
      },
      py::arg("blobs"), py::arg("out"),
      "Write the canonical (raw) bytes of each blob, one after the other, into `out` (coded blobs decoded).");

  m.def(
      "upload_raw_chunks_cuda",
      [](const py::list& blobs, py::handle out, uintptr_t stream) {
        HeldView dst = view_from_object(out, "out");
        KDN_CHECK_INPUT(dst.view.device == DeviceType::kCUDA && dst.view.is_contiguous() && dst.view.writable,
                        "upload_raw_chunks_cuda: out must be a contiguous writable CUDA tensor");
        std::vector<ByteSpan> keep;
        const std::vector<ChunkBytes> spans = chunk_bytes(blobs, &keep);
        std::vector<uint64_t> offsets;
        uint64_t at = 0;
        for (size_t i = 0; i < spans.size(); ++i) {
          BlobHeader h;
          const Status st = blob_parse_header(spans[i].data, spans[i].size, &h);
          if (!st.ok) throw BlobError("upload_raw_chunks_cuda: blob " + std::to_string(i) + ": " + st.message, __FILE__, __LINE__);
          offsets.push_back(at);
          at += raw_payload_bytes(h);
        }
        KDN_CHECK_INPUT(at == static_cast<uint64_t>(dst.view.numel()) * dtype_size(dst.view.dtype),
                        "upload_raw_chunks_cuda: out holds " + std::to_string(dst.view.numel() * dtype_size(dst.view.dtype)) +
                            " bytes, the chunks " + std::to_string(at));
        std::vector<uint8_t> uploaded;
        Status st;
        {
          py::gil_scoped_release release;
          st = upload_raw_chunks_cuda(spans, offsets, dst.view.data, stream, &uploaded);
        }
        if (!st.ok) throw BlobError(st.message, __FILE__, __LINE__);
        return std::vector<bool>(uploaded.begin(), uploaded.end());
      },
      py::arg("blobs"), py::arg("out"), py::arg("stream") = 0,
      "The CUDA twin of decode_chunks for raw blobs in page-locked memory: each such blob's payload is copied to its\n"
      "place in the device tensor `out` (the blobs' canonical bytes back to back) by one asynchronous DMA on `stream`\n"
      "(the blobs must outlive it); returns which blobs were (coded or pageable ones are left to the caller).");
  m.def(
      "host_memory_locked", [](py::handle obj) { return host_memory_locked(bytes_from_object(obj, "obj").data); },
      py::arg("obj"), "Whether the bytes of `obj` (a Buffer, bytes, an array) are page-locked for the device.");

  m.def(
      "pack_pointer",
      [](py::handle fingerprint, py::handle key, py::handle target, uint32_t position, py::array_t<uint32_t> tokens) {
        KDN_CHECK_INPUT(tokens.ndim() == 1, "pack_pointer: tokens must be 1-D");
        const auto t = tokens.unchecked<1>();
        std::vector<uint32_t> ids(t.data(0), t.data(0) + t.shape(0));
        return pack_pointer(key_arg(fingerprint, "fingerprint"), key_arg(key, "key"), key_arg(target, "target"),
                            position, ids.data(), static_cast<int64_t>(ids.size()));
      },
      py::arg("fingerprint"), py::arg("key"), py::arg("target"), py::arg("position"), py::arg("tokens"),
      "A sealed pointer blob, filed under `key`, to the chunk keyed `target` holding `tokens` from `position`.");
  m.def(
      "read_pointer",
      [](py::handle blob, py::handle fingerprint, py::handle key) {
        std::vector<ByteSpan> keep;
        py::list one;
        one.append(blob);
        const ChunkBytes bytes = chunk_bytes(one, &keep)[0];
        Pointer p;
        const Status st = read_pointer(bytes, key_arg(fingerprint, "fingerprint"), key_arg(key, "key"), &p);
        if (!st.ok) throw BlobError("pointer: " + st.message, __FILE__, __LINE__);
        py::array_t<uint32_t> tokens(static_cast<py::ssize_t>(p.tokens.size()));
        std::copy(p.tokens.begin(), p.tokens.end(), tokens.mutable_data());
        return py::make_tuple(py::bytes(reinterpret_cast<const char*>(p.target.data()), 16), p.position, tokens);
      },
      py::arg("blob"), py::arg("fingerprint"), py::arg("key"),
      "(target key, position, tokens) of a verified pointer blob; BlobError if it is damaged or not this one.");

  m.def(
      "unpack_chunks",
      [](const py::list& blobs, const py::sequence& kv, int64_t count, int64_t first_layer, int64_t layers) {
        KvViews v = kv_views(kv, true);
        KDN_CHECK_INPUT(v.device == DeviceType::kCPU, "unpack_chunks: tensors must be on the CPU");
        std::vector<ByteSpan> keep;
        const std::vector<ChunkBytes> spans = chunk_bytes(blobs, &keep);
        py::gil_scoped_release release;
        unpack_chunks(spans, KvShape{v.layers, v.seq, v.heads, v.dim}, v.table(), v.dtype, count,
                      default_num_threads(), first_layer, layers);
      },
      py::arg("blobs"), py::arg("kv"), py::arg("count"), py::arg("first_layer") = 0, py::arg("layers") = -1,
      "Copy the first `count` tokens held by consecutive blobs into per-layer KV tensors; `kv` may hold\n"
      "layers [first_layer, ...) of the blobs' `layers` only (layer-wise delivery; only those planes are read).");

  // paged_copy_cpu / paged_copy_cuda: a canonical chunk tensor <-> an engine's paged blocks (any layout
  // given as strides, kdn/paged.h); the same checks, then the CPU oracle or its CUDA twin. The
  // paged_copy_chunks_* forms take many chunks in one call (a load's): one GIL release, one wait.
  for (const DeviceType device : {DeviceType::kCPU, DeviceType::kCUDA}) {
    const bool cuda = device == DeviceType::kCUDA;
    const char* one = cuda ? "paged_copy_cuda" : "paged_copy_cpu";
    const char* many = cuda ? "paged_copy_chunks_cuda" : "paged_copy_chunks_cpu";
    m.def(
        one,
        [one, device](const py::sequence& layers, py::array_t<int64_t, py::array::c_style> block_ids,
                      py::handle chunk, int64_t from, int64_t position, int64_t count, bool to_chunk,
                      const py::object& layout, uintptr_t stream) {
          py::list copies;
          copies.append(py::make_tuple(chunk, from, position, count));
          paged_copies(one, device, layers, block_ids, copies, to_chunk, layout, stream);
        },
        py::arg("layers"), py::arg("block_ids"), py::arg("chunk"), py::arg("start"), py::arg("position"),
        py::arg("count"), py::arg("to_chunk"), py::arg("layout") = py::none(), py::arg("stream") = 0,
        cuda ? "CUDA twin of paged_copy_cpu: blocks and chunk on the device, block_ids on the host (uploaded);\n"
               "stream: cudaStream_t as an int. Returns once the copy has run."
             : "CPU copy of chunk tokens [start, start + count) <-> sequence positions [position, ...) of paged\n"
               "blocks (`layout`: a strides dict, None for vLLM's CPU 'vec'; the oracle of paged_copy_cuda).");
    m.def(
        many,
        [many, device](const py::sequence& layers, py::array_t<int64_t, py::array::c_style> block_ids,
                       const py::list& copies, bool to_chunk, const py::object& layout, uintptr_t stream) {
          paged_copies(many, device, layers, block_ids, copies, to_chunk, layout, stream);
        },
        py::arg("layers"), py::arg("block_ids"), py::arg("copies"), py::arg("to_chunk"),
        py::arg("layout") = py::none(), py::arg("stream") = 0,
        "paged_copy_* of each (chunk, start, position, count) in `copies`, in one call: the GIL released\n"
        "once (a thread taking it back once per chunk waits a switch interval each time while another\n"
        "runs Python) and, on CUDA, the layer pointers and block ids uploaded once, one wait at the end.");
  }

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
          Status st;
          {
            py::gil_scoped_release release;
            if (cuda)
              st = kv_copy_cuda(shape, v.table(), c.view.data, dtype_size(v.dtype), cache_start, count, dir, stream);
            else
              kv_copy_cpu(shape, v.table(), c.view.data, dtype_size(v.dtype), cache_start, count, dir,
                          default_num_threads());
          }
          if (!st.ok) throw Error(fn + ": " + st.message, __FILE__, __LINE__);
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
