"""KV-cache groups: layers that share one block table. A full-attention group keeps every block
of a request; a sliding-window group frees the blocks that have left its window. All groups take
pages from one BlockPool, a page holding `page_layers` layers' K and V of `block_size` tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers (model indices) with one attention type; `sliding_window` None = full attention."""

    layers: tuple[int, ...]
    sliding_window: int | None = None

    def num_skipped_blocks(self, num_computed_tokens: int, block_size: int) -> int:
        """Leading blocks no later token attends to once `num_computed_tokens` are cached: the
        next token, at that position p, sees keys p - W + 1 .. p only."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // block_size

    def window_blocks(self, block_size: int) -> int | None:
        """Blocks before a prefix boundary that a hit must hold (None: all of them)."""
        if self.sliding_window is None:
            return None
        return -(-(self.sliding_window - 1) // block_size)


@dataclass(frozen=True)
class KVCacheGroups:
    """How the model's layers map onto block tables and onto the page layout of the cache.

    Layer i lives in group `slots[i][0]` at position `slots[i][1]` of a page: every group's
    j-th layer shares the cache tensor j, which is safe because a page belongs to one group at
    a time (vLLM's hybrid layout). Group 0 is a full-attention group when there is one, so its
    block keys are the plain block hashes the router knows."""

    groups: tuple[KVCacheGroup, ...]
    page_layers: int

    @classmethod
    def single(cls, num_layers: int, sliding_window: int | None = None) -> "KVCacheGroups":
        return cls((KVCacheGroup(tuple(range(num_layers)), sliding_window),), num_layers)

    @classmethod
    def from_windows(cls, windows: Sequence[int | None]) -> "KVCacheGroups":
        """Groups for layers with these windows: one group when all layers are alike; else each
        attention type split into groups of the smallest type's layer count."""
        by_type: dict[int | None, list[int]] = {}
        for i, w in enumerate(windows):
            by_type.setdefault(w, []).append(i)
        if len(by_type) <= 1:
            return cls.single(len(windows), windows[0] if windows else None)
        size = min(len(v) for v in by_type.values())
        kinds = sorted(by_type, key=lambda w: (w is not None, w or 0))  # full attention first
        groups = tuple(KVCacheGroup(tuple(by_type[w][i:i + size]), w)
                       for w in kinds for i in range(0, len(by_type[w]), size))
        return cls(groups, size)

    def blocks_for(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """The most blocks one request of `num_tokens` holds at once, prefilled `chunk` tokens
        a step: every block in a full group, the window and one chunk in a sliding one."""
        full = -(-num_tokens // block_size)
        return sum(full if g.sliding_window is None else
                   min(full, -(-(g.sliding_window - 1 + chunk) // block_size) + 1)
                   for g in self.groups)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def slides(self) -> bool:
        return any(g.sliding_window is not None for g in self.groups)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    @property
    def slots(self) -> list[tuple[int, int]]:
        """(group, position in the page) of each model layer, by layer index."""
        out: dict[int, tuple[int, int]] = {}
        for g, group in enumerate(self.groups):
            for j, layer in enumerate(group.layers):
                out[layer] = (g, j)
        return [out[i] for i in range(len(out))]

    @property
    def layer_groups(self) -> tuple[int, ...]:
        """The group of each model layer."""
        return tuple(g for g, _ in self.slots)


def group_key(block_hash: bytes, group: int) -> bytes:
    """The prefix-cache key of a block of `group`: group 0 keeps the plain hash (what the router
    computes), other groups append their index so one hash names one page per group."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


def is_plain_key(hex_key: str, hash_hex_len: int = 32) -> bool:
    """Whether a hex key is a plain block hash (group 0), not another group's key."""
    return len(hex_key) == hash_hex_len
