// Chunks of a model's KV: pack per-layer tensors into a sealed raw blob, verify a run of prefix
// chunks against what a reader expects, and unpack (decoding coded chunks) into per-layer tensors.
// The product logic behind the pack_chunk / verify_chunks / unpack_chunks bindings.
#pragma once

#include <string>
#include <vector>

#include "kdn/blob.h"
#include "kdn/kv_layout.h"

namespace kdn {

// What a reader expects of every chunk of a prefix: model, layout, tokens per chunk.
struct ChunkExpect {
  Key128 fingerprint{};
  DType dtype = DType::kFloat32;
  uint32_t layers = 0, kv_heads = 0, head_dim = 0, chunk_tokens = 0;
};

// A blob's bytes and, when it is a kdn Buffer, the buffer (which remembers a verified checksum).
struct ChunkBytes {
  const uint8_t* data = nullptr;
  size_t size = 0;
  Buffer* buffer = nullptr;
};

// A sealed raw blob with tokens [start, start + count) of the per-layer tensors in `table`
// (shape.tokens = the tensors' length). Throws InputError for an out-of-range request.
BufferPtr pack_chunk(const KvShape& shape, const KvTable& table, DType dtype, int64_t start, int64_t count,
                     const Key128& fingerprint, const Key128& key, int threads);

// OK if a parsed header is chunk `position / chunk_tokens` of the expected model under `key`.
Status check_chunk_header(const BlobHeader& h, const ChunkExpect& e, const Key128& key, uint32_t position);

// Checks consecutive prefix chunks (parse, checksum unless already verified, header) in parallel.
// Returns the number of leading valid chunks; *error names the first invalid one.
int64_t verify_chunks(const std::vector<ChunkBytes>& blobs, const std::vector<Key128>& keys, const ChunkExpect& e,
                      int threads, std::string* error);

// Copies the first `count` tokens held by consecutive blobs (any codec: coded ones are decoded
// into a pooled buffer first) into the per-layer tensors of `table` (shape.tokens = their
// length). Throws BlobError for an undecodable payload, InputError for a layout mismatch.
void unpack_chunks(const std::vector<ChunkBytes>& blobs, const KvShape& shape, const KvTable& table, DType dtype,
                   int64_t count, int threads);

}  // namespace kdn
