"""HostBlocks: the host tier's memory (block-major, pinned on CUDA) and its batched copies to and
from the device KV cache. Per step and direction: one gather kernel over the device blocks and one
scatter; on CUDA the copies run on a side stream that the forward waits for only where it must.

Block-major (`[slot, K/V, layer, token, head, dim]`) keeps every host block one contiguous run of
bytes: one DMA per block on CUDA, and one buffer per block for a disk tier or a compressor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvserve.kernels.fp8 import FP8_DTYPE


@dataclass(frozen=True)
class CopyTiming:
    """One batched copy between device and host: what it moved (this rank) and how long."""

    kind: str  # "offload" | "restore" | "load" | "swap_out" | "swap_in"
    num_bytes: int
    seconds: float


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Index ops see fp8 as bytes (a copy moves bits, so nothing is converted)."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


class HostBlocks:
    def __init__(self, kv: torch.Tensor, num_blocks: int) -> None:
        self.kv = kv  # the device cache [2, layers, blocks, block_size, kv_heads, head_dim]
        self.device = kv.device
        shape = (num_blocks, kv.shape[0], kv.shape[1], *kv.shape[3:])
        cuda = self.device.type == "cuda"
        # Not zeroed: a slot is always written by an offload before any restore reads it.
        self.data = torch.empty(shape, dtype=kv.dtype, pin_memory=cuda)
        self.block_bytes = self.data[0].numel() * self.data.element_size()
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self._events: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = []
        self._timings: list[tuple[str, int, float]] = []

    def offload(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host slots: (device block, host slot) pairs."""
        src, dst = zip(*pairs)
        nbytes = len(src) * self.block_bytes
        if self.stream is None:
            t0 = time.perf_counter()
            blocks = _raw(self.kv).index_select(2, torch.tensor(src)).movedim(2, 0)
            _raw(self.data).index_copy_(0, torch.tensor(dst), blocks)
            self._timings.append(("offload", nbytes, time.perf_counter() - t0))
            return
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)  # the evicted blocks hold what earlier steps wrote
        with torch.cuda.stream(self.stream):
            start, end, gathered = (torch.cuda.Event(enable_timing=True),
                                    torch.cuda.Event(enable_timing=True), torch.cuda.Event())
            start.record()
            idx = torch.tensor(src, device=self.device)
            staged = _raw(self.kv).index_select(2, idx).movedim(2, 0).contiguous()
            gathered.record()
            host = _raw(self.data)
            for i, slot in enumerate(dst):
                host[slot].copy_(staged[i], non_blocking=True)
            end.record()
        cur.wait_event(gathered)  # the forward may overwrite the evicted blocks once gathered
        self._events.append(("offload", nbytes, start, end))

    def restore(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host slots back into device blocks: (host slot, device block) pairs."""
        src, dst = zip(*pairs)
        nbytes = len(src) * self.block_bytes
        if self.stream is None:
            t0 = time.perf_counter()
            blocks = _raw(self.data).index_select(0, torch.tensor(src)).movedim(0, 2)
            _raw(self.kv).index_copy_(2, torch.tensor(dst), blocks)
            self._timings.append(("restore", nbytes, time.perf_counter() - t0))
            return
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)  # earlier steps' reads of the reused device blocks
        with torch.cuda.stream(self.stream):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            host = _raw(self.data)
            staged = torch.empty((len(src), *host.shape[1:]), dtype=host.dtype,
                                 device=self.device)
            for i, slot in enumerate(src):
                staged[i].copy_(host[slot], non_blocking=True)
            idx = torch.tensor(dst, device=self.device)
            _raw(self.kv).index_copy_(2, idx, staged.movedim(0, 2))
            end.record()
        cur.wait_stream(self.stream)  # the forward reads the restored blocks
        self._events.append(("restore", nbytes, start, end))

    def load(self, pairs: list[tuple[bytearray, int]]) -> None:
        """Copy block payloads (the disk tier's, in this layout) into device blocks: (payload,
        device block) pairs, staged in one host buffer and scattered in one copy."""
        payloads, dst = zip(*pairs)
        t0 = time.perf_counter()
        raw = _raw(self.data)
        staged = torch.empty((len(dst), *raw.shape[1:]), dtype=raw.dtype,
                             pin_memory=self.stream is not None)
        flat = staged.view(len(dst), -1).view(torch.uint8)
        for i, p in enumerate(payloads):
            flat[i].copy_(torch.frombuffer(p, dtype=torch.uint8))
        idx = torch.tensor(dst, device=self.device)
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                staged_dev = staged.to(self.device, non_blocking=True)
                _raw(self.kv).index_copy_(2, idx, staged_dev.movedim(0, 2))
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self.stream.synchronize()  # the staging buffer is freed on return
        else:
            _raw(self.kv).index_copy_(2, idx, staged.movedim(0, 2))
        self._timings.append(("load", len(dst) * self.block_bytes, time.perf_counter() - t0))

    def read_block(self, slot: int, from_device: bool = False) -> torch.Tensor:
        """One host block (or, `from_device`, device block `slot` in the host layout) as its
        bytes on the host, once every copy into it is done (disk tier, tests)."""
        if self.stream is not None:
            self.stream.synchronize()
        if from_device:
            return _raw(self.kv)[:, :, slot].contiguous().cpu().reshape(-1).view(torch.uint8)
        return _raw(self.data)[slot].reshape(-1).view(torch.uint8)

    def take_timings(self) -> list[CopyTiming]:
        """(kind, bytes, seconds) of the copies since the last call, as CopyTimings."""
        out = [CopyTiming(*t) for t in self._timings]
        for kind, nbytes, start, end in self._events:
            end.synchronize()
            out.append(CopyTiming(kind, nbytes, start.elapsed_time(end) / 1000))
        self._timings, self._events = [], []
        return out
