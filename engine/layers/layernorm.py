"""RMSNorm over the kernels' fused ops (norm alone, or the residual add and norm in one pass)."""

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
