"""The torch path's per-step precomputation: decode chunks (gather indices + length masks) and
prefill sequences (gather indices + causal masks), built once per step and reused by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.kernels.plan import AttentionPlan

# Gathered K+V bytes per decode chunk: small enough to stay in the last-level cache between the
# gather and the matmuls that read it (the sweep that chose it: docs/perf.md).
CHUNK_BYTES = 8 << 20


@dataclass
class DecodeChunk:
    """Decode sequences of similar length, padded to `key_len` = whole blocks."""

    tokens: torch.Tensor  # int64 [n]: rows of q
    blocks: torch.Tensor  # int64 [n * blocks_per_seq]: physical blocks, padded with a valid id
    key_len: int
    pad: torch.Tensor  # bool [n, 1, key_len]: True where the key is past the sequence
    lens: torch.Tensor  # int64 [n]: keys of each sequence from its first gathered block
    masks: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def additive_mask(self, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
        """0 / -inf [n, 1, key_len] in `dtype`, made once per (dtype, window): keys past the
        sequence and, with a sliding window W, keys before position lens - W are hidden."""
        key = (dtype, window)
        if key not in self.masks:
            hidden = self.pad
            if window is not None:
                keys = torch.arange(self.key_len, device=self.pad.device)[None, None, :]
                hidden = hidden | (keys < (self.lens - window)[:, None, None])
            zeros = torch.zeros(self.pad.shape, dtype=dtype, device=self.pad.device)
            self.masks[key] = zeros.masked_fill_(hidden, float("-inf"))
        return self.masks[key]


@dataclass
class PrefillSeq:
    """One sequence with several new tokens: q rows [start, end) over its first `seq_len` keys."""

    start: int
    end: int
    seq_len: int
    blocks: torch.Tensor  # int64 [ceil(seq_len / block_size)]
    additive: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def additive_mask(self, window: int | None = None) -> torch.Tensor:
        """fp32 0 / -inf [end - start, seq_len]: causal (shifted by any cached context) and,
        with a sliding window W, nothing older than W - 1 positions back; once per window."""
        if window not in self.additive:
            n, device = self.end - self.start, self.blocks.device
            rows = torch.arange(n, device=device)[:, None] + (self.seq_len - n)
            keys = torch.arange(self.seq_len, device=device)[None, :]
            hidden = keys > rows
            if window is not None:
                hidden = hidden | (keys <= rows - window)
            self.additive[window] = torch.zeros(n, self.seq_len, device=device).masked_fill_(
                hidden, float("-inf"))
        return self.additive[window]


@dataclass
class TorchPlan:
    decode: list[DecodeChunk]
    prefill: list[PrefillSeq]


def torch_plan(plan: AttentionPlan, bytes_per_token: int,
               chunk_bytes: int = CHUNK_BYTES, with_decode: bool = True,
               window: int | None = None) -> TorchPlan:
    """Split the batch into decode chunks and prefill sequences (cached in plan.parts).
    `with_decode=False`: prefill only (the CPU backend's kernel serves the decode rows).
    `window`: decode chunks gather only the blocks that hold a key of the window."""
    key = ("torch", bytes_per_token, chunk_bytes, with_decode, window)
    if key not in plan.parts:
        tables = plan.block_tables.long()
        decode = [s for s in range(plan.num_seqs) if plan.query_lens[s] == 1 and with_decode]
        prefill = [s for s in range(plan.num_seqs) if plan.query_lens[s] > 1]
        starts = [0]  # from the plan's host lists: the offsets tensor may be on a device
        for q_len in plan.query_lens:
            starts.append(starts[-1] + q_len)
        plan.parts[key] = TorchPlan(
            _decode_chunks(plan, tables, decode, starts, bytes_per_token, chunk_bytes, window),
            [_prefill_seq(plan, tables, s, starts[s]) for s in prefill])
    return plan.parts[key]


def _first_block(plan: AttentionPlan, s: int, window: int | None) -> int:
    """The first block holding a key that sequence s's decode token sees."""
    if window is None:
        return 0
    return max(0, plan.seq_lens[s] - window) // plan.block_size


def _decode_chunks(plan: AttentionPlan, tables: torch.Tensor, seqs: list[int], starts: list[int],
                   bytes_per_token: int, chunk_bytes: int,
                   window: int | None) -> list[DecodeChunk]:
    """Most blocks first, so each chunk pads its sequences to a near-equal number of blocks."""
    bs = plan.block_size
    first = {s: _first_block(plan, s, window) for s in seqs}
    count = {s: -(-plan.seq_lens[s] // bs) - first[s] for s in seqs}
    order = sorted(seqs, key=lambda s: -count[s])
    chunks, i = [], 0
    while i < len(order):
        blocks = count[order[i]]
        n = max(1, chunk_bytes // max(1, blocks * bs * bytes_per_token))
        members = order[i:i + n]
        chunks.append(_decode_chunk(plan, tables, members, starts, blocks,
                                    [first[s] for s in members]))
        i += n
    return chunks


def _decode_chunk(plan: AttentionPlan, tables: torch.Tensor, members: list[int],
                  starts: list[int], blocks: int, first: list[int]) -> DecodeChunk:
    """Each member's blocks from its `first` on; lengths and masks count keys from there."""
    device = tables.device
    idx = torch.tensor(members, dtype=torch.long, device=device)
    offset = torch.tensor(first, dtype=torch.long, device=device)
    lens = plan.seq_lens_t.long()[idx] - offset * plan.block_size
    key_len = blocks * plan.block_size
    cols = offset[:, None] + torch.arange(blocks, device=device)[None, :]
    used = torch.arange(blocks, device=device)[None, :] * plan.block_size < lens[:, None]
    # Padding entries point at a block the sequence does own (its first) so the gather stays valid.
    own = tables[idx].gather(1, cols.clamp(max=tables.shape[1] - 1))
    gather = torch.where(used, own, tables[idx, :1])
    pad = torch.arange(key_len, device=device)[None, None, :] >= lens[:, None, None]
    tokens = torch.tensor([starts[s] for s in members], dtype=torch.long, device=device)
    return DecodeChunk(tokens, gather.reshape(-1), key_len, pad, lens)


def _prefill_seq(plan: AttentionPlan, tables: torch.Tensor, s: int, start: int) -> PrefillSeq:
    n, seq_len = plan.query_lens[s], plan.seq_lens[s]
    blocks = tables[s, : -(-seq_len // plan.block_size)]
    return PrefillSeq(start, start + n, seq_len, blocks)
