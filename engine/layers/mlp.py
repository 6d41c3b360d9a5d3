"""The gated MLP: down(act(gate(x)) * up(x)), gate and up fused into one matmul; act is SiLU
(SwiGLU: Llama, Qwen, Phi) or tanh-GELU (GeGLU: Gemma). Under tensor parallelism each rank holds
a slice of the intermediate size and all-reduces the output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvserve.engine.distributed import TPGroup
from kvserve.engine.layers.linear import skip_init_linear
from kvserve.kernels import cpu_ops as ops


ACTIVATIONS = ("silu", "gelu_tanh")


class GatedMLP(nn.Module):
    """`gate_up_proj` [2 * intermediate, hidden] and `down_proj` (row parallel)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, tp: TPGroup | None,
                 dtype: torch.dtype, device=None, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: expected one of {ACTIVATIONS}")
        self.tp, self.activation = tp, activation
        self.gate_up_proj = skip_init_linear(hidden, 2 * intermediate, bias, dtype, device)
        self.down_proj = skip_init_linear(intermediate, hidden, bias, dtype, device)

    def forward(self, x: Tensor) -> Tensor:
        h = self.gate_up_proj(x)
        if ops.use_triton(h) and h.dim() == 2 and h.stride(-1) == 1:
            from kvserve.kernels import triton_fused

            h = triton_fused.act_and_mul(h, self.activation)
        elif self.activation == "silu":
            h = ops.silu_and_mul(h)
        else:  # gelu_tanh: HF's gelu_pytorch_tanh
            gate, up = h.chunk(2, dim=-1)
            h = F.gelu(gate, approximate="tanh") * up
        out = self.down_proj(h)
        return out if self.tp is None else self.tp.all_reduce(out)  # row parallel
