// Chunks of a model's KV: pack per-layer tensors into a sealed raw blob, verify a run of prefix
// chunks against what a reader expects, and unpack (decoding coded chunks) into per-layer tensors;
// and pointers, the small blobs that let a reader find a stored chunk sharing only some of its
// tokens (kdn/keys.h: probe_keys). The product logic behind the chunk bindings.
#pragma once

#include <string>
#include <vector>

#include "kdn/blob.h"
#include "kdn/kv_layout.h"
#include "kdn/paged.h"

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
// (shape.tokens = the tensors' length), at sequence position `position` (-1: `start`; the tensors
// may begin later in the sequence than position 0). Throws InputError for an out-of-range request.
BufferPtr pack_chunk(const KvShape& shape, const KvTable& table, DType dtype, int64_t start, int64_t count,
                     const Key128& fingerprint, const Key128& key, int threads, int64_t position = -1);

// The same, gathered straight out of an engine's paged KV blocks (kdn/paged.h): sequence positions
// [start, start + count) of the request whose blocks are `block_ids`. One copy, no intermediate
// tensor. Throws InputError when a position's block is outside block_ids.
BufferPtr pack_chunk_paged(const PagedLayout& paged, void* const* layers, const int64_t* block_ids,
                           int64_t num_block_ids, DType dtype, int64_t start, int64_t count, const Key128& fingerprint,
                           const Key128& key, int threads);

// One chunk of a store: sequence positions [start, start + count), filed under `key`.
struct ChunkSpan {
  int64_t start, count;
  Key128 key;
};

// pack_chunk for each of `chunks` (the tensors in `table` hold positions [first, ...)), or
// pack_chunk_paged for each when `paged` is given: several chunks side by side, one thread each
// (their checksums too), a single chunk's rows over `threads`.
std::vector<BufferPtr> pack_chunks(const KvShape& shape, const KvTable& table, DType dtype,
                                   const std::vector<ChunkSpan>& chunks, const Key128& fingerprint, int64_t first,
                                   int threads);
std::vector<BufferPtr> pack_chunks_paged(const PagedLayout& paged, void* const* layers, const int64_t* block_ids,
                                         int64_t num_block_ids, DType dtype, const std::vector<ChunkSpan>& chunks,
                                         const Key128& fingerprint, int threads);

// OK if a parsed header is a KV chunk of `tokens` tokens at `position` of the expected model under `key`.
Status check_chunk_header(const BlobHeader& h, const ChunkExpect& e, const Key128& key, uint32_t position,
                          uint32_t tokens);

// Checks consecutive prefix chunks (parse, checksum unless already verified, header) in parallel:
// chunk i sits at (first_chunk + i) * chunk_tokens (a prefix read from its chunk `first_chunk` on)
// and holds chunk_tokens tokens, except that the last holds `last_tokens` when that is not 0 (a
// chunk that ends a stored prompt). Returns the number of leading valid chunks; *error names the
// first invalid one.
int64_t verify_chunks(const std::vector<ChunkBytes>& blobs, const std::vector<Key128>& keys, const ChunkExpect& e,
                      uint32_t last_tokens, int threads, std::string* error, uint32_t first_chunk = 0);

// As unpack_chunks, into paged KV blocks (kdn/paged.h): tokens [from, count) of the run the blobs
// hold go to sequence positions [from, count) of the paged `layers`. Coded blobs are decoded first.
// `layers` may be layers [first_layer, first_layer + paged.layers) of the blobs' `total_layers`
// (-1: paged.layers) only: layer-wise delivery into a serving engine's blocks.
void unpack_chunks_paged(const std::vector<ChunkBytes>& blobs, const PagedLayout& paged, void* const* layers,
                         const int64_t* block_ids, int64_t num_block_ids, DType dtype, int64_t from, int64_t count,
                         int threads, int64_t first_layer = 0, int64_t total_layers = -1);

// Writes the canonical bytes ([layers, 2, tokens, kv_heads, head_dim], raw) of each blob, one
// after the other, into `out` (decoding coded ones), blobs in parallel: the host half of a copy to
// a device. `out_bytes` must equal the sum of their raw payload sizes. Throws BlobError for an
// undecodable payload.
void decode_chunks(const std::vector<ChunkBytes>& blobs, uint8_t* out, size_t out_bytes, int threads);

// A pointer to the chunk keyed `target` (tokens [position, position + count)), filed under `key`
// (one of the chunk's probe keys): a sealed blob of kind kBlobKindPointer holding the key and the
// chunk's tokens, so a reader can measure how many tokens it shares with its own.
BufferPtr pack_pointer(const Key128& fingerprint, const Key128& key, const Key128& target, uint32_t position,
                       const uint32_t* tokens, int64_t count);

struct Pointer {
  Key128 target{};
  uint32_t position = 0;
  std::vector<uint32_t> tokens;
};

// Parses and verifies (checksum, kind, model, key) a pointer blob. A pointer is trusted for nothing:
// a reader recomputes the target's key from its parent and the tokens (kdn/keys.h: chunk_key).
Status read_pointer(const ChunkBytes& blob, const Key128& fingerprint, const Key128& key, Pointer* out);

// Copies the first `count` tokens held by consecutive blobs (any codec: coded ones are decoded
// into a pooled buffer first) into the per-layer tensors of `table` (shape.tokens = their
// length). `table` holds layers [first_layer, first_layer + shape.layers) of the blobs'
// `total_layers` (-1: shape.layers) (layer-wise delivery unpacks one layer group at a time; only those planes are read, so the
// others may still be arriving). Throws BlobError for an undecodable payload, InputError for a
// layout mismatch.
void unpack_chunks(const std::vector<ChunkBytes>& blobs, const KvShape& shape, const KvTable& table, DType dtype,
                   int64_t count, int threads, int64_t first_layer = 0, int64_t total_layers = -1);

}  // namespace kdn
