"""Decode CUDA graphs: a ladder of captured batch sizes, static inputs filled from persistent
staging buffers, each batch padded to the next captured size (slot -1, length 0, no LoRA
adapter, dropped)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.kernels.metadata import AttentionMetadata
from kvserve.kernels.plan import AttentionPlan

MAX_CAPTURE = 512
# forward(input_ids, positions, meta, lora_slots) -> hidden [N, hidden]: the model and attention,
# no sampling; lora_slots [N] int64 is each row's adapter slot (-1: none), for LoRA models
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]
# capture(fn) -> replay: records fn once; replay() re-runs it on the same buffers and returns
# its output (torch.cuda.CUDAGraph on a GPU; the tests pass a plain call as the stand-in).
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 256 and of 16 beyond, ending at max_num_seqs itself
    (at most 512); largest first, so the smaller graphs reuse its memory pool."""
    cap = min(max(max_num_seqs, 1), MAX_CAPTURE)
    sizes = [s for s in (1, 2, 4, 8) if s < cap]
    size = 8
    while size < cap:
        size += 8 if size < 256 else 16
        sizes.append(min(size, cap))
    if cap not in sizes:
        sizes.append(cap)
    return sorted(set(sizes), reverse=True)


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size holding n rows; None when n is past the largest."""
    fits = [s for s in sizes if s >= n]
    return min(fits) if fits else None


@dataclass
class DecodeBuffers:
    """One set of decode inputs for `rows` sequences of one token each."""

    input_ids: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [rows] int64
    slot_mapping: torch.Tensor  # [rows] int64
    block_tables: torch.Tensor  # [rows, width] int32
    seq_lens: torch.Tensor  # [rows] int32
    lora_slots: torch.Tensor  # [rows] int64: each row's LoRA slot, -1 for none

    @classmethod
    def empty(cls, rows: int, width: int, device, pin: bool = False) -> DecodeBuffers:
        def z(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
        return cls(z(rows), z(rows), z(rows), z(rows, width, dtype=torch.int32),
                   z(rows, dtype=torch.int32), z(rows).fill_(-1))

    def fields(self) -> tuple[torch.Tensor, ...]:
        return (self.input_ids, self.positions, self.slot_mapping, self.block_tables,
                self.seq_lens, self.lora_slots)


def fill_staging(staging: DecodeBuffers, size: int, input_ids: torch.Tensor,
                 positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 lora_slots: torch.Tensor | None = None) -> None:
    """Write n real rows into the staging buffers' first n rows and pad rows n..size: token 0
    at position 0, slot -1 (never written), an all-zero block table row, length 0, no LoRA
    adapter (slot -1). `lora_slots` None: no row has an adapter."""
    n, width = block_tables.shape
    staging.input_ids[:n] = input_ids
    staging.positions[:n] = positions
    staging.slot_mapping[:n] = slot_mapping
    staging.block_tables[:n, :width] = block_tables
    staging.block_tables[:n, width:] = 0
    staging.seq_lens[:n] = seq_lens
    for buf in (staging.input_ids, staging.positions, staging.seq_lens):
        buf[n:size] = 0
    staging.slot_mapping[n:size] = -1
    staging.block_tables[n:size] = 0
    if lora_slots is None:
        staging.lora_slots[:size] = -1
    else:
        staging.lora_slots[:n] = lora_slots
        staging.lora_slots[n:size] = -1


def decode_plan(bufs: DecodeBuffers, rows: int, block_size: int,
                max_seq_len: int, query_start_loc: torch.Tensor) -> AttentionPlan:
    """The plan of a captured decode batch, built once with no look at the values: every row
    one token, lengths up to max_seq_len, so the kernel's split count and range are fixed and
    each split's bounds come from the device's seq_lens (a padded row's 0 gives zeros)."""
    return AttentionPlan(rows, rows, block_size, 1, max_seq_len, -1, [1] * rows, [],
                         bufs.block_tables[:rows], bufs.seq_lens[:rows], query_start_loc)


class DecodeGraphs:
    """The captured decode forwards, one per ladder size, sharing one set of static buffers
    (a graph of size s reads their first s rows). With tensor parallelism every rank holds one,
    captured from the same arguments in the same order (the forward's all-reduces are recorded
    in every rank's graphs alike), and every rank replays the size the driver chose."""

    def __init__(self, forward: Forward, max_num_seqs: int, max_blocks_per_seq: int,
                 block_size: int, device: torch.device, capture: Capture, backend: str,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        self.sizes = capture_sizes(max_num_seqs)
        self.width, self.block_size = max_blocks_per_seq, block_size
        top = self.sizes[0]
        self.static = DecodeBuffers.empty(top, self.width, device)
        self.stagings = [DecodeBuffers.empty(top, self.width, "cpu", pin=device.type == "cuda")
                         for _ in range(2)]
        self.qsl = torch.arange(top + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}
        self.replays = 0  # steps run from a graph (tests and figures)
        max_seq_len = max_blocks_per_seq * block_size
        for size in self.sizes:  # largest first
            meta = AttentionMetadata(
                slot_mapping=self.static.slot_mapping[:size],
                block_tables=self.static.block_tables[:size], seq_lens=self.static.seq_lens[:size],
                query_start_loc=self.qsl[:size + 1], max_query_len=1, max_seq_len=max_seq_len,
                k_scale=k_scale, v_scale=v_scale, backend=backend,
                plan=decode_plan(self.static, size, block_size, max_seq_len, self.qsl[:size + 1]))
            ids, pos = self.static.input_ids[:size], self.static.positions[:size]
            lora = self.static.lora_slots[:size]
            self.graphs[size] = capture(
                lambda ids=ids, pos=pos, meta=meta, lora=lora: forward(ids, pos, meta, lora))

    def can_run(self, num_seqs: int, num_tokens: int, width: int) -> bool:
        """A pure decode batch (one token per sequence) within the ladder and the table width;
        anything else (prefill, mixed, larger) runs eagerly."""
        return num_tokens == num_seqs and 0 < num_seqs <= self.sizes[0] and width <= self.width

    def size_for(self, num_seqs: int, num_tokens: int, width: int) -> int | None:
        """The captured size a batch replays (None: it runs eagerly)."""
        if not self.can_run(num_seqs, num_tokens, width):
            return None
        return padded_size(num_seqs, self.sizes)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor,
            lora_slots: torch.Tensor | None = None, size: int | None = None,
            fill: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Hidden states of the n real rows (host tensors in): stage, copy without blocking,
        let `fill` write the tokens still on the device (async scheduling), replay `size`
        (default: the next captured size), drop the padded rows."""
        n = seq_lens.shape[0]
        size = size if size is not None else padded_size(n, self.sizes)
        if size not in self.graphs or size < n:
            raise RuntimeError(f"no captured decode graph of size {size} for {n} rows "
                               f"(captured: {self.sizes})")
        # Two staging sets taken in turn: with async scheduling step N+1 is staged while step
        # N's copies may still be queued, but step N-1's tokens (and so its copies) were read.
        staging = self.stagings[self.replays % 2]
        fill_staging(staging, size, input_ids, positions, slot_mapping, block_tables,
                     seq_lens, lora_slots)
        for dst, src in zip(self.static.fields(), staging.fields()):
            dst[:size].copy_(src[:size], non_blocking=True)
        if fill is not None:
            fill(self.static.input_ids)
        self.replays += 1
        return self.graphs[size]()[:n]


def eager_reason(device_type: str, enforce_eager: bool, backend: str) -> str | None:
    """Why an engine does not capture decode graphs at start (None: it tries)."""
    if device_type != "cuda":
        return f"device {device_type}; CUDA only"
    if enforce_eager:
        return "--enforce-eager"
    if backend != "triton":
        return f"attention backend {backend}; captured with triton only"
    return None


def graphs_log_line(graphs: DecodeGraphs | None, why_not: str | None = None) -> str:
    """The start-up line on decode CUDA graphs: the batch sizes captured, or why none were."""
    if graphs is not None:
        sizes = ", ".join(map(str, graphs.sizes))
        return f"CUDA graphs: captured for decode at batch sizes {sizes}"
    return f"CUDA graphs: not captured ({why_not or 'the capture failed'}); decode runs eagerly"


def cuda_capture(pool=None) -> Capture:
    """Capture on a GPU: one warm-up run, then torch.cuda.CUDAGraph in one shared pool."""
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()

    def capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        fn()  # warm-up: Triton compiles and caches are allocated outside the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out
        return replay
    return capture
