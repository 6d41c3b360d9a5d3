"""One step's batch as the driver broadcasts it to every rank (StepInput) and the block copies
that run before its forward (BlockMoves): plain data, apart from the runner that consumes it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

BlockPairs = list[tuple[int, int]]


@dataclass
class BlockMoves:
    """One step's (src, dst) block pairs, applied in this order: spills (host tier -> disk tier)
    first, since the host slots they read are about to be reused by offloads (device -> host
    tier), which come next since the blocks they read were evicted and are about to be reused;
    swap-outs; then restores (host tier -> device), loads (disk tier -> device), swap-ins and
    copy-on-write."""

    swap_out: BlockPairs = field(default_factory=list)
    swap_in: BlockPairs = field(default_factory=list)
    copy: BlockPairs = field(default_factory=list)
    offload: BlockPairs = field(default_factory=list)
    restore: BlockPairs = field(default_factory=list)
    spill: list[tuple[str, int, bytes]] = field(default_factory=list)  # (medium, index, hash)
    load: list[tuple[bytearray, int]] = field(default_factory=list)  # (payload, device block)
    kv_meta: Any = None  # the KV connector's metadata: its loads land last, before the forward

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copy or self.offload or self.restore
                    or self.spill or self.load or self.kv_meta)


@dataclass
class StepInput:
    """One step's flattened batch as CPU tensors: what the driver broadcasts to every rank."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [G, T] int64: one row per KV-cache group
    block_tables: torch.Tensor  # [G, B, W] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    max_query_len: int
    max_seq_len: int
    sample_rows: list[int]  # batch index per sampled row (may repeat: n > 1)
    moves: BlockMoves
    # prompt logprobs (sample/prompt_logprobs.py): flattened rows, the token each predicts, top-k
    prompt_rows: list[int] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)
    prompt_k: int = 0
    lora_slots: torch.Tensor | None = None  # [T] int64: each token's LoRA slot (-1: none)
    # the captured decode size every rank replays (None: eager), chosen by the driver, and its
    # tokens per sequence (1: decode; 1 + k: a speculative verification, worker/cuda_graph.py)
    graph_size: int | None = None
    graph_query_len: int = 1
    # input tokens still on the device (async scheduling's placeholders; single rank only)
    fill: Any = None
    # prompt embeddings: (flattened rows [E] int64, values [E, hidden]) fed in place of the
    # embedded ids of those rows (engine/prompt_embeds.py); every rank gets them
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # pipeline stages: the step's SamplingMetadata, for the last stage to sample (None: it
    # returns the sampled rows' logits, as when the driver holds a logits hook)
    sampling: Any = None
    # speculative decoding: per sampled row, how many tokens before its seq's last scheduled
    # token its logits are taken (0: the last; None: every row the last)
    sample_offsets: list[int] | None = None
