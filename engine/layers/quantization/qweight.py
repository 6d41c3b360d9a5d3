"""QuantizedWeight: one linear's quantised weight in a format-neutral layout, the meeting point of
the checkpoint readers (one per format) and the kernels (one per matmul)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from kvserve.engine.errors import QuantizationError


@dataclass(frozen=True)
class QuantizedWeight:
    """w[o, i] = (values[o, i] - zero[o, g]) * scale[o, g] with g = g_idx[i] (or i // group_size).

    `values` are signed integer codes in int8 (int4 codes in [-8, 7]: a format's unsigned codes
    minus 2^(bits-1), zero points shifted the same way) or float8_e4m3fn codes (bits 8, no zero).
    `scale` is float32 [out, groups]; a per-tensor or per-channel scale is one group of width `in`.
    """

    values: Tensor
    scale: Tensor
    zero: Tensor | None
    group_size: int
    bits: int
    g_idx: Tensor | None = None
    input_scale: float | None = None  # a static activation scale (per tensor), if the scheme has one

    @property
    def out_features(self) -> int:
        return self.values.shape[0]

    @property
    def in_features(self) -> int:
        return self.values.shape[1]

    @property
    def is_float(self) -> bool:
        return self.values.dtype == torch.float8_e4m3fn

    def group_of_column(self) -> Tensor:
        """[in] group index of every input column."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.in_features, device=self.values.device) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The dense weight [out, in] in `dtype` (the reference every kernel is checked against)."""
        cols = self.group_of_column()
        w = self.values.float()
        if self.zero is not None:
            w = w - self.zero.float()[:, cols]
        return (w * self.scale[:, cols]).to(dtype)

    def narrow(self, dim: int, start: int, length: int) -> "QuantizedWeight":
        """Rows (dim 0: output features) or columns (dim 1: input features) of the weight, with
        the scales, zero points and g_idx that belong to them."""
        if dim == 0:
            return replace(self, values=self.values.narrow(0, start, length),
                           scale=self.scale.narrow(0, start, length),
                           zero=None if self.zero is None else self.zero.narrow(0, start, length))
        values = self.values.narrow(1, start, length)
        if self.g_idx is None and self.scale.shape[1] == 1:  # one group spans every column
            return replace(self, values=values, group_size=length)
        if self.g_idx is None and start % self.group_size == 0 and length % self.group_size == 0:
            first, n = start // self.group_size, length // self.group_size
            return replace(self, values=values, scale=self.scale.narrow(1, first, n),
                           zero=None if self.zero is None else self.zero.narrow(1, first, n))
        # Groups that straddle the cut (or act order): keep every group, map columns by g_idx.
        g_idx = self.group_of_column().narrow(0, start, length).to(torch.int32)
        return replace(self, values=values, g_idx=g_idx)


def concat_rows(parts: list[QuantizedWeight], name: str) -> QuantizedWeight:
    """Fused projections (q/k/v, gate/up): the shards stacked along the output dim, each keeping
    its own scales (a per-tensor scale becomes one per row)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    for p in parts[1:]:
        same = (p.bits == first.bits and p.values.dtype == first.values.dtype
                and (p.zero is None) == (first.zero is None) and p.in_features == first.in_features)
        if not same:
            raise QuantizationError(
                f"the fused shards of {name} are quantised differently (bits, dtype, zero points "
                "or input width differ); a fused linear needs one scheme for all of its shards")
    if any(p.g_idx is not None for p in parts) or \
            len({(p.group_size, p.scale.shape[1]) for p in parts}) > 1:
        cols = [p.group_of_column() for p in parts]
        if any(not torch.equal(c, cols[0]) for c in cols[1:]):
            raise QuantizationError(
                f"the fused shards of {name} group their input columns differently (g_idx or "
                "group size); they cannot share one matmul")
    zero = None if first.zero is None else torch.cat([p.zero for p in parts])
    # The shards read the same input: one static input scale, the largest (as vLLM does).
    statics = [p.input_scale for p in parts if p.input_scale is not None]
    return replace(first, values=torch.cat([p.values for p in parts]),
                   scale=torch.cat([p.scale for p in parts]), zero=zero,
                   input_scale=max(statics) if statics else None)


def check_shape(name: str, tensor: Tensor, expected: tuple[int, ...]) -> Tensor:
    """`tensor` when its shape is `expected`, else an error naming the tensor."""
    if tuple(tensor.shape) != tuple(expected):
        raise QuantizationError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, its weight needs "
            f"{tuple(expected)}: the scales or zero points do not fit the weight")
    return tensor


def scale_per_row(name: str, scale: Tensor, out_features: int, in_features: int,
                  group_size: int | None) -> tuple[Tensor, int]:
    """A weight scale (per tensor: [] or [1]; per channel: [out] or [out, 1]; per group:
    [out, in/group]) as float32 [out, groups], with the group width."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(out_features, 1).contiguous(), in_features
    if scale.dim() == 1:
        scale = scale.unsqueeze(1)
    groups = 1 if not group_size or group_size <= 0 else -(-in_features // group_size)
    check_shape(name, scale, (out_features, groups))
    return scale, in_features if groups == 1 else group_size


def unpack_int32(packed: Tensor, bits: int, count: int, dim: int) -> Tensor:
    """Codes packed little-endian in int32 words along `dim` (element j of a word at bits
    bits * j), as unsigned int16 values; `count` codes are kept along that dim."""
    if bits not in (4, 8):
        raise QuantizationError(f"{bits}-bit packing is not supported; supported: 4 and 8 bits")
    moved = packed.movedim(dim, -1).contiguous()
    as_bytes = moved.view(torch.uint8)  # little-endian: byte k of word w is bits 8k..8k+7
    if bits == 8:
        codes = as_bytes
    else:
        codes = torch.stack((as_bytes & 0xF, as_bytes >> 4), dim=-1).flatten(-2)
    return codes[..., :count].to(torch.int16).movedim(-1, dim)
