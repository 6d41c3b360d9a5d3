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


def fused_rows(x: Tensor) -> bool:
    """Whether x takes the C++ one-pass row ops (kernels/csrc/cpu_quant.cpp): a CPU float32 or
    bfloat16 matrix with contiguous rows, where the C++ build is available."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2 \
            or x.stride(-1) != 1:
        return False
    from kvserve.kernels.cpu_ops import fused_available

    return fused_available()


def int8_per_token(x: Tensor, static_scale: float | None = None) -> tuple[Tensor, Tensor]:
    """(int8 codes [T, K], float32 scales [T, 1]) with x ~= codes * scales; dynamic scales of
    a CPU matrix in one C++ pass (the same codes and scales as the torch expression below)."""
    if static_scale is None and fused_rows(x):
        return torch.ops.kvserve_ops.quant_int8_rows(x)
    return torch_int8_per_token(x, static_scale)


def torch_int8_per_token(x: Tensor, static_scale: float | None = None) -> tuple[Tensor, Tensor]:
    """int8_per_token as torch ops: the reference, and the path off the CPU."""
    xf = x.float()
    if static_scale is not None:
        scale = torch.full((x.shape[0], 1), static_scale, dtype=torch.float32, device=x.device)
    else:
        # absmax * 2 / (127 - (-128)): the int8 range is [-128, 127], as compressed-tensors has it
        scale = (xf.abs().amax(dim=-1, keepdim=True) / 127.5).clamp_min_(torch.finfo(torch.float32).eps)
    codes = torch.round(xf / scale).clamp_(-128, 127).to(torch.int8)
    return codes, scale


def fp8_per_token(x: Tensor, static_scale: float | None = None) -> tuple[Tensor, Tensor]:
    """(float8_e4m3fn codes, float32 scale [T, 1]) of x [T, K]: each row scaled by its absmax
    over FP8's largest value, or every row by the checkpoint's static scale."""
    xf = x.float()
    if static_scale is not None:
        scale = x.new_full((x.shape[0], 1), static_scale, dtype=torch.float32)
    else:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min_(
            torch.finfo(torch.float32).eps)
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_fake_quant(x: Tensor, static_scale: float | None = None) -> Tensor:
    """x rounded through float8_e4m3fn (per token, or with the checkpoint's static scale), in
    x's dtype: what an FP8 GEMM would see, for the CPU's dequantising path."""
    codes, scale = fp8_per_token(x, static_scale)
    return (codes.float() * scale).to(x.dtype)
