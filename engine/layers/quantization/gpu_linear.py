"""The quantised matmuls of a CUDA device: FP8 x FP8 through `torch._scaled_mm` (SM89+; per-token
and per-channel scales need SM90's row-wise scaling), W4A16 through the Triton kernel that
dequantises inside the tile (kernels/triton_w4a16.py). `gpu_kernel_choice` is the selection,
kept free of the device so it is testable anywhere."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvserve.engine.layers.quantization.activation import ActivationScheme, fp8_per_token
from kvserve.engine.layers.quantization.qweight import QuantizedWeight
from kvserve.engine.layers.quantization.weight_only import act_order

SCALED_MM_MIN = (8, 9)  # Ada / Hopper: FP8 tensor cores
ROWWISE_MIN = (9, 0)  # row-wise (per-token x per-channel) scales in _scaled_mm


def gpu_kernel_choice(w: QuantizedWeight, activation: ActivationScheme | None,
                      capability: tuple[int, int] | None) -> str:
    """"scaled_mm_fp8", "triton_w4a16" or "dequant" (the per-call dequantising matmul) for a
    weight on a GPU of `capability` (None: not a CUDA device)."""
    if capability is None:
        return "dequant"
    per_channel = w.g_idx is None and w.scale.shape[1] == 1 and w.zero is None
    if w.is_float and activation is not None and activation.kind == "fp8" and per_channel \
            and capability >= SCALED_MM_MIN:
        per_tensor = activation.static and bool((w.scale == w.scale[0, 0]).all())
        if per_tensor or capability >= ROWWISE_MIN:
            return "scaled_mm_fp8"
    if not w.is_float and w.bits == 4 and activation is None and act_order(w)[0].g_idx is None:
        return "triton_w4a16"
    return "dequant"


class ScaledMMFp8Linear(nn.Module):
    """y = (q(x) @ Wq^T) * s_x * s_w on FP8 tensor cores: x quantised per token (or with the
    checkpoint's static scale), the weight [K, N] column-major as _scaled_mm wants."""

    def __init__(self, w: QuantizedWeight, dtype: torch.dtype,
                 static_input_scale: float | None = None) -> None:
        super().__init__()
        self.dtype, self.static_input_scale = dtype, static_input_scale
        self.register_buffer("weight", w.values.t(), persistent=False)  # [K, N], column-major
        self.register_buffer("weight_scale", w.scale[:, 0].float().reshape(1, -1).contiguous(),
                             persistent=False)
        self.per_tensor = static_input_scale is not None and \
            bool((self.weight_scale == self.weight_scale[0, 0]).all())

    def forward(self, x: Tensor) -> Tensor:
        codes, scale = fp8_per_token(x, self.static_input_scale)
        if self.per_tensor:
            return torch._scaled_mm(codes, self.weight, scale_a=scale[:1, :1].reshape(()),
                                    scale_b=self.weight_scale[0, 0], out_dtype=x.dtype)
        return torch._scaled_mm(codes, self.weight, scale_a=scale, scale_b=self.weight_scale,
                                out_dtype=x.dtype)


class TritonW4A16Linear(nn.Module):
    """W4A16 on a GPU (or on CPU tensors under TRITON_INTERPRET=1): codes packed two per byte,
    fp32 scale and offset per group; act order (g_idx) sorts the columns once, x is gathered."""

    def __init__(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        from kvserve.kernels.triton_w4a16 import pack_w4a16

        w, perm = act_order(w)
        self.group, self.dtype = w.group_size, dtype
        zero = torch.zeros_like(w.scale) if w.zero is None else w.zero.float()
        offset = -(zero + 8) * w.scale  # codes here are u - 8: w = (u - 8 - z) * s
        packed, scale, off = pack_w4a16(w.values.to(torch.int16) + 8, w.scale, offset)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("offset", off, persistent=False)
        self.register_buffer("perm", perm, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        from kvserve.kernels.triton_w4a16 import w4a16_matmul

        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return w4a16_matmul(x.to(self.dtype), self.packed, self.scale, self.offset,
                            self.group).to(x.dtype)
