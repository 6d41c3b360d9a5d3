"""Triton elementwise kernels for the GPU step: add + RMSNorm (Llama's and Gemma's (1 + w)),
SiLU/GeLU(tanh)-and-mul and in-place RoPE, each one launch where torch runs several."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_GELU_C = 0.7978845608028654  # sqrt(2 / pi)


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, eps,
                         N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr,
                         GEMMA: tl.constexpr):
    """Program t: s = x[t] (+ res[t], rounded to x's dtype and stored back into res[t]);
    out[t] = norm(s) * w rounded after (Gemma: * (1 + w) in fp32) or before (Llama) the scale."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + t * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_ptr + t * stride_r + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if GEMMA:
        y = x32 * rstd * (1.0 + w.to(tl.float32))
    else:  # HF rounds the normalised x to its dtype before the weight multiplies it
        y = (x32 * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, gemma: bool = False) -> torch.Tensor:
    """RMSNorm of x [T, N] (of x + residual, written into `residual` in place, when given)."""
    t, n = x.shape
    out = torch.empty_like(x)
    res = residual if residual is not None else x
    if t:
        _add_rms_norm_kernel[(t,)](x, res, weight, out, x.stride(0), res.stride(0),
                                   out.stride(0), eps, N=n, BLOCK=triton.next_power_of_2(n),
                                   HAS_RES=residual is not None, GEMMA=gemma)
    return out


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N: tl.constexpr,
                        BLOCK: tl.constexpr, GELU: tl.constexpr):
    """Program (t, b): out[t, cols] = act(gate[t, cols]) * up[t, cols], in fp32, rounded once."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # tanh(z) = 2 * sigmoid(2z) - 1 (tl has no tanh on every backend)
        z = _GELU_C * (gate + 0.044715 * gate * gate * gate)
        act = gate * tl.sigmoid(2.0 * z)  # = 0.5 * gate * (1 + tanh(z))
    else:
        act = gate * tl.sigmoid(gate)
    tl.store(out_ptr + t * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """[T, 2I] (gate | up) -> act(gate) * up [T, I]; activation "silu" or "gelu_tanh"."""
    if activation not in ("silu", "gelu_tanh"):
        raise ValueError(f"activation {activation!r}: expected 'silu' or 'gelu_tanh'")
    t, n2 = x.shape
    n = n2 // 2
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(max(n, 1)))
    if t and n:
        _act_and_mul_kernel[(t, triton.cdiv(n, block))](
            x, out, x.stride(0), out.stride(0), N=n, BLOCK=block, GELU=activation != "silu")
    return out


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_c, HEADS: tl.constexpr,
                 HEADS_P2: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr):
    """Program t: rotate every head of x[t] in place (rotate-half layout) by cos/sin[t]."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_P2)[:, None]
    d = tl.arange(0, HALF_P2)[None, :]
    mask = (h < HEADS) & (d < HALF)
    cos = tl.load(cos_ptr + t * stride_c + d, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_c + d, mask=d < HALF, other=0.0).to(tl.float32)
    p1 = x_ptr + t * stride_t + h * stride_h + d
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


def _rope_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    t, heads, dim = x.shape
    if t:
        _rope_kernel[(t,)](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), HEADS=heads,
                           HEADS_P2=triton.next_power_of_2(heads), HALF=dim // 2,
                           HALF_P2=triton.next_power_of_2(dim // 2))


def rotate_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (unit last stride) in place by cos, sin [T, D/2]; returns x."""
    if x.stride(-1) != 1:
        raise ValueError("rotate_inplace needs x with a unit last stride")
    _rope_inplace(x, cos.contiguous(), sin.contiguous())
    return x


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place (views with unit last stride are fine)
    by cos, sin [T, D/2]; returns q and k themselves."""
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    for x in (q, k):
        if x.stride(-1) != 1:
            raise ValueError("rotary_embedding needs q and k with a unit last stride")
        _rope_inplace(x, cos, sin)
    return q, k


@triton.jit
def _rope_write_kv_kernel(k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                          stride_kt, stride_kh, stride_vt, stride_vh, stride_c,
                          KV_HEADS: tl.constexpr, HEADS_P2: tl.constexpr, HALF: tl.constexpr,
                          HALF_P2: tl.constexpr):
    """Program t: cache[slot[t]] = (rope(k[t]), v[t]); a negative slot writes nothing."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, HEADS_P2)[:, None]
        d = tl.arange(0, HALF_P2)[None, :]
        mask = (h < KV_HEADS) & (d < HALF)
        cos = tl.load(cos_ptr + t * stride_c + d, mask=d < HALF, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + t * stride_c + d, mask=d < HALF, other=0.0).to(tl.float32)
        src = k_ptr + t * stride_kt + h * stride_kh + d
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        dst = slot * (KV_HEADS * 2 * HALF) + h * (2 * HALF) + d
        ty = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + dst, (x1 * cos - x2 * sin).to(ty), mask=mask)
        tl.store(k_cache_ptr + dst + HALF, (x2 * cos + x1 * sin).to(ty), mask=mask)
        vsrc = v_ptr + t * stride_vt + h * stride_vh + d
        tl.store(v_cache_ptr + dst, tl.load(vsrc, mask=mask), mask=mask)
        tl.store(v_cache_ptr + dst + HALF, tl.load(vsrc + HALF, mask=mask), mask=mask)


def rope_write_kv(key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """RoPE applied in the KV write: the rotated key [T, Hk, D] and the value go straight into
    their cache slots (contiguous caches of the rows' dtype), with no rotated copy of k kept.
    The layers call it through kernels/write_kv.py's rope_write_kv on decode steps."""
    t, kv_heads, dim = key.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.dtype == v_cache.dtype == value.dtype
            and key.stride(-1) == 1 and value.stride(-1) == 1):
        raise ValueError("rope_write_kv needs contiguous caches of the value's dtype and "
                         "key/value rows with a unit last stride")
    cos, sin = cos.contiguous(), sin.contiguous()
    if t:
        _rope_write_kv_kernel[(t,)](
            key, value, cos, sin, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1),
            value.stride(0), value.stride(1), cos.stride(0), KV_HEADS=kv_heads,
            HEADS_P2=triton.next_power_of_2(kv_heads), HALF=dim // 2,
            HALF_P2=triton.next_power_of_2(dim // 2))
