// `kvtc` codec (kdn/kvtc.h): component models, plane encoder and decoder (calibrations: kvtc_calibration.cpp).
#include "kdn/kvtc.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>

#include "kdn/byte_io.h"
#include "kdn/codec.h"
#include "kdn/convert.h"
#include "kdn/quant.h"
#include "kdn/rans.h"

namespace kdn {

namespace {

// Zero-inflated discrete Laplace models: P(0) = zero (Q16: 1 / (1 + 2^(4 - 2i)), i = 0..7) and
// P(+-r) proportional to decay^(r - 1) (Q16: 1 - 2^(-k), k = 0..7). Literal, so every machine
// builds the same tables. 64 models keep a plane's tables in a core's L2 cache while it decodes.
constexpr uint32_t kZeroQ16[kKvtcZeros] = {3855, 13107, 32768, 52429, 61681, 64528, 65281, 65472};
constexpr uint32_t kDecayQ16[kKvtcDecays] = {0, 32768, 49152, 57344, 61440, 63488, 64512, 65024};
constexpr int kSymbols = 2 * kKvtcRange + 1;

struct Model {
  RansTable table;
  float bits[kSymbols];
};

std::unique_ptr<Model> build_model(int m) {
  const uint64_t zero = kZeroQ16[m / kKvtcDecays], decay = kDecayQ16[m % kKvtcDecays];
  uint64_t weight[kKvtcRange + 1], w = 1ull << 40, rest = 0;
  for (int r = 1; r <= kKvtcRange; ++r) {
    weight[r] = w;
    rest += 2 * w;
    w = (w * decay) >> 16;
  }
  const uint32_t spare = kRansScale - kSymbols;  // every symbol keeps a frequency of at least 1
  const uint32_t zero_extra = static_cast<uint32_t>(spare * zero >> 16);
  uint16_t freq[kSymbols];
  uint32_t sum = 0;
  for (int r = 1; r <= kKvtcRange; ++r) {
    const auto f = static_cast<uint16_t>(1 + (spare - zero_extra) * (weight[r] >> 8) / (rest >> 8));
    freq[kKvtcRange + r] = freq[kKvtcRange - r] = f;
    sum += 2u * f;
  }
  freq[kKvtcRange] = static_cast<uint16_t>(kRansScale - sum);
  auto model = std::make_unique<Model>();
  rans_table_build(freq, kSymbols, &model->table);
  for (int s = 0; s < kSymbols; ++s)
    model->bits[s] = static_cast<float>(kRansProbBits - std::log2(static_cast<double>(freq[s])));
  return model;
}

const Model& model_of(int m) {
  static std::mutex mu;
  static std::unique_ptr<Model> built[kKvtcModels];
  std::lock_guard<std::mutex> lock(mu);
  if (!built[m]) built[m] = build_model(m);
  return *built[m];
}

// out[r][c] = mean[c] + sum over j (ascending) of v[r][j] * rows[j][c], each step one fused
// multiply-add, for `count` rows of K components: the decoder's reconstruction. The CUDA decoder
// sums in the same order with the same IEEE fma (__fmaf_rn), so both give the same values. A zero
// v[r][j] is skipped here and on the GPU: fma(0, x, acc) has acc's value (the AVX2 kernel below does
// not skip; a sum that is exactly -0 may then come out +0, the same value).
void reconstruct_portable(const float* v, const float* const* rows, const float* mean, int64_t count, int64_t K,
                          int64_t C, float* out) {
  for (int64_t r = 0; r < count; ++r) {
    float* o = out + r * C;
    std::copy(mean, mean + C, o);
    for (int64_t j = 0; j < K; ++j) {
      const float w = v[r * K + j];
      if (w != 0.f)
        for (int64_t c = 0; c < C; ++c) o[c] = std::fma(w, rows[j][c], o[c]);
    }
  }
}

#if defined(__x86_64__)
// The same for R rows at a time, 16 channels per tile: 2R accumulators, two basis vectors and one
// broadcast weight stay in the 16 AVX registers (R = 6 fills them). Dense over j: no branch on zero
// weights, whose fma leaves the sum's value unchanged. Measured against MKL's sgemm on the same
// shapes by benchmarks/bench_kvtc.py.
template <int R>
__attribute__((target("avx2,fma"), always_inline)) inline void reconstruct_rows_avx2(
    const float* v, const float* const* rows, const float* mean, int64_t K, int64_t C, float* out) {
  const int64_t tiled = C / 16 * 16;
  for (int64_t c0 = 0; c0 < tiled; c0 += 16) {
    __m256 lo[R], hi[R];
    const __m256 m0 = _mm256_loadu_ps(mean + c0), m1 = _mm256_loadu_ps(mean + c0 + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) lo[r] = m0, hi[r] = m1;
    for (int64_t j = 0; j < K; ++j) {
      const __m256 x0 = _mm256_loadu_ps(rows[j] + c0), x1 = _mm256_loadu_ps(rows[j] + c0 + 8);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 w = _mm256_broadcast_ss(v + r * K + j);
        lo[r] = _mm256_fmadd_ps(w, x0, lo[r]);
        hi[r] = _mm256_fmadd_ps(w, x1, hi[r]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * C + c0, lo[r]), _mm256_storeu_ps(out + r * C + c0 + 8, hi[r]);
  }
  for (int r = 0; r < R; ++r)  // channels past the last tile
    for (int64_t c = tiled; c < C; ++c) {
      float acc = mean[c];
      for (int64_t j = 0; j < K; ++j) acc = __builtin_fmaf(v[r * K + j], rows[j][c], acc);
      out[r * C + c] = acc;
    }
}

__attribute__((target("avx2,fma"))) void reconstruct_avx2(const float* v, const float* const* rows,
                                                          const float* mean, int64_t count, int64_t K, int64_t C,
                                                          float* out) {
  int64_t r = 0;
  for (; r + 6 <= count; r += 6) reconstruct_rows_avx2<6>(v + r * K, rows, mean, K, C, out + r * C);
  if (r + 4 <= count) reconstruct_rows_avx2<4>(v + r * K, rows, mean, K, C, out + r * C), r += 4;
  if (r + 2 <= count) reconstruct_rows_avx2<2>(v + r * K, rows, mean, K, C, out + r * C), r += 2;
  if (r < count) reconstruct_rows_avx2<1>(v + r * K, rows, mean, K, C, out + r * C);
}
#endif

void reconstruct(const float* v, const float* const* rows, const float* mean, int64_t count, int64_t K, int64_t C,
                 float* out) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) return reconstruct_avx2(v, rows, mean, count, K, C, out);
#endif
  reconstruct_portable(v, rows, mean, count, K, C, out);
}

// reconstruct() under per-head bases: each head's channels from its own components only (a basis
// row is zero outside its head, so the other heads' terms add nothing): 1 / heads of the work.
void reconstruct_by_head(const float* v, const std::vector<const float*>& rows, const std::vector<int>& head,
                         const float* mean, int64_t count, int64_t head_dim, int64_t C, float* out) {
  const int64_t live = static_cast<int64_t>(rows.size());
  std::vector<float> vh, part(static_cast<size_t>(count) * head_dim);
  std::vector<const float*> rh;
  for (int64_t h = 0; h < C / head_dim; ++h) {
    std::vector<int64_t> mine;
    for (int64_t j = 0; j < live; ++j)
      if (head[j] == h) mine.push_back(j);
    const int64_t k = static_cast<int64_t>(mine.size());
    vh.resize(static_cast<size_t>(count) * k);
    rh.clear();
    for (int64_t j : mine) rh.push_back(rows[j] + h * head_dim);
    for (int64_t r = 0; r < count; ++r)
      for (int64_t i = 0; i < k; ++i) vh[r * k + i] = v[r * live + mine[i]];
    reconstruct(vh.data(), rh.data(), mean + h * head_dim, count, k, head_dim, part.data());
    for (int64_t r = 0; r < count; ++r)
      std::copy(&part[r * head_dim], &part[(r + 1) * head_dim], out + r * C + h * head_dim);
  }
}

// Turns every head's pairs of a key row by the (cos, sin) of table[pair] (sign -1: backwards).
void rotate_row(float* row, int64_t channels, int64_t head_dim, RopeStyle style, const float* table, float sign) {
  for (int64_t h = 0; h < channels / head_dim; ++h)
    for (int64_t i = 0; i < head_dim / 2; ++i) {
      int64_t a, b;
      rope_pair(style, head_dim, i, &a, &b);
      rope_turn(&row[h * head_dim + a], &row[h * head_dim + b], table[2 * i], sign * table[2 * i + 1]);
    }
}

// Which (coded row, KV head) rows a plane under a per-head calibration holds: one bit each, LSB
// first, in the payload after the component models. Off (no bits, every row present) otherwise.
struct KvtcPresence {
  bool on;
  int64_t heads;
  std::vector<uint8_t> bits;
  KvtcPresence(bool per_head, int64_t rows, int64_t heads_)
      : on(per_head), heads(heads_), bits(per_head ? static_cast<size_t>((rows * heads_ + 7) / 8) : 0, 0) {}
  void set(int64_t row, int64_t head, bool held) {
    const int64_t i = row * heads + head;
    if (held) bits[i / 8] |= static_cast<uint8_t>(1u << (i % 8));
  }
  bool held(int64_t row, int64_t head) const {
    const int64_t i = row * heads + head;
    return !on || (bits[i / 8] >> (i % 8) & 1);
  }
  // whether coded component j (of L.coded) has a value in `row`
  bool has(int64_t row, const KvtcLayout& L, int64_t j) const {
    return !on || held(row, L.plane->head[L.coded[j]]);
  }
};

}  // namespace

const RansTable& kvtc_table(int m) { return model_of(m).table; }

uint8_t kvtc_choose_model(const uint32_t* h, double* model_bits, double* empirical_bits) {
  double n = 0, abs_sum = 0, empirical = 0;
  int used[kSymbols], count = 0;
  for (int s = 0; s < kSymbols; ++s)
    if (h[s]) {
      used[count++] = s;
      n += h[s];
      abs_sum += static_cast<double>(h[s]) * std::abs(s - kKvtcRange);
    }
  const double zeros = h[kKvtcRange];
  if (n == 0 || zeros == n) return kKvtcAllZero;
  for (int k = 0; k < count; ++k) empirical += h[used[k]] * std::log2(n / h[used[k]]);
  // start from the grid points nearest the histogram's P(0) and mean |r| over r != 0, then search around
  const double zero_q16 = 65536.0 * zeros / n, decay_q16 = 65536.0 * (1.0 - (n - zeros) / abs_sum);
  int zi = 0, di = 0;
  while (zi + 1 < kKvtcZeros && kZeroQ16[zi + 1] <= zero_q16) ++zi;
  while (di + 1 < kKvtcDecays && kDecayQ16[di + 1] <= decay_q16) ++di;
  double best = INFINITY;
  int choice = 0;
  for (int z = std::max(0, zi - 2); z <= std::min(kKvtcZeros - 1, zi + 2); ++z)
    for (int d = std::max(0, di - 2); d <= std::min(kKvtcDecays - 1, di + 2); ++d) {
      const Model& m = model_of(z * kKvtcDecays + d);
      double bits = 0;
      for (int k = 0; k < count; ++k) bits += h[used[k]] * static_cast<double>(m.bits[used[k]]);
      if (bits < best) {
        best = bits;
        choice = z * kKvtcDecays + d;
      }
    }
  *model_bits += best;
  *empirical_bits += empirical;
  return static_cast<uint8_t>(choice);
}

bool kvtc_layout(const Plane& p, uint32_t params, const KvtcCalibration& cal, KvtcLayout* out) {
  const int ratio = cal.ratio_index(params & 0xff);
  if (ratio < 0 || cal.layers != static_cast<uint32_t>(p.layers) || cal.channels != p.channels ||
      cal.head_dim != static_cast<uint32_t>(p.head_dim))
    return false;
  out->plane = &cal.planes[2 * p.layer + (p.values ? 1 : 0)];
  const float* step = out->plane->step.data() + static_cast<size_t>(ratio) * cal.components;
  out->coded.clear();
  out->steps.clear();
  for (uint32_t i = 0; i < cal.components; ++i)
    if (step[i] > 0) {
      out->coded.push_back(static_cast<int>(i));
      out->steps.push_back(step[i]);
    }
  const int64_t sink = params >> 8 & 0xff, recent = params >> 16 & 0xff;
  out->first_coded = std::clamp<int64_t>(sink - p.position, 0, p.tokens);
  out->end_coded = std::max(out->first_coded, p.tokens - recent);
  out->angles.reset();
  if (!p.values && cal.prerope) {
    // every key plane of a chunk turns by the same angles: computed once per thread and chunk, shared
    thread_local Key128 last_cal{};
    thread_local int64_t last_position = -1, last_tokens = -1;
    thread_local std::shared_ptr<const std::vector<float>> last_angles;
    if (last_cal != cal.id || last_position != p.position || last_tokens != p.tokens) {
      std::vector<int64_t> positions(p.tokens);
      for (int64_t t = 0; t < p.tokens; ++t) positions[t] = p.position + t;
      auto angles = std::make_shared<std::vector<float>>(static_cast<size_t>(p.tokens) * cal.head_dim);
      rope_angle_table(RopeShift{1, 1, p.tokens, cal.head_dim, cal.style}, cal.inv_freq.data(), positions.data(),
                       angles->data());
      last_angles = std::move(angles);
      last_cal = cal.id, last_position = p.position, last_tokens = p.tokens;
    }
    out->angles = last_angles;
  }
  return true;
}

Status kvtc_check(uint32_t params) {
  const uint32_t ratio = params & 0xff;
  if (ratio < 2) return Status::Fail("kvtc ratio must be in [2, 255], got " + std::to_string(ratio));
  if (params >> 24) return Status::Fail("kvtc: reserved parameter bits set");
  return Status::Ok();
}

std::shared_ptr<const void> kvtc_prepare(const BlobHeader& h) {
  std::shared_ptr<const KvtcCalibration> calibration = kvtc_for_model(h.fingerprint);
  KDN_CHECK_INPUT(calibration, "kvtc: no calibration is loaded for this model (kdn.kvtc.calibrate, KDN.calibrate)");
  return calibration;
}

std::vector<uint8_t> kvtc_encode(const Plane& p, uint32_t params, const uint8_t* raw, const void* state,
                                 CodecReport* report) {
  const KvtcCalibration& cal = *static_cast<const KvtcCalibration*>(state);
  KvtcLayout L;
  if (!kvtc_layout(p, params, cal, &L)) {
    std::string offered;
    for (uint32_t r : cal.ratios) offered += (offered.empty() ? "" : ", ") + std::to_string(r);
    throw InputError("kvtc: the model's calibration does not fit this KV or offers no ratio " +
                         std::to_string(params & 0xff) + " (it offers " + offered + ")",
                     __FILE__, __LINE__);
  }
  const int64_t T = p.tokens, C = p.channels, K = static_cast<int64_t>(L.coded.size());
  const size_t dsize = dtype_size(p.dtype);
  constexpr int symbols = 2 * kKvtcRange + 1;
  const int64_t exact = T - (L.end_coded - L.first_coded);
  std::vector<int16_t> q(static_cast<size_t>(T - exact) * K);
  std::vector<uint32_t> hist(static_cast<size_t>(K) * symbols, 0);
  std::vector<float> x(C);
  const int64_t H = C / p.head_dim;
  KvtcPresence present(cal.per_head, T - exact, H);
  for (int64_t t = L.first_coded, row = 0; t < L.end_coded; ++t, ++row) {
    for (int64_t c = 0; c < C; ++c) {
      x[c] = load_float(raw, p.dtype, t * C + c);
      KDN_CHECK_INPUT(std::isfinite(x[c]) && std::fabs(x[c]) < 60000.f, "kvtc needs finite KV within the fp16 range");
    }
    if (cal.per_head)
      for (int64_t h = 0; h < H; ++h)
        present.set(row, h, std::any_of(&x[h * p.head_dim], &x[(h + 1) * p.head_dim], [](float v) { return v != 0.f; }));
    if (L.angles) rotate_row(x.data(), C, p.head_dim, cal.style, &(*L.angles)[t * p.head_dim], -1.f);
    for (int64_t c = 0; c < C; ++c) x[c] -= L.plane->mean[c];
    for (int64_t j = 0; j < K; ++j) {
      if (!present.has(row, L, j)) continue;  // q stays 0, not coded
      const float* b = &L.plane->basis[static_cast<size_t>(L.coded[j]) * C];
      double z = 0;
      for (int64_t c = 0; c < C; ++c) z += static_cast<double>(b[c]) * x[c];
      const double s = std::nearbyint(z / L.steps[j]);
      const int v = static_cast<int>(std::clamp(s, -static_cast<double>(kKvtcRange), static_cast<double>(kKvtcRange)));
      q[row * K + j] = static_cast<int16_t>(v);
      ++hist[j * symbols + v + kKvtcRange];
    }
  }
  ByteWriter w;
  w.append(cal.id.data(), 16);
  std::vector<uint8_t> choice(K);
  std::vector<int64_t> live;  // components with symbols to code
  for (int64_t j = 0; j < K; ++j) {
    choice[j] = kvtc_choose_model(&hist[j * symbols], &report->model_bits, &report->empirical_bits);
    if (choice[j] != kKvtcAllZero) live.push_back(j);
  }
  w.append(choice.data(), K);
  w.append(present.bits.data(), present.bits.size());
  w.append(raw, L.first_coded * C * dsize);  // exact rows: the sink ones, then the recent ones
  w.append(raw + L.end_coded * C * dsize, (T - L.end_coded) * C * dsize);
  const int64_t rows = L.end_coded - L.first_coded, n_live = static_cast<int64_t>(live.size());
  std::vector<uint16_t> cum, freq;
  cum.reserve(rows * n_live), freq.reserve(rows * n_live);
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t j : live) {
      if (!present.has(row, L, j)) continue;
      const RansTable& tab = kvtc_table(choice[j]);
      cum.push_back(tab.cum[q[row * K + j] + kKvtcRange]);
      freq.push_back(tab.freq[q[row * K + j] + kKvtcRange]);
    }
  const size_t n = cum.size();
  const size_t before = w.out.size();
  rans_encode(cum.data(), freq.data(), n, w);
  report->coded_bytes += w.out.size() - before;
  report->table_bytes += 16 + K + present.bits.size();
  report->side_bytes += exact * C * dsize;
  report->symbols += n;
  return std::move(w.out);
}

bool kvtc_decode(const Plane& p, uint32_t params, const uint8_t* in, size_t size, uint8_t* out) {
  Key128 id;
  if (!kvtc_plane_calibration(in, size, &id)) return false;
  const auto cal = kvtc_by_id(id);
  KvtcLayout L;
  if (!cal || !kvtc_layout(p, params, *cal, &L)) return false;
  const int64_t T = p.tokens, C = p.channels, K = static_cast<int64_t>(L.coded.size());
  const size_t dsize = dtype_size(p.dtype);
  ByteReader r(in, size);
  r.take(16);
  const uint8_t* choice = r.take(K);
  const int64_t exact_rows = T - (L.end_coded - L.first_coded), H = C / p.head_dim;
  KvtcPresence present(cal->per_head, T - exact_rows, H);
  const uint8_t* bits = r.take(present.bits.size());
  if (bits) std::copy(bits, bits + present.bits.size(), present.bits.begin());
  const uint8_t* exact = r.take(exact_rows * C * dsize);
  RansLane lanes[kRansLanes];
  if (!r.ok() || !rans_open(r, lanes) || r.remaining() != 0) return false;
  std::vector<const RansTable*> table;  // the components with coded symbols
  std::vector<const float*> rows;
  std::vector<float> steps;
  std::vector<int> head;  // per-head calibrations: each live component's KV head
  for (int64_t j = 0; j < K; ++j) {
    if (choice[j] == kKvtcAllZero) continue;
    if (choice[j] >= kKvtcModels) return false;
    table.push_back(&kvtc_table(choice[j]));
    rows.push_back(&L.plane->basis[static_cast<size_t>(L.coded[j]) * C]);
    steps.push_back(L.steps[j]);
    if (present.on) head.push_back(L.plane->head[L.coded[j]]);
  }
  const int64_t live = static_cast<int64_t>(table.size());
  std::memcpy(out, exact, L.first_coded * C * dsize);
  std::memcpy(out + L.end_coded * C * dsize, exact + L.first_coded * C * dsize, (T - L.end_coded) * C * dsize);
  // symbols first (the values q * step, row by row), then the reconstruction of every row
  const int64_t count = L.end_coded - L.first_coded;
  // every element is written before it is read: no zero-fill
  std::unique_ptr<float[]> v(new float[static_cast<size_t>(count) * live]);
  std::unique_ptr<float[]> rows_out(new float[static_cast<size_t>(count) * C]);
  // symbol i is in lane i % kRansLanes and of component i % live: the lanes run in lockstep, each
  // on a local copy of its state, so their decodes overlap
  static_assert(kRansLanes == 4, "the symbol loops below are unrolled for 4 lanes");
  RansLane l0 = lanes[0], l1 = lanes[1], l2 = lanes[2], l3 = lanes[3];
  if (present.on) {  // symbols only for the heads a row holds: each symbol's (value, component) listed first
    std::fill(v.get(), v.get() + count * live, 0.f);
    std::vector<int32_t> at, comp;
    at.reserve(count * live), comp.reserve(count * live);
    for (int64_t row = 0; row < count; ++row)
      for (int64_t jj = 0; jj < live; ++jj)
        if (present.held(row, head[jj])) at.push_back(static_cast<int32_t>(row * live + jj)), comp.push_back(int32_t(jj));
    const int64_t m = static_cast<int64_t>(at.size());
    int64_t k = 0;
    for (; k + kRansLanes <= m; k += kRansLanes) {
      const int32_t c0 = comp[k], c1 = comp[k + 1], c2 = comp[k + 2], c3 = comp[k + 3];
      const int s0 = rans_lane_decode(l0, *table[c0]), s1 = rans_lane_decode(l1, *table[c1]);
      const int s2 = rans_lane_decode(l2, *table[c2]), s3 = rans_lane_decode(l3, *table[c3]);
      v[at[k]] = static_cast<float>(s0 - kKvtcRange) * steps[c0];
      v[at[k + 1]] = static_cast<float>(s1 - kKvtcRange) * steps[c1];
      v[at[k + 2]] = static_cast<float>(s2 - kKvtcRange) * steps[c2];
      v[at[k + 3]] = static_cast<float>(s3 - kKvtcRange) * steps[c3];
    }
    RansLane* tail[kRansLanes] = {&l0, &l1, &l2, &l3};
    for (int lane = 0; k < m; ++k, ++lane)
      v[at[k]] = static_cast<float>(rans_lane_decode(*tail[lane], *table[comp[k]]) - kKvtcRange) * steps[comp[k]];
  }
  const int64_t n = present.on ? 0 : count * live;
  int64_t i = 0, j = 0;
  const auto next = [live](int64_t c) { return c + 1 == live ? 0 : c + 1; };
  for (; i + kRansLanes <= n; i += kRansLanes) {
    const int64_t j1 = next(j), j2 = next(j1), j3 = next(j2);
    const int s0 = rans_lane_decode(l0, *table[j]), s1 = rans_lane_decode(l1, *table[j1]);
    const int s2 = rans_lane_decode(l2, *table[j2]), s3 = rans_lane_decode(l3, *table[j3]);
    v[i] = static_cast<float>(s0 - kKvtcRange) * steps[j];
    v[i + 1] = static_cast<float>(s1 - kKvtcRange) * steps[j1];
    v[i + 2] = static_cast<float>(s2 - kKvtcRange) * steps[j2];
    v[i + 3] = static_cast<float>(s3 - kKvtcRange) * steps[j3];
    j = next(j3);
  }
  RansLane* tail[kRansLanes] = {&l0, &l1, &l2, &l3};
  for (int lane = 0; i < n; ++i, ++lane, j = next(j))
    v[i] = static_cast<float>(rans_lane_decode(*tail[lane], *table[j]) - kKvtcRange) * steps[j];
  lanes[0] = l0, lanes[1] = l1, lanes[2] = l2, lanes[3] = l3;
  if (present.on)
    reconstruct_by_head(v.get(), rows, head, L.plane->mean.data(), count, p.head_dim, C, rows_out.get());
  else
    reconstruct(v.get(), rows.data(), L.plane->mean.data(), count, live, C, rows_out.get());
  for (int64_t t = L.first_coded; t < L.end_coded; ++t) {
    float* row = &rows_out[(t - L.first_coded) * C];
    if (L.angles) rotate_row(row, C, p.head_dim, cal->style, &(*L.angles)[t * p.head_dim], 1.f);
    for (int64_t h = 0; h < H; ++h)  // a head the row does not hold decodes as zeros
      if (!present.held(t - L.first_coded, h)) std::fill(row + h * p.head_dim, row + (h + 1) * p.head_dim, 0.f);
    store_floats(out, p.dtype, t * C, row, C);
  }
  for (const RansLane& lane : lanes)
    if (!rans_lane_finished(lane)) return false;
  return true;
}

}  // namespace kdn
