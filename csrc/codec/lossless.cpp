// `lossless` codec: each plane split into byte planes (byte b of every element), each byte plane
// rANS-coded under its own order-0 table, or stored when coding would not pay (mantissa noise).
//
// Plane payload, per byte plane b < element size:
//   u8 mode: 0 stored -> count bytes | 1 coded -> u16 n, n x (u8 symbol, u16 freq) ascending, rANS section
#include <cmath>

#include "kdn/byte_io.h"
#include "kdn/codec.h"
#include "kdn/rans.h"

namespace kdn {

Status lossless_check(uint32_t params) {
  return params == 0 ? Status::Ok() : Status::Fail("lossless codec takes no parameters");
}

std::vector<uint8_t> lossless_encode(const Plane& p, uint32_t, const uint8_t* raw, const void*, CodecReport* report) {
  const int64_t n = p.count();
  const int es = static_cast<int>(dtype_size(p.dtype));
  ByteWriter w;
  std::vector<uint8_t> bytes(n);
  std::vector<uint16_t> cum(n), freq(n);
  for (int b = 0; b < es; ++b) {
    uint64_t counts[256] = {0};
    for (int64_t i = 0; i < n; ++i) ++counts[bytes[i] = raw[i * es + b]];
    int present = 0;
    double entropy = 0;
    for (uint64_t c : counts)
      if (c) {
        ++present;
        entropy += c * std::log2(static_cast<double>(n) / c);
      }
    const double table = 3.0 + 3.0 * present + 4 * kRansLanes + 4;
    if (entropy / 8 + table >= 0.98 * n) {  // stored
      w.put<uint8_t>(0);
      w.append(bytes.data(), n);
      report->side_bytes += n + 1;
      continue;
    }
    uint16_t f[256];
    rans_normalize(counts, 256, f);
    uint16_t c[256];
    uint32_t acc = 0;
    w.put<uint8_t>(1);
    w.put<uint16_t>(static_cast<uint16_t>(present));
    for (int s = 0; s < 256; ++s) {
      c[s] = static_cast<uint16_t>(acc);
      acc += f[s];
      if (!f[s]) continue;
      w.put<uint8_t>(static_cast<uint8_t>(s));
      w.put<uint16_t>(f[s]);
      report->model_bits += counts[s] * (kRansProbBits - std::log2(static_cast<double>(f[s])));
    }
    for (int64_t i = 0; i < n; ++i) {
      cum[i] = c[bytes[i]];
      freq[i] = f[bytes[i]];
    }
    const size_t before = w.out.size();
    rans_encode(cum.data(), freq.data(), n, w);
    report->coded_bytes += w.out.size() - before;
    report->table_bytes += 3 + 3 * present;
    report->symbols += n;
    report->empirical_bits += entropy;
  }
  return std::move(w.out);
}

bool lossless_decode(const Plane& p, uint32_t, const uint8_t* in, size_t size, uint8_t* out) {
  const int64_t n = p.count();
  const int es = static_cast<int>(dtype_size(p.dtype));
  ByteReader r(in, size);
  RansTable table;
  for (int b = 0; b < es; ++b) {
    const uint8_t mode = r.get<uint8_t>();
    if (!r.ok() || mode > 1) return false;
    if (mode == 0) {
      const uint8_t* stored = r.take(n);
      if (!stored) return false;
      for (int64_t i = 0; i < n; ++i) out[i * es + b] = stored[i];
      continue;
    }
    const int present = r.get<uint16_t>();
    if (present < 1 || present > 256) return false;
    uint16_t freq[256] = {0};
    int last = -1;
    for (int k = 0; k < present; ++k) {
      const int s = r.get<uint8_t>();
      const uint16_t f = r.get<uint16_t>();
      if (!r.ok() || s <= last || f == 0) return false;
      freq[s] = f;
      last = s;
    }
    if (!rans_table_build(freq, 256, &table)) return false;
    if (!rans_decode(r, n, [&](size_t) -> const RansTable& { return table; },
                     [&](size_t i, int s) { out[i * es + b] = static_cast<uint8_t>(s); }))
      return false;
  }
  return r.ok() && r.remaining() == 0;
}

}  // namespace kdn
