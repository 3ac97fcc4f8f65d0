// Interleaved rANS entropy coder: 32-bit state, 16-bit renormalization, 12-bit probabilities.
//
// A coded section holds kRansLanes independent byte streams ("lanes"); symbol i of a section
// belongs to lane i % kRansLanes, so a decoder can run the lanes in lockstep (instruction-level
// parallelism on the CPU, one thread per lane on a GPU). Section layout:
//   u32 lane_bytes[kRansLanes]  then the lanes' bytes, concatenated.
// Each lane starts with its 4-byte final encoder state, then 16-bit little-endian words; a decode
// step reads at most one word (state in [2^16, 2^32)), so renormalization is a single, rarely
// taken branch instead of a byte loop. After the last symbol every lane's state
// is back at kRansLow and every byte has been consumed: decoders check both, so truncation and
// most corruptions are detected, and a decoder never reads outside its lane.
#pragma once

#include <cstdint>
#include <vector>

#include "kdn/byte_io.h"
#include "kdn/common.h"

namespace kdn {

constexpr uint32_t kRansProbBits = 12;
constexpr uint32_t kRansScale = 1u << kRansProbBits;  // frequencies of a table sum to this
constexpr uint32_t kRansLow = 1u << 16;
constexpr int kRansLanes = 4;
constexpr int kRansMaxSymbols = 256;

// A static model over an alphabet of at most 256 symbols, with the slot -> symbol decode table.
struct RansTable {
  uint16_t freq[kRansMaxSymbols];
  uint16_t cum[kRansMaxSymbols];
  uint8_t slot[kRansScale];
  int symbols;
};

// Builds a table from frequencies (each <= kRansScale, summing to kRansScale); false if invalid.
bool rans_table_build(const uint16_t* freq, int symbols, RansTable* out);

// Scales a histogram to frequencies summing to kRansScale, every present symbol >= 1
// (deterministic; the encoder's choice, transmitted or rebuilt identically by the decoder).
void rans_normalize(const uint64_t* counts, int symbols, uint16_t* freq);

// One lane of a decoder: its state and the unread part of its bytes.
struct RansLane {
  uint32_t x;
  const uint8_t* p;
  const uint8_t* end;
  bool ok;
};

KDN_HD void rans_lane_init(RansLane& lane, const uint8_t* p, const uint8_t* end) {
  lane.ok = end - p >= 4;
  lane.p = p;
  lane.end = end;
  lane.x = 0;
  if (!lane.ok) return;
  lane.x = uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
  lane.p = p + 4;
}

// Decodes one symbol with `t` and renormalizes; on running out of bytes marks the lane bad and
// keeps returning symbols in range (callers check `ok` after the section).
KDN_HD int rans_lane_decode(RansLane& lane, const RansTable& t) {
  const uint32_t slot = lane.x & (kRansScale - 1);
  const int s = t.slot[slot];
  uint32_t x = t.freq[s] * (lane.x >> kRansProbBits) + slot - t.cum[s];
  if (x < kRansLow) {
    if (lane.end - lane.p >= 2) {
      x = (x << 16) | uint32_t(lane.p[0]) | uint32_t(lane.p[1]) << 8;
      lane.p += 2;
    } else {
      lane.ok = false;
      x = kRansLow;
    }
  }
  lane.x = x;
  return s;
}

KDN_HD bool rans_lane_finished(const RansLane& lane) { return lane.ok && lane.x == kRansLow && lane.p == lane.end; }

// Encodes n symbols given by their (cum, freq) under their tables into one section appended to `out`.
void rans_encode(const uint16_t* cum, const uint16_t* freq, size_t n, ByteWriter& out);

// Reads a section header: the lanes' byte ranges; false if the lengths do not fit the input.
bool rans_open(ByteReader& in, RansLane lanes[kRansLanes]);

// Decodes a section of n symbols: table_of(i) gives symbol i's table, emit(i, symbol) receives it.
template <typename TableOf, typename Emit>
bool rans_decode(ByteReader& in, size_t n, TableOf&& table_of, Emit&& emit) {
  RansLane lanes[kRansLanes];
  if (!rans_open(in, lanes)) return false;
  size_t i = 0;
  for (; i + kRansLanes <= n; i += kRansLanes)
    for (int j = 0; j < kRansLanes; ++j) emit(i + j, rans_lane_decode(lanes[j], table_of(i + j)));
  for (int j = 0; i < n; ++i, ++j) emit(i, rans_lane_decode(lanes[j], table_of(i)));
  bool ok = true;
  for (const RansLane& lane : lanes) ok = ok && rans_lane_finished(lane);
  return ok;
}

}  // namespace kdn
