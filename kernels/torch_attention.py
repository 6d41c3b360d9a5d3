"""The CPU fast path: paged attention with batched torch ops over gathered blocks.

Decodes: sequences are grouped into chunks of similar length; each chunk gathers its blocks with one
index_select per cache ([n, key_len, kv_heads * head_dim], no transpose) and runs two bmm's with a
block-diagonal query, so GQA needs no repeated K/V. Prefills: one SDPA per sequence over its
gathered blocks, causal (shifted by the cached context for chunked prefill).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.kernels.plan import AttentionPlan
from kvserve.kernels.torch_plan import DecodeChunk, PrefillSeq, torch_plan

FP8 = torch.float8_e4m3fn


def torch_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          plan: AttentionPlan, scale: float, k_scale: float = 1.0,
                          v_scale: float = 1.0) -> torch.Tensor:
    """Same contract as reference_paged_attention; fp8 scales are folded into the matmuls."""
    if k_cache.dtype != FP8:  # scales describe fp8 storage only
        k_scale = v_scale = 1.0
    token_bytes = 2 * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
    parts = torch_plan(plan, token_bytes)
    out = torch.empty_like(q)
    flat_k, flat_v = _flat(k_cache), _flat(v_cache)
    for chunk in parts.decode:
        res = _decode(q, flat_k, flat_v, k_cache, chunk, scale * k_scale, v_scale)
        out.index_copy_(0, chunk.tokens, res)
    for seq in parts.prefill:
        out[seq.start:seq.end] = _prefill(q, flat_k, flat_v, k_cache, seq, scale, k_scale, v_scale)
    return out


def _flat(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size * kv_heads * head_dim]; fp8 as bytes (index_select has no fp8)."""
    flat = cache.view(cache.shape[0], -1)
    return flat.view(torch.uint8) if cache.dtype == FP8 else flat


def _gather(flat: torch.Tensor, blocks: torch.Tensor, cache_dtype: torch.dtype,
            dtype: torch.dtype) -> torch.Tensor:
    rows = flat.index_select(0, blocks)
    return rows.view(FP8).to(dtype) if cache_dtype == FP8 else rows.to(dtype)


def _decode(q: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor, k_cache: torch.Tensor,
            chunk: DecodeChunk, qk_scale: float, v_scale: float) -> torch.Tensor:
    """[n, num_heads, head_dim] for one decode chunk."""
    n, (kv_heads, head_dim), heads = chunk.tokens.shape[0], k_cache.shape[2:], q.shape[1]
    group = heads // kv_heads
    k = _gather(flat_k, chunk.blocks, k_cache.dtype, q.dtype).view(n, chunk.key_len, -1)
    v = _gather(flat_v, chunk.blocks, k_cache.dtype, q.dtype).view(n, chunk.key_len, -1)
    qs = q.index_select(0, chunk.tokens).view(n, kv_heads, group, 1, head_dim)
    # Block-diagonal query [n, heads, kv_heads * head_dim]: head h only sees its KV head's slice.
    eye = torch.eye(kv_heads, dtype=q.dtype, device=q.device).view(1, kv_heads, 1, kv_heads, 1)
    q_big = (qs * eye).view(n, heads, kv_heads * head_dim)
    scores = torch.baddbmm(chunk.additive_mask(q.dtype), q_big, k.transpose(1, 2), alpha=qk_scale)
    probs = torch.softmax(scores, dim=-1)
    full = torch.bmm(probs, v).view(n, kv_heads, group, kv_heads, head_dim)
    res = torch.diagonal(full, dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(n, heads, head_dim)
    return res.mul_(v_scale) if v_scale != 1.0 else res


def _prefill(q: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor, k_cache: torch.Tensor,
             seq: PrefillSeq, scale: float, k_scale: float, v_scale: float) -> torch.Tensor:
    """[end - start, num_heads, head_dim] for one sequence with several new tokens."""
    kv_shape = (-1, *k_cache.shape[2:])
    k = _gather(flat_k, seq.blocks, k_cache.dtype, q.dtype).view(kv_shape)[: seq.seq_len]
    v = _gather(flat_v, seq.blocks, k_cache.dtype, q.dtype).view(kv_shape)[: seq.seq_len]
    res = F.scaled_dot_product_attention(
        q[seq.start:seq.end].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=seq.mask, is_causal=seq.mask is None, scale=scale * k_scale, enable_gqa=True)
    res = res.transpose(0, 1)
    return res * v_scale if v_scale != 1.0 else res
