// The batched LoRA delta on the CPU (punica's BGMV, one call for a whole step):
//   y[t, off[s] + n] += sum_r (x[t] . A[s, idx[t], r]) * Bt[s, idx[t], r, n]   for n < width[s]
// for every row t whose slot idx[t] >= 0 (rows of the base model, -1, are not touched).
// Layouts (lora/layers.py): A [S, L, R, K], Bt [S, L, R, N] (N: the widest slice, zero padded),
// y [T, sum widths] with contiguous rows, x [T, K] with contiguous rows; float32 or bfloat16,
// all of one dtype, accumulated in float32, each y element rounded once.
// At decode sizes (T ~ 16, R = 8) the work is a few hundred thousand multiply-adds a linear:
// dense matmuls over every slot cost oneDNN's fixed per-call overhead three times over
// (docs/perf/lora.md); this reads only each row's own adapter, in one pass.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "bf16.h"

namespace {

inline float ld(float v) { return v; }
inline float ld(uint16_t v) { return kvserve_bf16::to_float(v); }
inline void st(float* p, float v) { *p = v; }
inline void st(uint16_t* p, float v) { *p = kvserve_bf16::from_float(v); }

constexpr int64_t kMaxRank = 256;

template <typename T>
void lora_rows(T* y, int64_t ys, const T* x, int64_t xs, const T* a, const T* bt,
               const int64_t* idx, const int64_t* off, const int64_t* width, int64_t rows,
               int64_t S, int64_t L, int64_t R, int64_t K, int64_t N) {
  at::parallel_for(0, rows, 32, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(N);
    float h[kMaxRank];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = idx[t];
      if (slot < 0) continue;
      const T* xr = x + t * xs;
      for (int64_t s = 0; s < S; ++s) {
        const T* as = a + ((s * L + slot) * R) * K;
        // four ranks a pass over x: four independent accumulator chains (one chain is
        // bound by the FMA latency, not its throughput)
        int64_t r = 0;
        for (; r + 4 <= R; r += 4) {
          const T *a0 = as + r * K, *a1 = a0 + K, *a2 = a1 + K, *a3 = a2 + K;
          float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
          for (int64_t k = 0; k < K; ++k) {
            const float xv = ld(xr[k]);
            s0 += xv * ld(a0[k]);
            s1 += xv * ld(a1[k]);
            s2 += xv * ld(a2[k]);
            s3 += xv * ld(a3[k]);
          }
          h[r] = s0, h[r + 1] = s1, h[r + 2] = s2, h[r + 3] = s3;
        }
        for (; r < R; ++r) {
          const T* ar = as + r * K;
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t k = 0; k < K; ++k) sum += ld(xr[k]) * ld(ar[k]);
          h[r] = sum;
        }
        const int64_t w = width[s];
        float* o = acc.data();
#pragma omp simd
        for (int64_t n = 0; n < w; ++n) o[n] = 0.f;
        const T* bs = bt + ((s * L + slot) * R) * N;
        int64_t q = 0;
        for (; q + 4 <= R; q += 4) {
          const float h0 = h[q], h1 = h[q + 1], h2 = h[q + 2], h3 = h[q + 3];
          if (h0 == 0.f && h1 == 0.f && h2 == 0.f && h3 == 0.f) continue;  // rank padding
          const T *b0 = bs + q * N, *b1 = b0 + N, *b2 = b1 + N, *b3 = b2 + N;
#pragma omp simd
          for (int64_t n = 0; n < w; ++n)
            o[n] += h0 * ld(b0[n]) + h1 * ld(b1[n]) + h2 * ld(b2[n]) + h3 * ld(b3[n]);
        }
        for (; q < R; ++q) {
          const float hq = h[q];
          const T* bq = bs + q * N;
#pragma omp simd
          for (int64_t n = 0; n < w; ++n) o[n] += hq * ld(bq[n]);
        }
        T* yr = y + t * ys + off[s];
#pragma omp simd
        for (int64_t n = 0; n < w; ++n) st(yr + n, ld(yr[n]) + o[n]);
      }
    }
  });
}

void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
              const at::Tensor& indices, at::IntArrayRef offsets, at::IntArrayRef widths) {
  TORCH_CHECK(a.dim() == 4 && bt.dim() == 4 && a.is_contiguous() && bt.is_contiguous(),
              "lora_add: A [S, L, R, K] and Bt [S, L, R, N] must be contiguous");
  const int64_t S = a.size(0), L = a.size(1), R = a.size(2), K = a.size(3), N = bt.size(3);
  TORCH_CHECK(bt.size(0) == S && bt.size(1) == L && bt.size(2) == R && R <= kMaxRank,
              "lora_add: A and Bt disagree on slices, slots or rank (rank <= 256)");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.stride(1) == 1 && y.dim() == 2 &&
                  y.stride(1) == 1 && y.size(0) == x.size(0),
              "lora_add: x [T, K] and y [T, sum widths] need contiguous rows");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == y.scalar_type() &&
                  bt.scalar_type() == y.scalar_type(),
              "lora_add: x, y, A and Bt must have one dtype");
  TORCH_CHECK(indices.scalar_type() == at::kLong && indices.is_contiguous() &&
                  indices.numel() == x.size(0), "lora_add: one int64 slot per row");
  TORCH_CHECK((int64_t)offsets.size() == S && (int64_t)widths.size() == S,
              "lora_add: one offset and one width per slice");
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(widths[s] <= N && offsets[s] + widths[s] <= y.size(1),
                "lora_add: a slice runs past y or Bt");
  const int64_t rows = x.size(0);
  const int64_t* idx = indices.data_ptr<int64_t>();
  if (y.scalar_type() == at::kFloat) {
    lora_rows(y.data_ptr<float>(), y.stride(0), x.data_ptr<float>(), x.stride(0),
              a.data_ptr<float>(), bt.data_ptr<float>(), idx, offsets.data(), widths.data(),
              rows, S, L, R, K, N);
  } else {
    TORCH_CHECK(y.scalar_type() == at::kBFloat16, "lora_add: float32 or bfloat16 only");
    auto p = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
    lora_rows(p(y), y.stride(0), p(x), x.stride(0), p(a), p(bt), idx, offsets.data(),
              widths.data(), rows, S, L, R, K, N);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_ops, m) {
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor a, Tensor bt, Tensor indices, int[] offsets, "
        "int[] widths) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_ops, CPU, m) { m.impl("lora_add", &lora_add); }
