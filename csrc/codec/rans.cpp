// rANS tables, histogram normalization and the lane encoder (format in kdn/rans.h).
#include "kdn/rans.h"

#include <algorithm>
#include <cstring>

namespace kdn {

bool rans_table_build(const uint16_t* freq, int symbols, RansTable* out) {
  if (symbols < 1 || symbols > kRansMaxSymbols) return false;
  uint32_t total = 0;
  for (int s = 0; s < symbols; ++s) {
    if (freq[s] > kRansScale) return false;
    out->freq[s] = freq[s];
    out->cum[s] = static_cast<uint16_t>(total);
    std::memset(out->slot + total, s, freq[s] <= kRansScale - total ? freq[s] : 0);
    total += freq[s];
    if (total > kRansScale) return false;
  }
  out->symbols = symbols;
  return total == kRansScale;
}

void rans_normalize(const uint64_t* counts, int symbols, uint16_t* freq) {
  uint64_t total = 0;
  int present = 0;
  for (int s = 0; s < symbols; ++s) {
    total += counts[s];
    present += counts[s] > 0;
  }
  if (total == 0) {  // nothing to code: any valid table
    std::fill(freq, freq + symbols, 0);
    freq[0] = kRansScale;
    return;
  }
  // Every present symbol gets 1, the rest of the scale is shared in proportion (floor), and the
  // remainder goes to the most frequent symbol.
  const uint64_t spare = kRansScale - present;
  uint32_t sum = 0;
  int top = 0;
  for (int s = 0; s < symbols; ++s) {
    freq[s] = counts[s] ? static_cast<uint16_t>(1 + counts[s] * spare / total) : 0;
    sum += freq[s];
    if (counts[s] > counts[top]) top = s;
  }
  freq[top] = static_cast<uint16_t>(freq[top] + (kRansScale - sum));
}

void rans_encode(const uint16_t* cum, const uint16_t* freq, size_t n, ByteWriter& out) {
  // At most one 16-bit word per symbol + the 4-byte state.
  const size_t lane_cap = 2 * (n / kRansLanes + 1) + 4;
  std::vector<uint8_t> buf(lane_cap * kRansLanes);
  uint32_t lane_bytes[kRansLanes];
  const uint8_t* lane_start[kRansLanes];
  for (int j = 0; j < kRansLanes; ++j) {
    uint8_t* end = buf.data() + (j + 1) * lane_cap;
    uint8_t* p = end;
    uint32_t x = kRansLow;
    // the last symbol of this lane first: rANS decodes in the reverse order of encoding
    const size_t count = n > static_cast<size_t>(j) ? (n - j + kRansLanes - 1) / kRansLanes : 0;
    for (size_t k = count; k-- > 0;) {
      const size_t i = j + k * kRansLanes;
      const uint32_t f = freq[i];
      const uint64_t x_max = uint64_t((kRansLow >> kRansProbBits) << 16) * f;  // 2^32 when f is the whole scale
      if (x >= x_max) {  // at most one word: x < 2^32 <= x_max << 16
        p -= 2;
        p[0] = static_cast<uint8_t>(x);
        p[1] = static_cast<uint8_t>(x >> 8);
        x >>= 16;
      }
      x = ((x / f) << kRansProbBits) + (x % f) + cum[i];
    }
    p -= 4;
    std::memcpy(p, &x, 4);
    lane_bytes[j] = static_cast<uint32_t>(end - p);
    lane_start[j] = p;
  }
  for (uint32_t b : lane_bytes) out.put<uint32_t>(b);
  for (int j = 0; j < kRansLanes; ++j) out.append(lane_start[j], lane_bytes[j]);
}

bool rans_open(ByteReader& in, RansLane lanes[kRansLanes]) {
  uint32_t lane_bytes[kRansLanes];
  for (uint32_t& b : lane_bytes) b = in.get<uint32_t>();
  if (!in.ok()) return false;
  for (int j = 0; j < kRansLanes; ++j) {
    const uint8_t* p = in.take(lane_bytes[j]);
    if (p == nullptr) return false;
    rans_lane_init(lanes[j], p, p + lane_bytes[j]);
    if (!lanes[j].ok) return false;
  }
  return true;
}

}  // namespace kdn
