"""Weight-only int4 / int8 matmuls (W4A16, W8A16) through torch's CPU kernels, which read the
packed weight and scale it inside the GEMM; the weight is repacked once at load."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvserve.engine.layers.quantization.qweight import QuantizedWeight

INT4_GROUPS = (256, 128, 64, 32)  # group sizes _weight_int4pack_mm_for_cpu takes
# Above this many rows (prefill) the int4 kernel's cost grows far faster than a dense GEMM's:
# the weight is dequantised from its packed bytes into a temporary and multiplied densely.
INT4_KERNEL_MAX_ROWS = 16


def int4_kernel_group(w: QuantizedWeight) -> int | None:
    """The int4 kernel's group size for `w` (a divisor of its own group width), or None when the
    kernel cannot take this weight (act-order groups that are not contiguous after sorting)."""
    for g in INT4_GROUPS:
        if w.group_size % g == 0 and w.in_features % g == 0:
            return g
    return None


def act_order(w: QuantizedWeight) -> tuple[QuantizedWeight, Tensor | None]:
    """With a g_idx, sort the input columns by group (GPTQ's desc_act): the groups become
    contiguous and the matmul reads x[:, perm]. Returns (weight in sorted order, perm or None)."""
    if w.g_idx is None:
        return w, None
    g_idx = w.g_idx.long()
    perm = torch.argsort(g_idx, stable=True)
    sorted_groups = g_idx[perm]
    n = w.in_features // w.group_size if w.in_features % w.group_size == 0 else -1
    contiguous = n > 0 and torch.equal(
        sorted_groups, torch.arange(w.in_features, device=g_idx.device) // w.group_size)
    if not contiguous:
        return w, None
    used = sorted_groups.view(n, w.group_size)[:, 0]
    return (QuantizedWeight(w.values[:, perm], w.scale[:, used],
                            None if w.zero is None else w.zero[:, used], w.group_size, w.bits),
            perm)


def int4_supported(w: QuantizedWeight) -> bool:
    if w.is_float or w.bits != 4 or w.values.device.type != "cpu":
        return False
    w, perm = act_order(w)
    return w.g_idx is None and int4_kernel_group(w) is not None


class Int4WeightLinear(nn.Module):
    """W4A16: `_weight_int4pack_mm_for_cpu`, whose dequantisation is (q - 8) * scale + offset per
    group; a zero point z becomes the offset -z * scale (codes here are already q - 8)."""

    def __init__(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        w, perm = act_order(w)
        group = int4_kernel_group(w)
        assert group is not None and w.g_idx is None, "int4_supported() was not checked"
        self.group, self.out_features = group, w.out_features
        repeat = w.group_size // group
        scale = w.scale.repeat_interleave(repeat, dim=1) if repeat > 1 else w.scale
        zero = torch.zeros_like(scale) if w.zero is None else \
            w.zero.float().repeat_interleave(repeat, dim=1) if repeat > 1 else w.zero.float()
        sz = torch.stack((scale, -zero * scale), dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", sz.to(dtype), persistent=False)
        unsigned = (w.values.to(torch.int32) + 8).contiguous()
        self.register_buffer("weight", torch._convert_weight_to_int4pack_for_cpu(unsigned, 1),
                             persistent=False)
        self.register_buffer("perm", perm, persistent=False)
        # the packed layout is read back for prefill; only where it is the one we know
        self.unpackable = torch.equal(unpack_int4pack(self.weight, w.in_features), unsigned)

    def forward(self, x: Tensor) -> Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        sz = self.scales_and_zeros
        if x.shape[0] > INT4_KERNEL_MAX_ROWS and self.unpackable:
            return F.linear(x.to(sz.dtype), self.dense_weight()).to(x.dtype)
        return torch._weight_int4pack_mm_for_cpu(x.to(sz.dtype), self.weight, self.group,
                                                 sz).to(x.dtype)

    def dense_weight(self) -> Tensor:
        """The dequantised weight [out, in] in the scales' dtype, from the packed bytes."""
        sz = self.scales_and_zeros  # [in / group, out, 2]
        codes = unpack_int4pack(self.weight, sz.shape[0] * self.group).to(sz.dtype) - 8
        scale = sz[:, :, 0].t().repeat_interleave(self.group, dim=1)
        offset = sz[:, :, 1].t().repeat_interleave(self.group, dim=1)
        return codes * scale + offset


@functools.cache
def int4pack_block() -> int:
    """The output rows per block of `_convert_weight_to_int4pack_for_cpu`'s layout on this CPU
    (torch 2.13, x86: 64 where AVX-512 is used, 32 on AVX2), found by packing a known pattern
    once; 0 for a layout neither reads back."""
    codes = torch.arange(64 * 64, dtype=torch.int32).view(64, 64) % 16
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
    for block in (64, 32):
        if torch.equal(_unpack_blocks(packed, 64, block), codes):
            return block
    return 0


def _unpack_blocks(packed: Tensor, in_features: int, block: int) -> Tensor:
    out = packed.shape[0]
    blocks = packed.view(out // block, in_features, block // 2)
    rows = torch.cat((blocks & 0xF, blocks >> 4), dim=2)  # [out / block, in, block]
    return rows.transpose(1, 2).reshape(out, in_features).to(torch.int32)


def unpack_int4pack(packed: Tensor, in_features: int) -> Tensor:
    """Codes [out, in] from `_convert_weight_to_int4pack_for_cpu`'s layout: blocks of
    `int4pack_block()` output rows; within a block, byte j of input column k holds row j in its
    low nibble and row block/2 + j in its high nibble. Empty where the layout is not known."""
    block = int4pack_block()
    if not block or packed.shape[0] % block:
        return torch.empty(0)
    return _unpack_blocks(packed, in_features, block)


def int8_supported(w: QuantizedWeight) -> bool:
    return not w.is_float and w.bits == 8 and w.g_idx is None and w.scale.shape[1] == 1 \
        and w.values.device.type == "cpu"


class Int8WeightLinear(nn.Module):
    """W8A16 per output channel: `_weight_int8pack_mm` (symmetric); a zero point z is taken out
    after as sum_k x_k * z * s, one row vector per token."""

    def __init__(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        scale = w.scale[:, 0]
        self.register_buffer("weight", w.values.contiguous(), persistent=False)
        self.register_buffer("scale", scale.to(dtype), persistent=False)
        zs = None if w.zero is None else (w.zero[:, 0].float() * scale).to(dtype)
        self.register_buffer("zero_scale", zs, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        xs = x.to(self.scale.dtype)
        y = torch._weight_int8pack_mm(xs, self.weight, self.scale)
        if self.zero_scale is not None:
            y = y - xs.sum(dim=-1, keepdim=True) * self.zero_scale
        return y.to(x.dtype)
