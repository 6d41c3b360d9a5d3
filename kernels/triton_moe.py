"""The fused mixture-of-experts matmul in Triton, free of host syncs (and so CUDA-graph safe).

`align_block_size` sorts the T x k (token, expert) pairs by expert on the device and pads every
expert's segment to a multiple of BLOCK_M; `moe_matmul` then runs one program per (block of
BLOCK_M pairs, BLOCK_N outputs): rows gathered from the input by pair, times the transposed
weight of the block's expert, the weight dequantised inside each K tile when it is quantised.
The grid comes from host-known shapes only (the worst-case block count); blocks past the used
ones read expert -1 and exit at once. Output rows are written in pair order, so the caller's sum
over the k experts of a token is one reduction.

Weight formats (`ExpertWeights.fmt`), every expert's stacked along dim 0:
  dense  the model's own [E, N, K] tensor (fp32 / bf16 / fp16), read through its strides
  int4   codes u in [0, 15], two per byte along K (k even in the low nibble): uint8 [E, K/2, N];
         w = u * scale + offset
  int8   signed codes v: int8 [E, K, N]; w = v * scale (+ offset: a zero point as -z * scale)
  fp8    float8_e4m3fn codes [E, K, N]; w = v * scale
scale / offset are fp32 [E, G, N]; input column k reads group k // group, or g_idx[e, k] (act
order, or groups that straddle a tensor-parallel cut). With one group and no offset the scale
is applied once to the product (the dot then runs on the exact codes).

Activation-quantised schemes pass the input as per-row codes (int8 or fp8, quantised with torch
before the call) plus fp32 row scales; the scale of a row is applied after its K loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

FORMATS = ("dense", "int4", "int8", "fp8")


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks the padded, expert-sorted pairs can need: each expert holding pairs pads by at most
    BLOCK_M - 1 rows, and at most min(E, pairs) experts hold any."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)


def align_block_size(ids: Tensor, num_experts: int,
                     block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """ids [T, k] expert ids -> (sorted_pairs int32 [max_blocks * BLOCK_M]: pair indices t * k + j
    grouped by expert, each expert's segment padded to a multiple of BLOCK_M with the sentinel
    T * k; block_expert int32 [max_blocks]: each block's expert, -1 past the used blocks;
    used_blocks int32 [1]). Tensor ops only: nothing is read back to the host."""
    flat = ids.reshape(-1)
    pairs, device = flat.shape[0], flat.device
    nb = max_blocks(pairs, num_experts, block_m)
    # new tensors from `flat` (its device, and a test's stand-in device type)
    counts = flat.new_zeros(num_experts, dtype=torch.int64)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount reads its max on the host
    padded = (counts + block_m - 1) // block_m * block_m
    pad_ends = padded.cumsum(0)
    starts = counts.cumsum(0) - counts
    order = flat.argsort(stable=True)
    experts = flat.index_select(0, order)
    dest = (pad_ends - padded).index_select(0, experts) + \
        torch.arange(pairs, device=device) - starts.index_select(0, experts)
    sorted_pairs = flat.new_full((nb * block_m,), pairs, dtype=torch.int32)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    first_rows = torch.arange(nb, device=device) * block_m
    block_expert = torch.searchsorted(pad_ends, first_rows, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert, (pad_ends[-1:] // block_m).to(torch.int32)


@dataclass(frozen=True)
class ExpertWeights:
    """One projection of every expert, as the kernel reads it: y[p] = x[p] @ w[e]^T, w[e] of
    [n, k]. `codes`: dense [E, N, K] or the packed [E, K(/2), N] of a quantised format."""

    fmt: str
    codes: Tensor
    n: int
    k: int
    scale: Tensor | None = None  # fp32 [E, G, N]
    offset: Tensor | None = None  # fp32 [E, G, N]
    group: int = 0
    g_idx: Tensor | None = None  # int32 [E, K]

    def strides(self) -> tuple[int, int, int]:
        """(expert, k, n) strides of the codes; int4's k stride is per packed byte row."""
        c = self.codes
        if self.fmt == "dense":
            return c.stride(0), c.stride(2), c.stride(1)
        return c.stride(0), c.stride(1), c.stride(2)


@triton.jit
def _moe_kernel(a_ptr, a_scale_ptr, w_ptr, s_ptr, o_ptr, g_ptr, bias_ptr, rw_ptr, y_ptr,
                sorted_ptr, block_expert_ptr, num_pairs, N, K, group, a_div,
                stride_am, stride_we, stride_wk, stride_wn, stride_se, stride_sg,
                stride_ge, stride_be, stride_ym,
                FMT: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_GIDX: tl.constexpr,
                SCALE_AFTER: tl.constexpr, HAS_ASCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                MUL_WEIGHT: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (b, j): the pairs of block b (one expert's), output columns j * BLOCK_N + ..."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e < 0:  # past the used blocks: the grid is the worst case, sized on the host
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    a_row = (pair // a_div).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    w_base = w_ptr + e * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        a = tl.load(a_ptr + a_row[:, None] * stride_am + rk[None, :],
                    mask=valid[:, None] & kmask[None, :], other=0.0)
        wmask = kmask[:, None] & nmask[None, :]
        if FMT == "int4":
            packed = tl.load(w_base + (rk // 2)[:, None] * stride_wk + rn[None, :] * stride_wn,
                             mask=wmask, other=0)
            w = ((packed >> ((rk % 2) * 4)[:, None].to(tl.uint8)) & 0xF).to(tl.float32)
        elif FMT == "dense":
            w = tl.load(w_base + rk[:, None] * stride_wk + rn[None, :] * stride_wn, mask=wmask,
                        other=0.0)
        else:  # int8 and fp8 codes convert to fp32 exactly
            w = tl.load(w_base + rk[:, None] * stride_wk + rn[None, :] * stride_wn, mask=wmask,
                        other=0.0).to(tl.float32)
        if FMT != "dense" and not SCALE_AFTER:
            if HAS_GIDX:
                g = tl.load(g_ptr + e * stride_ge + rk, mask=kmask, other=0).to(tl.int64)
            else:
                g = rk // group
            s_off = e * stride_se + g[:, None] * stride_sg + rn[None, :]
            w = w * tl.load(s_ptr + s_off, mask=wmask, other=0.0)
            if HAS_OFFSET:
                w = w + tl.load(o_ptr + s_off, mask=wmask, other=0.0)
        acc += tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=PRECISION)
    if SCALE_AFTER:
        acc = acc * tl.load(s_ptr + e * stride_se + rn, mask=nmask, other=0.0)[None, :]
    if HAS_ASCALE:
        acc = acc * tl.load(a_scale_ptr + a_row, mask=valid, other=0.0)[:, None]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + e * stride_be + rn, mask=nmask, other=0.0)[None, :]
    if MUL_WEIGHT:
        acc = acc * tl.load(rw_ptr + pair, mask=valid, other=0.0)[:, None]
    out = y_ptr + pair.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


@dataclass(frozen=True)
class MoETiles:
    """The tiles of one launch: BLOCK_M is align_block_size's too."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 2


def choose_tiles(num_pairs: int, num_experts: int) -> MoETiles:
    """Decode (few pairs per expert) wastes least with 16-row blocks; prefill takes 64."""
    if num_pairs <= 4 * num_experts:
        return MoETiles(16, 64, 64)
    return MoETiles(64, 64, 64, num_warps=4, num_stages=3)


def moe_matmul(a: Tensor, w: ExpertWeights, sorted_pairs: Tensor, block_expert: Tensor,
               num_pairs: int, a_div: int, out_dtype: torch.dtype, tiles: MoETiles,
               a_scale: Tensor | None = None, bias: Tensor | None = None,
               route_weight: Tensor | None = None) -> Tensor:
    """y [num_pairs, w.n]: row p = a[p // a_div] @ w[expert of p]^T (* a_scale[p // a_div])
    (+ bias[e]) (* route_weight[p]); a [rows, K] in the model dtype, or int8 / fp8 codes with
    fp32 a_scale [rows]. Rows of pairs in no block are left unwritten."""
    if w.fmt not in FORMATS:
        raise ValueError(f"weight format {w.fmt!r}: expected one of {FORMATS}")
    if a.stride(-1) != 1:
        a = a.contiguous()
    y = a.new_empty((num_pairs, w.n), dtype=out_dtype)
    quant = w.fmt != "dense"
    scale_after = quant and w.g_idx is None and w.offset is None and w.scale.shape[1] == 1
    dot_fp32 = a.device.type != "cuda" or out_dtype == torch.float32  # see triton_attention
    se, wk, wn = w.strides()
    dummy = y  # an unused pointer argument (its constexpr branch is compiled out)
    grid = (block_expert.shape[0], triton.cdiv(w.n, tiles.block_n))
    _moe_kernel[grid](
        a, a_scale if a_scale is not None else dummy, w.codes,
        w.scale if quant else dummy, w.offset if w.offset is not None else dummy,
        w.g_idx if w.g_idx is not None else dummy, bias if bias is not None else dummy,
        route_weight if route_weight is not None else dummy, y, sorted_pairs, block_expert,
        num_pairs, w.n, w.k, max(w.group, 1), a_div, a.stride(0), se, wk, wn,
        w.scale.stride(0) if quant else 0, w.scale.stride(1) if quant else 0,
        w.g_idx.stride(0) if w.g_idx is not None else 0,
        bias.stride(0) if bias is not None else 0, y.stride(0),
        FMT=w.fmt, HAS_OFFSET=w.offset is not None, HAS_GIDX=w.g_idx is not None,
        SCALE_AFTER=scale_after, HAS_ASCALE=a_scale is not None, HAS_BIAS=bias is not None,
        MUL_WEIGHT=route_weight is not None,
        DOT_DTYPE=tl.float32 if dot_fp32 else _TL_DTYPES[out_dtype],
        PRECISION="ieee" if dot_fp32 else "tf32",
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return y


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# ---- packing: one expert's quantised weight into the kernel's layout, then stacked ----------
def pack_int4(codes: Tensor) -> Tensor:
    """codes [N, K] unsigned 4-bit values -> uint8 [ceil(K / 2), N] (k even in the low nibble)."""
    u = codes.to(torch.uint8).t().contiguous()
    if u.shape[0] % 2:
        u = torch.cat((u, torch.zeros_like(u[:1])))
    return (u[0::2] | (u[1::2] << 4)).contiguous()
