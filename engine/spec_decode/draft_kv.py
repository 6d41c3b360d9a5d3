"""The paged KV cache of a drafting model (a draft model or an EAGLE head): its own pool of blocks
and one block table per stream, and the flattened step inputs for a batch of streams.

Why a pool of its own and not pages of the target's: a draft's block has another shape (its
layers, KV heads and head dim), so the target's blocks cannot hold it without a shared byte region
and a scheduler that allocates for two models per request. This pool lives beside the target's:
it starts at `initial_blocks` and doubles when the live streams need more (a copy of the blocks
into the larger tensor), and a stream's blocks return to it on `free`. Its bytes are the draft's
share of the memory, reported by `nbytes`; for a draft model ~10x smaller than its target that is
~1/10 of the target's KV for the same tokens.

The tensors and the attention metadata come from the engine's own ModelRunner (engine/worker/
model_runner.py): the same KV layout, kernels and planning as the target's forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.engine.worker.model_runner import BlockMoves, ModelRunner, StepInput
from kvserve.kernels.metadata import AttentionMetadata


@dataclass
class DraftBatch:
    """One forward's inputs on the device, and the row of each stream's last token."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    last_rows: torch.Tensor  # [B] int64


class DraftKV:
    """Blocks of a drafting model's KV cache, by stream id."""

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, block_size: int = 16, initial_blocks: int = 64,
                 attention_backend: str = "auto") -> None:
        self.shape = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          block_size=block_size, kv_dtype=dtype, device=device)
        self.block_size = block_size
        self.backend = attention_backend
        self.runner = self._runner(max(1, initial_blocks))
        self.free_blocks: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}

    def _runner(self, num_blocks: int) -> ModelRunner:
        return ModelRunner(torch.nn.Identity(), num_blocks=num_blocks,
                           attention_backend=self.backend, **self.shape)

    @property
    def num_blocks(self) -> int:
        return int(self.runner.kv.shape[2])

    @property
    def nbytes(self) -> int:
        return self.runner.kv.numel() * self.runner.kv.element_size()

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.runner.kv_caches

    def ensure(self, stream_id: str, num_positions: int) -> None:
        """Give the stream blocks for positions [0, num_positions)."""
        table = self.tables.setdefault(stream_id, [])
        need = -(-num_positions // self.block_size) - len(table)
        if need <= 0:
            return
        if need > len(self.free_blocks):
            self._grow(need - len(self.free_blocks))
        for _ in range(need):
            table.append(self.free_blocks.pop())

    def _grow(self, at_least: int) -> None:
        old = self.runner
        n = old.kv.shape[2]
        new = self._runner(max(2 * n, n + at_least))
        new.kv[:, :, :n] = old.kv
        self.runner = new
        self.free_blocks = list(range(new.kv.shape[2] - 1, n - 1, -1)) + self.free_blocks

    def free(self, stream_id: str) -> None:
        self.free_blocks.extend(reversed(self.tables.pop(stream_id, [])))

    def batch(self, stream_ids: Sequence[str], starts: Sequence[int],
              tokens: Sequence[Sequence[int]],
              position_offsets: Sequence[int] | None = None) -> DraftBatch:
        """Inputs for writing ``tokens[i]`` at cache positions ``starts[i]...`` of each stream
        (whose blocks must cover them) and attending over its cache up to there. The rotary
        positions are the cache positions plus ``position_offsets[i]`` (a stream whose cache
        starts after a prefix the drafting model never saw)."""
        q_lens = torch.tensor([len(t) for t in tokens], dtype=torch.int64)
        start_t = torch.tensor(list(starts), dtype=torch.int64)
        tables = [self.tables[s] for s in stream_ids]
        width = max(len(t) for t in tables)
        bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        qsl = torch.zeros(len(tables) + 1, dtype=torch.int32)
        torch.cumsum(q_lens, 0, out=qsl[1:])
        seq_idx = torch.repeat_interleave(torch.arange(len(tables)), q_lens)
        positions = torch.arange(int(qsl[-1])) - qsl[:-1].long()[seq_idx] + start_t[seq_idx]
        bs = self.block_size
        slots = bt[seq_idx, positions // bs].long() * bs + positions % bs
        seq_lens = (start_t + q_lens).to(torch.int32)
        ids = torch.tensor([t for ts in tokens for t in ts], dtype=torch.int64)
        step = StepInput(ids, positions, slots[None], bt[None], seq_lens, qsl,
                         int(q_lens.max()), int(seq_lens.max()), [], BlockMoves())
        if position_offsets is not None and any(position_offsets):
            step.positions = positions + torch.tensor(list(position_offsets))[seq_idx]
        dev_ids, dev_pos, meta = self.runner.to_device(step)
        last = self.runner._dev(qsl[1:].long() - 1)
        return DraftBatch(dev_ids, dev_pos, meta, last)
