"""write_kv: store new tokens' keys and values into the paged caches (torch path and dispatch)."""

from __future__ import annotations

import torch

from kvserve.kernels import cpu_ops
from kvserve.kernels.backend import resolve_backend
from kvserve.kernels.checks import check_write_kv
from kvserve.kernels.fp8 import FP8_DTYPE
from kvserve.kernels.reference import quantize, reference_write_kv


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
             backend: str = "auto") -> None:
    """k_cache/v_cache[slot // block_size, slot % block_size] = key/value (/ scale for fp8)."""
    check_write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    chosen = resolve_backend(backend, k_cache.device)
    if not k_cache.is_contiguous():  # page-strided (kv_region.py): only the torch path takes it
        chosen = "torch"
    if chosen == "reference":
        reference_write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    elif chosen == "triton":
        from kvserve.kernels.triton_cache import triton_write_kv

        triton_write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        torch_write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def torch_write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                   v_scale: float = 1.0) -> None:
    """One index_copy_ per cache over the flattened slots; negative slots are dropped first.
    float32/bf16 rows into a cache of their dtype on the CPU take the fused C++ copy instead."""
    if cpu_ops.fused_write_kv(key, value, k_cache, v_cache, slot_mapping):
        return
    slots = slot_mapping.long()
    if slots.numel() and int(slots.min()) < 0:
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    if not k_cache.is_contiguous():  # a page-strided view (engine/worker/kv_region.py)
        _strided_write(key, value, k_cache, v_cache, slots, k_scale, v_scale)
        return
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    if k_cache.dtype == FP8_DTYPE:
        # index_copy_ has no fp8 kernel: copy the bytes.
        flat_k, flat_v = flat_k.view(torch.uint8), flat_v.view(torch.uint8)
        key = quantize(key, k_scale, k_cache.dtype).view(torch.uint8)
        value = quantize(value, v_scale, v_cache.dtype).view(torch.uint8)
    flat_k.index_copy_(0, slots, key.to(flat_k.dtype))
    flat_v.index_copy_(0, slots, value.to(flat_v.dtype))


def _strided_write(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slots: torch.Tensor, k_scale: float,
                   v_scale: float) -> None:
    """Caches whose blocks lie a page apart (one row of slots cannot be flattened over them):
    one indexed store per cache, by (block, offset)."""
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    for cache, rows, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        if cache.dtype == FP8_DTYPE:  # index_put_ has no fp8 kernel: store the bytes
            cache.view(torch.uint8)[blocks, offsets] = \
                quantize(rows, scale, cache.dtype).view(torch.uint8)
        else:
            cache[blocks, offsets] = rows.to(cache.dtype)


def rope_write_kv(key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  k_scale: float = 1.0, v_scale: float = 1.0, backend: str = "auto") -> bool:
    """RoPE applied in the KV write: rope(key) and value stored at their slots by one Triton
    kernel (triton_fused.rope_write_kv), where it serves: the Triton backend, the fused ops on
    (cpu_ops.use_triton), caches of the key's dtype (not fp8). Returns False, having written
    nothing, elsewhere: the caller then rotates the key and calls write_kv."""
    if not (resolve_backend(backend, k_cache.device) == "triton" and cpu_ops.use_triton(key)
            and k_cache.is_contiguous()
            and k_cache.dtype == key.dtype == value.dtype and cos.shape[-1] * 2 == key.shape[-1]
            and key.stride(-1) == 1 and value.stride(-1) == 1):
        return False
    check_write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    from kvserve.kernels.triton_fused import rope_write_kv as fused

    fused(key, value, cos, sin, k_cache, v_cache, slot_mapping)
    return True
