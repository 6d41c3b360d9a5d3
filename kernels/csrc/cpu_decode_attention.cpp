// Paged decode attention on the CPU: one pass over each sequence's blocks, read in place.
//
// The torch path gathers every block into a workspace before two batched matmuls read it, so
// decode moves ~3x the bytes contiguous SDPA moves. This kernel walks the block table instead:
// for each sequence (or, with few sequences, each sequence and KV head) it scores every query
// head against each block's keys, keeps an online softmax (running max and sum per head,
// rescaled once per block) and accumulates the values, reading K and V exactly once, straight
// from the pool, while the next block is prefetched.
//
// Caches: float32, bfloat16, float16, or fp8 e4m3 passed as uint8 bytes with a 256-entry
// decode table. Queries and output are float32 or bfloat16 (the Python wrapper converts
// float16). Built with -O3 -march=native: explicit AVX2 for the score and value loops where the
// CPU has it, loops the compiler vectorises otherwise. Measurements: docs/perf.md, "Kernels".

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
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

// Sliding window: in the block holding the window's first key, the `skip` keys before it get
// the padding score (-FLT_MAX, weight ~0 after the softmax's clamped exp); skip <= 0: none.
inline void hide_before_window(float* scores, int64_t width, int64_t block_size, int64_t skip) {
  for (int64_t w = 0; w < width && skip > 0; ++w)
    std::fill(scores + w * block_size, scores + w * block_size + skip, -FLT_MAX);
}

#if KVSERVE_AVX2
using kvserve_attn::load8;
using kvserve_attn::softmax_block_simd;

// Scores: 8 keys at a time, one 8-lane accumulator per key, then one transpose-and-add tree
// gives the 8 dot products (instead of a horizontal sum per dot, which the compiler's
// vectorised reduction does). Values: 8 lanes of head_dim.

// Lane j of the result = sum of the 8 lanes of a[j].
inline __m256 sum8x8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// scores[h * block_size + t] = q_h . k_t for the rounded-up 8-row tiles of one block and one KV
// head's query group. Rows past ntok lie inside the block (block_size % 8 == 0): read, unused.
template <typename T>
inline void block_scores_simd(const T* k, int64_t tok_stride, int64_t ntok, const float* qs,
                              int64_t group, int64_t head_dim, int64_t block_size,
                              const float* lut, float* scores) {
  for (int64_t t0 = 0; t0 < ntok; t0 += 8) {
    for (int64_t h = 0; h < group; ++h) {
      const float* qh = qs + h * head_dim;
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t d = 0; d < head_dim; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qh + d);
        for (int j = 0; j < 8; ++j)
          acc[j] = _mm256_fmadd_ps(qv, load8(k + (t0 + j) * tok_stride + d, lut), acc[j]);
      }
      _mm256_storeu_ps(scores + h * block_size + t0, sum8x8(acc));
    }
  }
}

// acc_h[d0, d0 + 8 ND) += sum_t p_h[t] v_t[d0, d0 + 8 ND): the ND accumulators stay in registers
// over the block's tokens (one load and one store of acc per block, not per token).
template <typename T, int ND>
inline void values_chunk(const T* v, int64_t tok_stride, int64_t ntok, const float* ph,
                         const float* lut, float* ah) {
  __m256 r[ND];
  for (int j = 0; j < ND; ++j) r[j] = _mm256_loadu_ps(ah + 8 * j);
  for (int64_t t = 0; t < ntok; ++t) {
    const __m256 w = _mm256_set1_ps(ph[t]);
    const T* vr = v + t * tok_stride;
    for (int j = 0; j < ND; ++j) r[j] = _mm256_fmadd_ps(w, load8(vr + 8 * j, lut), r[j]);
  }
  for (int j = 0; j < ND; ++j) _mm256_storeu_ps(ah + 8 * j, r[j]);
}

// acc_h += p[h * block_size + t] * v_t for t < ntok, over one KV head's query group, in
// 64-wide chunks of head_dim (8 registers; head_dim % 8 == 0).
template <typename T>
inline void block_values_simd(const T* v, int64_t tok_stride, int64_t ntok, const float* p,
                              int64_t group, int64_t head_dim, int64_t block_size,
                              const float* lut, float* acc) {
  for (int64_t h = 0; h < group; ++h) {
    const float* ph = p + h * block_size;
    for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
      float* ah = acc + h * head_dim + d0;
      const T* vd = v + d0;
      switch (std::min<int64_t>(64, head_dim - d0) / 8) {
        case 8: values_chunk<T, 8>(vd, tok_stride, ntok, ph, lut, ah); break;
        case 7: values_chunk<T, 7>(vd, tok_stride, ntok, ph, lut, ah); break;
        case 6: values_chunk<T, 6>(vd, tok_stride, ntok, ph, lut, ah); break;
        case 5: values_chunk<T, 5>(vd, tok_stride, ntok, ph, lut, ah); break;
        case 4: values_chunk<T, 4>(vd, tok_stride, ntok, ph, lut, ah); break;
        case 3: values_chunk<T, 3>(vd, tok_stride, ntok, ph, lut, ah); break;
        case 2: values_chunk<T, 2>(vd, tok_stride, ntok, ph, lut, ah); break;
        default: values_chunk<T, 1>(vd, tok_stride, ntok, ph, lut, ah); break;
      }
    }
  }
}


#endif  // KVSERVE_AVX2

#if KVSERVE_AVX512BF16
using kvserve_attn::dp_bf16;
using kvserve_attn::interleaved_index;

// bfloat16 queries on a bfloat16 cache (a bf16 model) with AVX512-BF16 (cpu_attention_common.h):
// neither K nor V is widened. Scores: each key row against the query row, 16 keys reduced
// together by one shuffle tree. Values: two keys at a time, interleaved (interleaved_index).
// Probabilities are rounded to bf16 for that product as HF's bf16 attention does; softmax and
// accumulation stay float32.

// The slot of key j (0..15) in sum16x16's input that puts its sum at output lane j.
constexpr int sum_slot(int j) { return 4 * (j % 4) + j / 4; }

// Output lane 4k + e = the sum of the 16 lanes of v[4e + k] (see sum_slot).
inline __m512 sum16x16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
}

// scores[t] = qk_scale * q . k_t for t < ntok of one block (0 for the block's later slots);
// NC = head_dim / 32.
template <int NC>
inline void scores_bf16(const uint16_t* k, int64_t tok_stride, int64_t ntok, int64_t block_size,
                        const uint16_t* q, float qk_scale, float* scores) {
  __m512i qv[NC];
  for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_si512(q + 32 * c);
  const __m512 scale = _mm512_set1_ps(qk_scale);
  for (int64_t t0 = 0; t0 < block_size; t0 += 16) {
    __m512 v[16];
    for (int j = 0; j < 16; ++j) {
      __m512 acc = _mm512_setzero_ps();
      if (t0 + j < ntok)
        for (int c = 0; c < NC; ++c)
          acc = dp_bf16(acc, _mm512_loadu_si512(k + (t0 + j) * tok_stride + 32 * c), qv[c]);
      v[sum_slot(j)] = acc;
    }
    const __m512 r = _mm512_mul_ps(sum16x16(v), scale);
    if (block_size - t0 >= 16) {
      _mm512_storeu_ps(scores + t0, r);
    } else {
      _mm512_mask_storeu_ps(scores + t0, static_cast<__mmask16>((1u << (block_size - t0)) - 1), r);
    }
  }
}

// acc_h += sum_t p_h[t] v_t for NH heads at once, t < ntok (p_h[ntok] is 0 when ntok is odd).
// acc_h is 2 NC vectors in the interleaved order (lo, hi per 32 columns).
template <int NC, int NH>
inline void values_bf16(const uint16_t* v, int64_t tok_stride, int64_t ntok, const uint16_t* p,
                        int64_t p_stride, float* acc, int64_t acc_stride) {
  __m512 a[NH][2 * NC];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < 2 * NC; ++c) a[h][c] = _mm512_loadu_ps(acc + h * acc_stride + 16 * c);
  for (int64_t t = 0; t < ntok; t += 2) {
    __m512i lo[NC], hi[NC];
    for (int c = 0; c < NC; ++c) {
      const __m512i r0 = _mm512_loadu_si512(v + t * tok_stride + 32 * c);
      const __m512i r1 = t + 1 < ntok ? _mm512_loadu_si512(v + (t + 1) * tok_stride + 32 * c)
                                      : _mm512_setzero_si512();
      kvserve_attn::interleave_rows(r0, r1, lo[c], hi[c]);
    }
    for (int h = 0; h < NH; ++h) {
      int32_t pair;
      std::memcpy(&pair, p + h * p_stride + t, sizeof pair);
      const __m512i pp = _mm512_set1_epi32(pair);
      for (int c = 0; c < NC; ++c) {
        a[h][2 * c] = dp_bf16(a[h][2 * c], lo[c], pp);
        a[h][2 * c + 1] = dp_bf16(a[h][2 * c + 1], hi[c], pp);
      }
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < 2 * NC; ++c) _mm512_storeu_ps(acc + h * acc_stride + 16 * c, a[h][c]);
}

template <int NC>
inline void values_bf16_heads(const uint16_t* v, int64_t tok_stride, int64_t ntok,
                              const uint16_t* p, int64_t p_stride, int64_t heads, float* acc,
                              int64_t acc_stride) {
  constexpr int NH = NC == 1 ? 4 : NC == 2 ? 3 : 2;  // NH x 2 NC accumulators + 2 NC rows <= 32
  int64_t h = 0;
  for (; h + NH <= heads; h += NH)
    values_bf16<NC, NH>(v, tok_stride, ntok, p + h * p_stride, p_stride, acc + h * acc_stride,
                        acc_stride);
  for (; h < heads; ++h)
    values_bf16<NC, 1>(v, tok_stride, ntok, p + h * p_stride, p_stride, acc + h * acc_stride,
                       acc_stride);
}

// One task of decode_kernel (a sequence and KV heads [g0, g0 + nkv)) on the bf16 path.
template <int NC>
void decode_task_bf16(const uint16_t* qrow, const uint16_t* k_cache, const uint16_t* v_cache,
                      int64_t block_stride, int64_t tok_stride, const int32_t* table, int64_t len,
                      int64_t g0, int64_t nkv, int64_t group, int64_t block_size, float qk_scale,
                      float v_scale, int64_t lo, float* scores, uint16_t* pbf, float* acc,
                      float* m, float* l, uint16_t* orow) {
  constexpr int64_t D = 32 * NC;
  const int64_t width = nkv * group;
  std::fill(acc, acc + width * D, 0.f);
  std::fill(m, m + width, -FLT_MAX);
  std::fill(l, l + width, 0.f);
  const int64_t num_blocks = (len + block_size - 1) / block_size;
  for (int64_t b = lo / block_size; b < num_blocks; ++b) {
    const int64_t base = static_cast<int64_t>(table[b]) * block_stride;
    const int64_t ntok = std::min(block_size, len - b * block_size);
    if (b + 1 < num_blocks) {
      const int64_t next = static_cast<int64_t>(table[b + 1]) * block_stride;
      kvserve_attn::prefetch_block(k_cache + next, v_cache + next, block_stride * 2);
    }
    for (int64_t g = 0; g < nkv; ++g)
      for (int64_t h = 0; h < group; ++h) {
        const int64_t w = g * group + h;
        scores_bf16<NC>(k_cache + base + (g0 + g) * D, tok_stride, ntok, block_size,
                        qrow + w * D, qk_scale, scores + w * block_size);
      }
    hide_before_window(scores, width, block_size, lo - b * block_size);
    for (int64_t w = 0; w < width; ++w) {
      float* sc = scores + w * block_size;
      const float prev = m[w];
      const float sum = softmax_block_simd(sc, ntok, m[w]);
      const float corr = exp_nonpositive(prev - m[w]);
      l[w] = l[w] * corr + sum;
      if (corr != 1.f) {
        const __m512 f = _mm512_set1_ps(corr);
        for (int64_t d = 0; d < D; d += 16)
          _mm512_storeu_ps(acc + w * D + d, _mm512_mul_ps(f, _mm512_loadu_ps(acc + w * D + d)));
      }
      uint16_t* pw = pbf + w * (block_size + 1);
      for (int64_t t = 0; t < ntok; ++t) pw[t] = kvserve_bf16::from_float(sc[t]);
      pw[ntok] = 0;  // the odd key's partner weighs nothing
    }
    for (int64_t g = 0; g < nkv; ++g)
      values_bf16_heads<NC>(v_cache + base + (g0 + g) * D, tok_stride, ntok,
                            pbf + g * group * (block_size + 1), block_size + 1, group,
                            acc + g * group * D, D);
  }
  for (int64_t w = 0; w < width; ++w) {
    const float norm = v_scale / l[w];
    for (int64_t d = 0; d < D; ++d)
      orow[w * D + d] = kvserve_bf16::from_float(acc[w * D + interleaved_index(d)] * norm);
  }
}
#endif  // KVSERVE_AVX512BF16

// QT: the query/output storage (float, or uint16_t bfloat16 bits); T: the cache's.
template <typename T, typename QT, int64_t D>
void decode_kernel(const QT* q, int64_t q_tok_stride, const T* k_cache, const T* v_cache,
                   int64_t block_stride, int64_t tok_stride, const int32_t* block_tables,
                   int64_t bt_stride, const int32_t* seq_lens, const int64_t* seq_ids,
                   const int64_t* rows, int64_t n, int64_t heads, int64_t kv_heads,
                   int64_t runtime_head_dim, int64_t block_size, float qk_scale, float v_scale,
                   int64_t window, const float* lut, QT* out) {
  // D > 0: head_dim known at compile time (the common sizes), so the loops over it unroll.
  const int64_t head_dim = D > 0 ? D : runtime_head_dim;
  const int64_t group = heads / kv_heads;
  // One task = one sequence and a range of its KV heads: all KV heads when there are enough
  // sequences to keep every thread busy (each block's K/V rows are then read front to back),
  // one KV head each otherwise (a single long sequence still uses every thread).
  const int64_t split = n >= 2 * at::get_num_threads() ? 1 : kv_heads;
  const int64_t heads_per_task = kv_heads / split;
  const int64_t block_bytes = block_stride * static_cast<int64_t>(sizeof(T));
#if KVSERVE_AVX2
  const bool simd = head_dim % 8 == 0 && block_size % 8 == 0;
#endif
#if KVSERVE_AVX512BF16
  constexpr bool bf16_types = kvserve_attn::kBf16Types<T, QT>;
  const bool bf16_path = bf16_types && kvserve_attn::bf16_head_dim(head_dim) && block_size % 8 == 0;
#endif
  at::parallel_for(0, n * split, 1, [&](int64_t begin, int64_t end) {
    const int64_t width = heads_per_task * group;  // query heads of one task
    std::vector<float> qs(width * head_dim), acc(width * head_dim);
    std::vector<float> scores(width * block_size), m(width), l(width);
    std::vector<float> kbuf(head_dim), vbuf(head_dim);
#if KVSERVE_AVX512BF16
    std::vector<uint16_t> pbf(bf16_path ? width * (block_size + 1) : 0);
#endif
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / split, g0 = (task % split) * heads_per_task;
      const int64_t s = seq_ids[i], row = rows[i];
      const int64_t len = seq_lens[s];
      // A sliding window of W keys: the token at len - 1 sees positions lo .. len - 1.
      const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const QT* qrow = q + row * q_tok_stride + g0 * group * head_dim;
#if KVSERVE_AVX512BF16
      if constexpr (bf16_types) {
        if (bf16_path) {
          const auto* kc = reinterpret_cast<const uint16_t*>(k_cache);
          const auto* vc = reinterpret_cast<const uint16_t*>(v_cache);
          QT* orow = out + row * q_tok_stride + g0 * group * head_dim;
          kvserve_attn::with_chunks(head_dim, [&](auto nc) {
            decode_task_bf16<decltype(nc)::value>(
                qrow, kc, vc, block_stride, tok_stride, block_tables + s * bt_stride, len, g0,
                heads_per_task, group, block_size, qk_scale, v_scale, lo, scores.data(),
                pbf.data(), acc.data(), m.data(), l.data(), orow);
          });
          continue;
        }
      }
#endif
      for (int64_t x = 0; x < width * head_dim; ++x) qs[x] = q_to_float(qrow[x]) * qk_scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -FLT_MAX);
      std::fill(l.begin(), l.end(), 0.f);
      const int32_t* table = block_tables + s * bt_stride;
      const int64_t num_blocks = (len + block_size - 1) / block_size;
      for (int64_t b = lo / block_size; b < num_blocks; ++b) {
        const int64_t base = static_cast<int64_t>(table[b]) * block_stride;
        const int64_t ntok = std::min(block_size, len - b * block_size);
        if (b + 1 < num_blocks) {  // two blocks ahead measured no better
          const int64_t next = static_cast<int64_t>(table[b + 1]) * block_stride;
          kvserve_attn::prefetch_block(k_cache + next, v_cache + next, block_bytes);
        }
#if KVSERVE_AVX2
        if (simd) {
          for (int64_t g = 0; g < heads_per_task; ++g)
            block_scores_simd(k_cache + base + (g0 + g) * head_dim, tok_stride, ntok,
                              qs.data() + g * group * head_dim, group, head_dim, block_size,
                              lut, scores.data() + g * group * block_size);
        } else
#endif
        for (int64_t t = 0; t < ntok; ++t) {
          const T* krow = k_cache + base + t * tok_stride + g0 * head_dim;
          for (int64_t g = 0; g < heads_per_task; ++g) {
            const float* kr = Row<T>::load(krow + g * head_dim, kbuf.data(), head_dim, lut);
            for (int64_t h = g * group; h < (g + 1) * group; ++h) {
              const float* qh = qs.data() + h * head_dim;
              float dot = 0.f;
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * kr[d];
              scores[h * block_size + t] = dot;
            }
          }
        }
        hide_before_window(scores.data(), width, block_size, lo - b * block_size);
#if KVSERVE_AVX2
        if (simd) {
          for (int64_t h = 0; h < width; ++h) {  // online softmax, one rescale per block
            const float prev = m[h];
            const float sum = softmax_block_simd(scores.data() + h * block_size, ntok, m[h]);
            const float corr = exp_nonpositive(prev - m[h]);
            l[h] = l[h] * corr + sum;
            if (corr != 1.f) {
              float* ah = acc.data() + h * head_dim;
              for (int64_t d = 0; d < head_dim; ++d) ah[d] *= corr;
            }
          }
        } else
#endif
        for (int64_t h = 0; h < width; ++h) {  // online softmax, one rescale per block
          float* sc = scores.data() + h * block_size;
          float top = m[h];
          for (int64_t t = 0; t < ntok; ++t) top = std::max(top, sc[t]);
          const float corr = exp_nonpositive(m[h] - top);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < ntok; ++t) {
            sc[t] = exp_nonpositive(sc[t] - top);
            sum += sc[t];
          }
          l[h] = l[h] * corr + sum;
          m[h] = top;
          if (corr != 1.f) {
            float* ah = acc.data() + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) ah[d] *= corr;
          }
        }
#if KVSERVE_AVX2
        if (simd) {
          for (int64_t g = 0; g < heads_per_task; ++g)
            block_values_simd(v_cache + base + (g0 + g) * head_dim, tok_stride, ntok,
                              scores.data() + g * group * block_size, group, head_dim,
                              block_size, lut, acc.data() + g * group * head_dim);
        } else
#endif
        for (int64_t t = 0; t < ntok; ++t) {
          const T* vrow = v_cache + base + t * tok_stride + g0 * head_dim;
          for (int64_t g = 0; g < heads_per_task; ++g) {
            const float* vr = Row<T>::load(vrow + g * head_dim, vbuf.data(), head_dim, lut);
            for (int64_t h = g * group; h < (g + 1) * group; ++h) {
              const float p = scores[h * block_size + t];
              float* ah = acc.data() + h * head_dim;
#pragma omp simd
              for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * vr[d];
            }
          }
        }
      }
      QT* orow = out + row * q_tok_stride + g0 * group * head_dim;
      for (int64_t h = 0; h < width; ++h) {
        const float norm = v_scale / l[h];
        for (int64_t d = 0; d < head_dim; ++d)
          store_out(orow + h * head_dim + d, acc[h * head_dim + d] * norm);
      }
    }
  });
}

void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                  const at::Tensor& seq_ids, const at::Tensor& rows, const at::Tensor& lut,
                  double qk_scale, double v_scale, int64_t window, at::Tensor& out) {
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                  out.scalar_type() == q.scalar_type(),
              "paged_decode: q and out must be float32 or bfloat16, the same");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && block_tables.is_contiguous(),
              "paged_decode: tensors must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "paged_decode: block_tables and seq_lens must be int32");
  TORCH_CHECK(seq_ids.scalar_type() == at::kLong && rows.scalar_type() == at::kLong,
              "paged_decode: seq_ids and rows must be int64");
  const int64_t heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t block_stride = block_size * kv_heads * head_dim, tok_stride = kv_heads * head_dim;
  const float* lut_ptr = lut.numel() ? lut.data_ptr<float>() : nullptr;
  kvserve_attn::with_types("paged_decode", k_cache, q, lut_ptr, [&](auto* cache, auto* query) {
    using T = std::remove_pointer_t<decltype(cache)>;
    using QT = std::remove_pointer_t<decltype(query)>;
    auto run = [&](auto dim) {  // head_dim fixed at compile time for the common sizes
      decode_kernel<T, QT, decltype(dim)::value>(
          reinterpret_cast<const QT*>(q.data_ptr()), heads * head_dim,
          reinterpret_cast<const T*>(k_cache.data_ptr()),
          reinterpret_cast<const T*>(v_cache.data_ptr()), block_stride, tok_stride,
          block_tables.data_ptr<int32_t>(), block_tables.size(1), seq_lens.data_ptr<int32_t>(),
          seq_ids.data_ptr<int64_t>(), rows.data_ptr<int64_t>(), seq_ids.numel(), heads,
          kv_heads, head_dim, block_size, static_cast<float>(qk_scale),
          static_cast<float>(v_scale), window, lut_ptr, reinterpret_cast<QT*>(out.data_ptr()));
    };
    switch (head_dim) {
      case 64: run(std::integral_constant<int64_t, 64>{}); break;
      case 128: run(std::integral_constant<int64_t, 128>{}); break;
      default: run(std::integral_constant<int64_t, 0>{}); break;
    }
  });
}

}  // namespace

TORCH_LIBRARY(kvserve_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor seq_ids, Tensor rows, Tensor lut, float qk_scale, "
        "float v_scale, int window, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
