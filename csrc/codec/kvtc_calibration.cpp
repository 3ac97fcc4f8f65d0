// `kvtc` calibrations (kdn/kvtc.h): parsing, the per-process registry that encoders and decoders
// look them up in, their blobs in the tiers, and which calibration a payload names.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>

#include "kdn/byte_io.h"
#include "kdn/kvtc.h"

namespace kdn {

int KvtcCalibration::ratio_index(uint32_t ratio) const {
  for (size_t i = 0; i < ratios.size(); ++i)
    if (ratios[i] == ratio) return static_cast<int>(i);
  return -1;
}

namespace {

void read_floats(ByteReader& r, std::vector<float>& out, size_t n) {
  out.resize(n);
  const uint8_t* p = r.take(4 * n);
  if (p) std::memcpy(out.data(), p, 4 * n);
}

struct Registry {
  std::mutex mu;
  std::map<Key128, std::shared_ptr<const KvtcCalibration>> by_id;
  std::map<Key128, std::shared_ptr<const KvtcCalibration>> by_model;
};

Registry& registry() {
  static Registry r;
  return r;
}

// The KV head each basis row lives in (a per-head calibration's rows are zero outside one head).
std::vector<int> component_heads(const std::vector<float>& basis, uint32_t components, uint32_t channels,
                                 uint32_t head_dim) {
  std::vector<int> head(components);
  for (uint32_t j = 0; j < components; ++j) {
    const float* row = &basis[static_cast<size_t>(j) * channels];
    int found = -1;
    for (uint32_t c = 0; c < channels; ++c) {
      if (row[c] == 0.f) continue;
      const int h = static_cast<int>(c / head_dim);
      KDN_CHECK_INPUT(found < 0 || found == h, "kvtc calibration: a per-head basis row spans two heads");
      found = h;
    }
    head[j] = std::max(found, 0);
  }
  return head;
}

}  // namespace

std::shared_ptr<const KvtcCalibration> kvtc_parse(const uint8_t* data, size_t size) {
  auto cal = std::make_shared<KvtcCalibration>();
  ByteReader r(data, size);
  const uint8_t* magic = r.take(4);
  KDN_CHECK_INPUT(magic && std::memcmp(magic, "KVTC", 4) == 0, "kvtc calibration: bad magic");
  const uint32_t version = r.get<uint32_t>();
  KDN_CHECK_INPUT(version == kKvtcVersion, "kvtc calibration: unsupported version " + std::to_string(version));
  const uint8_t* fp = r.take(16);
  if (fp) std::memcpy(cal->fingerprint.data(), fp, 16);
  cal->layers = r.get<uint32_t>();
  cal->channels = r.get<uint32_t>();
  cal->head_dim = r.get<uint32_t>();
  cal->components = r.get<uint32_t>();
  const uint32_t ratios = r.get<uint32_t>(), flags = r.get<uint32_t>();
  KDN_CHECK_INPUT(r.ok() && cal->layers > 0 && cal->layers <= 4096 && cal->head_dim > 0 && cal->head_dim % 2 == 0 &&
                      cal->channels > 0 && cal->channels <= 65536 && cal->channels % cal->head_dim == 0 &&
                      cal->components > 0 && cal->components <= cal->channels && ratios > 0 && ratios <= 64 &&
                      flags <= 7,
                  "kvtc calibration: bad dimensions");
  cal->prerope = flags & 1;
  cal->per_head = flags & 4;
  cal->style = flags & 2 ? RopeStyle::kInterleaved : RopeStyle::kRotateHalf;
  read_floats(r, cal->inv_freq, cal->head_dim / 2);
  for (uint32_t i = 0; i < ratios; ++i) cal->ratios.push_back(r.get<uint32_t>());
  const size_t per_plane = 4 * (cal->channels + static_cast<size_t>(cal->components) * (cal->channels + ratios));
  KDN_CHECK_INPUT(r.ok() && r.remaining() == per_plane * 2 * cal->layers, "kvtc calibration: size does not match");
  cal->planes.resize(2 * cal->layers);
  for (auto& plane : cal->planes) {
    read_floats(r, plane.mean, cal->channels);
    read_floats(r, plane.basis, static_cast<size_t>(cal->components) * cal->channels);
    read_floats(r, plane.step, static_cast<size_t>(ratios) * cal->components);
    for (float s : plane.step) KDN_CHECK_INPUT(std::isfinite(s) && s >= 0, "kvtc calibration: bad step");
    for (float v : plane.basis) KDN_CHECK_INPUT(std::isfinite(v), "kvtc calibration: bad basis");
    for (float v : plane.mean) KDN_CHECK_INPUT(std::isfinite(v), "kvtc calibration: bad mean");
    if (cal->per_head) plane.head = component_heads(plane.basis, cal->components, cal->channels, cal->head_dim);
  }
  for (uint32_t ratio : cal->ratios) KDN_CHECK_INPUT(ratio >= 2 && ratio <= 255, "kvtc calibration: bad ratio");
  cal->id = blake3_128(data, size);
  return cal;
}

Key128 kvtc_load(const uint8_t* data, size_t size) {
  auto cal = kvtc_parse(data, size);
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  reg.by_id[cal->id] = cal;
  reg.by_model[cal->fingerprint] = cal;
  return cal->id;
}

std::shared_ptr<const KvtcCalibration> kvtc_by_id(const Key128& id) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.by_id.find(id);
  return it == reg.by_id.end() ? nullptr : it->second;
}

std::shared_ptr<const KvtcCalibration> kvtc_for_model(const Key128& fingerprint) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.by_model.find(fingerprint);
  return it == reg.by_model.end() ? nullptr : it->second;
}

void kvtc_unload_all() {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  reg.by_id.clear();
  reg.by_model.clear();
}

BufferPtr kvtc_pack(const Key128& fingerprint, const Key128& key, const uint8_t* data, size_t size) {
  KDN_CHECK_INPUT(kvtc_parse(data, size)->fingerprint == fingerprint, "kvtc_pack: calibration of another model");
  return pack_bytes_blob(kBlobKindCalibration, fingerprint, key, data, size);
}

Status kvtc_load_blob(const uint8_t* blob, size_t size, const Key128& fingerprint, const Key128& key, Key128* id) {
  size_t offset = 0, bytes = 0;
  Status st = read_bytes_blob(blob, size, kBlobKindCalibration, fingerprint, key, &offset, &bytes);
  if (!st.ok) return st;
  try {
    *id = kvtc_load(blob + offset, bytes);
  } catch (const InputError& e) {
    return Status::Fail(e.what());
  }
  return Status::Ok();
}

bool kvtc_plane_calibration(const uint8_t* plane, size_t size, Key128* id) {
  if (size < 16) return false;
  std::memcpy(id->data(), plane, 16);
  return true;
}

bool kvtc_payload_per_head(const BlobHeader& h, const uint8_t* payload, size_t size) {
  const size_t first = 8 * static_cast<size_t>(h.layers);  // after the u32 size of each of 2 * layers planes
  Key128 id;
  if (size < first || !kvtc_plane_calibration(payload + first, size - first, &id)) return false;
  const auto cal = kvtc_by_id(id);
  return cal && cal->per_head;
}

}  // namespace kdn
