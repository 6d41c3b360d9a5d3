"""Triton paged attention: one varlen kernel for prefill, decode and chunked prefill, walking block
tables with an online softmax, GQA heads packed in the tile, fp8 dequantised in the kernel; with
NUM_SPLITS > 1 it is the split-KV (flash-decoding) variant, merged by a small reduce kernel.

Per-layer options, each a runtime value behind a constexpr switch (so a layer without them
compiles to the plain kernel): `sliding_window` (USE_WINDOW) hides keys more than W - 1
positions behind the query and skips the key blocks wholly before every row's window;
`soft_cap_log2` (USE_SOFT_CAP) is the soft cap c times log2(e), the unit the scores are in
here, so s becomes c * tanh(s / c) before the mask; `sinks` (HAS_SINKS, per head, times
log2(e) on the host) join the running max and sum of split 0 only, so the merge of the splits
counts each once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.kernels.fp8 import FP8_DTYPE
from kvserve.kernels.plan import AttentionPlan

LOG2E = 1.4426950408889634


@triton.jit
def _tanh(x):
    """tanh from exp (the interpreter and every GPU have exp): saturates to +-1, no NaN."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _attend_range(m_i, l_i, acc, q, k_ptr, v_ptr, bt_row_ptr, kv_head, q_pos, lo, hi, qk_scale,
                  sliding_window, soft_cap_log2,
                  stride_kb, stride_ks, stride_kh, d, d_ok,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                  IS_FP8: tl.constexpr, DOT_FP32: tl.constexpr,
                  PRECISION: tl.constexpr, USE_WINDOW: tl.constexpr,
                  USE_SOFT_CAP: tl.constexpr, MASKED: tl.constexpr):
    """Online softmax of q's rows over keys [lo, hi), continuing (m_i, l_i, acc). MASKED=False:
    the caller guarantees every key of the range is visible to every row (whole tiles below the
    causal diagonal, no window), so no bound or causal mask is built or applied."""
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        if MASKED:
            j_ok = j < hi
            block = tl.load(bt_row_ptr + j // BLOCK_SIZE, mask=j_ok, other=0).to(tl.int64)
            kv_mask = j_ok[:, None] & d_ok[None, :]
        else:
            block = tl.load(bt_row_ptr + j // BLOCK_SIZE).to(tl.int64)
            kv_mask = d_ok[None, :]
        offs = block * stride_kb + (j % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        k = tl.load(k_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IS_FP8 or DOT_FP32:
            k = k.to(tl.float32).to(q.dtype)
            v = v.to(tl.float32).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if USE_SOFT_CAP:
            s = soft_cap_log2 * _tanh(s / soft_cap_log2)
        if MASKED:
            visible = (j[None, :] <= q_pos[:, None]) & j_ok[None, :]
            if USE_WINDOW:
                visible = visible & (j[None, :] > q_pos[:, None] - sliding_window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _paged_attention_kernel(
        out_ptr, ws_acc_ptr, ws_lse_ptr, q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
        qk_scale, v_scale, split_len, stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_bt, sliding_window, soft_cap_log2, sinks_ptr,
        GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_Q: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, IS_FP8: tl.constexpr,
        NUM_HEADS: tl.constexpr, DOT_FP32: tl.constexpr,
        PRECISION: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
        HAS_SINKS: tl.constexpr):
    """Program (sequence, query tile, kv head x split): BLOCK_Q tokens x GROUP heads as rows."""
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        rows = tl.arange(0, BLOCK_Q * GROUP_P2)
        tok = q_tile * BLOCK_Q + rows // GROUP_P2
        g = rows % GROUP_P2
        row_ok = (tok < q_len) & (g < GROUP)
        head = kv_head * GROUP + g
        d = tl.arange(0, HEAD_DIM_P2)
        d_ok = d < HEAD_DIM
        token = (q_start + tok).to(tl.int64)
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        q_pos = seq_len - q_len + tok
        kv_end = tl.minimum(seq_len, seq_len - q_len + (q_tile + 1) * BLOCK_Q)
        lo = split * split_len
        hi = tl.minimum(kv_end, lo + split_len)
        first_pos = seq_len - q_len + q_tile * BLOCK_Q  # the tile's first row's position
        m_i = tl.full([BLOCK_Q * GROUP_P2], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_P2], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_P2, HEAD_DIM_P2], tl.float32)
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        if USE_WINDOW:  # no row of this tile sees a key before its first row's window
            lo = tl.maximum(lo, first_pos - sliding_window + 1)
        else:
            # Whole key tiles at or before the first row's position are visible to every row
            # of the tile: no mask there. Tiles past the last row's position were already cut
            # off by kv_end; only the tiles across the diagonal (and a ragged end) are masked.
            full = tl.maximum(tl.minimum(hi, first_pos + 1) - lo, 0) // BLOCK_N * BLOCK_N
            m_i, l_i, acc = _attend_range(
                m_i, l_i, acc, q, k_ptr, v_ptr, bt_row, kv_head, q_pos, lo, lo + full,
                qk_scale, sliding_window, soft_cap_log2, stride_kb, stride_ks, stride_kh, d,
                d_ok, BLOCK_SIZE, BLOCK_N, IS_FP8, DOT_FP32, PRECISION, USE_WINDOW,
                USE_SOFT_CAP, False)
            lo = lo + full
        m_i, l_i, acc = _attend_range(
            m_i, l_i, acc, q, k_ptr, v_ptr, bt_row, kv_head, q_pos, lo, hi,
            qk_scale, sliding_window, soft_cap_log2, stride_kb, stride_ks, stride_kh, d, d_ok,
            BLOCK_SIZE, BLOCK_N, IS_FP8, DOT_FP32, PRECISION, USE_WINDOW, USE_SOFT_CAP, True)
        if HAS_SINKS:  # one more logit in the denominator, with no value: in split 0 only
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0)
            sink = tl.where(split == 0, sink, float("-inf"))
            m_new = tl.maximum(m_i, sink)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.exp2(sink - m_safe)
            acc = acc * alpha[:, None]
            m_i = m_new
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        res = acc / l_safe[:, None]
        store_mask = row_ok[:, None] & d_ok[None, :]
        if NUM_SPLITS == 1:
            o_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
            tl.store(out_ptr + o_offs, (res * v_scale).to(out_ptr.dtype.element_ty),
                     mask=store_mask)
        else:
            # Workspace [num_tokens, num_heads, NUM_SPLITS(, HEAD_DIM_P2)], log2-sum-exp per row.
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
            w_row = (token * NUM_HEADS + head) * NUM_SPLITS + split
            tl.store(ws_lse_ptr + w_row, lse, mask=row_ok)
            tl.store(ws_acc_ptr + w_row[:, None] * HEAD_DIM_P2 + d[None, :], res,
                     mask=store_mask)


@triton.jit
def _merge_splits_kernel(out_ptr, ws_acc_ptr, ws_lse_ptr, v_scale, stride_ot, stride_oh,
                         NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HEAD_DIM_P2: tl.constexpr):
    """Program (token, head): weight each split's normalised output by its share of the sum."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = (token * NUM_HEADS + head) * NUM_SPLITS
    s = tl.arange(0, SPLITS_P2)
    lse = tl.load(ws_lse_ptr + row + s, mask=s < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, 0)
    # A row with no keys at all (a CUDA graph's padding, length 0) has every lse -inf: it
    # yields zeros, not (-inf) - (-inf) = NaN.
    w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    d = tl.arange(0, HEAD_DIM_P2)
    acc = tl.load(ws_acc_ptr + (row + s)[:, None] * HEAD_DIM_P2 + d[None, :],
                  mask=(s < NUM_SPLITS)[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    total = tl.sum(w, 0)
    res = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total) * v_scale
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, res.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


@dataclass(frozen=True)
class TritonConfig:
    block_q: int
    block_n: int
    num_splits: int
    split_len: int
    q_tiles: int
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class Tiles:
    """Rows (query tokens x heads of a group) and keys per program step, and the launch shape."""

    rows: int
    block_n: int
    num_warps: int
    num_stages: int


def tiles(capability: tuple[int, int] | None, decode: bool, head_dim: int,
          block_size: int) -> Tiles:
    """The tile shape for a device of compute `capability` (None: the CPU interpreter).

    tl.dot needs >= 16 rows on a GPU; a decode batch has one token per sequence, so its tile is
    16 rows (the GQA group, padded). Prefill tiles are 64 x 64; on Hopper (sm_90+, 228 KiB of
    shared memory per SM and wgmma) 128 query rows x 64 keys with 8 warps and 3 stages, as
    FlashAttention-2's Hopper forward, while the head fits (head_dim <= 128).
    """
    min_n = max(16, block_size) if capability is None else max(64, block_size)
    if decode:
        return Tiles(16, min_n, 4, 2)
    if capability is not None and capability[0] >= 9 and head_dim <= 128:
        return Tiles(128, min_n, 8, 3)
    return Tiles(64, min_n, 4, 2 if capability is None or capability[0] < 8 else 3)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def triton_config(plan: AttentionPlan, group: int, num_kv_heads: int,
                  device: torch.device, head_dim: int = 128) -> TritonConfig:
    """Tile sizes and the KV split: split only decode batches too small to fill the device."""
    group_p2 = triton.next_power_of_2(group)
    capability = _capability(device.index or 0) if device.type == "cuda" else None
    t = tiles(capability, plan.max_query_len == 1, head_dim, plan.block_size)
    block_q = max(1, t.rows // group_p2)
    block_n = t.block_n
    num_splits = 1
    if plan.max_query_len == 1 and device.type == "cuda" and plan.max_seq_len > 1024:
        programs = max(1, plan.num_seqs * num_kv_heads)
        wanted = triton.cdiv(4 * _sm_count(device.index or 0), programs)
        num_splits = max(1, min(wanted, triton.cdiv(plan.max_seq_len, 512), 64))
    split_len = triton.cdiv(triton.cdiv(max(plan.max_seq_len, 1), num_splits), block_n) * block_n
    q_tiles = max(1, triton.cdiv(plan.max_query_len, block_q))
    return TritonConfig(block_q, block_n, num_splits, split_len, q_tiles, t.num_warps,
                        t.num_stages)


def triton_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           plan: AttentionPlan, scale: float, k_scale: float = 1.0,
                           v_scale: float = 1.0, num_splits: int | None = None, *,
                           sliding_window: int | None = None,
                           logits_soft_cap: float | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the varlen kernel (and the merge when the KV is split); `num_splits` overrides.
    `sliding_window` / `logits_soft_cap` / `sinks`: as paged_attention's (None = off)."""
    is_fp8 = k_cache.dtype == FP8_DTYPE
    if q.stride(-1) != 1:  # the kernel assumes a unit stride along head_dim
        q = q.contiguous()
    if not is_fp8:
        k_scale = v_scale = 1.0
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    cfg = plan.parts.get(("triton", kv_heads, heads))
    if cfg is None:
        cfg = plan.parts[("triton", kv_heads, heads)] = triton_config(
            plan, heads // kv_heads, kv_heads, q.device, q.shape[2])
    if num_splits is not None:
        split_len = triton.cdiv(triton.cdiv(max(plan.max_seq_len, 1), num_splits), cfg.block_n)
        cfg = TritonConfig(cfg.block_q, cfg.block_n, num_splits, split_len * cfg.block_n,
                           cfg.q_tiles, cfg.num_warps, cfg.num_stages)
    sinks_log2 = None if sinks is None else sinks.float().mul(LOG2E).contiguous()
    layer = LayerOptions(sliding_window, logits_soft_cap, sinks_log2)
    return _launch(q, k_cache, v_cache, plan, cfg, scale * k_scale * LOG2E, v_scale, is_fp8,
                   layer)


@dataclass(frozen=True)
class LayerOptions:
    """A layer's attention options in the kernel's units (0 where off: never read then)."""

    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    sinks_log2: torch.Tensor | None = None  # fp32 [num_heads], in log2 units

    def kernel_args(self, unused: torch.Tensor) -> dict:
        """`unused`: any tensor on the device, passed for sinks_ptr when there are none."""
        return {"sliding_window": self.sliding_window or 0,
                "soft_cap_log2": (self.logits_soft_cap or 0.0) * LOG2E,
                "sinks_ptr": unused if self.sinks_log2 is None else self.sinks_log2,
                "USE_WINDOW": self.sliding_window is not None,
                "USE_SOFT_CAP": self.logits_soft_cap is not None,
                "HAS_SINKS": self.sinks_log2 is not None}


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan,
            cfg: TritonConfig, qk_scale: float, v_scale: float, is_fp8: bool,
            layer: LayerOptions = LayerOptions()) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if plan.num_tokens == 0:
        return out
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    d_p2 = max(16, triton.next_power_of_2(head_dim))
    ws_acc = ws_lse = out
    if cfg.num_splits > 1:
        ws_acc = q.new_empty((plan.num_tokens, heads, cfg.num_splits, d_p2), dtype=torch.float32)
        ws_lse = q.new_empty((plan.num_tokens, heads, cfg.num_splits), dtype=torch.float32)
    tables = plan.block_tables
    grid = (plan.num_seqs, cfg.q_tiles, kv_heads * cfg.num_splits)
    _paged_attention_kernel[grid](
        out, ws_acc, ws_lse, q, k_cache, v_cache, tables, plan.seq_lens_t, plan.query_start_loc,
        qk_scale, v_scale, cfg.split_len, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        GROUP=heads // kv_heads, GROUP_P2=triton.next_power_of_2(heads // kv_heads),
        BLOCK_Q=cfg.block_q, HEAD_DIM=head_dim, HEAD_DIM_P2=d_p2, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_N=cfg.block_n, NUM_SPLITS=cfg.num_splits, IS_FP8=is_fp8, NUM_HEADS=heads,
        # The interpreter's tl.dot is wrong for bf16 operands: on the CPU the dots run in fp32.
        DOT_FP32=q.device.type != "cuda",
        # tl.dot rounds fp32 operands to TF32 by default; an fp32 model asks for fp32 accuracy.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **layer.kernel_args(out))
    if cfg.num_splits > 1:
        _merge_splits_kernel[(plan.num_tokens, heads)](
            out, ws_acc, ws_lse, v_scale, out.stride(0), out.stride(1), NUM_HEADS=heads,
            NUM_SPLITS=cfg.num_splits, SPLITS_P2=triton.next_power_of_2(cfg.num_splits),
            HEAD_DIM=head_dim, HEAD_DIM_P2=d_p2)
    return out
