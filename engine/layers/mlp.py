"""The gated MLP (SwiGLU): down(silu(gate(x)) * up(x)), gate and up fused into one matmul; under
tensor parallelism each rank holds a slice of the intermediate size and all-reduces the output."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvserve.engine.distributed import TPGroup
from kvserve.engine.layers.linear import skip_init_linear
from kvserve.kernels import cpu_ops as ops


class GatedMLP(nn.Module):
    """`gate_up_proj` [2 * intermediate, hidden] and `down_proj` (row parallel)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, tp: TPGroup | None,
                 dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.tp = tp
        self.gate_up_proj = skip_init_linear(hidden, 2 * intermediate, bias, dtype, device)
        self.down_proj = skip_init_linear(intermediate, hidden, bias, dtype, device)

    def forward(self, x: Tensor) -> Tensor:
        out = self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        return out if self.tp is None else self.tp.all_reduce(out)  # row parallel
