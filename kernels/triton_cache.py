"""Triton write_kv: one program per token stores its keys and values into their cache slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.fp8 import FP8_DTYPE
from kvserve.kernels.reference import quantize



@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale, v_scale,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     NUM_KV_HEADS: tl.constexpr, HEADS_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEAD_DIM_P2: tl.constexpr, QUANTIZE: tl.constexpr):
    """Program t: cache[slot[t]] = key[t] (divided by the scale and cast when QUANTIZE)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, HEADS_P2)
        d = tl.arange(0, HEAD_DIM_P2)
        mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        dst = slot * (NUM_KV_HEADS * HEAD_DIM) + h[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        if QUANTIZE:
            k = tl.clamp(k.to(tl.float32) / k_scale, -448.0, 448.0)
            v = tl.clamp(v.to(tl.float32) / v_scale, -448.0, 448.0)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def triton_write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                    v_scale: float = 1.0, quantize_in_kernel: bool | None = None) -> None:
    """Launch one program per token. fp8 is quantised in the kernel on a GPU; on the CPU
    (Triton's interpreter rounds some fp32 -> e4m3 conversions wrongly) torch quantises and the
    kernel copies bytes, unless `quantize_in_kernel` says otherwise."""
    if key.shape[0] == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        key, value = key.contiguous(), value.contiguous()
    in_kernel = k_cache.dtype == FP8_DTYPE and (
        quantize_in_kernel if quantize_in_kernel is not None else key.device.type == "cuda")
    if k_cache.dtype == FP8_DTYPE and not in_kernel:
        key = quantize(key, k_scale, FP8_DTYPE).view(torch.uint8)
        value = quantize(value, v_scale, FP8_DTYPE).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    heads, head_dim = key.shape[1], key.shape[2]
    _write_kv_kernel[(key.shape[0],)](
        key, value, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=heads, HEADS_P2=triton.next_power_of_2(heads), HEAD_DIM=head_dim,
        HEAD_DIM_P2=triton.next_power_of_2(head_dim), QUANTIZE=in_kernel)
