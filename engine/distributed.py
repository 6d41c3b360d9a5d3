"""Tensor parallelism's arithmetic and collectives: which heads, intermediate columns and vocabulary
rows each of N ranks holds, whether N splits a model at all, and the two collectives the sharded
model calls (an all-reduce after each row-parallel linear, a gather of the logits to rank 0).

Megatron layout: q/k/v and gate/up are split by output (column parallel), o and down by input (row
parallel: each rank holds a partial sum, one all-reduce adds them), the embedding and lm_head by
vocabulary row. With more ranks than KV heads, each KV head is replicated on N / kv_heads ranks, as
vLLM does, so that every rank's query heads find their KV head locally.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.errors import ConfigError
from kvserve.engine.sizing.memory import kv_heads_per_rank  # noqa: F401 - re-exported with its rule


def check_tensor_parallel(size: int, num_heads: int, num_kv_heads: int,
                          intermediate: int) -> None:
    """ConfigError (naming the sizes) when `size` ranks cannot split this model evenly."""
    if size < 1:
        raise ConfigError(f"tensor_parallel_size must be at least 1, got {size}")
    if size == 1:
        return
    problems = []
    if num_heads % size:
        problems.append(f"{num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        problems.append(f"{num_kv_heads} KV heads (N must divide them, or be a multiple of them)")
    if intermediate % size:
        problems.append(f"intermediate size {intermediate}")
    if problems:
        ok = [n for n in range(1, num_heads + 1) if _splits(n, num_heads, num_kv_heads,
                                                             intermediate)]
        raise ConfigError(
            f"tensor_parallel_size={size} does not evenly split this model's "
            f"{', '.join(problems)}; sizes that work for it: {ok}")


def _splits(n: int, heads: int, kv_heads: int, intermediate: int) -> bool:
    return heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0) and intermediate % n == 0


@dataclass(frozen=True)
class TPShape:
    """One rank's share of each sharded size (rank 0 of 1 holds everything)."""

    rank: int
    size: int
    num_heads: int  # query heads on this rank
    q_head_start: int
    num_kv_heads: int  # KV heads on this rank (1 when replicated)
    kv_head_start: int
    intermediate: int
    intermediate_start: int
    vocab_start: int
    vocab_per_rank: int  # ceil(vocab / size): the last rank's rows past the vocabulary are zero
    vocab_rows: int  # real vocabulary rows on this rank

    @classmethod
    def of(cls, rank: int, size: int, num_heads: int, num_kv_heads: int, intermediate: int,
           vocab: int) -> "TPShape":
        check_tensor_parallel(size, num_heads, num_kv_heads, intermediate)
        heads = num_heads // size
        if size <= num_kv_heads:
            kv, kv_start = num_kv_heads // size, rank * (num_kv_heads // size)
        else:  # replicated: ranks [r * k, (r + 1) * k) share KV head r, k = size / kv_heads
            kv, kv_start = 1, rank // (size // num_kv_heads)
        inter = intermediate // size
        per_rank = -(-vocab // size)
        v_start = rank * per_rank
        return cls(rank, size, heads, rank * heads, kv, kv_start, inter, rank * inter,
                   v_start, per_rank, max(min(per_rank, vocab - v_start), 0))


class TPGroup:
    """This process's rank in its tensor-parallel group, and the model's collectives. `group`:
    the torch.distributed subgroup of one pipeline stage's ranks (None: the default group, the
    whole world); `first`: the global rank of the group's rank 0 (where logits gather)."""

    def __init__(self, rank: int, size: int, group: object | None = None,
                 first: int = 0) -> None:
        self.rank, self.size, self.group, self.first = rank, size, group, first

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial results in place (after o_proj, down_proj, the embedding)."""
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def gather_logits(self, local: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """[S, vocab_per_rank] on every rank -> [S, vocab] on rank 0 (None elsewhere)."""
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        torch.distributed.gather(local, parts, dst=self.first, group=self.group)
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, :vocab]

    def all_reduce_max(self, values: list[float]) -> list[float]:
        """The largest of each value over all ranks (fp8 KV-scale calibration)."""
        t = torch.tensor(values, dtype=torch.float64)
        if torch.distributed.get_backend() == "nccl":
            t = t.cuda()
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return t.tolist()


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """vLLM's teardown between two engines in one process: this process's default process group
    (if it has one) destroyed, garbage collected, the accelerator's cached memory returned.
    kvserve starts no Ray, so `shutdown_ray` asks nothing."""
    import gc

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
