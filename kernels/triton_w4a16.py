"""W4A16 GEMM in Triton: y = x @ W^T with W's int4 codes dequantised inside each K tile (never
materialised), one fp32 scale and offset per group of input columns and output feature.

Layout (packed once at load by `pack_w4a16`): codes unsigned u in [0, 15] with
w[n, k] = u[n, k] * scale[k // group, n] + offset[k // group, n]; two k per byte along K
(k even in the low nibble), stored [K / 2, N] so a tile's loads are coalesced along N."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _w4a16_kernel(x_ptr, w_ptr, s_ptr, o_ptr, y_ptr, M, N, K, group,
                  stride_xm, stride_wk, stride_sg, stride_ym,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                    mask=(rm[:, None] < M) & kmask[None, :], other=0.0)
        wmask = kmask[:, None] & (rn[None, :] < N)
        packed = tl.load(w_ptr + (rk // 2)[:, None] * stride_wk + rn[None, :], mask=wmask,
                         other=0)
        codes = (packed >> ((rk % 2) * 4)[:, None].to(tl.uint8)) & 0xF
        g = rk // group
        scale = tl.load(s_ptr + g[:, None] * stride_sg + rn[None, :], mask=wmask, other=0.0)
        offset = tl.load(o_ptr + g[:, None] * stride_sg + rn[None, :], mask=wmask, other=0.0)
        w = codes.to(tl.float32) * scale + offset  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x.to(tl.float32), w)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def pack_w4a16(codes: Tensor, scale: Tensor, offset: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """codes [N, K] unsigned int4 values (any integer dtype), scale / offset [N, K / group] ->
    (packed uint8 [K / 2, N], scale fp32 [groups, N], offset fp32 [groups, N])."""
    u = codes.to(torch.uint8).t().contiguous()  # [K, N]
    if u.shape[0] % 2:
        u = torch.cat((u, torch.zeros_like(u[:1])))
    packed = (u[0::2] | (u[1::2] << 4)).contiguous()
    return packed, scale.float().t().contiguous(), offset.float().t().contiguous()


def w4a16_matmul(x: Tensor, packed: Tensor, scale: Tensor, offset: Tensor, group: int,
                 block_m: int = 16, block_n: int = 64, block_k: int = 32) -> Tensor:
    """y [M, N] = x [M, K] @ W^T in x's dtype; `group` a multiple of nothing in particular (each
    k reads its own group's scale), K even."""
    M, K = x.shape
    N = packed.shape[1]
    x = x.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _w4a16_kernel[grid](x, packed, scale, offset, y, M, N, K, group,
                        x.stride(0), packed.stride(0), scale.stride(0), y.stride(0),
                        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y
