"""AttentionMetadata: the per-step description of a flattened batch that every layer's attention
reads (built once per step by the model runner, shared by all layers)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens]: block * block_size + offset, <0 = skip
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]: cached + new tokens of each sequence
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: offsets of each sequence's new tokens
    max_query_len: int
    max_seq_len: int
    k_scale: float = 1.0  # fp8 KV cache: stored = value / scale
    v_scale: float = 1.0
    backend: str = "auto"  # "auto" | "cpu" | "torch" | "triton" | "reference"
    plan: object | None = None  # backend-specific precomputation shared by all layers of a step
    # KV-cache groups (engine/core/kv_cache_groups.py): each group's own metadata (its block
    # tables, slot mapping and plan) and the group of each layer; empty with one group.
    groups: tuple["AttentionMetadata", ...] = ()
    layer_groups: tuple[int, ...] = ()

    def for_layer(self, layer: int) -> "AttentionMetadata":
        """What layer `layer` attends through: its group's metadata (this one with one group)."""
        return self.groups[self.layer_groups[layer]] if self.groups else self
