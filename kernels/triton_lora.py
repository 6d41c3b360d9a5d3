"""Triton kernels of the batched LoRA op (punica's shrink / expand, our own): every row of the
flattened batch reads its own adapter's A and B by the row's slot index, so one launch of each
serves a batch that mixes adapters (and rows with no adapter, slot -1, which are skipped).

Layouts (lora/layers.py): A [S, L, R, K] (S output slices of a fused linear, L slots, rank R,
K inputs) and B^T [S, L, R, N] (N: the widest slice); y [T, sum of slice widths] += the delta.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, idx_ptr, buf_ptr, stride_x, K, L,
                   R: tl.constexpr, BLOCK_K: tl.constexpr, S: tl.constexpr):
    """Program (t, s): buf[t, s, :] = x[t] @ A[s, idx[t]]^T (fp32)."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    slot = tl.load(idx_ptr + t).to(tl.int64)
    if slot >= 0:
        rows = tl.arange(0, R)
        acc = tl.zeros((R,), dtype=tl.float32)
        a_base = a_ptr + ((s * L + slot) * R) * K
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            kmask = cols < K
            x = tl.load(x_ptr + t * stride_x + cols, mask=kmask, other=0.0).to(tl.float32)
            a = tl.load(a_base + rows[:, None] * K + cols[None, :], mask=kmask[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
        tl.store(buf_ptr + (t * S + s) * R + rows, acc)


@triton.jit
def _expand_kernel(buf_ptr, b_ptr, idx_ptr, y_ptr, off_ptr, width_ptr, stride_y, L, N,
                   R: tl.constexpr, BLOCK_N: tl.constexpr, S: tl.constexpr):
    """Program (t, s, j): y[t, off[s] + n] += buf[t, s] @ B^T[s, idx[t], :, n] for n in block j."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    j = tl.program_id(2)
    slot = tl.load(idx_ptr + t).to(tl.int64)
    width = tl.load(width_ptr + s)
    if slot >= 0 and j * BLOCK_N < width:
        rows = tl.arange(0, R)
        cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = cols < width
        h = tl.load(buf_ptr + (t * S + s) * R + rows)
        b = tl.load(b_ptr + ((s * L + slot) * R + rows[:, None]) * N + cols[None, :],
                    mask=nmask[None, :], other=0.0).to(tl.float32)
        delta = tl.sum(h[:, None] * b, axis=0)
        out = y_ptr + t * stride_y + tl.load(off_ptr + s) + cols
        y = tl.load(out, mask=nmask, other=0.0).to(tl.float32)
        tl.store(out, (y + delta).to(y_ptr.dtype.element_ty), mask=nmask)


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             indices: torch.Tensor, offsets: torch.Tensor, widths: torch.Tensor) -> None:
    """y [T, sum widths] += LoRA delta of x [T, K]; `indices` [T] int (slot, -1 = none),
    `offsets`/`widths` [S] int32 (where each slice's columns start in y, and how many)."""
    t, k = x.shape
    s, l, r, n = b.shape
    if t == 0:
        return
    x = x if x.stride(-1) == 1 else x.contiguous()
    buf = torch.empty((t, s, r), dtype=torch.float32, device=x.device)
    _shrink_kernel[(t, s)](x, a, indices, buf, x.stride(0), k, l, R=r,
                           BLOCK_K=min(128, triton.next_power_of_2(k)), S=s)
    block_n = min(128, triton.next_power_of_2(n))
    _expand_kernel[(t, s, triton.cdiv(n, block_n))](buf, b, indices, y, offsets, widths,
                                                    y.stride(0), l, n, R=r, BLOCK_N=block_n, S=s)
