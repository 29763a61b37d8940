// rng.h — counter-based random numbers: a value is a pure function of (seed, name, index).
//
// This is what lets every technique reproduce 01 bit for bit at initialisation: a rank that
// owns a slice of a weight computes exactly the values of that slice of the full weight, with
// no broadcast and no dependence on how the model is split.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>

#include "tensor/core.h"
#include "tensor/device.h"

namespace ts {

// SplitMix64's finaliser: a strong 64-bit mixer, cheap enough to call once per element.
TS_HD uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The per-tensor key: FNV-1a of the name, mixed with the seed.
inline uint64_t rng_key(uint64_t seed, const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  return mix64(seed ^ mix64(h));
}

// Uniform in (0, 1): 24 random bits, offset by half a step so that log() never sees 0.
TS_HD float rng_uniform(uint64_t key, uint64_t counter) {
  uint64_t r = mix64(key ^ mix64(counter));
  return (float(r >> 40) + 0.5f) * (1.0f / 16777216.0f);
}

// Standard normal by Box-Muller from two uniforms of the element's own counters (2i, 2i+1).
// Computed in double on the host and device alike so both backends give the same bits.
TS_HD float rng_normal(uint64_t key, uint64_t index) {
  double u1 = rng_uniform(key, 2 * index), u2 = rng_uniform(key, 2 * index + 1);
  return float(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

}  // namespace ts
