"""The decoder's elementwise ops: RMSNorm (with the residual add fused), SiLU-and-mul, RoPE;
the KV cache write's row copy; and the greedy sampler's row argmax.

Each function has two implementations with the same results up to float rounding: the plain
torch expression (the reference, used on GPUs and wherever the C++ build is unavailable) and,
for CPU float32/bfloat16 tensors, one fused C++ loop from csrc/cpu_ops.cpp (built with the
decode kernel, see cpu_attention.py). Unfused, a decode step ran ~25 small ATen kernels per
layer around the matmuls; the figures are in docs/perf.md ("Fused elementwise ops").
On CUDA tensors the same ops run as Triton kernels (triton_fused.py).
KVSERVE_FUSED_OPS=0 keeps the torch expressions.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import Tensor

_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def fused_available() -> bool:
    """Whether the C++ ops are built and enabled (builds them once per machine)."""
    if os.environ.get("KVSERVE_FUSED_OPS", "1") == "0":
        return False
    from kvserve.kernels import cpu_attention

    return cpu_attention.available()


def _fused(x: Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _DTYPES and fused_available()


def use_triton(x: Tensor) -> bool:
    """Whether x takes the Triton kernels of triton_fused.py: CUDA tensors, unless
    KVSERVE_FUSED_OPS=0 (the CPU keeps the C++ / torch paths above)."""
    return x.is_cuda and os.environ.get("KVSERVE_FUSED_OPS", "1") != "0"


def _triton_fused():
    from kvserve.kernels import triton_fused  # imported only on a GPU: triton compiles there

    return triton_fused


# ---- torch references -------------------------------------------------------------------------
def torch_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF's LlamaRMSNorm: normalise in float32, round to x's dtype, scale by the weight."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def torch_silu_and_mul(x: Tensor) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_clamped(h: Tensor, alpha: float, limit: float) -> Tensor:
    """gpt-oss's activation on [M, 2I] (gate | up): (clamp(up) + 1) * g * sigmoid(alpha * g),
    g = min(gate, limit)."""
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def torch_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, D] rotated in HF's rotate-half layout; cos, sin [T, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# ---- the ops the model calls ------------------------------------------------------------------
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x [T, hidden]."""
    if _fused(x) and x.dim() == 2 and x.stride(-1) == 1:
        return torch.ops.kvserve_ops.rms_norm(x, weight, eps)
    if use_triton(x) and x.dim() == 2 and x.stride(-1) == 1:
        return _triton_fused().add_rms_norm(x, None, weight, eps)
    return torch_rms_norm(x, weight, eps)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(RMSNorm(x + residual), x + residual). The fused path updates `residual` in place and
    returns it; callers must own it (the decoder's running residual stream)."""
    if _fused(x) and x.dim() == 2 and x.stride(-1) == 1 and residual.is_contiguous():
        out = torch.ops.kvserve_ops.add_rms_norm(x, residual, weight, eps)
        return out, residual
    if use_triton(x) and x.dim() == 2 and x.stride(-1) == 1 and residual.is_contiguous():
        return _triton_fused().add_rms_norm(x, residual, weight, eps), residual
    residual = x + residual
    return torch_rms_norm(residual, weight, eps), residual


def silu_and_mul(x: Tensor) -> Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    if _fused(x) and x.dim() == 2 and x.stride(-1) == 1:
        return torch.ops.kvserve_ops.silu_and_mul(x)
    if use_triton(x) and x.dim() == 2 and x.stride(-1) == 1:
        return _triton_fused().act_and_mul(x, "silu")
    return torch_silu_and_mul(x)


def rotary_embedding(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] (views into the fused qkv output are fine) by
    cos, sin [T, D/2]. The fused path rotates in place and returns q and k themselves."""
    if _fused(q) and q.stride(-1) == 1 and q.stride(1) == q.shape[2] and \
            k.stride(-1) == 1 and k.stride(1) == k.shape[2] and cos.dtype == q.dtype:
        torch.ops.kvserve_ops.rotary_embedding(q, k, cos, sin)
        return q, k
    if use_triton(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
        return _triton_fused().rotary_embedding(q, k, cos, sin)
    return torch_rope(q, cos, sin), torch_rope(k, cos, sin)


def rotate_queries(q: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """q [T, Hq, D] rotated alone (its keys are rotated in the KV write, rope_write_kv): in
    place by Triton on the GPU, the torch expression elsewhere."""
    if use_triton(q) and q.stride(-1) == 1:
        return _triton_fused().rotate_inplace(q, cos, sin)
    return torch_rope(q, cos, sin)


def argmax(x: Tensor) -> Tensor:
    """int64 [S]: each row's first largest value of x [S, V] (the first NaN, if any), as
    torch.argmax(x, -1). The fused path reads bf16 logits as they are, with no float32 copy."""
    if _fused(x) and x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] > 0:
        return torch.ops.kvserve_ops.argmax(x)
    return x.argmax(dim=-1)


def fused_write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                   slot_mapping: Tensor) -> bool:
    """Copy key/value [T, kv_heads, D] rows into their slots in one C++ pass (negative slots
    skipped) when the caches hold the rows' dtype; False (nothing written) otherwise."""
    if not (_fused(key) and k_cache.dtype == key.dtype == value.dtype == v_cache.dtype and
            slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and
            k_cache.is_contiguous() and v_cache.is_contiguous() and
            key.stride(-1) == 1 and key.stride(1) == key.shape[2] and
            value.stride(-1) == 1 and value.stride(1) == value.shape[2]):
        return False
    torch.ops.kvserve_ops.write_kv(key, value, k_cache, v_cache, slot_mapping)
    return True
