"""The CPU fast path: paged attention with batched torch ops over gathered blocks.

Decodes: sequences are grouped into chunks of similar length (torch_plan.py); each chunk gathers
its blocks with one index_select per cache into a reused workspace ([n, key_len, kv_heads *
head_dim], no transpose), sized to stay in the last-level cache for the matmuls that follow. In
fp32, two bmm's with a block-diagonal query do GQA without repeating K/V; in bf16/fp16 (whose
small bmm's are slow on some CPUs) one SDPA runs on the strided per-head view. Prefills: per
sequence, two bmm's over its gathered blocks with each KV head's query group stacked, fp32
softmax, causal (shifted by the cached context for chunked prefill), tiled over query rows.
fp8 caches are gathered as bytes and widened with fp8_cpu's bit trick; scales fold into the math.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.kernels.fp8 import FP8_DTYPE
from kvserve.kernels.fp8_cpu import FP8_TO_FP16_FACTOR, fp8_bytes_to_fp16
from kvserve.kernels.plan import AttentionPlan
from kvserve.kernels.torch_plan import DecodeChunk, PrefillSeq, torch_plan
from kvserve.kernels.workspace import Workspace

PREFILL_TILE_BYTES = 8 << 20  # fp32 scores of one prefill tile (all heads)


def torch_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          plan: AttentionPlan, scale: float, k_scale: float = 1.0,
                          v_scale: float = 1.0, *, out: torch.Tensor | None = None,
                          decode: bool = True, sliding_window: int | None = None,
                          logits_soft_cap: float | None = None,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as reference_paged_attention. With `decode=False` the decode rows are left
    to the caller (the CPU backend's kernel has written them into `out`). A sliding window is
    one more mask term; a soft cap or sinks go through the explicit-softmax paths (not SDPA):
    a sink scales each row's weights by Z / (Z + e^sink) = sigmoid(logsumexp(scores) - sink)."""
    if k_cache.dtype == FP8_DTYPE:  # gathered values come out divided by 256
        k_scale, v_scale = k_scale * FP8_TO_FP16_FACTOR, v_scale * FP8_TO_FP16_FACTOR
    else:  # scales describe fp8 storage only
        k_scale = v_scale = 1.0
    token_bytes = 2 * k_cache.shape[2] * k_cache.shape[3] * q.element_size()
    parts = torch_plan(plan, token_bytes, with_decode=decode, window=sliding_window)
    ws = plan.parts.setdefault("workspace", Workspace(q.device))
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    gather = _Gather(k_cache, v_cache, q.dtype, ws)
    layer = _Layer(scale * k_scale, v_scale, sliding_window, logits_soft_cap,
                   None if sinks is None else sinks.float())
    for chunk in parts.decode:
        out.index_copy_(0, chunk.tokens, _decode(q, gather, chunk, layer))
    for seq in parts.prefill:
        out[seq.start:seq.end] = _prefill(q, gather, seq, layer)
    return out


@dataclass(frozen=True)
class _Layer:
    """One call's score scale, output scale and per-layer options."""

    qk_scale: float
    v_scale: float
    window: int | None
    soft_cap: float | None
    sinks: torch.Tensor | None = None  # fp32 [num_heads]

    @property
    def explicit(self) -> bool:
        """Whether the scores must be materialised in fp32 (no SDPA, no fused baddbmm)."""
        return self.soft_cap is not None or self.sinks is not None

    def sink(self, probs: torch.Tensor, scores: torch.Tensor, shape: tuple) -> torch.Tensor:
        """probs with each head's sink in the denominator (`shape` views sinks like scores)."""
        if self.sinks is None:
            return probs
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        return probs.mul_(torch.sigmoid(lse - self.sinks.view(shape)))

    def cap(self, scores: torch.Tensor) -> torch.Tensor:
        """Scaled scores, soft-capped in place when the layer has a cap (before the mask)."""
        if self.soft_cap is not None:
            scores.div_(self.soft_cap).tanh_().mul_(self.soft_cap)
        return scores


class _Gather:
    """Copies a list of blocks of K or V into the workspace, in the compute dtype."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype,
                 ws: Workspace) -> None:
        self.fp8 = k_cache.dtype == FP8_DTYPE
        self.flat = {name: cache.view(cache.shape[0], -1) for name, cache in
                     (("k", k_cache), ("v", v_cache))}
        if self.fp8:  # index_select has no fp8 kernel: move bytes
            self.flat = {name: flat.view(torch.uint8) for name, flat in self.flat.items()}
        self.width = self.flat["k"].shape[1]
        self.kv_heads = k_cache.shape[2]
        self.dtype, self.ws = dtype, ws

    def __call__(self, name: str, blocks: torch.Tensor) -> torch.Tensor:
        """[len(blocks), block_size * kv_heads * head_dim] in the compute dtype."""
        flat, shape = self.flat[name], (blocks.shape[0], self.width)
        raw = torch.index_select(flat, 0, blocks, out=self.ws.get(name, shape, flat.dtype))
        if self.fp8:
            raw = fp8_bytes_to_fp16(raw, out=self.ws.get(name + "16", shape, torch.float16))
        if raw.dtype == self.dtype:
            return raw
        return self.ws.get(name + "c", shape, self.dtype).copy_(raw)


def _decode(q: torch.Tensor, gather: _Gather, chunk: DecodeChunk, layer: _Layer) -> torch.Tensor:
    """[n, num_heads, head_dim] for one decode chunk."""
    n, heads, head_dim = chunk.tokens.shape[0], q.shape[1], q.shape[2]
    k = gather("k", chunk.blocks).view(n, chunk.key_len, -1)
    v = gather("v", chunk.blocks).view(n, chunk.key_len, -1)
    kv_heads = k.shape[2] // head_dim
    qs = q.index_select(0, chunk.tokens).view(n, kv_heads, heads // kv_heads, head_dim)
    if q.dtype == torch.float32 or layer.explicit:
        res = _decode_bmm(qs, k, v, chunk.additive_mask(torch.float32, layer.window), layer)
    else:
        res = F.scaled_dot_product_attention(
            qs, k.view(n, -1, kv_heads, head_dim).transpose(1, 2),
            v.view(n, -1, kv_heads, head_dim).transpose(1, 2),
            attn_mask=chunk.additive_mask(q.dtype, layer.window).unsqueeze(1),
            scale=layer.qk_scale)
    res = res.reshape(n, heads, head_dim)
    return res.mul_(layer.v_scale) if layer.v_scale != 1.0 else res


def _decode_bmm(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                layer: _Layer) -> torch.Tensor:
    """qs [n, kv_heads, group, d] against k/v [n, key_len, kv_heads * d] -> [n, kv, group, d].

    The query is made block-diagonal ([n, heads, kv_heads * d], head h non-zero only on its KV
    head's slice), so each bmm reads the gathered rows as they lie: no transpose, no repeat.
    Scores and softmax are fp32 (`mask` is fp32); a bf16 query comes here with a cap or sinks.
    """
    n, kv_heads, group, head_dim = qs.shape
    eye = torch.eye(kv_heads, dtype=qs.dtype, device=qs.device).view(1, kv_heads, 1, kv_heads, 1)
    q_big = (qs.unsqueeze(3) * eye).view(n, kv_heads * group, kv_heads * head_dim)
    if layer.soft_cap is None and qs.dtype == torch.float32:
        scores = torch.baddbmm(mask, q_big, k.transpose(1, 2), alpha=layer.qk_scale)
    else:
        scores = torch.bmm(q_big, k.transpose(1, 2)).float().mul_(layer.qk_scale)
        scores = layer.cap(scores).add_(mask)
    probs = layer.sink(torch.softmax(scores, dim=-1), scores, (1, -1, 1)).to(v.dtype)
    full = torch.bmm(probs, v).view(n, kv_heads, group, kv_heads, head_dim)
    return torch.diagonal(full, dim1=1, dim2=3).permute(0, 3, 1, 2)


def _prefill(q: torch.Tensor, gather: _Gather, seq: PrefillSeq, layer: _Layer) -> torch.Tensor:
    """[end - start, num_heads, head_dim] for one sequence with several new tokens.

    Each KV head's query group is stacked into one matrix ([kv_heads, n * group, d]), so two
    bmm's per tile do GQA without repeating K/V; scores and softmax are fp32, the bmm's run in
    the compute dtype (bf16 on AMX). Faster than SDPA, whose bf16 CPU path with a mask or
    enable_gqa falls back to its slow math kernel (docs/perf.md). Query rows are tiled so
    the fp32 scores stay ~PREFILL_TILE_BYTES whatever the prompt length.
    """
    n, heads, head_dim = seq.end - seq.start, q.shape[1], q.shape[2]
    kv_heads = gather.kv_heads
    group = heads // kv_heads
    kv_shape = (-1, kv_heads, head_dim)
    k = gather("k", seq.blocks).view(kv_shape)[: seq.seq_len].permute(1, 2, 0)  # [kvh, d, L]
    v = gather("v", seq.blocks).view(kv_shape)[: seq.seq_len].transpose(0, 1)  # [kvh, L, d]
    mask = seq.additive_mask(layer.window)
    qs = q[seq.start:seq.end].view(n, kv_heads, group, head_dim).transpose(0, 1)
    out = torch.empty(n, heads, head_dim, dtype=q.dtype, device=q.device)
    tile = max(1, PREFILL_TILE_BYTES // (4 * kv_heads * group * seq.seq_len))
    for r0 in range(0, n, tile):
        r1 = min(n, r0 + tile)
        rows = (r1 - r0) * group
        qt = qs[:, r0:r1].reshape(kv_heads, rows, head_dim)
        scores = torch.bmm(qt, k).float().view(kv_heads, r1 - r0, group, seq.seq_len)
        layer.cap(scores.mul_(layer.qk_scale)).add_(mask[None, r0:r1, None, :])
        probs = layer.sink(torch.softmax(scores, dim=-1), scores, (kv_heads, 1, group, 1))
        probs = probs.to(q.dtype).view(kv_heads, rows, seq.seq_len)
        res = torch.bmm(probs, v).view(kv_heads, r1 - r0, group, head_dim)
        out[r0:r1] = res.transpose(0, 1).reshape(r1 - r0, heads, head_dim)
    return out.mul_(layer.v_scale) if layer.v_scale != 1.0 else out
