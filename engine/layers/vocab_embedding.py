"""The vocabulary-parallel embedding: each rank holds a slice of the rows and one all-reduce gives
every rank every token's row."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvserve.engine.distributed import TPGroup, TPShape


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
