"""The matmul for weights no fused kernel takes on this device (FP8 on x86, which has no FP8
GEMM; int8 weights with groups): the weight stays quantised in memory and is dequantised into a
temporary for each call, with the activations rounded as the scheme says."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvserve.engine.layers.quantization.activation import ActivationScheme, fp8_fake_quant, \
    int8_per_token
from kvserve.engine.layers.quantization.qweight import QuantizedWeight


class DequantLinear(nn.Module):
    """y = x' W^T with W dequantised per call; x' = x, or x rounded through the activation
    scheme's int8 / fp8 grid."""

    def __init__(self, w: QuantizedWeight, dtype: torch.dtype,
                 activation: ActivationScheme | None = None,
                 input_scale: float | None = None) -> None:
        super().__init__()
        self.dtype, self.activation, self.input_scale = dtype, activation, input_scale
        self.per_channel = w.g_idx is None and w.scale.shape[1] == 1
        self.register_buffer("values", w.values, persistent=False)
        self.register_buffer("scale", w.scale, persistent=False)
        self.register_buffer("zero", w.zero, persistent=False)
        self.register_buffer("cols", None if self.per_channel else w.group_of_column(),
                             persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        x = self._round_input(x)
        w = self.values.to(self.dtype)
        if self.per_channel:  # the scale is per output: apply it to the product, not the weight
            if self.zero is not None:
                w = w - self.zero.to(self.dtype)
            return (F.linear(x.to(self.dtype), w) * self.scale[:, 0].to(self.dtype)).to(x.dtype)
        if self.zero is not None:
            w = w - self.zero.to(self.dtype)[:, self.cols]
        w = w * self.scale.to(self.dtype)[:, self.cols]
        return F.linear(x.to(self.dtype), w).to(x.dtype)

    def _round_input(self, x: Tensor) -> Tensor:
        if self.activation is None:
            return x
        if self.activation.kind == "fp8":
            return fp8_fake_quant(x, self.input_scale)
        codes, scale = int8_per_token(x, self.input_scale)
        return (codes.float() * scale).to(x.dtype)
