// `cachegen` codec: CacheGen-style quantization per token vector with layer-dependent bins, optional
// anchor/delta coding, and rANS under per-(K or V, layer, channel) Laplace models.
//
// A plane's values x[t][c] are normalized per channel (u = (x - offset[c]) / scale[c], so the key
// channels' outliers do not set everyone's step), then each token vector is quantized with its
// own scale (its RMS: q = round(u / (step * rms))), step and range chosen by level and layer group.
// With anchor/delta coding, tokens other than the first of each group of kCacheGenAnchorGroup code
// their difference to the group's reconstructed first token. Each context (channel, and anchor
// vs delta) picks one of kCacheGenModels discrete Laplace models, the one that codes its symbols
// shortest; only that 1-byte choice is transmitted, so models cost ~0.03 bits per value at 256 tokens.
//
// Plane payload: fp16 offset[C], fp16 scale[C], fp16 rms[T], u8 model[contexts], rANS section.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>

#include "kdn/byte_io.h"
#include "kdn/cachegen.h"
#include "kdn/codec.h"
#include "kdn/convert.h"
#include "kdn/quant.h"

namespace kdn {
namespace {

// Decay per model in Q16: rho_k = 1 - 2^(-k/8) (literal, so every machine builds the same tables).
constexpr uint32_t kDecayQ16[kCacheGenModels] = {
    0,     5439,  10427, 15001, 19195, 23041, 26568, 29802, 32768, 35488, 37982, 40268, 42366,
    44289, 46052, 47669, 49152, 50512, 51759, 52902, 53951, 54912, 55794, 56603, 57344, 58024,
    58647, 59219, 59743, 60224, 60665, 61069, 61440, 61780, 62092, 62378, 62640, 62880, 63101,
    63303, 63488, 63658, 63814, 63957, 64088, 64208, 64318, 64419, 64512, 64597, 64675, 64746,
    64812, 64872, 64927, 64978, 65024, 65066, 65105, 65141, 65174, 65204, 65232, 65257};

struct Model {
  RansTable table;
  float bits[kRansMaxSymbols];
  double mean_abs;
};

std::unique_ptr<Model> build_model(int k, int range) {
  auto m = std::make_unique<Model>();
  const int n = 2 * range + 1;
  uint64_t weight[kRansMaxSymbols];
  uint64_t w = 1ull << 30, total = 0;
  for (int r = 0; r <= range; ++r) {
    weight[range + r] = weight[range - r] = w;
    total += r ? 2 * w : w;
    w = (w * kDecayQ16[k]) >> 16;
  }
  uint16_t freq[kRansMaxSymbols];
  uint32_t sum = 0;
  const uint64_t spare = kRansScale - n;
  for (int s = 0; s < n; ++s) sum += freq[s] = static_cast<uint16_t>(1 + weight[s] * spare / total);
  freq[range] = static_cast<uint16_t>(freq[range] + kRansScale - sum);
  rans_table_build(freq, n, &m->table);
  m->mean_abs = 0;
  for (int s = 0; s < n; ++s) {
    m->bits[s] = static_cast<float>(kRansProbBits - std::log2(static_cast<double>(freq[s])));
    m->mean_abs += std::abs(s - range) * static_cast<double>(freq[s]) / kRansScale;
  }
  return m;
}

// The models of one range, built once per process and kept (a decoder looks them up per plane).
struct Models {
  const Model* m[kCacheGenModels];
};

const Models& models_for(int range) {
  static std::mutex mu;
  static std::unique_ptr<Models> by_range[kRansMaxSymbols / 2];
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = by_range[range];
  if (!slot) {
    slot = std::make_unique<Models>();
    for (int k = 0; k < kCacheGenModels; ++k) {
      static std::map<int, std::unique_ptr<Model>> built;
      auto& m = built[k * 256 + range];
      if (!m) m = build_model(k, range);
      slot->m[k] = m.get();
    }
  }
  return *slot;
}

int context_of(int64_t t, int64_t c, int64_t channels, bool anchor) {
  return static_cast<int>(anchor && t % kCacheGenAnchorGroup ? channels + c : c);
}

}  // namespace

CacheGenStep cachegen_step(int level, int layer, int layers, bool values) {
  // (keys, values) steps per level, chosen on SmolLM2-135M KV (benchmarks/bench_codecs.py):
  // level 1 ~6x smaller than fp16, level 2 ~5x, level 3 ~4x.
  static const float kStep[3][2] = {{0.45f, 1.0f}, {0.3f, 0.8f}, {0.2f, 0.45f}};
  static const float kGroup[3] = {0.85f, 1.0f, 1.0f};  // shallow, middle, deep thirds of the layers
  const int group = std::min(2, 3 * layer / std::max(1, layers));
  const float step = kStep[level - 1][values ? 1 : 0] * kGroup[group];
  return {step, std::min(127, static_cast<int>(std::ceil(12.f / step)))};
}

const RansTable& cachegen_table(int k, int range) { return models_for(range).m[k]->table; }

int cachegen_choose_model(const uint32_t* h, int range, double* model_bits, double* empirical_bits) {
  const Models& models = models_for(range);
  const int symbols = 2 * range + 1;
  double count = 0, abs_sum = 0, empirical = 0;
  for (int s = 0; s < symbols; ++s) {
    count += h[s];
    abs_sum += static_cast<double>(h[s]) * std::abs(s - range);
  }
  if (count == 0) return 0;
  for (int s = 0; s < symbols; ++s)
    if (h[s]) empirical += h[s] * std::log2(count / h[s]);
  int guess = 0;  // the model whose mean |symbol| is closest, then its neighbours
  while (guess + 1 < kCacheGenModels && models.m[guess + 1]->mean_abs <= abs_sum / count) ++guess;
  double best = INFINITY;
  int choice = 0;
  for (int k = std::max(0, guess - 3); k <= std::min(kCacheGenModels - 1, guess + 4); ++k) {
    double bits = 0;
    for (int s = 0; s < symbols; ++s)
      if (h[s]) bits += h[s] * static_cast<double>(models.m[k]->bits[s]);
    if (bits < best) {
      best = bits;
      choice = k;
    }
  }
  *model_bits += best;
  *empirical_bits += empirical;
  return choice;
}

Status cachegen_check(uint32_t params) {
  const uint32_t level = params & 0xff, flags = params >> 8;
  if (level < 1 || level > 3) return Status::Fail("cachegen level must be 1, 2 or 3, got " + std::to_string(level));
  if (flags > 1) return Status::Fail("cachegen: unknown flags " + std::to_string(flags));
  return Status::Ok();
}

std::vector<uint8_t> cachegen_encode(const Plane& p, uint32_t params, const uint8_t* raw, const void*,
                                     CodecReport* report) {
  const bool anchor = (params >> 8) & 1;
  const CacheGenStep st = cachegen_step(static_cast<int>(params & 0xff), p.layer, p.layers, p.values);
  const int64_t T = p.tokens, C = p.channels, n = p.count(), symbols = 2 * st.range + 1;
  const int contexts = static_cast<int>(anchor ? 2 * C : C);
  // per-channel offset and scale
  std::vector<uint16_t> offset(C), scale(C), rms(T);
  std::vector<float> off_f(C), scale_f(C);
  for (int64_t c = 0; c < C; ++c) {
    double sum = 0, sq = 0;
    for (int64_t t = 0; t < T; ++t) {
      const double x = load_float(raw, p.dtype, t * C + c);
      KDN_CHECK_INPUT(std::isfinite(x) && std::fabs(x) < 60000.0, "cachegen needs finite KV within the fp16 range");
      sum += x;
      sq += x * x;
    }
    const double mean = sum / T, var = std::max(0.0, sq / T - mean * mean);
    offset[c] = float_to_fp16(static_cast<float>(mean));
    off_f[c] = fp16_to_float(offset[c]);
    scale[c] = float_to_fp16(static_cast<float>(std::max(std::sqrt(var), 1e-4)));
    scale_f[c] = fp16_to_float(scale[c]);
  }
  // per-token quantization, anchors reconstructed as the decoder will see them
  std::vector<int16_t> q(n);
  std::vector<float> d(C), ref(C, 0.f), u_hat(C);
  for (int64_t t = 0; t < T; ++t) {
    const bool delta = anchor && t % kCacheGenAnchorGroup;
    double sq = 0;
    for (int64_t c = 0; c < C; ++c) {
      d[c] = (load_float(raw, p.dtype, t * C + c) - off_f[c]) / scale_f[c] - (delta ? ref[c] : 0.f);
      sq += static_cast<double>(d[c]) * d[c];
    }
    rms[t] = float_to_fp16(static_cast<float>(std::sqrt(sq / C)));
    const float unit = st.step * fp16_to_float(rms[t]);
    for (int64_t c = 0; c < C; ++c) {
      const float v = unit > 0 ? std::nearbyint(d[c] / unit) : 0.f;
      q[t * C + c] = static_cast<int16_t>(std::clamp(v, -static_cast<float>(st.range), static_cast<float>(st.range)));
      u_hat[c] = cachegen_normalized(q[t * C + c], st.step, fp16_to_float(rms[t]), delta ? ref[c] : 0.f);
    }
    if (!delta) ref = u_hat;
  }
  // per-context model choice: the Laplace model that codes the context's symbols shortest
  std::vector<uint32_t> hist(static_cast<size_t>(contexts) * symbols, 0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < C; ++c) ++hist[context_of(t, c, C, anchor) * symbols + q[t * C + c] + st.range];
  const Models& models = models_for(st.range);
  std::vector<uint8_t> choice(contexts);
  for (int ctx = 0; ctx < contexts; ++ctx)
    choice[ctx] = static_cast<uint8_t>(cachegen_choose_model(&hist[static_cast<size_t>(ctx) * symbols], st.range,
                                                             &report->model_bits, &report->empirical_bits));
  ByteWriter w;
  w.append(reinterpret_cast<const uint8_t*>(offset.data()), 2 * C);
  w.append(reinterpret_cast<const uint8_t*>(scale.data()), 2 * C);
  w.append(reinterpret_cast<const uint8_t*>(rms.data()), 2 * T);
  w.append(choice.data(), contexts);
  std::vector<uint16_t> cum(n), freq(n);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < C; ++c) {
      const RansTable& tab = models.m[choice[context_of(t, c, C, anchor)]]->table;
      const int s = q[t * C + c] + st.range;
      cum[t * C + c] = tab.cum[s];
      freq[t * C + c] = tab.freq[s];
    }
  const size_t before = w.out.size();
  rans_encode(cum.data(), freq.data(), n, w);
  report->coded_bytes += w.out.size() - before;
  report->table_bytes += contexts;
  report->side_bytes += 4 * C + 2 * T;
  report->symbols += n;
  return std::move(w.out);
}

bool cachegen_decode(const Plane& p, uint32_t params, const uint8_t* in, size_t size, uint8_t* out) {
  const bool anchor = (params >> 8) & 1;
  const CacheGenStep st = cachegen_step(static_cast<int>(params & 0xff), p.layer, p.layers, p.values);
  const int64_t T = p.tokens, C = p.channels;
  const int contexts = static_cast<int>(anchor ? 2 * C : C);
  ByteReader r(in, size);
  const uint8_t* offset = r.take(2 * C);
  const uint8_t* scale = r.take(2 * C);
  const uint8_t* rms = r.take(2 * T);
  const uint8_t* choice = r.take(contexts);
  RansLane lanes[kRansLanes];
  if (!r.ok() || !rans_open(r, lanes) || r.remaining() != 0) return false;
  const Models& models = models_for(st.range);
  std::vector<const RansTable*> table(contexts);
  for (int ctx = 0; ctx < contexts; ++ctx) {
    if (choice[ctx] >= kCacheGenModels) return false;
    table[ctx] = &models.m[choice[ctx]]->table;
  }
  std::vector<float> off_f(C), scale_f(C), ref(C, 0.f), row(C);
  for (int64_t c = 0; c < C; ++c) {
    uint16_t h;
    std::memcpy(&h, offset + 2 * c, 2);
    off_f[c] = fp16_to_float(h);
    std::memcpy(&h, scale + 2 * c, 2);
    scale_f[c] = fp16_to_float(h);
  }
  // Symbols arrive token by token; each token's row is dequantized as soon as it is decoded.
  for (int64_t t = 0; t < T; ++t) {
    const bool delta = anchor && t % kCacheGenAnchorGroup;
    const RansTable* const* tabs = table.data() + (delta ? C : 0);
    uint16_t h;
    std::memcpy(&h, rms + 2 * t, 2);
    const float ts = fp16_to_float(h);
    const int64_t first = t * C;
    auto value = [&](int64_t c, int s) {
      const float u = cachegen_normalized(s - st.range, st.step, ts, delta ? ref[c] : 0.f);
      if (anchor && !delta) ref[c] = u;
      row[c] = cachegen_denormalize(u, off_f[c], scale_f[c]);
    };
    int64_t c = 0;
    if (first % kRansLanes == 0)  // lanes in step with channels: unrolled, the usual case
      for (; c + kRansLanes <= C; c += kRansLanes)
        for (int j = 0; j < kRansLanes; ++j) value(c + j, rans_lane_decode(lanes[j], *tabs[c + j]));
    for (; c < C; ++c) value(c, rans_lane_decode(lanes[(first + c) % kRansLanes], *tabs[c]));
    store_floats(out, p.dtype, first, row.data(), C);
  }
  for (const RansLane& lane : lanes)
    if (!rans_lane_finished(lane)) return false;
  return true;
}

}  // namespace kdn
