// bfloat16 <-> float32 as bit operations on uint16_t, so loops over bf16 data vectorise.
//
// c10::BFloat16's conversions are correct but opaque to GCC's vectoriser (a struct wrapper and
// a NaN branch), so a bf16 loop written with them runs scalar, many times slower than the same
// loop in float32 (docs/perf.md). These give the same bits: widening is a shift, narrowing rounds to nearest
// even exactly as c10::detail::round_to_nearest_even does, NaN becoming 0x7FC0.
#pragma once

#include <cstdint>
#include <cstring>

namespace kvserve_bf16 {

static inline __attribute__((always_inline)) float to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

static inline __attribute__((always_inline)) uint16_t from_float(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
}

}  // namespace kvserve_bf16
