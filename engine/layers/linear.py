"""Linears: plain (skip-initialised) ones, and the rule that says which slice of each checkpoint
tensor a rank reads under tensor parallelism (the vocabulary-parallel embedding is in
vocab_embedding.py).

Column-parallel linears (q/k/v, gate/up, lm_head) are plain linears with fewer output rows; a
row-parallel one (o, down) is a plain linear with fewer input columns whose output the caller
all-reduces. Keeping them plain nn.Linear keeps oneDNN prepacking (packed_linear.py) and, at
N = 1, the exact module tree and kernels of the unsharded model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kvserve.engine.distributed import TPShape

# Our fused linears -> the checkpoint projections stacked in them, in output order (vLLM's
# packed_modules_mapping): the model loader, quantised linears and LoRA all read this one map.
PACKED_MODULES: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                              "gate_up_proj": ("gate_proj", "up_proj")}


def skip_init_linear(n_in: int, n_out: int, bias: bool, dtype: torch.dtype, device) -> nn.Linear:
    """A plain nn.Linear (column or row parallel: the caller passes this rank's sizes)."""
    # skip_init: no random init of weights that load_weights overwrites anyway
    return torch.nn.utils.skip_init(nn.Linear, n_in, n_out, bias=bias, dtype=dtype, device=device)


def empty_embedding(num: int, dim: int, dtype: torch.dtype, device) -> nn.Embedding:
    """An nn.Embedding over uninitialised memory (load_weights fills it). Not skip_init:
    nn.Embedding's meta-device init imports torch._dynamo, ~0.7 s of CPU in every process
    that builds a model."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim, dtype=dtype, device=device))


@dataclass(frozen=True)
class RankSlice:
    """Read `length` entries from `start` along `dim` of a checkpoint tensor; `zero` = this rank
    holds zeros instead (a row-parallel bias is added once, on rank 0)."""

    dim: int
    start: int
    length: int
    zero: bool = False


def rank_slice(proj: str, leaf: str, s: TPShape, head_dim: int) -> RankSlice | None:
    """This rank's slice of the HF tensor `<...>.<proj>.<leaf>`; None = the whole tensor."""
    if proj == "q_proj":
        return RankSlice(0, s.q_head_start * head_dim, s.num_heads * head_dim)
    if proj in ("k_proj", "v_proj"):
        return RankSlice(0, s.kv_head_start * head_dim, s.num_kv_heads * head_dim)
    if proj in ("gate_proj", "up_proj"):
        return RankSlice(0, s.intermediate_start, s.intermediate)
    if proj in ("o_proj", "down_proj"):
        if leaf == "bias":
            return RankSlice(0, 0, 0, zero=True) if s.rank else None
        start, n = ((s.q_head_start * head_dim, s.num_heads * head_dim) if proj == "o_proj"
                    else (s.intermediate_start, s.intermediate))
        return RankSlice(1, start, n)
    if proj in ("embed_tokens", "lm_head"):
        return RankSlice(0, s.vocab_start, s.vocab_rows)
    return None


def read_slice(source, sl: RankSlice | None) -> Tensor:
    """The slice of a checkpoint tensor (a Tensor, or a lazy safetensors slice that reads only
    those bytes from disk)."""
    if sl is None:
        return source if isinstance(source, Tensor) else source.narrow(0, 0, source.shape[0])
    return source.narrow(sl.dim, sl.start, sl.length)
