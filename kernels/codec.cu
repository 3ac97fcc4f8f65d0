// CUDA decoders of the `int*` (KIVI) and `cachegen` codecs (`kvtc`: kernels/kvtc.cu), on the same KDN_HD math as the CPU
// decoders (kdn/quant.h, kdn/rans.h). The host validates the payload's structure first (plane and
// lane lengths, model choices), so kernels only ever index inside checked ranges; rANS lanes also
// carry their own end pointers and report a bad lane through a device flag.
//
// Parallelism: cachegen's entropy decode runs one thread per (plane, lane), i.e. layers*2*4
// threads; dequantization runs one thread per element.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "kdn/byte_io.h"
#include "kdn/cachegen.h"
#include "kdn/codec.h"
#include "kdn/kvtc.h"
#include "kdn/quant.h"
#include "launch.cuh"

namespace kdn {
namespace {

struct PlaneInfo {
  uint64_t offset;                 // plane start in the payload
  uint64_t side, rms, choice;      // cachegen: offsets of offset/scale, rms and model choices
  uint64_t lane[kRansLanes];       // cachegen: lane start
  uint64_t lane_end[kRansLanes];
  float step;
  int range, slot;                 // symbols in [-range, range]; table block slot * kCacheGenModels
};

struct Geometry {
  int64_t tokens, channels, planes;
  DType dtype;
};

__global__ void kivi_kernel(Geometry g, const uint8_t* payload, const PlaneInfo* planes, int bits, int64_t group,
                            uint8_t* out) {
  const int64_t n = g.tokens * g.channels;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n * g.planes; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t p = i / n, e = i % n, t = e / g.channels, c = e % g.channels;
    const bool values = p & 1;
    const int64_t groups = values ? g.tokens * ((g.channels + group - 1) / group) : ((g.tokens + group - 1) / group) * g.channels;
    const uint8_t* base = payload + planes[p].offset;
    const int64_t k = kivi_group_index(values, t, c, g.channels, group);
    uint16_t s, z;
    memcpy(&s, base + 2 * k, 2);
    memcpy(&z, base + 2 * groups + 2 * k, 2);
    store_float(out, g.dtype, i, kivi_dequant(unpack_bits(base + 4 * groups, bits, e), fp16_to_float(s), fp16_to_float(z)));
  }
}

__global__ void cachegen_symbols_kernel(Geometry g, const uint8_t* payload, const PlaneInfo* planes,
                                        const RansTable* tables, bool anchor, int16_t* q, int* bad) {
  const int64_t id = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (id >= g.planes * kRansLanes) return;
  const int64_t p = id / kRansLanes, j = id % kRansLanes, n = g.tokens * g.channels;
  const PlaneInfo& info = planes[p];
  RansLane lane;
  rans_lane_init(lane, payload + info.lane[j], payload + info.lane_end[j]);
  const uint8_t* choice = payload + info.choice;
  for (int64_t i = j; i < n && lane.ok; i += kRansLanes) {
    const int64_t t = i / g.channels, c = i % g.channels;
    const int64_t ctx = anchor && t % kCacheGenAnchorGroup ? g.channels + c : c;
    const int s = rans_lane_decode(lane, tables[info.slot * kCacheGenModels + choice[ctx]]);
    q[p * n + i] = static_cast<int16_t>(s - info.range);
  }
  if (!rans_lane_finished(lane)) atomicOr(bad, 1);
}

KDN_HD float half_at(const uint8_t* p, int64_t i) {
  uint16_t h;
  memcpy(&h, p + 2 * i, 2);
  return fp16_to_float(h);
}

__global__ void cachegen_values_kernel(Geometry g, const uint8_t* payload, const PlaneInfo* planes, bool anchor,
                                       const int16_t* q, uint8_t* out) {
  const int64_t n = g.tokens * g.channels;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n * g.planes; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t p = i / n, e = i % n, t = e / g.channels, c = e % g.channels;
    const PlaneInfo& info = planes[p];
    const uint8_t* side = payload + info.side;
    const uint8_t* rms = payload + info.rms;
    float reference = 0.f;
    if (anchor && t % kCacheGenAnchorGroup) {
      const int64_t a = t - t % kCacheGenAnchorGroup;
      reference = cachegen_normalized(q[p * n + a * g.channels + c], info.step, half_at(rms, a), 0.f);
    }
    const float u = cachegen_normalized(q[i], info.step, half_at(rms, t), reference);
    store_float(out, g.dtype, i, cachegen_denormalize(u, half_at(side, c), half_at(side, g.channels + c)));
  }
}

// Host-side structure check of a cachegen plane; fills the offsets the kernels use.
bool parse_cachegen_plane(const uint8_t* payload, uint64_t offset, uint32_t size, int64_t tokens, int64_t channels,
                          bool anchor, PlaneInfo* info) {
  ByteReader r(payload + offset, size);
  r.take(4 * channels);
  info->rms = offset + 4 * channels;
  r.take(2 * tokens);
  info->choice = info->rms + 2 * tokens;
  const int64_t contexts = anchor ? 2 * channels : channels;
  const uint8_t* choice = r.take(contexts);
  if (!choice) return false;
  for (int64_t k = 0; k < contexts; ++k)
    if (choice[k] >= kCacheGenModels) return false;
  uint32_t lanes[kRansLanes];
  for (auto& l : lanes) l = r.get<uint32_t>();
  uint64_t at = offset + (size - r.remaining());
  for (int j = 0; j < kRansLanes; ++j) {
    if (!r.take(lanes[j]) || lanes[j] < 4) return false;
    info->lane[j] = at;
    info->lane_end[j] = at += lanes[j];
  }
  info->side = offset;
  return r.ok() && r.remaining() == 0;
}

}  // namespace

Status codec_decode_cuda(const BlobHeader& h, const uint8_t* payload, size_t size, void* out, uintptr_t stream) {
  if (h.codec == kCodecKvtc) return kvtc_decode_cuda(h, payload, size, out, stream);
  if (h.codec != kCodecKivi && h.codec != kCodecCacheGen) return Status::Fail("this codec decodes on the CPU only");
  Status st = codec_check(h.codec, h.codec_params);
  if (!st.ok) return st;
  const Geometry g{h.tokens, int64_t(h.kv_heads) * h.head_dim, 2 * int64_t(h.layers), h.dtype};
  const int64_t n = g.tokens * g.channels;
  const bool anchor = h.codec == kCodecCacheGen && (h.codec_params >> 8) & 1;
  ByteReader r(payload, size);
  std::vector<uint32_t> sizes(g.planes);
  for (auto& s : sizes) s = r.get<uint32_t>();
  std::vector<PlaneInfo> planes(g.planes);
  std::vector<RansTable> tables;
  std::vector<int> slot_range;
  for (int64_t p = 0; p < g.planes; ++p) {
    PlaneInfo& info = planes[p];
    info.offset = size - r.remaining();
    if (!r.take(sizes[p])) return Status::Fail("codec payload: plane sizes do not match the payload");
    if (h.codec == kCodecKivi) {
      const int bits = h.codec_params & 0xff;
      const int64_t group = h.codec_params >> 16;
      const int64_t groups = (p & 1) ? g.tokens * ((g.channels + group - 1) / group) : ((g.tokens + group - 1) / group) * g.channels;
      if (sizes[p] != uint64_t(4 * groups + (n * bits + 7) / 8)) return Status::Fail("codec payload: bad int plane size");
      continue;
    }
    const CacheGenStep step = cachegen_step(h.codec_params & 0xff, static_cast<int>(p / 2), static_cast<int>(h.layers), (p & 1) != 0);
    info.step = step.step;
    info.range = step.range;
    info.slot = -1;
    for (size_t s = 0; s < slot_range.size(); ++s)
      if (slot_range[s] == step.range) info.slot = static_cast<int>(s);
    if (info.slot < 0) {
      info.slot = static_cast<int>(slot_range.size());
      slot_range.push_back(step.range);
      for (int k = 0; k < kCacheGenModels; ++k) tables.push_back(cachegen_table(k, step.range));
    }
    if (!parse_cachegen_plane(payload, info.offset, sizes[p], g.tokens, g.channels, anchor, &info))
      return Status::Fail("codec payload: plane " + std::to_string(p) + " is corrupt");
  }
  if (!r.ok() || r.remaining() != 0) return Status::Fail("codec payload: plane sizes do not match the payload");

  auto s = reinterpret_cast<cudaStream_t>(stream);
  const size_t q_bytes = h.codec == kCodecCacheGen ? size_t(g.planes * n) * sizeof(int16_t) : 0;
  DeviceStaging staged(s, {{payload, size},
                           {planes.data(), planes.size() * sizeof(PlaneInfo)},
                           {tables.data(), tables.size() * sizeof(RansTable)},
                           {nullptr, q_bytes},
                           {nullptr, sizeof(int)}});
  if (staged.error() != cudaSuccess) return failed(staged.error(), "codec_decode_cuda");
  const auto* d_payload = staged.part<const uint8_t>(0);
  const auto* d_planes = staged.part<const PlaneInfo>(1);
  const auto* d_tables = staged.part<const RansTable>(2);
  auto* d_q = staged.part<int16_t>(3);
  auto* d_bad = staged.part<int>(4);
  const int threads = 256, blocks = grid_for(g.planes * n, threads);
  auto* dst = static_cast<uint8_t*>(out);
  if (h.codec == kCodecKivi) {
    kivi_kernel<<<blocks, threads, 0, s>>>(g, d_payload, d_planes, h.codec_params & 0xff, h.codec_params >> 16, dst);
  } else {
    const int lane_blocks = static_cast<int>((g.planes * kRansLanes + 63) / 64);
    cachegen_symbols_kernel<<<lane_blocks, 64, 0, s>>>(g, d_payload, d_planes, d_tables, anchor, d_q, d_bad);
    cachegen_values_kernel<<<blocks, threads, 0, s>>>(g, d_payload, d_planes, anchor, d_q, dst);
  }
  int bad = 0;
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) err = cudaMemcpyAsync(&bad, d_bad, sizeof(int), cudaMemcpyDeviceToHost, s);
  if (err != cudaSuccess) return failed(err, "codec_decode_cuda");
  st = finish(s, "codec_decode_cuda");  // host vectors must outlive the uploads
  if (!st.ok) return st;
  return bad ? Status::Fail("codec payload: an entropy-coded lane is corrupt") : Status::Ok();
}

// A chunk no CUDA decoder reads (kvtc under per-head bases): decoded by the host, then copied.
static Status decode_on_host(const DecodeJob& job, uintptr_t stream) {
  std::vector<uint8_t> raw(raw_payload_bytes(*job.header));
  Status st = codec_decode(*job.header, job.payload, job.size, raw.data(), 0);
  if (!st.ok) return st;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  cudaError_t err = cudaMemcpyAsync(job.out, raw.data(), raw.size(), cudaMemcpyHostToDevice, s);
  if (err != cudaSuccess) return failed(err, "codec_decode_cuda");
  return finish(s, "codec_decode_cuda");  // `raw` must outlive the copy
}

Status codec_decode_cuda_many(const std::vector<DecodeJob>& jobs, uintptr_t stream) {
  std::vector<DecodeJob> kvtc;
  for (const DecodeJob& job : jobs) {
    if (job.header->codec == kCodecKvtc && kvtc_payload_per_head(*job.header, job.payload, job.size)) {
      Status st = decode_on_host(job, stream);
      if (!st.ok) return st;
      continue;
    }
    if (job.header->codec == kCodecKvtc) {
      kvtc.push_back(job);
      continue;
    }
    Status st = codec_decode_cuda(*job.header, job.payload, job.size, job.out, stream);
    if (!st.ok) return st;
  }
  return kvtc.empty() ? Status::Ok() : kvtc_decode_cuda_batch(kvtc, stream);
}

}  // namespace kdn
