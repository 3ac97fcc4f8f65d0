// CUDA decoder of the `kvtc` codec (kdn/kvtc.h), on the same KDN_HD math as the CPU decoder: the
// host checks each plane's structure against its calibration (loaded in this process) and uploads
// the basis rows and steps of the components with coded symbols and the models they use; one thread per (plane, rANS lane) decodes symbols,
// then one thread per (plane, row, head, RoPE pair) sums the components in the CPU's order with
// the same IEEE fused multiply-add (__fmaf_rn) and turns keys back to post-RoPE.
//
// The calibration rows are uploaded with every call (a device-resident calibration cache is the
// next step when this decoder is on a serving path).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "kdn/byte_io.h"
#include "kdn/codec.h"
#include "kdn/kvtc.h"
#include "kdn/quant.h"
#include "launch.cuh"

namespace kdn {
namespace {

struct KvtcPlaneInfo {
  uint64_t exact;                       // payload offset of the exact rows
  uint64_t slots;                       // offset into the staged table slots of the live components
  uint64_t lane[kRansLanes], lane_end[kRansLanes];
  uint64_t rows, steps, mean, q, angles;  // offsets into the staged floats (rows, steps, mean, angles) and q
  int64_t coded, first_coded, end_coded;  // coded: the live components (symbols coded)
  int rotate;
};

struct KvtcGeometry {
  int64_t tokens, channels, head_dim, planes;
  DType dtype;
  RopeStyle style;
};

__global__ void kvtc_symbols_kernel(KvtcGeometry g, const uint8_t* payload, const KvtcPlaneInfo* planes,
                                    const RansTable* tables, const int* slots, int16_t* q, int* bad) {
  const int64_t id = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (id >= g.planes * kRansLanes) return;
  const int64_t p = id / kRansLanes, j = id % kRansLanes;
  const KvtcPlaneInfo& info = planes[p];
  const int64_t n = (info.end_coded - info.first_coded) * info.coded;
  RansLane lane;
  rans_lane_init(lane, payload + info.lane[j], payload + info.lane_end[j]);
  const int* slot = slots + info.slots;
  for (int64_t i = j; i < n && lane.ok; i += kRansLanes)
    q[info.q + i] = static_cast<int16_t>(rans_lane_decode(lane, tables[slot[i % info.coded]]) - kKvtcRange);
  if (!rans_lane_finished(lane)) atomicOr(bad, 1);
}

__global__ void kvtc_values_kernel(KvtcGeometry g, const uint8_t* payload, const KvtcPlaneInfo* planes,
                                   const float* floats, const int16_t* q, uint8_t* out) {
  const int64_t pairs = g.channels / 2, per_plane = g.tokens * pairs, size = dtype_size(g.dtype);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < g.planes * per_plane;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t p = i / per_plane, t = i % per_plane / pairs, pair = i % pairs;
    const int64_t head = pair / (g.head_dim / 2), k = pair % (g.head_dim / 2);
    const KvtcPlaneInfo& info = planes[p];
    int64_t a, b;
    rope_pair(g.style, g.head_dim, k, &a, &b);
    a += head * g.head_dim;
    b += head * g.head_dim;
    uint8_t* plane_out = out + p * g.tokens * g.channels * size;
    if (t < info.first_coded || t >= info.end_coded) {  // exact rows: sink rows, then recent rows
      const int64_t row = t < info.first_coded ? t : info.first_coded + (t - info.end_coded);
      const uint8_t* src = payload + info.exact + row * g.channels * size;
      memcpy(plane_out + (t * g.channels + a) * size, src + a * size, size);
      memcpy(plane_out + (t * g.channels + b) * size, src + b * size, size);
      continue;
    }
    const float* mean = floats + info.mean;
    float xa = mean[a], xb = mean[b];
    const int16_t* qs = q + info.q + (t - info.first_coded) * info.coded;
    for (int64_t j = 0; j < info.coded; ++j) {
      if (!qs[j]) continue;
      const float v = static_cast<float>(qs[j]) * floats[info.steps + j];
      const float* row = floats + info.rows + j * g.channels;
      xa = __fmaf_rn(v, row[a], xa);  // the CPU decoder's fused multiply-add, in its order
      xb = __fmaf_rn(v, row[b], xb);
    }
    if (info.rotate) {
      const float* cs = floats + info.angles + t * g.head_dim + 2 * k;
      rope_turn(&xa, &xb, cs[0], cs[1]);
    }
    store_float(plane_out, g.dtype, t * g.channels + a, xa);
    store_float(plane_out, g.dtype, t * g.channels + b, xb);
  }
}

}  // namespace

Status kvtc_decode_cuda(const BlobHeader& h, const uint8_t* payload, size_t size, void* out, uintptr_t stream) {
  const KvtcGeometry g{h.tokens, int64_t(h.kv_heads) * h.head_dim, h.head_dim, 2 * int64_t(h.layers), h.dtype,
                       RopeStyle::kRotateHalf};
  ByteReader r(payload, size);
  std::vector<uint32_t> sizes(g.planes);
  for (auto& s : sizes) s = r.get<uint32_t>();
  std::vector<KvtcPlaneInfo> planes(g.planes);
  std::vector<float> floats;
  std::vector<RansTable> tables;  // the models the payload uses, each once
  std::vector<int> slots, slot_of(kKvtcModels, -1);
  int64_t q_count = 0;
  std::shared_ptr<const KvtcCalibration> cal;
  KvtcGeometry geometry = g;
  const size_t dsize = dtype_size(h.dtype);
  for (int64_t p = 0; p < g.planes; ++p) {
    const uint64_t offset = size - r.remaining();
    const uint8_t* plane = r.take(sizes[p]);
    if (!plane) return Status::Fail("codec payload: plane sizes do not match the payload");
    Key128 id;
    if (!kvtc_plane_calibration(plane, sizes[p], &id) || !(cal = kvtc_by_id(id)))
      return Status::Fail("kvtc payload: its calibration is not loaded");
    geometry.style = cal->style;
    const Plane shape{h.tokens, g.channels, int(p / 2), int(h.layers), (p & 1) != 0, h.dtype, h.head_dim, h.position};
    KvtcLayout L;
    if (!kvtc_layout(shape, h.codec_params, *cal, &L)) return Status::Fail("kvtc payload: calibration does not fit");
    KvtcPlaneInfo& info = planes[p];
    info.first_coded = L.first_coded;
    info.end_coded = L.end_coded;
    ByteReader pr(plane, sizes[p]);
    pr.take(16);
    const uint8_t* choice = pr.take(L.coded.size());
    info.exact = offset + 16 + L.coded.size();
    pr.take((g.tokens - (L.end_coded - L.first_coded)) * g.channels * dsize);
    if (!choice) return Status::Fail("kvtc payload: plane " + std::to_string(p) + " is corrupt");
    std::vector<size_t> live;
    info.slots = slots.size();
    for (size_t j = 0; j < L.coded.size(); ++j) {
      if (choice[j] == kKvtcAllZero) continue;
      if (choice[j] >= kKvtcModels) return Status::Fail("kvtc payload: bad model choice");
      if (slot_of[choice[j]] < 0) {
        slot_of[choice[j]] = static_cast<int>(tables.size());
        tables.push_back(kvtc_table(choice[j]));
      }
      slots.push_back(slot_of[choice[j]]);
      live.push_back(j);
    }
    info.coded = static_cast<int64_t>(live.size());
    uint32_t lanes[kRansLanes];
    for (auto& l : lanes) l = pr.get<uint32_t>();
    uint64_t at = offset + (sizes[p] - pr.remaining());
    for (int j = 0; j < kRansLanes; ++j) {
      if (!pr.take(lanes[j]) || lanes[j] < 4) return Status::Fail("kvtc payload: plane " + std::to_string(p) + " is corrupt");
      info.lane[j] = at;
      info.lane_end[j] = at += lanes[j];
    }
    if (!pr.ok() || pr.remaining() != 0) return Status::Fail("kvtc payload: plane " + std::to_string(p) + " is corrupt");
    info.q = q_count;
    q_count += (L.end_coded - L.first_coded) * info.coded;
    info.rows = floats.size();
    for (size_t j : live) {
      const float* row = &L.plane->basis[size_t(L.coded[j]) * g.channels];
      floats.insert(floats.end(), row, row + g.channels);
    }
    info.steps = floats.size();
    for (size_t j : live) floats.push_back(L.steps[j]);
    info.mean = floats.size();
    floats.insert(floats.end(), L.plane->mean.begin(), L.plane->mean.end());
    info.rotate = !L.angles.empty();
    info.angles = floats.size();
    floats.insert(floats.end(), L.angles.begin(), L.angles.end());
  }
  if (!r.ok() || r.remaining() != 0) return Status::Fail("codec payload: plane sizes do not match the payload");
  if (tables.empty()) tables.push_back(kvtc_table(0));  // nothing coded: keep the uploads non-empty
  if (slots.empty()) slots.push_back(0);

  auto s = reinterpret_cast<cudaStream_t>(stream);
  DeviceStaging staged(s, {{payload, size},
                           {planes.data(), planes.size() * sizeof(KvtcPlaneInfo)},
                           {tables.data(), tables.size() * sizeof(RansTable)},
                           {floats.data(), floats.size() * sizeof(float)},
                           {nullptr, size_t(std::max<int64_t>(q_count, 1)) * sizeof(int16_t)},
                           {nullptr, sizeof(int)},
                           {slots.data(), slots.size() * sizeof(int)}});
  if (staged.error() != cudaSuccess) return failed(staged.error(), "kvtc_decode_cuda");
  auto* d_bad = staged.part<int>(5);
  const int lane_blocks = static_cast<int>((g.planes * kRansLanes + 63) / 64);
  kvtc_symbols_kernel<<<lane_blocks, 64, 0, s>>>(geometry, staged.part<const uint8_t>(0),
                                                 staged.part<const KvtcPlaneInfo>(1), staged.part<const RansTable>(2),
                                                 staged.part<const int>(6), staged.part<int16_t>(4), d_bad);
  const int threads = 256, blocks = grid_for(g.planes * g.tokens * (g.channels / 2), threads);
  kvtc_values_kernel<<<blocks, threads, 0, s>>>(geometry, staged.part<const uint8_t>(0),
                                                staged.part<const KvtcPlaneInfo>(1), staged.part<const float>(3),
                                                staged.part<const int16_t>(4), static_cast<uint8_t*>(out));
  int bad = 0;
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) err = cudaMemcpyAsync(&bad, d_bad, sizeof(int), cudaMemcpyDeviceToHost, s);
  if (err != cudaSuccess) return failed(err, "kvtc_decode_cuda");
  Status st = finish(s, "kvtc_decode_cuda");  // host vectors must outlive the uploads
  if (!st.ok) return st;
  return bad ? Status::Fail("codec payload: an entropy-coded lane is corrupt") : Status::Ok();
}

}  // namespace kdn
