// The one self-describing blob format of every tier: header + payload + checksums.
//
// Layout (little endian):
//   0  char[4]  magic "KDNB"          36 u8[16] model fingerprint
//   4  u16      format version (2)    52 u8[16] chunk key
//   6  u16      header bytes (80)     68 u64    payload bytes
//   8  u8       codec id (0 = raw)    76 u32    reserved (0)
//   9  u8       dtype (kdn::DType)    80 ...    payload
//  10  u16      kind (below)          end-8 u64 XXH64 of everything before it
//  12  u32      layers
//  16  u32      kv heads
//  20  u32      head dim
//  24  u32      tokens
//  28  u32      first position
//  32  u32      codec parameters (kdn/codec.h; 0 for raw)
//
// Trailer. Version 1: u64 XXH64 of everything before it. Version 2 (written since delivery
// streams layer groups): u64 XXH64 of each *section*, then u64 XXH64 of those section sums, so a
// reader that fetched only some layers verifies what it fetched. Section 0 is the header and the
// payload's plane-size table (coded KV: u32 per plane, kdn/codec.h; raw KV: none; a pointer: its
// whole payload); sections 1..2*layers are the planes (plane p = layer p/2, K if p is even, V if
// odd), the last one running to the payload's end. Readers accept both versions.
//
// Kinds: 0 = a KV chunk (payload: [layers, 2, tokens, kv_heads, head_dim] in `dtype`, or coded);
// 1 = a pointer (raw; layers, kv heads and head dim 0; payload: the 16-byte key of a stored
// chunk, then its `tokens` token ids as u32; see kdn/chunk.h); 2 = a codec calibration (raw; all
// dimensions 0; payload: a model's kvtc calibration, kdn/kvtc.h); 3 = an edit's sidecar (raw; all
// dimensions 0; payload: bytes an edit keeps beside the KV, e.g. steering's emphasized tokens,
// kdn/edits in Python). Readers of format 1 that predate kinds 1-3 reject them (their dimensions
// are 0), so they never read as KV.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kdn/buffer_pool.h"
#include "kdn/common.h"
#include "kdn/hash.h"

namespace kdn {

constexpr uint16_t kBlobVersion = 2;      // written
constexpr uint16_t kBlobVersionMin = 1;   // still read
constexpr size_t kBlobHeaderBytes = 80;
constexpr size_t kBlobTrailerBytes = 8;
constexpr uint8_t kCodecRaw = 0;
constexpr uint16_t kBlobKindKV = 0;
constexpr uint16_t kBlobKindPointer = 1;
constexpr uint16_t kBlobKindCalibration = 2;
constexpr uint16_t kBlobKindSidecar = 3;

struct BlobHeader {
  uint16_t version = kBlobVersion;
  uint16_t kind = kBlobKindKV;
  uint8_t codec = kCodecRaw;
  uint32_t codec_params = 0;
  DType dtype = DType::kFloat32;
  uint32_t layers = 0;
  uint32_t kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t tokens = 0;
  uint32_t position = 0;
  Key128 fingerprint{};
  Key128 key{};
  uint64_t payload_bytes = 0;
};

// An immutable, reference-counted byte buffer (blobs are shared between the store and readers).
// Buffer::live_bytes() counts the bytes of all buffers alive in the process (memory accounting).
// Large buffers come from the buffer pool (kdn/buffer_pool.h) and return to it when freed.
class Buffer {
 public:
  explicit Buffer(size_t size, bool writable = false)  // not zeroed
      : data_(pool_acquire(size, &capacity_)), size_(size), writable_(writable) {
    live_.fetch_add(static_cast<int64_t>(size));
  }
  ~Buffer() {
    pool_release(data_, capacity_);
    live_.fetch_sub(static_cast<int64_t>(size_));
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  bool writable() const { return writable_; }  // blobs are not; host arrays for tensors are
  void freeze() { writable_ = false; }  // filled in place (e.g. decrypted into): read-only from now on
  // A blob whose checksum kdn has computed (sealed) or checked since its bytes last changed; its
  // readers may skip re-hashing it. Bytes that arrive from Python or a file start unverified.
  bool verified() const { return verified_.load(std::memory_order_acquire); }
  void mark_verified() { verified_.store(true, std::memory_order_release); }
  // A blob read in part (DiskStore::get with sections: the header, the sections asked for and the
  // trailer were read and verified, the rest of its bytes are not its own): for the one reader that
  // asked, never stored, kept or verified whole (every store refuses it).
  bool partial() const { return partial_; }
  void mark_partial() { partial_ = true; }
  static int64_t live_bytes() { return live_.load(); }

 private:
  size_t capacity_ = 0;
  uint8_t* data_;
  size_t size_;
  bool writable_;
  std::atomic<bool> verified_{false};
  bool partial_ = false;
  static inline std::atomic<int64_t> live_{0};
};
using BufferPtr = std::shared_ptr<Buffer>;

// Raw-codec payload size for a header (of either kind), or 0 if the dimensions overflow or are out of range.
uint64_t raw_payload_bytes(const BlobHeader& h);

// Writes the header into out[0, kBlobHeaderBytes).
void blob_write_header(const BlobHeader& h, uint8_t* out);

// Writes the checksum trailer of a complete blob of `size` bytes (its header says the version).
void blob_seal(uint8_t* blob, size_t size);

// A sealed raw blob of `kind` (calibration or sidecar: all dimensions 0) holding `size` bytes of
// `data`, filed under `key` for the model `fingerprint`.
BufferPtr pack_bytes_blob(uint16_t kind, const Key128& fingerprint, const Key128& key, const uint8_t* data,
                          size_t size);

// The payload of a raw blob of `kind` (checksum verified) filed under `key` for `fingerprint`:
// its offset and size in `blob`, or a failed Status naming why it is unusable.
Status read_bytes_blob(const uint8_t* blob, size_t size, uint16_t kind, const Key128& fingerprint,
                       const Key128& key, size_t* offset, size_t* bytes);

// Parses and validates a blob: bounds, magic, version, codec and its parameters, dims, sizes and
// (if verify_checksum) the checksum. Never reads outside [data, data+size). A raw payload must be
// exactly raw_payload_bytes; a coded one at most kMaxCodedRatio times that and at least
// 1/kMaxDecodedRatio of it (so a forged header cannot make a reader allocate without bound).
constexpr uint64_t kMaxCodedRatio = 4;
constexpr uint64_t kMaxDecodedRatio = 4096;
Status blob_parse(const uint8_t* data, size_t size, bool verify_checksum, BlobHeader* out);

// The header checks of blob_parse alone (data holds at least kBlobHeaderBytes): what a reader
// checks before it reads (or allocates for) the rest of a blob.
Status blob_parse_header(const uint8_t* data, size_t size, BlobHeader* out);

// Checksummed sections of a version-2 blob (0 for version 1): section 0, then one per plane.
inline uint64_t blob_sections(const BlobHeader& h) {
  return h.version < 2 ? 0 : h.kind == kBlobKindKV ? 1 + 2 * uint64_t(h.layers) : 1;
}

// Bytes after the payload: the section sums (version 2) and the final XXH64.
inline uint64_t blob_trailer_bytes(const BlobHeader& h) { return 8 * blob_sections(h) + kBlobTrailerBytes; }

// Total bytes of the blob that a parsed header describes.
inline uint64_t blob_total_bytes(const BlobHeader& h) { return kBlobHeaderBytes + h.payload_bytes + blob_trailer_bytes(h); }

// Byte ranges [begin, end) of the sections of a version-2 blob, from its header and, for a coded
// KV blob, the plane-size table at the start of `payload` (of which `available` bytes are at hand:
// at least the table). Never reads outside them: sizes that overrun the payload are clamped, so
// the sections of a malformed table still cover every byte exactly once (its decoder rejects it).
std::vector<std::pair<uint64_t, uint64_t>> blob_section_ranges(const BlobHeader& h, const uint8_t* payload,
                                                               uint64_t available);

// Bytes of a coded KV payload's plane-size table (0 for raw and pointers): what section 0 holds
// beyond the header.
inline uint64_t blob_table_bytes(const BlobHeader& h) {
  return h.kind == kBlobKindKV && h.codec != kCodecRaw ? 8 * uint64_t(h.layers) : 0;
}

// Verifies sections [first, last] of a version-2 blob held in `data` (the full blob's size; only
// the bytes of section 0, of the sections asked for and of the trailer need be valid): the
// trailer's final sum over the section sums, then each section's XXH64. Section 0 is always
// checked. A version-1 blob fails (it can only be verified whole).
Status blob_verify_sections(const uint8_t* data, size_t size, uint64_t first, uint64_t last);

}  // namespace kdn
