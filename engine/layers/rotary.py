"""Rotary position embeddings: a cos/sin table for the config's rope type (transformers' own
init functions), gathered per token once per step."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvserve.engine.errors import ConfigError


class RotaryEmbedding(nn.Module):
    """A precomputed cos/sin table over every position, indexed by each token's position."""

    def __init__(self, config, head_dim: int, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        inv_freq, scaling, max_len = rope_inv_freq(config, head_dim)
        t = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_len, head_dim / 2]
        self.max_len = max_len
        self.register_buffer("cos", (freqs.cos() * scaling).to(dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("sin", (freqs.sin() * scaling).to(dtype=dtype, device=device),
                             persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [T, D/2] of each token, gathered once per step for all layers."""
        return self.cos[positions], self.sin[positions]


def rope_inv_freq(config, head_dim: int) -> tuple[Tensor, float, int]:
    """(inv_freq, cos/sin scaling, table length) for the config's rope type.

    Uses transformers' own init functions (default, linear, llama3, yarn, dynamic, ...). Dynamic
    NTK is fixed at the longest supported length, as vLLM does: a paged cache stores rotated keys,
    so frequencies cannot change while a sequence grows.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    max_len = int(config.max_position_embeddings)
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        return inv, 1.0, max_len
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ConfigError(f"rope_type {rope_type!r} is not supported; supported: "
                          f"{sorted(ROPE_INIT_FUNCTIONS)}")
    if rope_type == "dynamic":
        max_len = int(max_len * params["factor"])
        inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=max_len)
    else:
        inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv.float().cpu(), float(scaling), max_len
