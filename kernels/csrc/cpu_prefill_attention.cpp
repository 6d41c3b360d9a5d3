// Paged prefill attention on the CPU: causal attention of the new tokens of sequences with more
// than one (whole prompts, and chunked prefills over a cached prefix), read in place through the
// block table.
//
// One task = a tile of consecutive new tokens of one sequence (Python cuts them, at most
// kMaxTileRows) and one KV head. Its W = rows x group query vectors are held transposed,
// Qt[D][W], and each key block is one small GEMM, flash-attention style:
//   St[t][w] = sum_d K[t][d] Qt[d][w]     K broadcast, 8 query vectors a register
//   online softmax down each column w      vectorised over w, one rescale per block
//   O[w][d] += sum_t Pt[t][w] V[t][d]      P broadcast, 8 lanes of head_dim a register
// so every K/V element read from the pool serves W query vectors, no transpose is needed, and
// a tile stops at its own causal limit. K/V in bfloat16, float16 or fp8 are widened to float32
// once per block and tile. Tasks are taken longest first from a shared counter: the last tiles
// of a long prompt cost more than its first, and a static split would leave a thread idle.
//
// Measurements: docs/perf.md, "Kernels".

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_attention_common.h"

namespace {

using kvserve_attn::q_to_float;
using kvserve_attn::Row;
using kvserve_attn::store_out;
using kvserve_fast_exp::exp_nonpositive;

constexpr int64_t kMaxTileRows = 256;

// n float32 values of a cache row at dst (a copy even when the cache is float32).
template <typename T>
inline void widen_row(const T* src, float* dst, int64_t n, const float* lut) {
  const float* got = Row<T>::load(src, dst, n, lut);
  if (got != dst) std::memcpy(dst, got, n * sizeof(float));
}

#if KVSERVE_AVX2
// St[t][w0 .. w0 + 8 WC) for R tokens: R x WC accumulators, K[t][d] broadcast, Qt rows loaded.
template <int R, int WC>
inline void scores_tile(const float* k, int64_t k_stride, const float* qt, int64_t wp,
                        int64_t head_dim, float* st) {
  __m256 acc[R][WC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < WC; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; ++d) {
    __m256 qv[WC];
    for (int c = 0; c < WC; ++c) qv[c] = _mm256_loadu_ps(qt + d * wp + 8 * c);
    for (int r = 0; r < R; ++r) {
      const __m256 kb = _mm256_broadcast_ss(k + r * k_stride + d);
      for (int c = 0; c < WC; ++c) acc[r][c] = _mm256_fmadd_ps(kb, qv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < WC; ++c) _mm256_storeu_ps(st + r * wp + 8 * c, acc[r][c]);
}

template <int R>
inline void scores_rows(const float* k, int64_t k_stride, const float* qt, int64_t wp,
                        int64_t head_dim, float* st) {
  int64_t c = 0;
  for (; c + 3 <= wp / 8; c += 3)
    scores_tile<R, 3>(k, k_stride, qt + 8 * c, wp, head_dim, st + 8 * c);
  switch (wp / 8 - c) {
    case 2: scores_tile<R, 2>(k, k_stride, qt + 8 * c, wp, head_dim, st + 8 * c); break;
    case 1: scores_tile<R, 1>(k, k_stride, qt + 8 * c, wp, head_dim, st + 8 * c); break;
    default: break;
  }
}

// St[t][0 .. wp) for t < ntok (rounded up to 4 rows, which lie inside the block).
inline void block_scores(const float* k, int64_t k_stride, int64_t ntok, const float* qt,
                         int64_t wp, int64_t head_dim, float* st) {
  for (int64_t t = 0; t < ntok; t += 4)
    scores_rows<4>(k + t * k_stride, k_stride, qt, wp, head_dim, st + t * wp);
}

// O[w0 .. w0 + RW)[d0 .. d0 + 8 DC) += sum_t Pt[t][w] V[t][d]: RW x DC accumulators, the RW
// weights of a token broadcast once, each V vector loaded once (16 registers at 3 x 4).
template <int RW, int DC>
inline void values_tile(const float* v, int64_t v_stride, int64_t ntok, const float* pt,
                        int64_t wp, float* o, int64_t head_dim) {
  __m256 acc[RW][DC];
  for (int r = 0; r < RW; ++r)
    for (int c = 0; c < DC; ++c) acc[r][c] = _mm256_loadu_ps(o + r * head_dim + 8 * c);
  for (int64_t t = 0; t < ntok; ++t) {
    __m256 p[RW];
    for (int r = 0; r < RW; ++r) p[r] = _mm256_broadcast_ss(pt + t * wp + r);
    for (int c = 0; c < DC; ++c) {
      const __m256 vv = _mm256_loadu_ps(v + t * v_stride + 8 * c);
      for (int r = 0; r < RW; ++r) acc[r][c] = _mm256_fmadd_ps(p[r], vv, acc[r][c]);
    }
  }
  for (int r = 0; r < RW; ++r)
    for (int c = 0; c < DC; ++c) _mm256_storeu_ps(o + r * head_dim + 8 * c, acc[r][c]);
}

template <int RW>
inline void values_rows(const float* v, int64_t v_stride, int64_t ntok, const float* pt,
                        int64_t wp, float* o, int64_t head_dim) {
  int64_t c = 0;
  for (; c + 4 <= head_dim / 8; c += 4)
    values_tile<RW, 4>(v + 8 * c, v_stride, ntok, pt, wp, o + 8 * c, head_dim);
  switch (head_dim / 8 - c) {
    case 3: values_tile<RW, 3>(v + 8 * c, v_stride, ntok, pt, wp, o + 8 * c, head_dim); break;
    case 2: values_tile<RW, 2>(v + 8 * c, v_stride, ntok, pt, wp, o + 8 * c, head_dim); break;
    case 1: values_tile<RW, 1>(v + 8 * c, v_stride, ntok, pt, wp, o + 8 * c, head_dim); break;
    default: break;
  }
}

inline void block_values(const float* v, int64_t v_stride, int64_t ntok, const float* pt,
                         int64_t wp, int64_t width, float* o, int64_t head_dim) {
  int64_t w = 0;
  for (; w + 3 <= width; w += 3)
    values_rows<3>(v, v_stride, ntok, pt + w, wp, o + w * head_dim, head_dim);
  switch (width - w) {
    case 2: values_rows<2>(v, v_stride, ntok, pt + w, wp, o + w * head_dim, head_dim); break;
    case 1: values_rows<1>(v, v_stride, ntok, pt + w, wp, o + w * head_dim, head_dim); break;
    default: break;
  }
}

// The online-softmax step of one block, 8 columns at a time: St's masked entries hold -FLT_MAX.
// Replaces St by e^(St - new max), updates m and l, and writes each column's rescale factor.
inline void block_softmax(float* st, int64_t ntok, int64_t wp, float* m, float* l, float* corr) {
  for (int64_t c = 0; c < wp; c += 8) {
    const __m256 old = _mm256_loadu_ps(m + c);
    __m256 top = old;
    for (int64_t t = 0; t < ntok; ++t) top = _mm256_max_ps(top, _mm256_loadu_ps(st + t * wp + c));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < ntok; ++t) {
      const __m256 e = kvserve_fast_exp::exp8_nonpositive(
          _mm256_sub_ps(_mm256_loadu_ps(st + t * wp + c), top));
      _mm256_storeu_ps(st + t * wp + c, e);
      sum = _mm256_add_ps(sum, e);
    }
    const __m256 f = kvserve_fast_exp::exp8_nonpositive(_mm256_sub_ps(old, top));
    _mm256_storeu_ps(corr + c, f);
    _mm256_storeu_ps(l + c, _mm256_fmadd_ps(_mm256_loadu_ps(l + c), f, sum));
    _mm256_storeu_ps(m + c, top);
  }
}
#endif  // KVSERVE_AVX2

// Portable forms of the three steps (CPUs without AVX2, and shapes the SIMD path does not take).
inline void block_scores_portable(const float* k, int64_t k_stride, int64_t ntok, const float* qt,
                                  int64_t wp, int64_t head_dim, float* st) {
  for (int64_t t = 0; t < ntok; ++t) {
    float* row = st + t * wp;
    std::fill(row, row + wp, 0.f);
    for (int64_t d = 0; d < head_dim; ++d) {
      const float kd = k[t * k_stride + d];
      const float* qd = qt + d * wp;
#pragma omp simd
      for (int64_t w = 0; w < wp; ++w) row[w] += kd * qd[w];
    }
  }
}

inline void block_softmax_portable(float* st, int64_t ntok, int64_t wp, float* m, float* l,
                                   float* corr) {
  for (int64_t w = 0; w < wp; ++w) {
    float top = m[w];
    for (int64_t t = 0; t < ntok; ++t) top = std::max(top, st[t * wp + w]);
    float sum = 0.f;
    for (int64_t t = 0; t < ntok; ++t) {
      const float e = exp_nonpositive(st[t * wp + w] - top);
      st[t * wp + w] = e;
      sum += e;
    }
    corr[w] = exp_nonpositive(m[w] - top);
    l[w] = l[w] * corr[w] + sum;
    m[w] = top;
  }
}

inline void block_values_portable(const float* v, int64_t v_stride, int64_t ntok, const float* pt,
                                  int64_t wp, int64_t width, float* o, int64_t head_dim) {
  for (int64_t w = 0; w < width; ++w) {
    float* ow = o + w * head_dim;
    for (int64_t t = 0; t < ntok; ++t) {
      const float p = pt[t * wp + w];
      const float* vt = v + t * v_stride;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) ow[d] += p * vt[d];
    }
  }
}

#if KVSERVE_AVX512BF16
using kvserve_attn::dp_bf16;
using kvserve_attn::interleaved_index;

// The bf16 model on AVX512-BF16 (cpu_attention_common.h): the same tiles, with bf16 pairs.
//   scores: Qp[j][w] = (q_w[2j], q_w[2j+1]) as one 32-bit lane, 16 query vectors a register,
//           dotted with the broadcast pair (k_t[2j], k_t[2j+1]) read straight from the cache;
//   values: Pp[i][w] = (p_2i[w], p_2i+1[w]) broadcast, dotted with the interleaved V rows
//           2i, 2i+1 (built once per block), so O holds head_dim in interleaved order.

// St[t0 .. t0 + 4)[w0 .. w0 + 16 WC) = qk_scale * sum_j K pairs x Qp.
template <int WC>
inline void scores_tile_bf16(const uint16_t* k, int64_t k_stride, const uint32_t* qp,
                             int64_t wp, int64_t pairs, float qk_scale, float* st) {
  __m512 acc[4][WC];
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < WC; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    __m512i qv[WC];
    for (int c = 0; c < WC; ++c) qv[c] = _mm512_loadu_si512(qp + j * wp + 16 * c);
    for (int r = 0; r < 4; ++r) {
      int32_t kp;
      std::memcpy(&kp, k + r * k_stride + 2 * j, sizeof kp);
      const __m512i kb = _mm512_set1_epi32(kp);
      for (int c = 0; c < WC; ++c) acc[r][c] = dp_bf16(acc[r][c], kb, qv[c]);
    }
  }
  const __m512 scale = _mm512_set1_ps(qk_scale);
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < WC; ++c)
      _mm512_storeu_ps(st + r * wp + 16 * c, _mm512_mul_ps(acc[r][c], scale));
}

// Rows t < ntok rounded up to 4 (inside the block: read, then masked).
inline void block_scores_bf16(const uint16_t* k, int64_t k_stride, int64_t ntok,
                              const uint32_t* qp, int64_t wp, int64_t pairs, float qk_scale,
                              float* st) {
  for (int64_t t = 0; t < ntok; t += 4) {
    const uint16_t* kt = k + t * k_stride;
    float* s = st + t * wp;
    int64_t c = 0;
    for (; c + 4 <= wp / 16; c += 4)
      scores_tile_bf16<4>(kt, k_stride, qp + 16 * c, wp, pairs, qk_scale, s + 16 * c);
    const uint32_t* q = qp + 16 * c;
    switch (wp / 16 - c) {
      case 3: scores_tile_bf16<3>(kt, k_stride, q, wp, pairs, qk_scale, s + 16 * c); break;
      case 2: scores_tile_bf16<2>(kt, k_stride, q, wp, pairs, qk_scale, s + 16 * c); break;
      case 1: scores_tile_bf16<1>(kt, k_stride, q, wp, pairs, qk_scale, s + 16 * c); break;
      default: break;
    }
  }
}

// O[w0 .. w0 + RW) += sum_i Pp[i][w] . Vi[i]: RW x 2 NC accumulators (NC = head_dim / 32).
template <int NC, int RW>
inline void values_tile_bf16(const uint32_t* vi, int64_t npairs, const uint32_t* pp, int64_t wp,
                             float* o) {
  constexpr int D = 32 * NC;
  __m512 acc[RW][2 * NC];
  for (int r = 0; r < RW; ++r)
    for (int c = 0; c < 2 * NC; ++c) acc[r][c] = _mm512_loadu_ps(o + r * D + 16 * c);
  for (int64_t i = 0; i < npairs; ++i) {
    __m512i vv[2 * NC];
    for (int c = 0; c < 2 * NC; ++c) vv[c] = _mm512_loadu_si512(vi + i * D + 16 * c);
    for (int r = 0; r < RW; ++r) {
      const __m512i p = _mm512_set1_epi32(static_cast<int32_t>(pp[i * wp + r]));
      for (int c = 0; c < 2 * NC; ++c) acc[r][c] = dp_bf16(acc[r][c], vv[c], p);
    }
  }
  for (int r = 0; r < RW; ++r)
    for (int c = 0; c < 2 * NC; ++c) _mm512_storeu_ps(o + r * D + 16 * c, acc[r][c]);
}

template <int NC>
inline void block_values_bf16(const uint32_t* vi, int64_t npairs, const uint32_t* pp, int64_t wp,
                              int64_t width, float* o) {
  constexpr int D = 32 * NC;
  constexpr int RW = NC == 1 ? 8 : NC == 2 ? 4 : 2;  // RW x 2 NC + 2 NC registers <= 32
  int64_t w = 0;
  for (; w + RW <= width; w += RW) values_tile_bf16<NC, RW>(vi, npairs, pp + w, wp, o + w * D);
  for (; w < width; ++w) values_tile_bf16<NC, 1>(vi, npairs, pp + w, wp, o + w * D);
}

// One task of prefill_kernel on the bf16 path: tile (s, row0, rows, pos0), KV head g.
template <int NC>
void prefill_task_bf16(const uint16_t* q, int64_t q_tok_stride, const uint16_t* k_cache,
                       const uint16_t* v_cache, int64_t block_stride, int64_t tok_stride,
                       const int32_t* table, int64_t row0, int64_t rows, int64_t pos0, int64_t g,
                       int64_t group, int64_t block_size, float qk_scale, float v_scale,
                       uint32_t* qp, float* st, uint32_t* pp, uint32_t* vi, float* o, float* m,
                       float* l, float* corr, uint16_t* out) {
  constexpr int64_t D = 32 * NC, pairs = D / 2;
  const int64_t width = rows * group, wp = (width + 15) / 16 * 16;
  const auto* q32 = reinterpret_cast<const uint32_t*>(q);
  std::fill(qp, qp + pairs * wp, 0u);
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t h = 0; h < group; ++h) {
      const uint32_t* qrow = q32 + ((row0 + j) * q_tok_stride + (g * group + h) * D) / 2;
      const int64_t w = j * group + h;
      for (int64_t i = 0; i < pairs; ++i) qp[i * wp + w] = qrow[i];
    }
  std::fill(o, o + width * D, 0.f);
  std::fill(m, m + wp, -FLT_MAX);
  std::fill(l, l + wp, 0.f);
  const int64_t kv_len = pos0 + rows;
  const int64_t num_blocks = (kv_len + block_size - 1) / block_size;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t first = b * block_size;
    const int64_t ntok = std::min(block_size, kv_len - first);
    const int64_t base = static_cast<int64_t>(table[b]) * block_stride + g * D;
    block_scores_bf16(k_cache + base, tok_stride, ntok, qp, wp, pairs, qk_scale, st);
    const bool diagonal = first + ntok - 1 > pos0;
    if (diagonal)
      for (int64_t t = 0; t < ntok; ++t)
        for (int64_t w = 0; w < width; ++w)
          if (first + t > pos0 + w / group) st[t * wp + w] = -FLT_MAX;
    block_softmax(st, ntok, wp, m, l, corr);
    if (diagonal)
      for (int64_t t = 0; t < ntok; ++t)
        for (int64_t w = 0; w < width; ++w)
          if (first + t > pos0 + w / group) st[t * wp + w] = 0.f;
    for (int64_t w = 0; w < width; ++w) {
      if (corr[w] == 1.f) continue;
      const __m512 f = _mm512_set1_ps(corr[w]);
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_ps(o + w * D + d, _mm512_mul_ps(f, _mm512_loadu_ps(o + w * D + d)));
    }
    // Pp and Vi for the key pairs of this block (an odd last key pairs with zeros).
    const int64_t npairs = (ntok + 1) / 2;
    for (int64_t i = 0; i < npairs; ++i) {
      const bool two = 2 * i + 1 < ntok;
      for (int64_t w = 0; w < wp; w += 16) {
        const __m512i a = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(
            _mm512_cvtneps_pbh(_mm512_loadu_ps(st + 2 * i * wp + w))));
        const __m512i b = two ? _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(
                                    _mm512_cvtneps_pbh(_mm512_loadu_ps(st + (2 * i + 1) * wp + w))))
                              : _mm512_setzero_si512();
        _mm512_storeu_si512(pp + i * wp + w, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
      }
      const uint16_t* v0 = v_cache + base + 2 * i * tok_stride;
      for (int64_t c = 0; c < NC; ++c) {
        const __m512i r0 = _mm512_loadu_si512(v0 + 32 * c);
        const __m512i r1 = two ? _mm512_loadu_si512(v0 + tok_stride + 32 * c)
                               : _mm512_setzero_si512();
        __m512i lo, hi;
        kvserve_attn::interleave_rows(r0, r1, lo, hi);
        _mm512_storeu_si512(vi + i * D + 32 * c, lo);
        _mm512_storeu_si512(vi + i * D + 32 * c + 16, hi);
      }
    }
    block_values_bf16<NC>(vi, npairs, pp, wp, width, o);
  }
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t h = 0; h < group; ++h) {
      const int64_t w = j * group + h;
      const float norm = v_scale / l[w];
      uint16_t* orow = out + (row0 + j) * q_tok_stride + (g * group + h) * D;
      for (int64_t d = 0; d < D; ++d)
        orow[d] = kvserve_bf16::from_float(o[w * D + interleaved_index(d)] * norm);
    }
}
#endif  // KVSERVE_AVX512BF16

template <typename T, typename QT>
void prefill_kernel(const QT* q, int64_t q_tok_stride, const T* k_cache, const T* v_cache,
                    int64_t block_stride, int64_t tok_stride, const int32_t* block_tables,
                    int64_t bt_stride, const int64_t* tiles, int64_t n_tiles, int64_t max_rows,
                    int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                    float qk_scale, float v_scale, const float* lut, QT* out) {
  const int64_t group = heads / kv_heads;
  const int64_t max_width = max_rows * group;
  const int64_t max_wp = (max_width + 7) / 8 * 8;
  const int64_t total = n_tiles * kv_heads;
#if KVSERVE_AVX2
  const bool simd = head_dim % 8 == 0 && block_size % 4 == 0;
#endif
#if KVSERVE_AVX512BF16
  constexpr bool bf16_types = kvserve_attn::kBf16Types<T, QT>;
  const bool bf16_path = bf16_types && kvserve_attn::bf16_head_dim(head_dim) && block_size % 4 == 0;
  const int64_t wp16 = (max_width + 15) / 16 * 16;
#endif
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> qt(head_dim * max_wp), st(block_size * max_wp), o(max_width * head_dim);
    std::vector<float> m(max_wp), l(max_wp), corr(max_wp);
    std::vector<float> kbuf(block_size * head_dim), vbuf(block_size * head_dim);
#if KVSERVE_AVX512BF16
    std::vector<uint32_t> qp, pp, vi;
    if (bf16_path) {
      qp.resize(head_dim / 2 * wp16);
      pp.resize((block_size + 1) / 2 * wp16);
      vi.resize((block_size + 1) / 2 * head_dim);
      st.resize(block_size * wp16);
      m.resize(wp16);
      l.resize(wp16);
      corr.resize(wp16);
    }
#endif
    for (int64_t task = next++; task < total; task = next++) {
      const int64_t* tile = tiles + (task / kv_heads) * 4;
      const int64_t g = task % kv_heads;
      const int64_t s = tile[0], row0 = tile[1], rows = tile[2], pos0 = tile[3];
#if KVSERVE_AVX512BF16
      if constexpr (bf16_types) {
        if (bf16_path) {
          kvserve_attn::with_chunks(head_dim, [&](auto nc) {
            prefill_task_bf16<decltype(nc)::value>(
                reinterpret_cast<const uint16_t*>(q), q_tok_stride,
                reinterpret_cast<const uint16_t*>(k_cache),
                reinterpret_cast<const uint16_t*>(v_cache), block_stride, tok_stride,
                block_tables + s * bt_stride, row0, rows, pos0, g, group, block_size, qk_scale,
                v_scale, qp.data(), st.data(), pp.data(), vi.data(), o.data(), m.data(),
                l.data(), corr.data(), reinterpret_cast<uint16_t*>(out));
          });
          continue;
        }
      }
#endif
      const int64_t width = rows * group, wp = (width + 7) / 8 * 8;
      // Qt[d][w], w = token * group + head within the KV head's group; padding columns are 0.
      std::fill(qt.begin(), qt.begin() + head_dim * wp, 0.f);
      for (int64_t j = 0; j < rows; ++j)
        for (int64_t h = 0; h < group; ++h) {
          const QT* qrow = q + (row0 + j) * q_tok_stride + (g * group + h) * head_dim;
          const int64_t w = j * group + h;
          for (int64_t d = 0; d < head_dim; ++d) qt[d * wp + w] = q_to_float(qrow[d]) * qk_scale;
        }
      std::fill(o.begin(), o.begin() + width * head_dim, 0.f);
      std::fill(m.begin(), m.begin() + wp, -FLT_MAX);
      std::fill(l.begin(), l.begin() + wp, 0.f);
      const int32_t* table = block_tables + s * bt_stride;
      const int64_t kv_len = pos0 + rows;  // the tile's last token sees keys [0, kv_len)
      const int64_t num_blocks = (kv_len + block_size - 1) / block_size;
      for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t first = b * block_size;
        const int64_t ntok = std::min(block_size, kv_len - first);
        const int64_t base = static_cast<int64_t>(table[b]) * block_stride + g * head_dim;
        const float* k;
        const float* v;
        int64_t kv_stride;
        if constexpr (std::is_same_v<T, float>) {
          k = k_cache + base;
          v = v_cache + base;
          kv_stride = tok_stride;
        } else {
          // rows past ntok (up to a multiple of 4) are scored too, then masked: keep them finite
          const int64_t padded = std::min(block_size, (ntok + 3) / 4 * 4);
          for (int64_t t = 0; t < ntok; ++t) {
            widen_row(k_cache + base + t * tok_stride, kbuf.data() + t * head_dim, head_dim, lut);
            widen_row(v_cache + base + t * tok_stride, vbuf.data() + t * head_dim, head_dim, lut);
          }
          std::fill(kbuf.begin() + ntok * head_dim, kbuf.begin() + padded * head_dim, 0.f);
          k = kbuf.data();
          v = vbuf.data();
          kv_stride = head_dim;
        }
#if KVSERVE_AVX2
        if (simd) {
          block_scores(k, kv_stride, ntok, qt.data(), wp, head_dim, st.data());
        } else
#endif
          block_scores_portable(k, kv_stride, ntok, qt.data(), wp, head_dim, st.data());
        // Causal: token j of the tile (position pos0 + j) sees keys up to its own position.
        // Only the blocks reaching past pos0 hold masked entries.
        const bool diagonal = first + ntok - 1 > pos0;
        if (diagonal)
          for (int64_t t = 0; t < ntok; ++t)
            for (int64_t w = 0; w < width; ++w)
              if (first + t > pos0 + w / group) st[t * wp + w] = -FLT_MAX;
#if KVSERVE_AVX2
        if (simd) {
          block_softmax(st.data(), ntok, wp, m.data(), l.data(), corr.data());
        } else
#endif
          block_softmax_portable(st.data(), ntok, wp, m.data(), l.data(), corr.data());
        if (diagonal)  // masked keys weigh exactly 0 (not e^-87)
          for (int64_t t = 0; t < ntok; ++t)
            for (int64_t w = 0; w < width; ++w)
              if (first + t > pos0 + w / group) st[t * wp + w] = 0.f;
        for (int64_t w = 0; w < width; ++w) {
          if (corr[w] == 1.f) continue;
          float* ow = o.data() + w * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ow[d] *= corr[w];
        }
#if KVSERVE_AVX2
        if (simd) {
          block_values(v, kv_stride, ntok, st.data(), wp, width, o.data(), head_dim);
        } else
#endif
          block_values_portable(v, kv_stride, ntok, st.data(), wp, width, o.data(), head_dim);
      }
      for (int64_t j = 0; j < rows; ++j)
        for (int64_t h = 0; h < group; ++h) {
          const int64_t w = j * group + h;
          const float norm = v_scale / l[w];
          QT* orow = out + (row0 + j) * q_tok_stride + (g * group + h) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) store_out(orow + d, o[w * head_dim + d] * norm);
        }
    }
  });
}

// tiles: int64 [n, 4] = (sequence, first q row, rows, position of the first row), rows <=
// kMaxTileRows, ordered as they should be taken (longest first).
void paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& tiles, const at::Tensor& lut,
                   double qk_scale, double v_scale, at::Tensor& out) {
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                  out.scalar_type() == q.scalar_type(),
              "paged_prefill: q and out must be float32 or bfloat16, the same");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && block_tables.is_contiguous() && tiles.is_contiguous(),
              "paged_prefill: tensors must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt, "paged_prefill: block_tables must be int32");
  TORCH_CHECK(tiles.scalar_type() == at::kLong && tiles.dim() == 2 && tiles.size(1) == 4,
              "paged_prefill: tiles must be int64 [n, 4]");
  const int64_t n_tiles = tiles.size(0);
  if (n_tiles == 0) return;
  const int64_t max_rows = tiles.select(1, 2).max().item<int64_t>();
  TORCH_CHECK(max_rows >= 1 && max_rows <= kMaxTileRows, "paged_prefill: a tile has ", max_rows,
              " rows (1..", kMaxTileRows, ")");
  const int64_t heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t block_stride = block_size * kv_heads * head_dim, tok_stride = kv_heads * head_dim;
  const float* lut_ptr = lut.numel() ? lut.data_ptr<float>() : nullptr;
  kvserve_attn::with_types("paged_prefill", k_cache, q, lut_ptr, [&](auto* cache, auto* query) {
    using T = std::remove_pointer_t<decltype(cache)>;
    using QT = std::remove_pointer_t<decltype(query)>;
    prefill_kernel<T, QT>(reinterpret_cast<const QT*>(q.data_ptr()), heads * head_dim,
                          reinterpret_cast<const T*>(k_cache.data_ptr()),
                          reinterpret_cast<const T*>(v_cache.data_ptr()), block_stride, tok_stride,
                          block_tables.data_ptr<int32_t>(), block_tables.size(1),
                          tiles.data_ptr<int64_t>(), n_tiles, max_rows, heads, kv_heads, head_dim,
                          block_size, static_cast<float>(qk_scale), static_cast<float>(v_scale),
                          lut_ptr, reinterpret_cast<QT*>(out.data_ptr()));
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor tiles, Tensor lut, float qk_scale, float v_scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) { m.impl("paged_prefill", &paged_prefill); }
