"""The oracle: plain per-sequence paged attention and KV writes in torch, plainly correct."""

from __future__ import annotations

import torch

from kvserve.kernels.fp8 import FP8_DTYPE, FP8_MAX


def dequantize(cache: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache values as `dtype`: fp8 entries are multiplied back by their per-tensor scale."""
    if cache.dtype == FP8_DTYPE:
        return cache.to(torch.float32).mul(scale).to(dtype)
    return cache.to(dtype)


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """`x` as a cache of `dtype`: fp8 values are divided by the scale, clamped to e4m3's range."""
    if dtype == FP8_DTYPE:
        return x.to(torch.float32).div(scale).clamp_(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def reference_write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store token i's key/value at slot slot_mapping[i]; negative slots are skipped."""
    block_size = k_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        k_cache[block, offset] = quantize(key[i], k_scale, k_cache.dtype)
        v_cache[block, offset] = quantize(value[i], v_scale, v_cache.dtype)


def reference_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor,
                              query_start_loc: torch.Tensor, scale: float,
                              k_scale: float = 1.0, v_scale: float = 1.0, *,
                              sliding_window: int | None = None,
                              logits_soft_cap: float | None = None,
                              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole (cached + new) history.

    `sliding_window` W: a token at position p sees keys at positions p - W + 1 .. p only (W keys,
    as HF's Mistral/Gemma masks). `logits_soft_cap` c: scores become c * tanh(scores / c) before
    the mask and softmax (Gemma 2). `sinks` [num_heads]: one more logit per head in every
    softmax whose weight is dropped (gpt-oss's attention sinks, as HF's eager attention).
    """
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    block_size = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[s], starts[s + 1]
        if end == start:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[s, :num_blocks].long()
        k = dequantize(k_cache[blocks], k_scale, torch.float32).flatten(0, 1)[:seq_len]
        v = dequantize(v_cache[blocks], v_scale, torch.float32).flatten(0, 1)[:seq_len]
        k = k.repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        qs = q[start:end].to(torch.float32)  # [q_len, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        if logits_soft_cap is not None:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        context = seq_len - (end - start)
        q_pos = context + torch.arange(end - start, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        hidden = k_pos > q_pos
        if sliding_window is not None:
            hidden = hidden | (k_pos <= q_pos - sliding_window)
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(-1, end - start, 1)
            probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = scores.softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
