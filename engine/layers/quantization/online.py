"""Online quantisation of an unquantised checkpoint (`--quantization int8|fp8`, as vLLM's
`--quantization fp8`): each linear's dense weight is quantised per output channel at load."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvserve.engine.layers.quantization.activation import FP8_MAX, ActivationScheme
from kvserve.engine.layers.quantization.base import LinearMethod, QuantConfig
from kvserve.engine.layers.quantization.qweight import QuantizedWeight

ONLINE_SCHEMES = ("int8", "fp8")


def quantize_int8_per_channel(weight: Tensor) -> QuantizedWeight:
    """Symmetric int8 codes, scale = absmax / 127 per output row."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min_(torch.finfo(torch.float32).eps)
    codes = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(codes, scale, None, w.shape[1], 8)


def quantize_fp8_per_channel(weight: Tensor) -> QuantizedWeight:
    """float8_e4m3fn codes, scale = absmax / 448 per output row."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min_(torch.finfo(torch.float32).eps)
    codes = (w / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight(codes, scale, None, w.shape[1], 8)


@dataclass(frozen=True)
class OnlineMethod(LinearMethod):
    """Reads a dense `weight` and quantises it: int8 W8A8 or FP8 W8A8, activations per token."""

    scheme: str = "int8"

    @property
    def leaves(self) -> frozenset[str]:
        return frozenset({"weight"})

    def read(self, tensors: dict[str, Tensor], name: str) -> QuantizedWeight:
        quantize = quantize_int8_per_channel if self.scheme == "int8" else quantize_fp8_per_channel
        return quantize(tensors["weight"])


class OnlineConfig(QuantConfig):
    """Every linear of the decoder layers; the lm_head (and a tied embedding) stays dense."""

    def __init__(self, scheme: str) -> None:
        self.name = scheme
        self.method = OnlineMethod(f"online {scheme} W8A8 (per-channel weights, per-token "
                                   "activations)", ActivationScheme(scheme), scheme)

    def method_for(self, hf_name: str) -> LinearMethod | None:
        return None if hf_name.rpartition(".")[2] == "lm_head" else self.method
