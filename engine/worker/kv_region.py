"""KVRegion: one device buffer of KV pages shared by several models, and each model's view of
it as its own KV-cache tensor. Pages are the buffer's rows (page-major), so page p is the same
bytes whichever model holds it; a model reads a page as one block of its own layout
(2 x layers x block_size x kv_heads x head_dim) from the page's start, the rest unused.

The view is the runner's usual `(2, page_layers, num_blocks, block_size, kv_heads, head_dim)`
tensor with a page stride along the block axis: the torch and Triton attention paths read it
through strides; the CPU C++ kernels want contiguous caches, so a shared pool runs the torch
path on the CPU (docs/guides/multi-model.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvserve.engine.core.shared_pool import SharedBlockPool
from kvserve.engine.errors import ConfigError

PAGE_ALIGN = 64  # bytes: every page starts on a cache line, and any dtype's view divides it


def page_bytes_for(block_bytes: list[int]) -> int:
    """The page size for models with these block sizes: the largest, rounded up to PAGE_ALIGN."""
    return -(-max(block_bytes) // PAGE_ALIGN) * PAGE_ALIGN


class KVRegion:
    """`num_pages` pages of `page_bytes` bytes on `device`, zeroed."""

    def __init__(self, num_pages: int, page_bytes: int, device: torch.device) -> None:
        if page_bytes % PAGE_ALIGN:
            raise ValueError(f"page_bytes must be a multiple of {PAGE_ALIGN}, got {page_bytes}")
        self.num_pages, self.page_bytes = num_pages, page_bytes
        self.data = torch.zeros((num_pages, page_bytes), dtype=torch.uint8, device=device)

    def view(self, page_layers: int, block_size: int, kv_heads: int, head_dim: int,
             dtype: torch.dtype) -> torch.Tensor:
        """The model's KV tensor over the pages, (2, page_layers, pages, block_size, kv_heads,
        head_dim); a write through it lands in the pages its block ids name."""
        elem = torch.empty((), dtype=dtype).element_size()
        need = 2 * page_layers * block_size * kv_heads * head_dim * elem
        if need > self.page_bytes:
            raise ValueError(f"a block of {need} bytes does not fit a page of {self.page_bytes}")
        rows = self.data[:, :need].view(dtype)  # [pages, need / elem], page stride kept
        per_page = rows.view(self.num_pages, 2, page_layers, block_size, kv_heads, head_dim)
        return per_page.permute(1, 2, 0, 3, 4, 5)


@dataclass
class SharedKV:
    """What the models of one process share: the page allocator and the bytes it hands out.

    Opened by the first model to load: its block is the page (later models must fit it), and
    its KV budget, less `reserve_bytes` (the weights of the models still to load), is the pool,
    unless `num_pages` fixes it."""

    num_pages: int | None = None
    reserve_bytes: int = 0
    fair: bool = True
    pool: SharedBlockPool | None = None
    region: KVRegion | None = None

    def open(self, budget: Any, device: torch.device, enable_caching: bool) -> None:
        """Size and allocate the pool from the first model's MemoryBudget (once)."""
        if self.pool is not None:
            return
        page = page_bytes_for([budget.bytes_per_block])
        pages = self.num_pages or \
            (budget.num_blocks * budget.bytes_per_block - self.reserve_bytes) // page
        if pages < 1:
            raise ConfigError(
                f"no KV pages are left for the shared pool once the other models' weights "
                f"({self.reserve_bytes / 2**30:.2f} GiB) are set aside; give the server more "
                "memory (--gpu-memory-utilization / --kv-cache-memory) or fewer models")
        self.pool = SharedBlockPool(pages, page, enable_caching, self.fair)
        self.region = KVRegion(pages, page, device)

@dataclass(frozen=True)
class PoolSeat:
    """One model's place on a SharedKV: its member name and its block-hash key (None: plain
    hashes, for the server's first model, as the router computes them)."""

    shared: SharedKV
    member: str
    model_key: str | None = None
