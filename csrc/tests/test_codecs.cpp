// Codec round trips: lossless is bit-exact (fp32 with NaN/inf/-0/denormals, fp16), the lossy codecs
// stay within their quantization error, and a truncated payload is a failed Status, never a crash.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kdn/byte_io.h"
#include "kdn/codec.h"
#include "kdn/kvtc.h"

namespace kdn {
namespace {

BlobHeader header(DType dtype, uint32_t tokens, uint8_t codec, uint32_t params) {
  BlobHeader h;
  h.dtype = dtype;
  h.layers = 2;
  h.kv_heads = 2;
  h.head_dim = 16;
  h.tokens = tokens;
  h.codec = codec;
  h.codec_params = params;
  h.payload_bytes = raw_payload_bytes(h);
  return h;
}

std::vector<float> values(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = normal(rng);
  return v;
}

TEST(Codecs, LosslessIsBitExactOnSpecialFloats) {
  BlobHeader h = header(DType::kFloat32, 64, kCodecLossless, 0);
  std::vector<float> raw = values(h.payload_bytes / 4, 1);
  raw[0] = std::numeric_limits<float>::quiet_NaN();
  raw[1] = std::numeric_limits<float>::infinity();
  raw[2] = -0.0f;
  raw[3] = std::numeric_limits<float>::denorm_min();
  const auto* bytes = reinterpret_cast<const uint8_t*>(raw.data());
  const std::vector<uint8_t> coded = codec_encode(h, bytes, 2, nullptr);
  std::vector<uint8_t> out(h.payload_bytes);
  ASSERT_TRUE(codec_decode(h, coded.data(), coded.size(), out.data(), 2).ok);
  EXPECT_EQ(std::memcmp(out.data(), bytes, out.size()), 0);
}

TEST(Codecs, KiviInt8StaysWithinItsQuantizationStep) {
  const uint32_t params = 8u | (32u << 16);
  BlobHeader h = header(DType::kFloat32, 64, kCodecKivi, params);
  std::vector<float> raw = values(h.payload_bytes / 4, 2);
  const std::vector<uint8_t> coded = codec_encode(h, reinterpret_cast<const uint8_t*>(raw.data()), 2, nullptr);
  EXPECT_LT(coded.size(), h.payload_bytes / 3);  // about a quarter of fp32, plus scales
  std::vector<float> out(raw.size());
  ASSERT_TRUE(codec_decode(h, coded.data(), coded.size(), reinterpret_cast<uint8_t*>(out.data()), 2).ok);
  double worst = 0;
  for (size_t i = 0; i < raw.size(); ++i) worst = std::max(worst, double(std::fabs(out[i] - raw[i])));
  EXPECT_LT(worst, 0.05);  // range of a 32-group of N(0,1) / 255, with fp16 scales
  EXPECT_GT(worst, 0.0);
}

TEST(Codecs, EveryCodecRoundTripsAndRejectsATruncatedPayload) {
  const std::pair<uint8_t, uint32_t> codecs[] = {
      {kCodecLossless, 0}, {kCodecKivi, 4u | (32u << 16)}, {kCodecKivi, 2u | (32u << 16)},
      {kCodecCacheGen, 1}, {kCodecCacheGen, 3}, {kCodecCacheGen, 2 | (1u << 8)}};
  for (auto [codec, params] : codecs) {
    BlobHeader h = header(DType::kFloat32, 48, codec, params);
    ASSERT_TRUE(codec_check(codec, params).ok);
    std::vector<float> raw = values(h.payload_bytes / 4, 3);
    const std::vector<uint8_t> coded = codec_encode(h, reinterpret_cast<const uint8_t*>(raw.data()), 2, nullptr);
    std::vector<float> out(raw.size());
    ASSERT_TRUE(codec_decode(h, coded.data(), coded.size(), reinterpret_cast<uint8_t*>(out.data()), 2).ok)
        << int(codec) << ":" << params;
    double err = 0, norm = 0;
    for (size_t i = 0; i < raw.size(); ++i) {
      err += (out[i] - raw[i]) * (out[i] - raw[i]);
      norm += raw[i] * raw[i];
    }
    EXPECT_LT(std::sqrt(err / norm), 0.6) << int(codec) << ":" << params;  // int2 is the coarsest
    for (size_t cut : {coded.size() / 2, size_t{3}, size_t{0}}) {
      EXPECT_FALSE(codec_decode(h, coded.data(), cut, reinterpret_cast<uint8_t*>(out.data()), 2).ok)
          << int(codec) << ":" << params << " truncated to " << cut;
    }
  }
}

// A calibration of header()'s geometry: identity basis, zero mean, one ratio (4) with step `step`.
std::vector<uint8_t> identity_calibration(const Key128& fingerprint, float step) {
  ByteWriter w;
  w.append(reinterpret_cast<const uint8_t*>("KVTC"), 4);
  w.put<uint32_t>(kKvtcVersion);
  w.append(fingerprint.data(), 16);
  const uint32_t layers = 2, channels = 32, head_dim = 16;
  for (uint32_t v : {layers, channels, head_dim, channels, 1u, 0u}) w.put<uint32_t>(v);
  for (uint32_t i = 0; i < head_dim / 2; ++i) w.put<float>(1.f);
  w.put<uint32_t>(4);
  for (uint32_t p = 0; p < 2 * layers; ++p) {
    for (uint32_t c = 0; c < channels; ++c) w.put<float>(0.f);
    for (uint32_t i = 0; i < channels; ++i)
      for (uint32_t c = 0; c < channels; ++c) w.put<float>(i == c ? 1.f : 0.f);
    for (uint32_t i = 0; i < channels; ++i) w.put<float>(step);
  }
  return std::move(w.out);
}

TEST(Codecs, KvtcRoundTripsWithinHalfAStepAndNeedsItsCalibration) {
  BlobHeader h = header(DType::kFloat32, 40, kCodecKvtc, 4u | (2u << 8) | (3u << 16));  // sink 2, recent 3
  h.fingerprint.fill(7);
  EXPECT_THROW(codec_encode(h, nullptr, 2, nullptr), InputError);  // no calibration loaded yet
  const std::vector<uint8_t> cal = identity_calibration(h.fingerprint, 0.05f);
  kvtc_load(cal.data(), cal.size());
  std::vector<float> raw = values(h.payload_bytes / 4, 5);
  CodecReport report;
  const std::vector<uint8_t> coded = codec_encode(h, reinterpret_cast<const uint8_t*>(raw.data()), 2, &report);
  std::vector<float> out(raw.size());
  ASSERT_TRUE(codec_decode(h, coded.data(), coded.size(), reinterpret_cast<uint8_t*>(out.data()), 2).ok);
  for (size_t i = 0; i < raw.size(); ++i) {
    const int64_t t = i / 32 % 40;  // rows of 32 channels, 40 per plane
    if (t < 2 || t >= 37) EXPECT_EQ(out[i], raw[i]);  // sink and recent rows are exact
    else EXPECT_LE(std::fabs(out[i] - raw[i]), 0.025f + 1e-6f);
  }
  for (size_t cut : {coded.size() / 2, size_t{3}})
    EXPECT_FALSE(codec_decode(h, coded.data(), cut, reinterpret_cast<uint8_t*>(out.data()), 2).ok);
  kvtc_unload_all();  // the payload names a calibration that is gone: it does not decode
  EXPECT_FALSE(codec_decode(h, coded.data(), coded.size(), reinterpret_cast<uint8_t*>(out.data()), 2).ok);
  std::vector<uint8_t> bad = cal;
  bad.pop_back();
  EXPECT_THROW(kvtc_load(bad.data(), bad.size()), InputError);
}

TEST(Codecs, BadParametersAreRefused) {
  EXPECT_FALSE(codec_check(kCodecKivi, 3u | (32u << 16)).ok);  // 3 bits
  EXPECT_FALSE(codec_check(kCodecCacheGen, 9).ok);               // level 9
  EXPECT_FALSE(codec_check(42, 0).ok);                           // no such codec
  EXPECT_FALSE(codec_check(kCodecKvtc, 1).ok);                   // ratio 1
  EXPECT_FALSE(codec_check(kCodecKvtc, 8u | (1u << 24)).ok);     // reserved bits
}

}  // namespace
}  // namespace kdn

namespace kdn {
namespace {

#ifndef KDN_WITH_CUDA
TEST(CudaStandIns, ABuildWithoutNvccReportsItInsteadOfCrashing) {
  BlobHeader h = header(DType::kFloat32, 8, kCodecKivi, 4u | (32u << 16));
  const Status st = codec_decode_cuda(h, nullptr, 0, nullptr, 0);
  EXPECT_FALSE(st.ok);
  EXPECT_NE(st.message.find("without CUDA"), std::string::npos);
}
#endif

}  // namespace
}  // namespace kdn
