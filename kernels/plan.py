"""AttentionPlan: the per-step facts about a batch (validated once, shared by all layers' calls)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.kernels.checks import check_index, require


@dataclass
class AttentionPlan:
    """What paged_attention needs to know about a batch beyond the tensors themselves.

    `parts` holds backend-specific precomputation (gather indices, masks, splits), keyed by backend.
    """

    num_seqs: int
    num_tokens: int
    block_size: int
    max_query_len: int
    max_seq_len: int
    max_block_id: int  # largest block id any sequence uses; -1 when none
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor
    seq_lens_t: torch.Tensor
    query_start_loc: torch.Tensor
    parts: dict[str, object] = field(default_factory=dict)

    def check_against(self, q: torch.Tensor, k_cache: torch.Tensor) -> None:
        """The call's tensors agree with what was planned (cheap: no look at index values)."""
        require(q.shape[0] == self.num_tokens, "q",
                f"has {q.shape[0]} tokens, query_start_loc says {self.num_tokens}")
        require(k_cache.shape[1] == self.block_size, "k_cache",
                f"block_size {k_cache.shape[1]} differs from the plan's {self.block_size}")
        require(self.max_block_id < k_cache.shape[0], "block_tables",
                f"block id {self.max_block_id} is past the pool's {k_cache.shape[0]} blocks")


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, block_size: int, max_query_len: int | None = None,
                   max_seq_len: int | None = None) -> AttentionPlan:
    """Validate the batch description once and precompute what every layer reuses."""
    device = block_tables.device
    check_index(block_tables, "block_tables", 2, device)
    check_index(seq_lens, "seq_lens", 1, device)
    check_index(query_start_loc, "query_start_loc", 1, device)
    require(isinstance(block_size, int) and block_size > 0, "block_size", f"got {block_size!r}")
    num_seqs = seq_lens.shape[0]
    require(block_tables.shape[0] == num_seqs, "block_tables",
            f"{block_tables.shape[0]} rows for {num_seqs} sequences")
    require(query_start_loc.shape[0] == num_seqs + 1, "query_start_loc",
            f"expected num_seqs + 1 = {num_seqs + 1} entries, got {query_start_loc.shape[0]}")
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    require(starts[0] == 0, "query_start_loc", f"must start at 0, got {starts[0]}")
    query_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
    require(all(n >= 0 for n in query_lens), "query_start_loc", "must be non-decreasing")
    bad = [s for s in range(num_seqs) if query_lens[s] > lens[s]]
    require(not bad, "seq_lens", f"sequence {bad[:1]} has more new tokens than its length")
    top_q, top_s = max(query_lens, default=0), max(lens, default=0)
    require(max_query_len is None or max_query_len >= top_q, "max_query_len",
            f"{max_query_len} is below the batch's {top_q}")
    require(max_seq_len is None or max_seq_len >= top_s, "max_seq_len",
            f"{max_seq_len} is below the batch's {top_s}")
    max_block_id = _max_used_block(block_tables, seq_lens, block_size)
    return AttentionPlan(num_seqs, starts[-1], block_size, top_q, top_s, max_block_id, query_lens,
                         lens, block_tables, seq_lens, query_start_loc)


def _max_used_block(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> int:
    """Largest block id in the sequences' used entries; raises on a short table or a negative id."""
    if block_tables.shape[0] == 0:
        return -1
    needed = (seq_lens.long() + block_size - 1) // block_size
    top_needed = int(needed.max())
    require(top_needed <= block_tables.shape[1], "block_tables",
            f"has {block_tables.shape[1]} columns, a sequence needs {top_needed} blocks")
    columns = torch.arange(block_tables.shape[1], device=block_tables.device)
    used = columns[None, :] < needed[:, None]
    if not bool(used.any()):
        return -1
    entries = block_tables[used]
    require(int(entries.min()) >= 0, "block_tables", "holds a negative block id in a used entry")
    return int(entries.max())
