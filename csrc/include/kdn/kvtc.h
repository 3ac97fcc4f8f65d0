// `kvtc` codec: KV transform coding (after KVTC, arXiv 2511.01815) under a per-model calibration.
//
// A calibration (fit once per model by kdn.kvtc.calibrate, stored as a blob of its own) gives each
// plane (layer, K or V) a mean, an orthonormal PCA basis sorted by variance, and for every offered
// compression ratio a quantization step per component chosen by dynamic programming (0: the
// component is not coded). A plane is coded as: token rows whose position is below `sink` or that
// are among the chunk's last `recent` rows kept exact; every other row x (keys first turned back to
// their pre-RoPE form when the calibration says so) projected to z = B (x - mean), z_i quantized
// to round(z_i / step_i), the integers rANS-coded under one of kCacheGenModels discrete Laplace
// models per component (a 1-byte choice each). Decoding is x = mean + sum_i q_i step_i B_i (then
// re-rotated), so a decoder needs the very calibration the encoder used: each plane names it by
// its id (BLAKE3 of its bytes), and a payload whose calibration is not loaded does not decode (a
// miss), it is never decoded against another one.
//
// Codec params: ratio (bits 0-7, compression vs fp16 the calibration offers) | sink << 8 |
// recent << 16. Plane payload: u8 calibration_id[16], u8 model[coded components], the exact rows
// in the blob's dtype, then one rANS section (token-major, over the components whose model is not
// kKvtcAllZero, in basis order). A component's model is one of kKvtcModels zero-inflated discrete
// Laplace tables (probability of 0 x decay of the rest, kvtc_table), or kKvtcAllZero: every
// integer of the component is 0 in this chunk and none is coded.
//
// Calibration bytes (little endian): "KVTC", u32 version (1), u8 fingerprint[16], u32 layers,
// channels (kv_heads * head_dim), head_dim, components, ratio count R, flags (bit 0: keys coded
// pre-RoPE, bit 1: interleaved RoPE pairs, bit 2: per-head bases), f32 inv_freq[head_dim / 2],
// u32 ratio[R], then per plane (2 * layers, K then V per layer): f32 mean[channels], f32
// basis[components][channels], f32 step[R][components].
//
// Per-head bases (kdn.kvtc.fit(per_head=True)): every basis row is zero outside one KV head's
// channels, so a (token, head) row codes on its own. A plane under such a calibration also carries,
// after the component models, one bit per (coded row, head) — set when the row holds a nonzero
// value of that head — and codes symbols only for the components of the heads present: a KV head
// row that is all zero (a token kvzip dropped for that head, kdn.edits) costs one bit and decodes
// as zeros.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kdn/blob.h"
#include "kdn/codec.h"
#include "kdn/common.h"
#include "kdn/hash.h"
#include "kdn/rans.h"
#include "kdn/rope.h"

namespace kdn {

constexpr uint32_t kKvtcVersion = 1;
constexpr int kKvtcRange = 127;  // symbols in [-range, range]
constexpr int kKvtcZeros = 8, kKvtcDecays = 8;  // 64 models: a plane's tables stay in L2  // model = zero_index * kKvtcDecays + decay_index
constexpr int kKvtcModels = kKvtcZeros * kKvtcDecays;
constexpr uint8_t kKvtcAllZero = 255;

// The rANS table of model m (< kKvtcModels), built once per process with integer arithmetic.
const RansTable& kvtc_table(int model);

// The model that codes a histogram over [-range, range] (hist[s + range]) shortest, or
// kKvtcAllZero; adds its cost in bits to *model_bits and the empirical entropy to *empirical_bits.
uint8_t kvtc_choose_model(const uint32_t* hist, double* model_bits, double* empirical_bits);

struct KvtcPlane {
  std::vector<float> mean;   // [channels]
  std::vector<float> basis;  // [components][channels]
  std::vector<float> step;   // [ratios][components]
  std::vector<int> head;     // per-head calibrations: the KV head of each component; else empty
};

struct KvtcCalibration {
  Key128 id{};           // BLAKE3-128 of the calibration bytes
  Key128 fingerprint{};  // the model it was fit on
  uint32_t layers = 0, channels = 0, head_dim = 0, components = 0;
  bool prerope = false, per_head = false;
  RopeStyle style = RopeStyle::kRotateHalf;
  std::vector<float> inv_freq;  // [head_dim / 2]
  std::vector<uint32_t> ratios;
  std::vector<KvtcPlane> planes;  // 2 * layers
  int ratio_index(uint32_t ratio) const;  // -1 if not offered
};

// Parses calibration bytes; throws InputError (with the reason) when they are not well formed.
std::shared_ptr<const KvtcCalibration> kvtc_parse(const uint8_t* data, size_t size);

// Loads a calibration into the process: decoders find it by id, encoders by model fingerprint
// (the latest loaded for that model). Returns its id.
Key128 kvtc_load(const uint8_t* data, size_t size);
std::shared_ptr<const KvtcCalibration> kvtc_by_id(const Key128& id);           // null if not loaded
std::shared_ptr<const KvtcCalibration> kvtc_for_model(const Key128& fingerprint);  // null if none
void kvtc_unload_all();  // tests: back to no calibration

// A sealed calibration blob (kind kBlobKindCalibration) filed under `key`, holding calibration
// bytes fit on the model `fingerprint` (checked: InputError otherwise).
BufferPtr kvtc_pack(const Key128& fingerprint, const Key128& key, const uint8_t* data, size_t size);

// Verifies a calibration blob (checksum, kind, model, key) and loads its calibration; a failed
// Status says why (a damaged or foreign blob is never loaded).
Status kvtc_load_blob(const uint8_t* blob, size_t size, const Key128& fingerprint, const Key128& key, Key128* id);

// What coding one plane under (params, calibration) means, for the encoder and both decoders:
// the plane's calibration, the components coded (with their steps), the exact rows (rows below
// `first_coded` and from `end_coded` on), and for keys coded pre-RoPE the (cos, sin) of every
// (row, pair) angle. False when the calibration does not fit the plane or lacks the ratio.
struct KvtcLayout {
  const KvtcPlane* plane = nullptr;
  std::vector<int> coded;     // component indices
  std::vector<float> steps;   // their steps
  int64_t first_coded = 0, end_coded = 0;
  std::shared_ptr<const std::vector<float>> angles;  // [tokens][head_dim / 2][2]; null unless keys are coded pre-RoPE
};
bool kvtc_layout(const Plane& p, uint32_t params, const KvtcCalibration& cal, KvtcLayout* out);

// A plane's calibration id (its first 16 bytes); false if the plane is shorter.
bool kvtc_plane_calibration(const uint8_t* plane, size_t size, Key128* id);

// Whether a kvtc payload's (first plane's) calibration is loaded and has per-head bases: the CUDA
// decoder leaves those chunks to the host decoder.
bool kvtc_payload_per_head(const BlobHeader& h, const uint8_t* payload, size_t size);

// CUDA decoder (kernels/kvtc.cu, compiled with nvcc only; codec_decode_cuda dispatches to it).
Status kvtc_decode_cuda(const BlobHeader& h, const uint8_t* payload, size_t size, void* out, uintptr_t stream);
// Many chunks in one pair of launches (codec_decode_cuda_many gives it the kvtc ones).
Status kvtc_decode_cuda_batch(const std::vector<DecodeJob>& jobs, uintptr_t stream);

}  // namespace kdn
