// The decoder's elementwise ops fused for the CPU, one pass over memory each (vLLM's custom ops:
// rms_norm, fused_add_rms_norm, silu_and_mul, rotary_embedding), the KV cache write
// (reshape_and_cache), and the greedy sampler's row argmax.
//
// Unfused, a decode step runs ~25 small ATen kernels per layer around the matmuls (RMSNorm alone
// is pow, mean, add, rsqrt, mul, to, mul), each a pass over the activations with its own
// dispatch and allocation. Here each op is one loop per token row, parallel over rows, computing
// in float32 whatever the storage dtype (float32 or bfloat16) and rounding once on store.
// bfloat16 data is handled as its uint16_t bits (bf16.h), which GCC vectorises.
// Results equal the torch expressions in engine/models/llama.py up to float rounding (tested).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "fast_exp.h"

namespace {

// Storage types: float, or uint16_t holding bfloat16 bits.
inline float to_f(float x) { return x; }
inline float to_f(uint16_t x) { return kvserve_bf16::to_float(x); }
template <typename T>
inline T from_f(float x);
template <>
inline float from_f<float>(float x) { return x; }
template <>
inline uint16_t from_f<uint16_t>(float x) { return kvserve_bf16::from_float(x); }

// Calls fn with a value of the storage type of dtype (float32: float, bfloat16: uint16_t).
template <typename Fn>
void dispatch_storage(at::ScalarType dtype, Fn&& fn) {
  if (dtype == at::kFloat) {
    fn(float{});
  } else {
    fn(uint16_t{});
  }
}

template <typename S>
S* ptr(const at::Tensor& t) { return reinterpret_cast<S*>(t.data_ptr()); }

using kvserve_fast_exp::exp_nonpositive;

constexpr int64_t kGrain = 4;  // rows per task: decode batches have few rows, each ~576 wide

void check_rows(const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": ", name,
              " must be 2-D with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": ",
              name, " must be float32 or bfloat16");
}

void check_weight(const at::Tensor& weight, const at::Tensor& x, const char* op) {
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              op, ": weight must be contiguous [hidden] in x's dtype");
}

// out = w * (x / rms(x)); with `residual`: residual += x first and the norm is of the sum.
template <typename T>
void rms_rows(const T* x, int64_t x_stride, T* residual, int64_t r_stride, const T* w, T* out,
              int64_t o_stride, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* xi = x + i * x_stride;
      T* oi = out + i * o_stride;
      float ss = 0.f;
      if (residual != nullptr) {
        T* ri = residual + i * r_stride;
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < n; ++j) {
          const float s = to_f(xi[j]) + to_f(ri[j]);
          const T st = from_f<T>(s);
          ri[j] = st;
          const float sr = to_f(st);
          ss += sr * sr;
        }
        xi = ri;
      } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < n; ++j) ss += to_f(xi[j]) * to_f(xi[j]);
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        // like HF: normalise in float32, round to the model dtype, then scale by the weight
        const T normed = from_f<T>(to_f(xi[j]) * inv);
        oi[j] = from_f<T>(to_f(w[j]) * to_f(normed));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm", "x");
  check_weight(weight, x, "rms_norm");
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  dispatch_storage(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_rows<scalar_t>(ptr<scalar_t>(x), x.stride(0), nullptr, 0,
                       ptr<scalar_t>(weight), ptr<scalar_t>(out), out.stride(0),
                       x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// residual += x; returns rms_norm(residual) * weight (vLLM's fused_add_rms_norm, not in place
// on x: x is usually a matmul output that nothing else reads).
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  check_rows(x, "add_rms_norm", "x");
  check_rows(residual, "add_rms_norm", "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "add_rms_norm: x and residual must have the same shape and dtype");
  check_weight(weight, x, "add_rms_norm");
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  dispatch_storage(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_rows<scalar_t>(ptr<scalar_t>(x), x.stride(0), ptr<scalar_t>(residual),
                       residual.stride(0), ptr<scalar_t>(weight), ptr<scalar_t>(out),
                       out.stride(0), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// [T, 2I] (gate | up) -> [T, I] = silu(gate) * up, silu(g) = g * sigmoid(g) with
// sigmoid from e^-|g| (never overflows): 1 / (1 + e) for g >= 0, e / (1 + e) below.
template <typename T>
void silu_mul_rows(const T* src, int64_t stride, T* dst, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* g = src + i * stride;
      const T* u = g + n;
      T* o = dst + i * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const float gv = to_f(g[j]);
        const float e = exp_nonpositive(-std::fabs(gv));
        const float sig = (gv >= 0.f ? 1.f : e) / (1.f + e);
        // like torch: silu rounded to the dtype, then the product
        o[j] = from_f<T>(to_f(from_f<T>(gv * sig)) * to_f(u[j]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul", "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: the last dimension must be even");
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, x.options());
  dispatch_storage(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    silu_mul_rows<scalar_t>(ptr<scalar_t>(x), x.stride(0), ptr<scalar_t>(out), rows,
                            n);
  });
  return out;
}

// In place, HF's rotate-half layout: for each head, (x1, x2) -> (x1 cos - x2 sin,
// x2 cos + x1 sin) over the two halves of head_dim. x: [T, heads, D] with contiguous heads
// (a view into the fused qkv output is fine); cos, sin: [T, D / 2] in x's dtype.
template <typename T>
void rope_rows(T* x, int64_t tok_stride, int64_t heads, int64_t d, const T* cos, const T* sin,
               int64_t cs_stride, int64_t rows) {
  const int64_t half = d / 2;
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* c = cos + i * cs_stride;
      const T* s = sin + i * cs_stride;
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = x + i * tok_stride + h * d;
        T* x2 = x1 + half;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float a = to_f(x1[j]), b = to_f(x2[j]), cj = to_f(c[j]), sj = to_f(s[j]);
          // rounded per product like the torch expression, so bf16 matches it closely
          const float ac = to_f(from_f<T>(a * cj)), bs = to_f(from_f<T>(b * sj));
          const float bc = to_f(from_f<T>(b * cj)), as = to_f(from_f<T>(a * sj));
          x1[j] = from_f<T>(ac - bs);
          x2[j] = from_f<T>(bc + as);
        }
      }
    }
  });
}

void rope_one(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotary_embedding: q/k must be [T, heads, head_dim] with contiguous heads");
  TORCH_CHECK(x.size(2) % 2 == 0, "rotary_embedding: head_dim must be even");
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.stride(1) == 1 &&
                  sin.strides() == cos.strides() && cos.size(0) == x.size(0) &&
                  cos.size(1) == x.size(2) / 2 && cos.scalar_type() == x.scalar_type() &&
                  sin.scalar_type() == x.scalar_type(),
              "rotary_embedding: cos/sin must be [T, head_dim / 2] in q's dtype");
  dispatch_storage(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    rope_rows<scalar_t>(ptr<scalar_t>(x), x.stride(0), x.size(1), x.size(2),
                        ptr<scalar_t>(cos), ptr<scalar_t>(sin), cos.stride(0),
                        x.size(0));
  });
}

void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  rope_one(q, cos, sin);
  rope_one(k, cos, sin);
}

// k_cache/v_cache[slot] = key/value row by row, both in one pass, negative slots skipped; the
// new tokens' rows may be strided views into the fused qkv output. Caches in the rows' dtype
// (fp8 is quantised and written by the torch path). It replaces two index_copy_ calls a layer,
// whose cost at decode is mostly dispatch and their scans of the slots for negatives.
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
              at::Tensor& v_cache, const at::Tensor& slots) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.stride(2) == 1 &&
                  key.stride(1) == key.size(2) && value.stride(2) == 1 &&
                  value.stride(1) == value.size(2),
              "write_kv: key/value must be [T, kv_heads, head_dim] with contiguous heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == key.scalar_type() &&
                  v_cache.scalar_type() == value.scalar_type() &&
                  k_cache.sizes() == v_cache.sizes() &&
                  k_cache.size(2) * k_cache.size(3) == key.size(1) * key.size(2),
              "write_kv: caches must be contiguous [blocks, block_size, kv_heads, head_dim] "
              "in the rows' dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.is_contiguous() && slots.scalar_type() == at::kLong &&
                  slots.size(0) == key.size(0),
              "write_kv: slot_mapping must be int64 [T]");
  const int64_t n = key.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t row_bytes = key.size(1) * key.size(2) * key.element_size();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(slot[t] < num_slots, "write_kv: slot ", slot[t], " is past the cache");
  const auto* ks = static_cast<const char*>(key.data_ptr());
  const auto* vs = static_cast<const char*>(value.data_ptr());
  auto* kd = static_cast<char*>(k_cache.data_ptr());
  auto* vd = static_cast<char*>(v_cache.data_ptr());
  const int64_t k_step = key.stride(0) * key.element_size();
  const int64_t v_step = value.stride(0) * value.element_size();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slot[t] < 0) continue;
      std::memcpy(kd + slot[t] * row_bytes, ks + t * k_step, row_bytes);
      std::memcpy(vd + slot[t] * row_bytes, vs + t * v_step, row_bytes);
    }
  });
}

// Greedy sampling: the index of each row's largest value, the first one on ties, the first NaN
// if the row has one (torch.argmax's contract). ATen's argmax keeps an index beside every
// compared value and does not vectorise; two vectorised passes (the max with a NaN flag, then a
// scan for its first position, from L2) are an order of magnitude cheaper (docs/perf.md).
// bf16 logits are read as they are: widening is exact and keeps the order.
template <typename T>
void argmax_rows(const T* x, int64_t stride, int64_t* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* r = x + i * stride;
      float best = -INFINITY;
      int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
      for (int64_t j = 0; j < n; ++j) {
        const float v = to_f(r[j]);
        best = std::max(best, v);
        nan |= v != v;
      }
      int64_t at = 0;
      if (nan) {
        while (!std::isnan(to_f(r[at]))) ++at;
      } else {
        while (to_f(r[at]) != best) ++at;  // best is one of the row's values (-inf rows: 0)
      }
      out[i] = at;
    }
  });
}

at::Tensor argmax(const at::Tensor& x) {
  check_rows(x, "argmax", "x");
  TORCH_CHECK(x.size(1) > 0, "argmax: rows must not be empty");
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  dispatch_storage(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    argmax_rows<scalar_t>(ptr<scalar_t>(x), x.stride(0), out.data_ptr<int64_t>(), rows, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(kvserve_ops, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slots) -> ()");
  m.def("argmax(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_ops, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("write_kv", &write_kv);
  m.impl("argmax", &argmax);
}
