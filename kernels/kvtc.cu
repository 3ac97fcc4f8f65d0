// CUDA decoder of the `kvtc` codec (kdn/kvtc.h), on the same KDN_HD math as the CPU decoder: the
// host checks each plane's structure against its calibration (loaded in this process), a chunk per
// host thread, and joins the chunks' descriptions into one batch; one thread
// per (plane, rANS lane) decodes symbols, then one block per (plane, tile of rows) sums the
// components, each thread a RoPE pair of channels for every row of the tile (a basis element read
// once serves the tile), in the CPU's order with the same IEEE fused multiply-add (__fmaf_rn), and
// turns keys back to post-RoPE. A batch of chunks decodes in one pair of launches; each
// calibration's means, bases and steps are uploaded once per device and kept there (keyed by the
// calibration's id, a hash of its bytes, so a copy is never stale), and only the chunks (straight
// from the caller's memory), their plane descriptions and RoPE angles travel with a call.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "kdn/byte_io.h"
#include "kdn/codec.h"
#include "kdn/kvtc.h"
#include "kdn/parallel.h"
#include "kdn/quant.h"
#include "launch.cuh"

namespace kdn {
namespace {

struct KvtcPlaneInfo {
  uint64_t exact;                       // batch payload offset of the exact rows
  uint64_t slots;                       // offset into the staged model slots / component indices of the live components
  uint64_t lane[kRansLanes], lane_end[kRansLanes];
  uint64_t q;                           // offset into the decoded integers
  const float *mean, *basis, *steps;    // in the device-resident calibration
  uint64_t angles;                      // offset into the staged angles (keys coded pre-RoPE)
  uint8_t* out;                         // the plane's rows [tokens][channels]
  int64_t tokens, coded, first_coded, end_coded;  // coded: the live components (symbols coded)
  int rotate, style;
};

struct KvtcGeometry {
  int64_t channels, head_dim, planes, max_tokens;
  DType dtype;
};

__global__ void kvtc_symbols_kernel(KvtcGeometry g, const uint8_t* __restrict__ payload,
                                    const KvtcPlaneInfo* __restrict__ planes, const RansTable* __restrict__ tables,
                                    const int* __restrict__ slots, int16_t* __restrict__ q, int* bad) {
  const int64_t id = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (id >= g.planes * kRansLanes) return;
  const int64_t p = id / kRansLanes;
  const int j = static_cast<int>(id % kRansLanes);
  const KvtcPlaneInfo& info = planes[p];
  const int64_t coded = info.coded, n = (info.end_coded - info.first_coded) * coded;
  RansLane lane;
  rans_lane_init(lane, payload + info.lane[j], payload + info.lane_end[j]);
  const int* slot = slots + info.slots;
  int16_t* out = q + info.q;
  // symbol i is of component i % coded: a running component index instead of a 64-bit division
  int64_t c = j;
  while (coded > 0 && c >= coded) c -= coded;
  for (int64_t i = j; i < n && lane.ok; i += kRansLanes) {
    out[i] = static_cast<int16_t>(rans_lane_decode(lane, tables[slot[c]]) - kKvtcRange);
    for (c += kRansLanes; c >= coded;) c -= coded;
  }
  if (!rans_lane_finished(lane)) atomicOr(bad, 1);
}

// Rows decoded together by one block of kvtc_values_kernel: each basis element read from memory
// serves this many rows, whose weights wait in shared memory.
constexpr int kKvtcTileRows = 16;

// One block per (plane, tile of kKvtcTileRows rows); each thread one RoPE pair of channels at a
// time, with the tile's rows in registers. Per element the sum runs over the components in the
// CPU decoder's order, skipping zero weights, with its fused multiply-add.
__global__ void kvtc_values_kernel(KvtcGeometry g, const uint8_t* __restrict__ payload,
                                   const KvtcPlaneInfo* __restrict__ planes, const int* __restrict__ components,
                                   const float* __restrict__ angles, const int16_t* __restrict__ q) {
  extern __shared__ float tile[];  // [kKvtcTileRows][coded] weights, then [coded] basis row offsets
  const int64_t tiles = (g.max_tokens + kKvtcTileRows - 1) / kKvtcTileRows;
  const int64_t p = blockIdx.x / tiles, t0 = blockIdx.x % tiles * kKvtcTileRows;
  const KvtcPlaneInfo& info = planes[p];
  if (t0 >= info.tokens) return;
  const int64_t coded = info.coded, size = dtype_size(g.dtype);
  const int rows = info.tokens - t0 < kKvtcTileRows ? static_cast<int>(info.tokens - t0) : kKvtcTileRows;
  float* w = tile;
  int* offset = reinterpret_cast<int*>(tile + kKvtcTileRows * coded);
  const int* comp = components + info.slots;
  for (int j = threadIdx.x; j < coded; j += blockDim.x) offset[j] = comp[j] * static_cast<int>(g.channels);
  for (int e = threadIdx.x; e < kKvtcTileRows * static_cast<int>(coded); e += blockDim.x) {
    const int r = e / static_cast<int>(coded), j = e - r * static_cast<int>(coded);
    const int64_t t = t0 + r;
    const bool live = r < rows && t >= info.first_coded && t < info.end_coded;
    w[e] = live ? static_cast<float>(q[info.q + (t - info.first_coded) * coded + j]) * info.steps[comp[j]] : 0.f;
  }
  __syncthreads();
  const int64_t half = g.head_dim / 2;
  for (int64_t pair = threadIdx.x; pair < g.channels / 2; pair += blockDim.x) {
    const int64_t head = pair / half, k = pair % half;
    int64_t a, b;
    rope_pair(static_cast<RopeStyle>(info.style), g.head_dim, k, &a, &b);
    a += head * g.head_dim;
    b += head * g.head_dim;
    float xa[kKvtcTileRows], xb[kKvtcTileRows];
#pragma unroll
    for (int r = 0; r < kKvtcTileRows; ++r) xa[r] = info.mean[a], xb[r] = info.mean[b];
    for (int64_t j = 0; j < coded; ++j) {
      const float* row = info.basis + offset[j];
      const float ba = row[a], bb = row[b];
#pragma unroll
      for (int r = 0; r < kKvtcTileRows; ++r) {
        const float v = w[r * coded + j];
        if (v != 0.f) {
          xa[r] = __fmaf_rn(v, ba, xa[r]);  // the CPU decoder's fused multiply-add, in its order
          xb[r] = __fmaf_rn(v, bb, xb[r]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kKvtcTileRows; ++r) {
      const int64_t t = t0 + r;
      if (r >= rows) break;
      if (t < info.first_coded || t >= info.end_coded) {  // exact rows: sink rows, then recent rows
        const int64_t exact = t < info.first_coded ? t : info.first_coded + (t - info.end_coded);
        const uint8_t* src = payload + info.exact + exact * g.channels * size;
        memcpy(info.out + (t * g.channels + a) * size, src + a * size, size);
        memcpy(info.out + (t * g.channels + b) * size, src + b * size, size);
        continue;
      }
      float va = xa[r], vb = xb[r];
      if (info.rotate) {
        const float* cs = angles + info.angles + t * g.head_dim + 2 * k;
        rope_turn(&va, &vb, cs[0], cs[1]);
      }
      store_float(info.out, g.dtype, t * g.channels + a, va);
      store_float(info.out, g.dtype, t * g.channels + b, vb);
    }
  }
}

// A calibration on the device: per plane its mean [channels], basis [components][channels] and
// steps [ratios][components], back to back (plane_floats each).
struct DeviceCalibration {
  float* data = nullptr;
  uint64_t plane_floats = 0;
};

uint64_t plane_floats(const KvtcCalibration& cal) {
  return uint64_t(cal.channels) * (1 + cal.components) + uint64_t(cal.ratios.size()) * cal.components;
}

// The device copy of `cal` on the current device, uploaded on first use and kept for the process.
Status device_calibration(const KvtcCalibration& cal, DeviceCalibration* out) {
  static std::mutex mu;
  static std::map<std::pair<Key128, int>, DeviceCalibration> copies;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return failed(err, "kvtc_decode_cuda");
  std::lock_guard<std::mutex> lock(mu);
  auto found = copies.find({cal.id, device});
  if (found != copies.end()) {
    *out = found->second;
    return Status::Ok();
  }
  DeviceCalibration d;
  d.plane_floats = plane_floats(cal);
  std::vector<float> host;
  host.reserve(d.plane_floats * cal.planes.size());
  for (const KvtcPlane& plane : cal.planes) {
    host.insert(host.end(), plane.mean.begin(), plane.mean.end());
    host.insert(host.end(), plane.basis.begin(), plane.basis.end());
    host.insert(host.end(), plane.step.begin(), plane.step.end());
  }
  if (host.size() != d.plane_floats * cal.planes.size()) return Status::Fail("kvtc calibration: inconsistent sizes");
  err = cudaMalloc(reinterpret_cast<void**>(&d.data), host.size() * sizeof(float));
  if (err == cudaSuccess) err = cudaMemcpy(d.data, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice);
  if (err != cudaSuccess) {
    if (d.data) cudaFree(d.data);
    return failed(err, "kvtc_decode_cuda");
  }
  copies[{cal.id, device}] = d;
  *out = d;
  return Status::Ok();
}

// One chunk parsed on its own host thread: its planes' offsets are the chunk's own (payload from the
// chunk's start; slots, q and angles from the part's arrays), its calibration pointers are offsets
// into the calibration's device copy, resolved when the part joins the batch.
struct KvtcChunkPart {
  Status status = Status::Ok();
  std::vector<KvtcPlaneInfo> planes;
  struct Calibrated {
    std::shared_ptr<const KvtcCalibration> cal;
    uint64_t mean, steps;  // float offsets into the calibration's device copy
  };
  std::vector<Calibrated> calibrated;  // per plane
  std::vector<int> models, components;  // per live component: its rANS model, its basis row
  std::vector<float> angles;
  int64_t q_count = 0, max_coded = 0;
};

Status parse_chunk(const BlobHeader& h, const uint8_t* payload, size_t size, uint8_t* out, KvtcChunkPart* part) {
  const int64_t channels = int64_t(h.kv_heads) * h.head_dim, planes = 2 * int64_t(h.layers);
  const size_t dsize = dtype_size(h.dtype);
  ByteReader r(payload, size);
  std::vector<uint32_t> sizes(planes);
  for (auto& s : sizes) s = r.get<uint32_t>();
  int64_t angles_at = -1;
  std::shared_ptr<const KvtcCalibration> cal;  // the chunk's planes share one calibration (looked up again if not)
  KvtcLayout L;
  for (int64_t p = 0; p < planes; ++p) {
    const uint64_t offset = size - r.remaining();
    const uint8_t* plane = r.take(sizes[p]);
    if (!plane) return Status::Fail("codec payload: plane sizes do not match the payload");
    Key128 id;
    if (!kvtc_plane_calibration(plane, sizes[p], &id)) return Status::Fail("kvtc payload: plane " + std::to_string(p) + " is corrupt");
    if (!cal || cal->id != id) {
      if (!(cal = kvtc_by_id(id))) return Status::Fail("kvtc payload: its calibration is not loaded");
      if (cal->per_head) return Status::Fail("kvtc payload: per-head bases decode on the host");
    }
    const Plane shape{h.tokens, channels, int(p / 2), int(h.layers), (p & 1) != 0, h.dtype, h.head_dim, h.position};
    if (!kvtc_layout(shape, h.codec_params, *cal, &L)) return Status::Fail("kvtc payload: calibration does not fit");
    KvtcPlaneInfo info{};
    info.tokens = h.tokens;
    info.out = out + p * h.tokens * channels * dsize;
    info.first_coded = L.first_coded;
    info.end_coded = L.end_coded;
    info.style = static_cast<int>(cal->style);
    const uint64_t mean = p * plane_floats(*cal);
    const uint64_t steps = mean + uint64_t(1 + cal->components) * channels +
                           uint64_t(cal->ratio_index(h.codec_params & 0xff)) * cal->components;
    part->calibrated.push_back({cal, mean, steps});
    ByteReader pr(plane, sizes[p]);
    pr.take(16);
    const uint8_t* choice = pr.take(L.coded.size());
    info.exact = offset + 16 + L.coded.size();
    pr.take((h.tokens - (L.end_coded - L.first_coded)) * channels * dsize);
    if (!choice) return Status::Fail("kvtc payload: plane " + std::to_string(p) + " is corrupt");
    info.slots = part->models.size();
    for (size_t j = 0; j < L.coded.size(); ++j) {
      if (choice[j] == kKvtcAllZero) continue;
      if (choice[j] >= kKvtcModels) return Status::Fail("kvtc payload: bad model choice");
      part->models.push_back(choice[j]);
      part->components.push_back(L.coded[j]);
    }
    info.coded = static_cast<int64_t>(part->models.size() - info.slots);
    part->max_coded = std::max(part->max_coded, info.coded);
    uint32_t lanes[kRansLanes];
    for (auto& l : lanes) l = pr.get<uint32_t>();
    uint64_t at = offset + (sizes[p] - pr.remaining());
    for (int j = 0; j < kRansLanes; ++j) {
      if (!pr.take(lanes[j]) || lanes[j] < 4) return Status::Fail("kvtc payload: plane " + std::to_string(p) + " is corrupt");
      info.lane[j] = at;
      info.lane_end[j] = at += lanes[j];
    }
    if (!pr.ok() || pr.remaining() != 0) return Status::Fail("kvtc payload: plane " + std::to_string(p) + " is corrupt");
    info.q = part->q_count;
    part->q_count += (L.end_coded - L.first_coded) * info.coded;
    info.rotate = L.angles != nullptr;
    if (info.rotate && angles_at < 0) {  // every key plane of a chunk turns by the same angles
      angles_at = static_cast<int64_t>(part->angles.size());
      part->angles.insert(part->angles.end(), L.angles->begin(), L.angles->end());
    }
    info.angles = info.rotate ? uint64_t(angles_at) : 0;
    part->planes.push_back(info);
  }
  if (!r.ok() || r.remaining() != 0) return Status::Fail("codec payload: plane sizes do not match the payload");
  return Status::Ok();
}

// A page-locked host buffer of at least `bytes`, taken from a process-wide pool and given back (after
// its stream has finished with it) at scope exit: the batch's payloads are copied into one by the
// parsing threads, so they go up as one DMA instead of a pageable copy per chunk on one thread.
// The pool keeps its buffers for the process: one per call that ran at once, each as large as the
// largest batch it held (a request's coded KV).
class PinnedBuffer {
 public:
  PinnedBuffer(size_t bytes, cudaStream_t stream) : stream_(stream) {
    std::lock_guard<std::mutex> lock(pool_mu());
    auto& pool = free_list();
    for (size_t i = 0; i < pool.size(); ++i)
      if (pool[i].second >= bytes) {
        held_ = pool[i];
        pool.erase(pool.begin() + i);
        return;
      }
    void* data = nullptr;
    if (cudaHostAlloc(&data, std::max<size_t>(bytes, 1), cudaHostAllocDefault) == cudaSuccess)
      held_ = {static_cast<uint8_t*>(data), std::max<size_t>(bytes, 1)};
    else
      cudaGetLastError();  // none to be had: the caller uploads from pageable memory instead
  }
  ~PinnedBuffer() {
    if (!held_.first) return;
    cudaStreamSynchronize(stream_);  // an upload still reading it must end before another call writes it
    std::lock_guard<std::mutex> lock(pool_mu());
    free_list().push_back(held_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  uint8_t* data() const { return held_.first; }

 private:
  static std::mutex& pool_mu() {
    static std::mutex mu;
    return mu;
  }
  static std::vector<std::pair<uint8_t*, size_t>>& free_list() {
    static std::vector<std::pair<uint8_t*, size_t>> pool;
    return pool;
  }
  cudaStream_t stream_;
  std::pair<uint8_t*, size_t> held_{nullptr, 0};
};

// Everything one launch pair needs: the chunks' parts joined, their offsets moved to the batch's.
struct KvtcBatch {
  std::unique_ptr<PinnedBuffer> pinned;  // the payloads back to back (each 16-byte aligned), when one was had
  std::vector<std::pair<const uint8_t*, size_t>> payloads;  // else uploaded as they are, each 16-byte aligned
  uint64_t payload_bytes = 0;
  std::vector<KvtcPlaneInfo> planes;
  std::vector<RansTable> tables;       // the models the batch uses, each once
  std::vector<int> slot_of = std::vector<int>(kKvtcModels, -1);
  std::vector<int> slots, components;  // per live component: its model's table, its basis row
  std::vector<float> angles;
  int64_t q_count = 0, max_tokens = 0, max_coded = 0, channels = -1, head_dim = -1;
  DType dtype{};
};

Status join_chunk(const DecodeJob& job, const KvtcChunkPart& part, KvtcBatch* b) {
  const BlobHeader& h = *job.header;
  const int64_t channels = int64_t(h.kv_heads) * h.head_dim;
  if (b->channels < 0) b->channels = channels, b->head_dim = h.head_dim, b->dtype = h.dtype;
  if (b->channels != channels || b->head_dim != h.head_dim || b->dtype != h.dtype)
    return Status::Fail("kvtc_decode_cuda: a batch's chunks must share one model shape and dtype");
  const uint64_t base = b->payload_bytes, slots = b->slots.size(), q = b->q_count, angles = b->angles.size();
  b->payloads.emplace_back(job.payload, job.size);
  b->payload_bytes += (job.size + 15) & ~size_t(15);  // DeviceStaging's alignment of each part
  b->max_tokens = std::max<int64_t>(b->max_tokens, h.tokens);
  b->max_coded = std::max(b->max_coded, part.max_coded);
  b->q_count += part.q_count;
  b->angles.insert(b->angles.end(), part.angles.begin(), part.angles.end());
  for (int m : part.models) {
    if (b->slot_of[m] < 0) {
      b->slot_of[m] = static_cast<int>(b->tables.size());
      b->tables.push_back(kvtc_table(m));
    }
    b->slots.push_back(b->slot_of[m]);
  }
  b->components.insert(b->components.end(), part.components.begin(), part.components.end());
  const KvtcCalibration* last = nullptr;  // the chunk's planes share one calibration (looked up again if not)
  DeviceCalibration d;
  for (size_t p = 0; p < part.planes.size(); ++p) {
    KvtcPlaneInfo info = part.planes[p];
    const auto& c = part.calibrated[p];
    if (c.cal.get() != last) {
      Status st = device_calibration(*c.cal, &d);
      if (!st.ok) return st;
      last = c.cal.get();
    }
    info.mean = d.data + c.mean;
    info.basis = info.mean + channels;
    info.steps = d.data + c.steps;
    info.exact += base;
    for (int j = 0; j < kRansLanes; ++j) info.lane[j] += base, info.lane_end[j] += base;
    info.slots += slots;
    info.q += q;
    if (info.rotate) info.angles += angles;
    b->planes.push_back(info);
  }
  return Status::Ok();
}

// The jobs parsed on the host's threads (a chunk's planes take ~7 us each to check, and its RoPE
// angles are computed once per chunk), then joined in order: the first bad chunk's error wins.
Status build_batch(const std::vector<DecodeJob>& jobs, cudaStream_t stream, KvtcBatch* b) {
  std::vector<uint64_t> at(jobs.size() + 1, 0);  // each payload's place in the batch's, 16-byte aligned
  for (size_t i = 0; i < jobs.size(); ++i) at[i + 1] = at[i] + ((jobs[i].size + 15) & ~size_t(15));
  b->pinned = std::make_unique<PinnedBuffer>(at.back(), stream);
  uint8_t* pinned = b->pinned->data();
  std::vector<KvtcChunkPart> parts(jobs.size());
  parallel_for(static_cast<int64_t>(jobs.size()), default_num_threads(), [&](int64_t i) {
    const DecodeJob& job = jobs[i];
    if (pinned) std::memcpy(pinned + at[i], job.payload, job.size);
    parts[i].status = parse_chunk(*job.header, job.payload, job.size, static_cast<uint8_t*>(job.out), &parts[i]);
  });
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (!parts[i].status.ok) return parts[i].status;
    Status st = join_chunk(jobs[i], parts[i], b);
    if (!st.ok) return st;
  }
  return Status::Ok();
}

}  // namespace

Status kvtc_decode_cuda_batch(const std::vector<DecodeJob>& jobs, uintptr_t stream) {
  KvtcBatch b;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  Status built = build_batch(jobs, s, &b);
  if (!built.ok) return built;
  if (b.planes.empty()) return Status::Ok();
  if (b.tables.empty()) b.tables.push_back(kvtc_table(0));  // nothing coded: keep the uploads non-empty
  if (b.slots.empty()) b.slots.push_back(0), b.components.push_back(0);
  if (b.angles.empty()) b.angles.push_back(0.f);
  const KvtcGeometry g{b.channels, b.head_dim, static_cast<int64_t>(b.planes.size()), b.max_tokens, b.dtype};
  // the chunks' payloads go up after the batch's own arrays: from the pinned copy, else straight
  // from the caller's memory
  std::vector<DeviceStaging::Part> parts{{b.planes.data(), b.planes.size() * sizeof(KvtcPlaneInfo)},
                                         {b.tables.data(), b.tables.size() * sizeof(RansTable)},
                                         {b.angles.data(), b.angles.size() * sizeof(float)},
                                         {nullptr, size_t(std::max<int64_t>(b.q_count, 1)) * sizeof(int16_t)},
                                         {nullptr, sizeof(int)},
                                         {b.slots.data(), b.slots.size() * sizeof(int)},
                                         {b.components.data(), b.components.size() * sizeof(int)}};
  const size_t payload_part = parts.size();
  if (b.pinned->data())
    parts.push_back({b.pinned->data(), b.payload_bytes});
  else
    for (const auto& [data, size] : b.payloads) parts.push_back({data, size});
  DeviceStaging staged(s, parts);
  if (staged.error() != cudaSuccess) return failed(staged.error(), "kvtc_decode_cuda");
  const auto* payload = staged.part<const uint8_t>(payload_part);
  const auto* planes = staged.part<const KvtcPlaneInfo>(0);
  auto* d_bad = staged.part<int>(4);
  const int lane_blocks = static_cast<int>((g.planes * kRansLanes + 63) / 64);
  kvtc_symbols_kernel<<<lane_blocks, 64, 0, s>>>(g, payload, planes, staged.part<const RansTable>(1),
                                                 staged.part<const int>(5), staged.part<int16_t>(3), d_bad);
  const int64_t tiles = (g.max_tokens + kKvtcTileRows - 1) / kKvtcTileRows;
  const size_t shared = (kKvtcTileRows + 1) * std::max<int64_t>(b.max_coded, 1) * sizeof(float);
  cudaError_t err = cudaSuccess;
  if (shared > 48 * 1024)  // wide models: ask for more than the default shared memory
    err = cudaFuncSetAttribute(kvtc_values_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared));
  if (err != cudaSuccess) return failed(err, "kvtc_decode_cuda");
  const int threads = static_cast<int>(std::clamp<int64_t>((g.channels / 2 + 31) / 32 * 32, 32, 256));
  kvtc_values_kernel<<<static_cast<unsigned>(g.planes * tiles), threads, shared, s>>>(
      g, payload, planes, staged.part<const int>(6), staged.part<const float>(2), staged.part<const int16_t>(3));
  int bad = 0;
  err = cudaGetLastError();
  if (err == cudaSuccess) err = cudaMemcpyAsync(&bad, d_bad, sizeof(int), cudaMemcpyDeviceToHost, s);
  if (err != cudaSuccess) return failed(err, "kvtc_decode_cuda");
  Status st = finish(s, "kvtc_decode_cuda");  // host vectors must outlive the uploads
  if (!st.ok) return st;
  return bad ? Status::Fail("codec payload: an entropy-coded lane is corrupt") : Status::Ok();
}

Status kvtc_decode_cuda(const BlobHeader& h, const uint8_t* payload, size_t size, void* out, uintptr_t stream) {
  return kvtc_decode_cuda_batch({DecodeJob{&h, payload, size, out}}, stream);
}

}  // namespace kdn
