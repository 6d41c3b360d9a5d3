"""Activation quantisation on the fly: per-token dynamic or static per-tensor, to int8 or fp8,
following compressed-tensors' definition (symmetric scale = absmax / ((qmax - qmin) / 2))."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


@dataclass(frozen=True)
class ActivationScheme:
    """How a linear's input is quantised: `kind` "int8" or "fp8"; `static`: one per-tensor scale
    from the checkpoint (its `input_scale`), else dynamic, one scale per token."""

    kind: str
    static: bool = False


def int8_per_token(x: Tensor, static_scale: float | None = None) -> tuple[Tensor, Tensor]:
    """(int8 codes [T, K], float32 scales [T, 1]) with x ~= codes * scales."""
    xf = x.float()
    if static_scale is not None:
        scale = torch.full((x.shape[0], 1), static_scale, dtype=torch.float32, device=x.device)
    else:
        # absmax * 2 / (127 - (-128)): the int8 range is [-128, 127], as compressed-tensors has it
        scale = (xf.abs().amax(dim=-1, keepdim=True) / 127.5).clamp_min_(torch.finfo(torch.float32).eps)
    codes = torch.round(xf / scale).clamp_(-128, 127).to(torch.int8)
    return codes, scale


def fp8_fake_quant(x: Tensor, static_scale: float | None = None) -> Tensor:
    """x rounded through float8_e4m3fn (per token, or with the checkpoint's static scale), in
    x's dtype: what an FP8 GEMM would see, for the CPU's dequantising path."""
    xf = x.float()
    if static_scale is not None:
        scale = torch.tensor(static_scale, dtype=torch.float32, device=x.device)
    else:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min_(
            torch.finfo(torch.float32).eps)
    codes = (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (codes.float() * scale).to(x.dtype)
