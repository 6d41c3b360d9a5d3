"""Sharded layers that need more than a narrower nn.Linear: the vocabulary-parallel embedding, and
the rule that says which slice of each checkpoint tensor a rank reads.

Column-parallel linears (q/k/v, gate/up, lm_head) are plain linears with fewer output rows; a
row-parallel one (o, down) is a plain linear with fewer input columns whose output the caller
all-reduces. Keeping them plain nn.Linear keeps oneDNN prepacking (packed_linear.py) and, at
N = 1, the exact module tree and kernels of the unsharded model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvserve.engine.worker.distributed import TPGroup, TPShape


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_start + vocab_per_rank) of the embedding; ids outside give zero,
    and one all-reduce leaves every rank with every token's row (exact: one non-zero addend)."""

    def __init__(self, shape: TPShape, hidden: int, tp: TPGroup, dtype: torch.dtype,
                 device=None) -> None:
        super().__init__()
        self.tp, self.start, self.rows = tp, shape.vocab_start, shape.vocab_rows
        # Zeroed: the rows past the vocabulary on the last rank are padding that lm_head reads.
        self.weight = nn.Parameter(torch.zeros(shape.vocab_per_rank, hidden, dtype=dtype,
                                               device=device))

    def forward(self, input_ids: Tensor) -> Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)


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
