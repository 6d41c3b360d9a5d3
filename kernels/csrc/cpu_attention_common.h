// What the CPU attention kernels (cpu_decode_attention.cpp, cpu_prefill_attention.cpp) share:
// reading a cache row of any storage dtype as float32, the same on 8 AVX2 lanes, reading and
// writing query/output rows (float32 or bfloat16 bits), and one block's softmax step.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "bf16.h"
#include "fast_exp.h"

namespace kvserve_attn {

template <typename T>
struct Row {
  // Returns a float view of n values at src (converted into buf when T is not float).
  static const float* load(const T* src, float* buf, int64_t n, const float* lut);
};

template <>
struct Row<float> {
  static const float* load(const float* src, float*, int64_t, const float*) { return src; }
};

template <>
struct Row<at::BFloat16> {
  static const float* load(const at::BFloat16* src, float* buf, int64_t n, const float*) {
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
    uint32_t* out = reinterpret_cast<uint32_t*>(buf);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
    return buf;
  }
};

template <>
struct Row<at::Half> {
  static const float* load(const at::Half* src, float* buf, int64_t n, const float*) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
};

template <>
struct Row<uint8_t> {  // fp8 e4m3 bytes, decoded through a table
  static const float* load(const uint8_t* src, float* buf, int64_t n, const float* lut) {
    for (int64_t i = 0; i < n; ++i) buf[i] = lut[src[i]];
    return buf;
  }
};

// fn(cache_tag, query_tag) with null pointers typed by the storage of the cache (float,
// at::BFloat16, at::Half, or uint8_t fp8 bytes) and of q/out (float, or uint16_t bf16 bits).
template <typename Fn>
inline void with_types(const char* op, const at::Tensor& k_cache, const at::Tensor& q,
                       const float* lut, Fn&& fn) {
  auto with_q = [&](auto cache_tag) {
    if (q.scalar_type() == at::kFloat) {
      fn(cache_tag, static_cast<float*>(nullptr));
    } else {
      fn(cache_tag, static_cast<uint16_t*>(nullptr));
    }
  };
  switch (k_cache.scalar_type()) {
    case at::kFloat: with_q(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: with_q(static_cast<at::BFloat16*>(nullptr)); break;
    case at::kHalf: with_q(static_cast<at::Half*>(nullptr)); break;
    case at::kByte:
      TORCH_CHECK(lut != nullptr, op, ": fp8 bytes need the decode table");
      with_q(static_cast<uint8_t*>(nullptr));
      break;
    default: TORCH_CHECK(false, op, ": unsupported cache dtype ", k_cache.scalar_type());
  }
}

// Blocks lie anywhere in the pool, out of the hardware prefetcher's sight: the kernels ask for
// the next block's K and V (`bytes` each) into L2 while this one is computed.
inline void prefetch_block(const void* k, const void* v, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) {
    __builtin_prefetch(static_cast<const char*>(k) + off, 0, 2);
    __builtin_prefetch(static_cast<const char*>(v) + off, 0, 2);
  }
}

// Query and output rows: float32, or bfloat16 as its uint16_t bits.
inline float q_to_float(float x) { return x; }
inline float q_to_float(uint16_t x) { return kvserve_bf16::to_float(x); }
inline void store_out(float* dst, float x) { *dst = x; }
inline void store_out(uint16_t* dst, float x) { *dst = kvserve_bf16::from_float(x); }

#if defined(__AVX2__) && defined(__FMA__) && !defined(KVSERVE_NO_SIMD)
// Explicit AVX2 for the two inner loops. Scores: 8 keys at a time, one 8-lane accumulator per
// key, then one transpose-and-add tree gives the 8 dot products (instead of a horizontal sum
// per dot, which the compiler's vectorised reduction does). Values: 8 lanes of head_dim.
#define KVSERVE_AVX2 1
#include <immintrin.h>

using kvserve_fast_exp::exp8_nonpositive;

inline __m256 load8(const float* p, const float*) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p, const float*) {  // bf16: the top half of an fp32
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const at::Half* p, const float*) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const uint8_t* p, const float* lut) {  // fp8 e4m3 bytes via the table
  const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_i32gather_ps(lut, idx, 4);
}

// One head's scores of one block (rounded up to 8 lanes, lanes past ntok set to -FLT_MAX
// first): the new running max, scores replaced by e^(s - max), returns their sum.
inline float softmax_block_simd(float* sc, int64_t ntok, float& top_io) {
  const int64_t padded = (ntok + 7) / 8 * 8;
  for (int64_t t = ntok; t < padded; ++t) sc[t] = -FLT_MAX;
  __m256 mx = _mm256_set1_ps(top_io);
  for (int64_t t = 0; t < padded; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sc + t));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float top = _mm_cvtss_f32(m4);
  const __m256 tv = _mm256_set1_ps(top);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < padded; t += 8) {
    const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sc + t), tv));
    _mm256_storeu_ps(sc + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  s4 = _mm_hadd_ps(s4, s4);
  s4 = _mm_hadd_ps(s4, s4);
  top_io = top;
  return _mm_cvtss_f32(s4);
}
#else
#define KVSERVE_AVX2 0
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && \
    !defined(KVSERVE_NO_SIMD)
// bfloat16 dot products (AVX512-BF16: Zen 4, Sapphire Rapids): vdpbf16ps multiplies 32 bf16
// pairs and accumulates them into 16 float32 lanes, so bf16 K/V need no widening.
#define KVSERVE_AVX512BF16 1

// The bf16-pair paths serve a bf16 cache read by bf16 queries (a bf16 model), head_dim <= 128.
template <typename T, typename QT>
constexpr bool kBf16Types = std::is_same_v<T, at::BFloat16> && std::is_same_v<QT, uint16_t>;

inline bool bf16_head_dim(int64_t head_dim) { return head_dim % 32 == 0 && head_dim <= 128; }

inline __m512 dp_bf16(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

// Value rows are multiplied two keys at a time: rows t and t + 1 interleaved by unpack lo/hi
// (per 32 columns), each 32-bit lane a (v_t[d], v_t+1[d]) pair, dotted with the pair of their
// weights. The float32 accumulators then hold head_dim in a fixed order: column d of a head
// is at interleaved_index(d).
inline int64_t interleaved_index(int64_t d) {
  const int64_t c = d / 32, lane = (d % 32) / 8, i = d % 8;
  return 32 * c + 16 * (i / 4) + 4 * lane + i % 4;
}

// fn(std::integral_constant<int, NC>{}) for NC = head_dim / 32 in 1..4 (head_dim <= 128).
template <typename Fn>
inline void with_chunks(int64_t head_dim, Fn&& fn) {
  switch (head_dim / 32) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    default: fn(std::integral_constant<int, 4>{}); break;
  }
}

// lo, hi = the interleaved pairs of rows r0, r1 (32 bf16 columns each).
inline void interleave_rows(__m512i r0, __m512i r1, __m512i& lo, __m512i& hi) {
  lo = _mm512_unpacklo_epi16(r0, r1);
  hi = _mm512_unpackhi_epi16(r0, r1);
}
#else
#define KVSERVE_AVX512BF16 0
#endif

}  // namespace kvserve_attn
