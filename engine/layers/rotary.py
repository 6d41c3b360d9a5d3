"""Rotary position embeddings, every variant in one place: default, linear, dynamic NTK, llama3,
YaRN and LongRoPE, with partial rotary dims and per-layer-type parameters (Gemma 3).

The inverse frequencies come from transformers' own functions (ROPE_INIT_FUNCTIONS), so they match
the reference model by construction; what is ours is the choice of ONE fixed table per layer
type. A paged cache stores keys already rotated, so frequencies must never change while a
sequence grows: dynamic NTK is fixed at its longest length, and LongRoPE uses its long factors
for every position when max_model_len exceeds original_max_position_embeddings, its short ones
otherwise (as vLLM does), never switching mid-sequence as HF does for one forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kvserve.engine.errors import ConfigError

# rope_type -> the rope_parameters keys it reads (beyond rope_type / type / rope_theta /
# partial_rotary_factor). A key outside its type's set is refused: it would change the model.
ROPE_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"}),
    "yarn": frozenset({"factor", "original_max_position_embeddings", "attention_factor",
                       "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
    "longrope": frozenset({"short_factor", "long_factor", "original_max_position_embeddings",
                           "attention_factor", "factor"}),
}
_COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
# Keys of rope_parameters that name layer types (Gemma 3: one dict per attention kind).
LAYER_TYPE_KEYS = frozenset({"full_attention", "sliding_attention"})


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The rope parameters of one layer type (the whole dict when they are not per type)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if params and set(params) <= LAYER_TYPE_KEYS:
        if layer_type not in params:
            raise ConfigError(f"rope_parameters has no entry for layer type {layer_type!r} "
                              f"(it has {sorted(params)})")
        return dict(params[layer_type])
    return params


def check_rope(params: dict) -> str:
    """The rope_type, after refusing an unknown type or a key that type does not read."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_KEYS:
        raise ConfigError(f"rope_type {rope_type!r} is not supported by kvserve; supported: "
                          f"{sorted(ROPE_KEYS)}")
    unknown = sorted(set(params) - _COMMON_KEYS - ROPE_KEYS[rope_type])
    if unknown:
        raise ConfigError(f"rope_parameters key(s) {unknown} are not implemented for rope_type "
                          f"{rope_type!r} (it reads {sorted(ROPE_KEYS[rope_type])}); kvserve "
                          "refuses them rather than run a different model")
    return rope_type


@dataclass(frozen=True)
class RopeTable:
    """What one fixed cos/sin table is built from."""

    inv_freq: Tensor  # float32 [rotary_dim / 2]
    attention_scaling: float  # multiplies cos and sin (YaRN, LongRoPE)
    length: int  # positions covered
    rotary_dim: int  # leading dims of each head that rotate; the rest pass through


def rope_table(config, head_dim: int, layer_type: str | None = None,
               max_model_len: int | None = None) -> RopeTable:
    """The table for a layer type. `max_model_len` (default: max_position_embeddings) picks
    LongRoPE's factor set once, for every position."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = rope_parameters(config, layer_type)
    rope_type = check_rope(params)
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ConfigError(f"partial_rotary_factor gives {rotary_dim} rotary dims of {head_dim}: "
                          "it must be an even number of dims")
    max_len = int(config.max_position_embeddings)
    kwargs = {"layer_type": layer_type} if layer_type is not None and \
        layer_type in (getattr(config, "rope_parameters", None) or {}) else {}
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        steps = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        return RopeTable(1.0 / theta ** steps, 1.0, max_len, rotary_dim)
    if rope_type == "dynamic":
        max_len = int(max_len * params["factor"])
        inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=max_len, **kwargs)
    elif rope_type == "longrope":
        original = int(params.get("original_max_position_embeddings")
                       or getattr(config, "original_max_position_embeddings", max_len))
        long = (max_model_len or max_len) > original
        # HF picks the long factors for a forward longer than `original`: ask for that length.
        inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](
            config, "cpu", seq_len=original + 1 if long else None, **kwargs)
    else:
        inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)
    return RopeTable(inv.float().cpu(), float(scaling), max_len, rotary_dim)


class RotaryEmbedding(nn.Module):
    """A precomputed cos/sin table over every position, indexed by each token's position."""

    def __init__(self, config, head_dim: int, dtype: torch.dtype, device=None, *,
                 layer_type: str | None = None, max_model_len: int | None = None) -> None:
        super().__init__()
        table = rope_table(config, head_dim, layer_type, max_model_len)
        freqs = torch.outer(torch.arange(table.length, dtype=torch.float32), table.inv_freq)
        self.max_len, self.rotary_dim, self.head_dim = table.length, table.rotary_dim, head_dim
        scale = table.attention_scaling
        self.register_buffer("cos", (freqs.cos() * scale).to(dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("sin", (freqs.sin() * scale).to(dtype=dtype, device=device),
                             persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [T, rotary_dim / 2] of each token, gathered once per step for all layers."""
        return self.cos[positions], self.sin[positions]

    def rotate(self, q: Tensor, k: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """q [T, Hq, D], k [T, Hk, D] rotated (HF's rotate-half layout) on their first
        rotary_dim dims; the fused op in place when every dim rotates."""
        from kvserve.kernels import cpu_ops as ops

        if self.rotary_dim == self.head_dim:
            return ops.rotary_embedding(q, k, *rope)
        r = self.rotary_dim
        q = torch.cat((ops.torch_rope(q[..., :r], *rope), q[..., r:]), dim=-1)
        k = torch.cat((ops.torch_rope(k[..., :r], *rope), k[..., r:]), dim=-1)
        return q, k

