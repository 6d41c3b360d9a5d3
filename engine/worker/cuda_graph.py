"""Decode CUDA graphs: a ladder of captured batch sizes, static inputs filled from persistent
staging buffers, each batch padded to the next captured size (slot -1, length 0, no LoRA
adapter, dropped).

Speculative decoding's verification steps score 1 + k tokens per sequence (k drafts): with
`query_lens=(1 + k,)` a second ladder of uniform graphs is captured, each sequence q = 1 + k
tokens (sizes in tokens: batch x q, at most MAX_CAPTURE), as vLLM's uniform-decode graphs. A
step whose sequences score 1..q tokens each (drafts of uneven lengths, plain decode rows
beside them) pads every sequence to q: the real tokens first, then pad tokens whose KV is not
written (slot -1) and which no real token attends (they come after it), the sequence's length
raised by its pad count so the real tokens keep their positions; the pad rows are dropped."""

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


def uniform_sizes(sizes: list[int], query_len: int) -> list[int]:
    """The batch sizes captured with `query_len` tokens per sequence: those of the decode
    ladder whose token count (batch x query_len) is at most MAX_CAPTURE."""
    return [s for s in sizes if s * query_len <= MAX_CAPTURE] or [1]


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size holding n rows; None when n is past the largest."""
    fits = [s for s in sizes if s >= n]
    return min(fits) if fits else None


@dataclass
class DecodeBuffers:
    """One set of decode inputs for `rows` sequences (`tokens` token rows: rows x the largest
    query length captured; one token each for plain decode)."""

    input_ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64
    slot_mapping: torch.Tensor  # [tokens] int64
    block_tables: torch.Tensor  # [rows, width] int32
    seq_lens: torch.Tensor  # [rows] int32
    lora_slots: torch.Tensor  # [tokens] int64: each token's LoRA slot, -1 for none

    @classmethod
    def empty(cls, rows: int, width: int, device, pin: bool = False,
              tokens: int | None = None) -> DecodeBuffers:
        def z(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
        t = rows if tokens is None else tokens
        return cls(z(t), z(t), z(t), z(rows, width, dtype=torch.int32),
                   z(rows, dtype=torch.int32), z(t).fill_(-1))

    def fields(self) -> tuple[torch.Tensor, ...]:
        return (self.input_ids, self.positions, self.slot_mapping, self.block_tables,
                self.seq_lens, self.lora_slots)

    def copy_into(self, dst: DecodeBuffers, size: int, query_len: int = 1) -> None:
        """Copy the first `size` sequences (size x query_len tokens) without blocking."""
        tokens = size * query_len
        for name in ("input_ids", "positions", "slot_mapping", "lora_slots"):
            getattr(dst, name)[:tokens].copy_(getattr(self, name)[:tokens], non_blocking=True)
        for name in ("block_tables", "seq_lens"):
            getattr(dst, name)[:size].copy_(getattr(self, name)[:size], non_blocking=True)


def fill_staging(staging: DecodeBuffers, size: int, input_ids: torch.Tensor,
                 positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 lora_slots: torch.Tensor | None = None) -> None:
    """Write n real sequences into the staging buffers' first n rows (their tokens first) and
    pad sequences n..size: token 0 at position 0, slot -1 (never written), an all-zero block
    table row, length 0, no LoRA adapter (slot -1). `lora_slots` None: no row has an adapter.
    With q tokens per sequence the token arrays hold n * q real tokens (padded to size * q)."""
    n, width = block_tables.shape
    t = input_ids.shape[0]
    end = t if n == 0 else size * (t // n)
    staging.input_ids[:t] = input_ids
    staging.positions[:t] = positions
    staging.slot_mapping[:t] = slot_mapping
    staging.block_tables[:n, :width] = block_tables
    staging.block_tables[:n, width:] = 0
    staging.seq_lens[:n] = seq_lens
    for buf in (staging.input_ids, staging.positions):
        buf[t:end] = 0
    staging.seq_lens[n:size] = 0
    staging.slot_mapping[t:end] = -1
    staging.block_tables[n:size] = 0
    if lora_slots is None:
        staging.lora_slots[:end] = -1
    else:
        staging.lora_slots[:t] = lora_slots
        staging.lora_slots[t:end] = -1


def decode_plan(bufs: DecodeBuffers, rows: int, block_size: int,
                max_seq_len: int, query_start_loc: torch.Tensor,
                query_len: int = 1) -> AttentionPlan:
    """The plan of a captured decode batch, built once with no look at the values: every row
    `query_len` tokens, lengths up to max_seq_len, so the kernel's split count and range are
    fixed and each split's bounds come from the device's seq_lens (a padded row's 0 gives
    zeros). No sequence is a fresh prompt (the graphs serve none): every one goes through the
    paged kernel, as in the eager step."""
    plan = AttentionPlan(rows, rows * query_len, block_size, query_len, max_seq_len, -1,
                         [query_len] * rows, [], bufs.block_tables[:rows], bufs.seq_lens[:rows],
                         query_start_loc)
    plan.parts["fresh"] = None  # kernels/fresh_prefill.py: no fresh sequence here
    return plan


class DecodeGraphs:
    """The captured decode forwards, one per ladder size and query length (1: decode; 1 + k:
    speculative verification), sharing one set of static buffers (a graph of size s and query
    length q reads their first s rows and s x q tokens). With tensor parallelism every rank
    holds one, captured from the same arguments in the same order (the forward's all-reduces
    are recorded in every rank's graphs alike), and every rank replays the graph the driver
    chose."""

    def __init__(self, forward: Forward, max_num_seqs: int, max_blocks_per_seq: int,
                 block_size: int, device: torch.device, capture: Capture, backend: str,
                 k_scale: float = 1.0, v_scale: float = 1.0,
                 query_lens: tuple[int, ...] = ()) -> None:
        self.sizes = capture_sizes(max_num_seqs)
        self.ladders = {q: uniform_sizes(self.sizes, q) for q in sorted({1, *query_lens})}
        self.width, self.block_size = max_blocks_per_seq, block_size
        top = self.sizes[0]
        tokens = max(ladder[0] * q for q, ladder in self.ladders.items())
        self.static = DecodeBuffers.empty(top, self.width, device, tokens=tokens)
        self.stagings = [DecodeBuffers.empty(top, self.width, "cpu", pin=device.type == "cuda",
                                             tokens=tokens) for _ in range(2)]
        self.qsls = {q: torch.arange(top + 1, dtype=torch.int32, device=device) * q
                     for q in self.ladders}
        self.graphs: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}
        self.replays = 0  # steps run from a graph (tests and figures)
        self.replayed: dict[tuple[int, int], int] = {}  # (size, query length) -> replays
        max_seq_len = max_blocks_per_seq * block_size
        keys = [(size, q) for q, ladder in self.ladders.items() for size in ladder]
        for size, q in sorted(keys, key=lambda k: (-k[0] * k[1], k[1])):  # largest first
            self.graphs[(size, q)] = capture(self._recorded(forward, size, q, max_seq_len,
                                                            k_scale, v_scale, backend))

    @property
    def query_lens(self) -> list[int]:
        return list(self.ladders)

    def _recorded(self, forward: Forward, size: int, q: int, max_seq_len: int, k_scale: float,
                  v_scale: float, backend: str) -> Callable[[], torch.Tensor]:
        """The call a graph of `size` sequences of `q` tokens records."""
        st, t, qsl = self.static, size * q, self.qsls[q][:size + 1]
        meta = AttentionMetadata(
            slot_mapping=st.slot_mapping[:t], block_tables=st.block_tables[:size],
            seq_lens=st.seq_lens[:size], query_start_loc=qsl, max_query_len=q,
            max_seq_len=max_seq_len, k_scale=k_scale, v_scale=v_scale, backend=backend,
            plan=decode_plan(st, size, self.block_size, max_seq_len, qsl, q))
        ids, pos, lora = st.input_ids[:t], st.positions[:t], st.lora_slots[:t]
        return lambda: forward(ids, pos, meta, lora)

    def can_run(self, num_seqs: int, num_tokens: int, width: int, query_len: int = 1) -> bool:
        """A batch of `query_len` tokens per sequence (padded: see the module doc) within that
        ladder and the table width; anything else (prefill, mixed, larger) runs eagerly."""
        ladder = self.ladders.get(query_len)
        return ladder is not None and num_tokens == num_seqs * query_len \
            and 0 < num_seqs <= ladder[0] and width <= self.width

    def size_for(self, num_seqs: int, num_tokens: int, width: int,
                 query_len: int = 1) -> int | None:
        """The captured size a batch replays (None: it runs eagerly)."""
        if not self.can_run(num_seqs, num_tokens, width, query_len):
            return None
        return padded_size(num_seqs, self.ladders[query_len])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor,
            lora_slots: torch.Tensor | None = None, size: int | None = None,
            fill: Callable[[torch.Tensor], None] | None = None,
            query_len: int = 1) -> torch.Tensor:
        """Hidden states of the n real sequences' n x query_len tokens (host tensors in, each
        sequence's tokens padded to query_len already: `pad_to_uniform`): stage, copy without
        blocking, let `fill` write the tokens still on the device (async scheduling), replay
        `size` (default: the next captured size), drop the padded rows."""
        n = seq_lens.shape[0]
        ladder = self.ladders.get(query_len, [])
        size = size if size is not None else padded_size(n, ladder)
        if (size, query_len) not in self.graphs or size < n:
            raise RuntimeError(f"no captured decode graph of size {size} x {query_len} tokens "
                               f"for {n} rows (captured: {ladder})")
        # Two staging sets taken in turn: with async scheduling step N+1 is staged while step
        # N's copies may still be queued, but step N-1's tokens (and so its copies) were read.
        staging = self.stagings[self.replays % 2]
        fill_staging(staging, size, input_ids, positions, slot_mapping, block_tables,
                     seq_lens, lora_slots)
        staging.copy_into(self.static, size, query_len)
        if fill is not None:
            fill(self.static.input_ids)
        self.replays += 1
        key = (size, query_len)
        self.replayed[key] = self.replayed.get(key, 0) + 1
        return self.graphs[key]()[:n * query_len]


@dataclass
class UniformBatch:
    """A step's tokens laid out q per sequence (`pad_to_uniform`): the inputs a graph of query
    length q reads and, per real token, its row there (None: no padding, the same rows)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    lora_slots: torch.Tensor | None
    rows: torch.Tensor | None


def pad_to_uniform(query_start_loc: torch.Tensor, query_len: int, input_ids: torch.Tensor,
                   positions: torch.Tensor, slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
                   lora_slots: torch.Tensor | None) -> UniformBatch:
    """Each sequence's tokens followed by pad tokens up to `query_len` (host tensors): token 0
    at position 0, slot -1 (their KV is never written), no LoRA adapter; the sequence's length
    grows by its pad count, so its real tokens keep their places (the kernel puts a sequence's
    queries at the end of its length) and attend only to keys before them (the pads come
    after; their own outputs are dropped)."""
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    n = q_lens.shape[0]
    if bool((q_lens == query_len).all()):
        return UniformBatch(input_ids, positions, slot_mapping, seq_lens, lora_slots, None)
    seq_idx = torch.repeat_interleave(torch.arange(n), q_lens)
    offset = torch.arange(input_ids.shape[0]) - query_start_loc[:-1].long()[seq_idx]
    rows = seq_idx * query_len + offset
    pads = query_len - q_lens
    t = n * query_len
    ids = torch.zeros(t, dtype=input_ids.dtype)
    ids[rows] = input_ids
    slots = torch.full((t,), -1, dtype=slot_mapping.dtype)
    slots[rows] = slot_mapping
    pos = torch.zeros(t, dtype=positions.dtype)  # a pad's position only feeds its own rotary
    pos[rows] = positions
    lora = None
    if lora_slots is not None:
        lora = torch.full((t,), -1, dtype=lora_slots.dtype)
        lora[rows] = lora_slots
    return UniformBatch(ids, pos, slots, (seq_lens.long() + pads).to(seq_lens.dtype), lora,
                        rows)


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
        line = f"CUDA graphs: captured for decode at batch sizes {sizes}"
        for q, ladder in graphs.ladders.items():
            if q > 1:
                line += (f"; for verification ({q} tokens per sequence) at batch sizes "
                         f"{', '.join(map(str, ladder))}")
        return line
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
