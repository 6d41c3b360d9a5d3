"""SwapPool: the CPU blocks preempted sequences are swapped to (`swap_space`), allocated lazily.

The pool is cut into chunks of CHUNK_BYTES; a chunk is allocated when a swap-out first writes one
of its slots and released once every slot written to it has been swapped back in, so an engine
that never preempts by swapping holds no swap memory at all (the memory plan still charges the
whole budget: it is what the pool may grow to). Chunks are larger than glibc's largest mmap
threshold, so a released chunk goes back to the kernel. Slots are handed out low first (the block
manager's free list), so a swap touches one or two chunks: one indexed copy per chunk, not per
block. Layout per chunk, as the device cache: [K/V, layer page, slot, token, head, dim].
"""

from __future__ import annotations

import torch

CHUNK_BYTES = 64 << 20  # above glibc's 32 MiB mmap-threshold ceiling (malloc_tuning.py)


class SwapPool:
    def __init__(self, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 pin_memory: bool = False) -> None:
        """`block_shape`: one block's (2, pages, block_size, kv_heads, head_dim)."""
        self.num_blocks = num_blocks
        self.block_shape = block_shape
        self.dtype, self.pin_memory = dtype, pin_memory
        self.block_bytes = torch.Size(block_shape).numel() * torch.empty(0, dtype=dtype).element_size()
        self.chunk_blocks = max(1, min(num_blocks, CHUNK_BYTES // max(self.block_bytes, 1)))
        self.chunks: dict[int, torch.Tensor] = {}
        self.live: dict[int, set[int]] = {}  # chunk -> slots written and not yet read back

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the chunks allocated now (0 until the first swap-out)."""
        return sum(c.numel() * c.element_size() for c in self.chunks.values())

    def _by_chunk(self, slots: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """chunk -> (positions in `slots`, slots within the chunk)."""
        idx = torch.tensor(slots, dtype=torch.long)
        if len(slots) and not (0 <= int(idx.min()) and int(idx.max()) < self.num_blocks):
            raise IndexError(f"swap slots {slots} outside the pool of {self.num_blocks} blocks")
        chunk = idx // self.chunk_blocks
        out = {}
        for c in chunk.unique().tolist():  # one or two chunks per swap
            pos = (chunk == c).nonzero().squeeze(1)
            out[c] = (pos, idx[pos] - c * self.chunk_blocks)
        return out

    def _chunk(self, c: int) -> torch.Tensor:
        if c not in self.chunks:
            n = min(self.chunk_blocks, self.num_blocks - c * self.chunk_blocks)
            shape = (*self.block_shape[:2], n, *self.block_shape[2:])
            # Not zeroed: a slot is always written by a swap-out before a swap-in reads it.
            self.chunks[c] = torch.empty(shape, dtype=self.dtype, pin_memory=self.pin_memory)
        return self.chunks[c]

    def write(self, slots: list[int], blocks: torch.Tensor) -> None:
        """Store `blocks` ([2, pages, len(slots), ...] on any device) at `slots`."""
        for c, (pos, local) in self._by_chunk(slots).items():
            self._chunk(c)[:, :, local] = blocks[:, :, pos].to("cpu")
            self.live.setdefault(c, set()).update(local.tolist())

    def read(self, slots: list[int], device: torch.device) -> torch.Tensor:
        """The blocks at `slots` ([2, pages, len(slots), ...] on `device`); a chunk whose
        written slots have all been read back is released."""
        out = torch.empty((*self.block_shape[:2], len(slots), *self.block_shape[2:]),
                          dtype=self.dtype, device=device)
        for c, (pos, local) in self._by_chunk(slots).items():
            out[:, :, pos] = self.chunks[c][:, :, local].to(device)
            live = self.live.get(c, set())
            live.difference_update(local.tolist())
            if not live:
                self.chunks.pop(c, None)
                self.live.pop(c, None)
        return out
