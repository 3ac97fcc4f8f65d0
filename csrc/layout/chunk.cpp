// Pack, verify and unpack KV chunks (kdn/chunk.h).
#include "kdn/chunk.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "kdn/codec.h"
#include "kdn/kv_copy.h"
#include "kdn/parallel.h"

namespace kdn {

namespace {

// An unsealed raw chunk blob for tokens [start, start + count) of a model's KV: its header written,
// its payload (canonical [layers, 2, count, kv_heads, head_dim]) for the caller to fill.
BufferPtr new_chunk_blob(int64_t layers, int64_t kv_heads, int64_t head_dim, DType dtype, int64_t start,
                         int64_t count, const Key128& fingerprint, const Key128& key) {
  BlobHeader h;
  h.dtype = dtype;
  h.layers = static_cast<uint32_t>(layers);
  h.kv_heads = static_cast<uint32_t>(kv_heads);
  h.head_dim = static_cast<uint32_t>(head_dim);
  h.tokens = static_cast<uint32_t>(count);
  h.position = static_cast<uint32_t>(start);
  h.fingerprint = fingerprint;
  h.key = key;
  h.payload_bytes = raw_payload_bytes(h);
  KDN_CHECK_INPUT(h.payload_bytes > 0, "pack_chunk: dimensions out of range");
  auto blob = std::make_shared<Buffer>(blob_total_bytes(h));
  blob_write_header(h, blob->data());
  return blob;
}

BufferPtr sealed(BufferPtr blob) {
  blob_seal(blob->data(), blob->size());
  blob->mark_verified();
  return blob;
}

}  // namespace

BufferPtr pack_chunk(const KvShape& shape, const KvTable& table, DType dtype, int64_t start, int64_t count,
                     const Key128& fingerprint, const Key128& key, int threads, int64_t position) {
  KDN_CHECK_INPUT(start >= 0 && count > 0 && start + count <= shape.tokens,
                  "pack_chunk: tokens [" + std::to_string(start) + ", " + std::to_string(start + count) +
                      ") are outside the cache (" + std::to_string(shape.tokens) + " tokens)");
  KDN_CHECK_INPUT(position >= -1, "pack_chunk: position " + std::to_string(position) + " is negative");
  BufferPtr blob = new_chunk_blob(shape.layers, shape.kv_heads, shape.head_dim, dtype, position < 0 ? start : position,
                                  count, fingerprint, key);
  const KvShape chunk{shape.layers, count, shape.kv_heads, shape.head_dim};
  kv_copy_cpu(chunk, table, blob->data() + kBlobHeaderBytes, dtype_size(dtype), start, count,
              CopyDirection::kCacheToChunk, threads);
  return sealed(std::move(blob));
}

BufferPtr pack_chunk_paged(const PagedLayout& paged, void* const* layers, const int64_t* block_ids,
                           int64_t num_block_ids, DType dtype, int64_t start, int64_t count, const Key128& fingerprint,
                           const Key128& key, int threads) {
  KDN_CHECK_INPUT(start >= 0 && count > 0, "pack_chunk_paged: tokens [" + std::to_string(start) + ", " +
                                               std::to_string(start + count) + ") is not a range of positions");
  BufferPtr blob = new_chunk_blob(paged.layers, paged.kv_heads, paged.head_dim, dtype, start, count, fingerprint, key);
  const KvShape chunk{paged.layers, count, paged.kv_heads, paged.head_dim};
  paged_copy_cpu(chunk, paged, layers, block_ids, num_block_ids, blob->data() + kBlobHeaderBytes, dtype_size(dtype),
                 0, start, count, CopyDirection::kCacheToChunk, threads);
  return sealed(std::move(blob));
}

namespace {

// Runs pack(i, inner_threads) for chunks [0, n): side by side when there are several (a chunk's copy
// and checksum on one thread), a lone chunk's rows over every thread.
template <typename Pack>
std::vector<BufferPtr> pack_each(size_t n, int threads, Pack pack) {
  std::vector<BufferPtr> out(n);
  const int inner = std::max<int>(1, threads / static_cast<int>(std::max<size_t>(n, 1)));
  parallel_for(static_cast<int64_t>(n), threads, [&](int64_t i) { out[i] = pack(i, inner); });
  return out;
}

}  // namespace

std::vector<BufferPtr> pack_chunks(const KvShape& shape, const KvTable& table, DType dtype,
                                   const std::vector<ChunkSpan>& chunks, const Key128& fingerprint, int64_t first,
                                   int threads) {
  KDN_CHECK_INPUT(first >= 0, "pack_chunks: first must be a sequence position");
  return pack_each(chunks.size(), threads, [&](int64_t i, int inner) {
    const ChunkSpan& c = chunks[i];
    return pack_chunk(shape, table, dtype, c.start - first, c.count, fingerprint, c.key, inner, c.start);
  });
}

std::vector<BufferPtr> pack_chunks_paged(const PagedLayout& paged, void* const* layers, const int64_t* block_ids,
                                         int64_t num_block_ids, DType dtype, const std::vector<ChunkSpan>& chunks,
                                         const Key128& fingerprint, int threads) {
  return pack_each(chunks.size(), threads, [&](int64_t i, int inner) {
    const ChunkSpan& c = chunks[i];
    return pack_chunk_paged(paged, layers, block_ids, num_block_ids, dtype, c.start, c.count, fingerprint, c.key,
                            inner);
  });
}

Status check_chunk_header(const BlobHeader& h, const ChunkExpect& e, const Key128& key, uint32_t position,
                          uint32_t tokens) {
  if (h.kind != kBlobKindKV) return Status::Fail("blob is not a KV chunk (kind " + std::to_string(h.kind) + ")");
  if (h.fingerprint != e.fingerprint) return Status::Fail("blob belongs to another model (fingerprint mismatch)");
  if (h.key != key) return Status::Fail("blob was stored under another key");
  if (h.dtype != e.dtype)
    return Status::Fail(std::string("blob dtype ") + dtype_name(h.dtype) + " != model dtype " + dtype_name(e.dtype));
  if (h.layers != e.layers || h.kv_heads != e.kv_heads || h.head_dim != e.head_dim)
    return Status::Fail("blob layout [" + std::to_string(h.layers) + " layers, " + std::to_string(h.kv_heads) +
                        " heads, " + std::to_string(h.head_dim) + " dim] does not match the model");
  if (h.tokens != tokens)
    return Status::Fail("blob holds " + std::to_string(h.tokens) + " tokens, expected " + std::to_string(tokens));
  if (h.position != position)
    return Status::Fail("blob position " + std::to_string(h.position) + " != " + std::to_string(position));
  return Status::Ok();
}

int64_t verify_chunks(const std::vector<ChunkBytes>& blobs, const std::vector<Key128>& keys, const ChunkExpect& e,
                      uint32_t last_tokens, int threads, std::string* error, uint32_t first_chunk) {
  KDN_CHECK_INPUT(blobs.size() == keys.size(), "verify_chunks: blobs and keys differ in length");
  KDN_CHECK_INPUT(last_tokens <= e.chunk_tokens, "verify_chunks: last_tokens exceeds chunk_tokens");
  const int64_t last = static_cast<int64_t>(blobs.size()) - 1;
  std::vector<Status> status(blobs.size());
  parallel_for(static_cast<int64_t>(blobs.size()), threads, [&](int64_t i) {
    BlobHeader h;
    const bool hash = !(blobs[i].buffer && blobs[i].buffer->verified());
    status[i] = blob_parse(blobs[i].data, blobs[i].size, hash, &h);
    if (status[i].ok && hash && blobs[i].buffer) blobs[i].buffer->mark_verified();
    const uint32_t tokens = i == last && last_tokens ? last_tokens : e.chunk_tokens;
    if (status[i].ok)
      status[i] = check_chunk_header(h, e, keys[i], static_cast<uint32_t>((first_chunk + i) * e.chunk_tokens), tokens);
  });
  for (size_t i = 0; i < status.size(); ++i) {
    if (!status[i].ok) {
      *error = "chunk " + std::to_string(first_chunk + i) + ": " + status[i].message;
      return static_cast<int64_t>(i);
    }
  }
  error->clear();
  return static_cast<int64_t>(status.size());
}

namespace {

// The one loop under unpack_chunks and unpack_chunks_paged: checks every blob's header against the
// destination before anything is written, then decodes (when coded) layers [first_layer,
// first_layer + layers) of each blob that holds tokens of [from, count) of the run and hands them to
// place(chunk, chunk_shape, token_in_chunk, position, n).
template <typename Place>
void for_each_chunk(const char* what, const std::vector<ChunkBytes>& blobs, DType dtype, int64_t layers,
                    int64_t kv_heads, int64_t head_dim, int64_t first_layer, int64_t total_layers, int64_t from,
                    int64_t count, int threads, Place place) {
  const std::string name(what);
  KDN_CHECK_INPUT(from >= 0 && from <= count, name + ": bad token range");
  KDN_CHECK_INPUT(first_layer >= 0 && layers > 0 && first_layer + layers <= total_layers, name + ": bad layer range");
  std::vector<BlobHeader> headers(blobs.size());
  int64_t available = 0;
  for (size_t i = 0; i < blobs.size(); ++i) {
    Status st = blob_parse(blobs[i].data, blobs[i].size, false, &headers[i]);
    if (!st.ok) throw BlobError(st.message, __FILE__, __LINE__);
    const BlobHeader& h = headers[i];
    KDN_CHECK_INPUT(h.kind == kBlobKindKV && h.dtype == dtype && h.layers == total_layers && h.kv_heads == kv_heads &&
                        h.head_dim == head_dim,
                    name + ": blob " + std::to_string(i) + " layout does not match the destination");
    available += h.tokens;
  }
  KDN_CHECK_INPUT(available >= count, name + ": blobs hold " + std::to_string(available) + " tokens, fewer than count=" +
                                          std::to_string(count));
  const int64_t first = 2 * first_layer, last = 2 * (first_layer + layers);
  int64_t start = 0;  // sequence position of blob i's first token; chunks run in order, each copy in parallel
  for (size_t i = 0; i < blobs.size() && start < count; start += headers[i].tokens, ++i) {
    const BlobHeader& h = headers[i];
    const int64_t end = std::min<int64_t>(start + h.tokens, count);
    if (end <= from) continue;
    const size_t plane_raw = raw_payload_bytes(h) / (2 * h.layers);
    uint8_t* chunk = const_cast<uint8_t*>(blobs[i].data) + kBlobHeaderBytes + first * plane_raw;
    BufferPtr decoded;  // coded blobs are decoded into a pooled buffer, then copied like raw ones
    if (h.codec != kCodecRaw) {
      decoded = std::make_shared<Buffer>((last - first) * plane_raw);
      Status st = codec_decode_planes(h, blobs[i].data + kBlobHeaderBytes, h.payload_bytes, decoded->data(), first,
                                      last, threads);
      if (!st.ok) throw BlobError(name + ": blob " + std::to_string(i) + ": " + st.message, __FILE__, __LINE__);
      chunk = decoded->data();
    }
    const int64_t position = std::max(from, start);
    place(chunk, KvShape{layers, h.tokens, kv_heads, head_dim}, position - start, position, end - position);
  }
}

}  // namespace

void unpack_chunks(const std::vector<ChunkBytes>& blobs, const KvShape& shape, const KvTable& table, DType dtype,
                   int64_t count, int threads, int64_t first_layer, int64_t total_layers) {
  if (total_layers < 0) total_layers = shape.layers;
  KDN_CHECK_INPUT(count >= 0 && count <= shape.tokens, "unpack_chunks: count exceeds the destination length");
  for_each_chunk("unpack_chunks", blobs, dtype, shape.layers, shape.kv_heads, shape.head_dim, first_layer, total_layers,
                 0, count, threads, [&](uint8_t* chunk, const KvShape& chunk_shape, int64_t, int64_t position, int64_t n) {
                   // from = 0: every chunk is copied from its first token
                   kv_copy_cpu(chunk_shape, table, chunk, dtype_size(dtype), position, n, CopyDirection::kChunkToCache,
                               threads);
                 });
}

void unpack_chunks_paged(const std::vector<ChunkBytes>& blobs, const PagedLayout& paged, void* const* layers,
                         const int64_t* block_ids, int64_t num_block_ids, DType dtype, int64_t from, int64_t count,
                         int threads, int64_t first_layer, int64_t total_layers) {
  if (total_layers < 0) total_layers = paged.layers;
  for_each_chunk("unpack_chunks_paged", blobs, dtype, paged.layers, paged.kv_heads, paged.head_dim, first_layer,
                 total_layers, from, count, threads,
                 [&](uint8_t* chunk, const KvShape& chunk_shape, int64_t token, int64_t position, int64_t n) {
                   paged_copy_cpu(chunk_shape, paged, layers, block_ids, num_block_ids, chunk, dtype_size(dtype), token,
                                  position, n, CopyDirection::kChunkToCache, threads);
                 });
}

void decode_chunks(const std::vector<ChunkBytes>& blobs, uint8_t* out, size_t out_bytes, int threads) {
  std::vector<BlobHeader> headers(blobs.size());
  std::vector<size_t> offsets(blobs.size() + 1, 0);
  for (size_t i = 0; i < blobs.size(); ++i) {
    Status st = blob_parse(blobs[i].data, blobs[i].size, false, &headers[i]);
    if (!st.ok) throw BlobError(st.message, __FILE__, __LINE__);
    KDN_CHECK_INPUT(headers[i].kind == kBlobKindKV, "decode_chunks: blob " + std::to_string(i) + " is not KV");
    offsets[i + 1] = offsets[i] + raw_payload_bytes(headers[i]);
  }
  KDN_CHECK_INPUT(offsets.back() == out_bytes, "decode_chunks: out holds " + std::to_string(out_bytes) +
                                                   " bytes, the chunks " + std::to_string(offsets.back()));
  std::vector<Status> status(blobs.size());
  const int inner = std::max(1, threads / std::max<int>(1, static_cast<int>(blobs.size())));
  parallel_for(static_cast<int64_t>(blobs.size()), threads, [&](int64_t i) {
    const BlobHeader& h = headers[i];
    const uint8_t* payload = blobs[i].data + kBlobHeaderBytes;
    if (h.codec == kCodecRaw)
      std::memcpy(out + offsets[i], payload, h.payload_bytes);
    else
      status[i] = codec_decode(h, payload, h.payload_bytes, out + offsets[i], inner);
  });
  for (size_t i = 0; i < status.size(); ++i)
    if (!status[i].ok) throw BlobError("decode_chunks: blob " + std::to_string(i) + ": " + status[i].message, __FILE__, __LINE__);
}

BufferPtr pack_pointer(const Key128& fingerprint, const Key128& key, const Key128& target, uint32_t position,
                       const uint32_t* tokens, int64_t count) {
  BlobHeader h;
  h.kind = kBlobKindPointer;
  h.tokens = static_cast<uint32_t>(count);
  h.position = position;
  h.fingerprint = fingerprint;
  h.key = key;
  h.payload_bytes = raw_payload_bytes(h);
  KDN_CHECK_INPUT(count > 0 && h.payload_bytes > 0, "pack_pointer: bad token count " + std::to_string(count));
  auto blob = std::make_shared<Buffer>(blob_total_bytes(h));
  blob_write_header(h, blob->data());
  std::memcpy(blob->data() + kBlobHeaderBytes, target.data(), 16);
  std::memcpy(blob->data() + kBlobHeaderBytes + 16, tokens, static_cast<size_t>(count) * 4);
  blob_seal(blob->data(), blob->size());
  blob->mark_verified();
  return blob;
}

Status read_pointer(const ChunkBytes& blob, const Key128& fingerprint, const Key128& key, Pointer* out) {
  BlobHeader h;
  const bool hash = !(blob.buffer && blob.buffer->verified());
  Status st = blob_parse(blob.data, blob.size, hash, &h);
  if (!st.ok) return st;
  if (hash && blob.buffer) blob.buffer->mark_verified();
  if (h.kind != kBlobKindPointer) return Status::Fail("blob is not a pointer (kind " + std::to_string(h.kind) + ")");
  if (h.fingerprint != fingerprint) return Status::Fail("pointer belongs to another model (fingerprint mismatch)");
  if (h.key != key) return Status::Fail("pointer was stored under another key");
  const uint8_t* payload = blob.data + kBlobHeaderBytes;
  std::memcpy(out->target.data(), payload, 16);
  out->position = h.position;
  out->tokens.resize(h.tokens);
  std::memcpy(out->tokens.data(), payload + 16, size_t(h.tokens) * 4);
  return Status::Ok();
}

}  // namespace kdn
