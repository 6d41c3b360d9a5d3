"""RMSNorm variants: Llama's (normalise in float32, round, scale by w; over the kernels' fused ops,
the residual add fused in on request) and Gemma's (scale by 1 + w in float32, then round)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvserve.kernels import cpu_ops as ops


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, as HF's LlamaRMSNorm (the residual add fused in on request)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """norm(x); with `residual`: (norm(x + residual), x + residual), the add fused in."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class GemmaRMSNorm(nn.Module):
    """y = x / rms(x) * (1 + weight), all in float32 and rounded once, as HF's Gemma2/3 norms
    (the checkpoint's weight is the offset from 1; HF initialises it to 0)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device))

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """norm(x); with `residual`: (norm(x + residual), x + residual), the add in x's dtype
        (on CUDA one Triton kernel, which updates `residual` in place)."""
        if ops.use_triton(x) and x.dim() == 2 and x.stride(-1) == 1 and \
                (residual is None or residual.is_contiguous()):
            from kvserve.kernels import triton_fused

            out = triton_fused.add_rms_norm(x, residual, self.weight, self.eps, gemma=True)
            return out if residual is None else (out, residual)
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


def norm_heads(norm: nn.Module, x: Tensor) -> Tensor:
    """A per-head norm (Qwen3's and Gemma 3's q/k norms) over x [T, heads, head_dim]."""
    t, heads, head_dim = x.shape
    return norm(x.reshape(t * heads, head_dim)).view(t, heads, head_dim)
