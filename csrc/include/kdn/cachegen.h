// Parameters and symbol models of the `cachegen` codec, shared by its CPU coder and CUDA decoder.
#pragma once

#include <cstdint>

#include "kdn/rans.h"

namespace kdn {

constexpr int kCacheGenAnchorGroup = 8;  // tokens per anchor group when anchor/delta coding is on
constexpr int kCacheGenModels = 64;      // Laplace decays a context can choose from

// Quantization step (in units of the token vector's RMS) and symbol range of a plane at a level.
// Keys get finer steps than values (on SmolLM2-135M, key error moves the next-token distribution
// several times more per bit), and the shallow third of the layers a slightly finer one.
struct CacheGenStep {
  float step;
  int range;  // symbols are in [-range, range]
};
CacheGenStep cachegen_step(int level, int layer, int layers, bool values);

// The rANS table of a two-sided geometric (discrete Laplace) model, decay index `model` over
// [-range, range] (built once per (model, range) with integer arithmetic: identical everywhere).
const RansTable& cachegen_table(int model, int range);

// The model that codes a histogram of symbols over [-range, range] (hist[s + range]) shortest:
// its index, with that cost in bits added to *model_bits and the histogram's empirical entropy in
// bits to *empirical_bits. An empty histogram gets model 0 at no cost.
int cachegen_choose_model(const uint32_t* hist, int range, double* model_bits, double* empirical_bits);

}  // namespace kdn
