// W8A8 int8 linears' activation side on the CPU, one pass over the rows each:
//   quant_int8_rows: per-token dynamic int8 quantisation (compressed-tensors' symmetric scheme:
//     scale = absmax / 127.5, codes = round-half-even(x / scale) clamped to [-128, 127]);
//   scale_rows: the int8 GEMM's float32 output times each row's scale, cast to the model dtype.
// Unfused they are ~7 and 2 ATen kernels per linear (abs, amax, div, round, clamp, two casts;
// mul, cast), which cost more than the narrow GEMMs between them (docs/perf/quantization.md).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <tuple>

#include "bf16.h"

namespace {

inline float load(float x) { return x; }
inline float load(uint16_t x) { return kvserve_bf16::to_float(x); }

// Value-returning clamp: std::min / std::max return references, and under `omp simd` GCC keeps
// those temporaries in memory and gives up vectorising the loop (a 6x slower scalar loop).
inline float clamp_int8(float v) {
  v = v < -128.f ? -128.f : v;
  return v > 127.f ? 127.f : v;
}

template <typename T>
void quant_rows(const T* x, int64_t stride, int8_t* codes, float* scales, int64_t rows,
                int64_t n) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    // n copied: the int8 stores below may alias anything, so a bound read through the
    // lambda's reference would be reloaded each iteration and the loop left scalar
    const int64_t len = n;
    for (int64_t i = begin; i < end; ++i) {
      const T* __restrict r = x + i * stride;
      float amax = 0.f;
#pragma omp simd reduction(max : amax)
      for (int64_t j = 0; j < len; ++j) {
        const float a = std::fabs(load(r[j]));
        amax = a > amax ? a : amax;
      }
      const float s = amax / 127.5f > FLT_EPSILON ? amax / 127.5f : FLT_EPSILON;
      scales[i] = s;
      int8_t* __restrict q = codes + i * len;
      for (int64_t j = 0; j < len; ++j) {
        // x / s as torch computes it (a division, not a reciprocal multiply), then rint: round
        // half to even, as torch.round; clamping first gives the same codes (integer bounds)
        q[j] = static_cast<int8_t>(static_cast<int32_t>(std::nearbyint(clamp_int8(load(r[j]) / s))));
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> quant_int8_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "quant_int8_rows: x must be 2-D, rows contiguous");
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor codes = at::empty({rows, n}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({rows, 1}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kFloat) {
    quant_rows(x.data_ptr<float>(), x.stride(0), codes.data_ptr<int8_t>(),
               scales.data_ptr<float>(), rows, n);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "quant_int8_rows: x must be float32 or bfloat16");
    quant_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0),
               codes.data_ptr<int8_t>(), scales.data_ptr<float>(), rows, n);
  }
  return {codes, scales};
}

at::Tensor scale_rows(const at::Tensor& y, const at::Tensor& scales, at::ScalarType dtype) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kFloat,
              "scale_rows: y must be a contiguous float32 matrix");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == y.size(0) &&
                  scales.is_contiguous(), "scale_rows: one float32 scale per row of y");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "scale_rows: the output dtype must be float32 or bfloat16");
  const int64_t rows = y.size(0), n = y.size(1);
  at::Tensor out = at::empty({rows, n}, y.options().dtype(dtype));
  const float* src = y.data_ptr<float>();
  const float* s = scales.data_ptr<float>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* r = src + i * n;
      const float si = s[i];
      if (dtype == at::kFloat) {
        float* o = out.data_ptr<float>() + i * n;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) o[j] = r[j] * si;
      } else {
        uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr()) + i * n;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) o[j] = kvserve_bf16::from_float(r[j] * si);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_ops, m) {
  m.def("quant_int8_rows(Tensor x) -> (Tensor, Tensor)");
  m.def("scale_rows(Tensor y, Tensor scales, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_ops, CPU, m) {
  m.impl("quant_int8_rows", &quant_int8_rows);
  m.impl("scale_rows", &scale_rows);
}
