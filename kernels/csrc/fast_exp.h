// e^x for x <= 0, written so loops using it vectorise (scalar form) or on 8 AVX2 lanes.
// Used by the decode kernel's softmax (exponents after subtracting the max) and silu_and_mul.
//
// 2^(x log2 e) is split into an integer power, built in the exponent bits, and 2^f for f in
// [0, 1), from a degree-6 least-squares polynomial (a least-squares fit, not Taylor
// coefficients, keeps the relative error under 1e-7 in float32 over [0, 1)). x is clamped at -87,
// where the result, 1.6e-38, is still a normal float.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvserve_fast_exp {

// Horner coefficients of 2^f, highest power first.
constexpr float kC6 = 2.169060899e-4f, kC5 = 1.244308194e-3f, kC4 = 9.678472765e-3f,
                kC3 = 5.548352376e-2f, kC2 = 2.402298003e-1f, kC1 = 6.931470037e-1f;
constexpr float kLog2e = 1.44269504088896341f, kMinX = -87.0f;

static inline __attribute__((always_inline)) float exp_nonpositive(float x) {
  x = std::max(x, kMinX);
  const float t = x * kLog2e;
  const float fi = std::floor(t);
  const float f = t - fi;
  float p = kC6;
  p = p * f + kC5;
  p = p * f + kC4;
  p = p * f + kC3;
  p = p * f + kC2;
  p = p * f + kC1;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

inline __m256 exp8_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kMinX));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(kLog2e));
  const __m256 fi = _mm256_floor_ps(t);
  const __m256 f = _mm256_sub_ps(t, fi);
  __m256 p = _mm256_set1_ps(kC6);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kC5));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kC4));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kC3));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kC2));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kC1));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(fi), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

}  // namespace kvserve_fast_exp
