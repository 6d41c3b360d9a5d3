"""The CPU fast path: paged attention vectorised over the batch with torch ops (first cut)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.kernels.plan import AttentionPlan
from kvserve.kernels.reference import dequantize


def torch_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          plan: AttentionPlan, scale: float, k_scale: float = 1.0,
                          v_scale: float = 1.0) -> torch.Tensor:
    out = torch.empty_like(q)
    bs = plan.block_size
    start = 0
    for s in range(plan.num_seqs):
        n, seq_len = plan.query_lens[s], plan.seq_lens[s]
        if n:
            blocks = plan.block_tables[s, : -(-seq_len // bs)].long()
            k = dequantize(k_cache[blocks], k_scale, q.dtype).flatten(0, 1)[:seq_len]
            v = dequantize(v_cache[blocks], v_scale, q.dtype).flatten(0, 1)[:seq_len]
            ctx = seq_len - n
            mask = None
            if n > 1:
                pos = torch.arange(n)[:, None] + ctx
                mask = torch.arange(seq_len)[None, :] <= pos
            o = F.scaled_dot_product_attention(q[start:start + n].transpose(0, 1), k.transpose(0, 1),
                                               v.transpose(0, 1), attn_mask=mask, scale=scale,
                                               enable_gqa=True)
            out[start:start + n] = o.transpose(0, 1)
        start += n
    return out
