"""Pipeline parallelism's arithmetic and its one data path: which layers each stage holds
(balanced by layer, or vLLM's `VLLM_PP_LAYER_PARTITION`), where a global rank sits in the
PP x TP grid, and the hand-off of (hidden states, residual) from one stage to the next with
torch.distributed point-to-point (gloo on the CPU, NCCL on CUDA).

Ranks are laid out as vLLM does: global rank g is stage g // TP, tensor-parallel rank g % TP, so
a stage's TP ranks are neighbours (one node when TP = GPUs per node) and stage s's TP rank r
sends to stage s + 1's TP rank r. Rank 0 (stage 0, TP rank 0) is the driver.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from kvserve.engine.errors import ConfigError

PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"
MICROBATCH_ENV = "KVSERVE_PP_MICROBATCHES"


def microbatches_for(stages: int) -> int:
    """Micro-batches per step for `stages` stages (worker/microbatch.py):
    $KVSERVE_PP_MICROBATCHES, else one per stage (1: the step goes through whole)."""
    value = os.environ.get(MICROBATCH_ENV)
    try:
        return max(int(value), 1) if value else stages
    except ValueError:
        raise ConfigError(f"{MICROBATCH_ENV}={value!r} is not an integer") from None


def partition_layers(num_layers: int, stages: int, spec: str | None = None) -> list[int]:
    """Layers per stage: `spec` (a comma list summing to `num_layers`, vLLM's env var), else
    balanced as vLLM's get_pp_indices: the remainder one layer each to the stages just before
    the last (the last also computes the logits, the first the embedding)."""
    if stages < 1:
        raise ConfigError(f"pipeline_parallel_size must be at least 1, got {stages}")
    if spec is None:
        spec = os.environ.get(PARTITION_ENV) or None
    if spec:
        try:
            counts = [int(x) for x in spec.split(",")]
        except ValueError:
            raise ConfigError(f"{PARTITION_ENV}={spec!r} is not a comma list of layer "
                              "counts") from None
        if len(counts) != stages or sum(counts) != num_layers or min(counts) < 1:
            raise ConfigError(
                f"{PARTITION_ENV}={spec!r} must name {stages} stage(s), each at least one "
                f"layer, summing to the model's {num_layers} layers")
        return counts
    if num_layers < stages:
        raise ConfigError(f"pipeline_parallel_size={stages} needs at least one layer per "
                          f"stage; this model has {num_layers} layers")
    base, extra = divmod(num_layers, stages)
    counts = [base] * stages
    for i in range(2, extra + 2):
        counts[-i] += 1
    return counts


@dataclass(frozen=True)
class PPStage:
    """One pipeline stage: its index, the stage count, and its layers [start, end)."""

    rank: int
    size: int
    start: int
    end: int

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def holds(self, layer: int) -> bool:
        return self.start <= layer < self.end

    @classmethod
    def of(cls, rank: int, size: int, num_layers: int, spec: str | None = None) -> "PPStage":
        counts = partition_layers(num_layers, size, spec)
        start = sum(counts[:rank])
        return cls(rank, size, start, start + counts[rank])


@dataclass(frozen=True)
class Layout:
    """The PP x TP grid of a replica's world (world = pp * tp ranks)."""

    tp: int = 1
    pp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp

    def stage_of(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tp

    def tp_ranks(self, stage: int) -> list[int]:
        return [stage * self.tp + r for r in range(self.tp)]

    def last_stage_driver(self) -> int:
        """The global rank that returns the last stage's outputs to the driver."""
        return (self.pp - 1) * self.tp


@dataclass
class LinkFigures:
    """What the stage hand-offs cost this rank: sends and receives, bytes and seconds."""

    sends: int = 0
    recvs: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    send_s: float = 0.0
    recv_s: float = 0.0


@dataclass
class StageLink:
    """This rank's neighbours in the pipeline: it receives (hidden, residual) from `prev` and
    sends them to `next` (None at the ends); one [2, T, hidden] tensor per micro-batch."""

    prev: int | None
    next: int | None
    hidden: int
    dtype: torch.dtype
    device: torch.device
    microbatches: int = 1  # per step; every stage cuts a step the same way
    via_host: bool = False  # gloo with GPU tensors: staged through host memory
    figures: LinkFigures = field(default_factory=LinkFigures)

    @classmethod
    def of(cls, rank: int, layout: Layout, hidden: int, dtype: torch.dtype,
           device: torch.device, microbatches: int = 1, via_host: bool = False
           ) -> "StageLink":
        stage = layout.stage_of(rank)
        prev = rank - layout.tp if stage > 0 else None
        nxt = rank + layout.tp if stage < layout.pp - 1 else None
        return cls(prev, nxt, hidden, dtype, device, microbatches,
                   via_host and device.type == "cuda")

    def recv(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's (hidden states, residual) of a step of `num_tokens` tokens."""
        where = torch.device("cpu") if self.via_host else self.device
        buf = torch.empty((2, num_tokens, self.hidden), dtype=self.dtype, device=where)
        t0 = time.perf_counter()
        torch.distributed.recv(buf, src=self.prev)
        if self.via_host:
            buf = buf.to(self.device)
        self.figures.recv_s += time.perf_counter() - t0
        self.figures.recvs += 1
        self.figures.bytes_received += buf.numel() * buf.element_size()
        return buf[0], buf[1]

    def isend(self, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[object, object]:
        """Start sending (hidden states, residual) to the next stage; `wait` for it."""
        t0 = time.perf_counter()
        buf = torch.stack((hidden, residual)).contiguous()
        if self.via_host:
            buf = buf.cpu()
        work = torch.distributed.isend(buf, dst=self.next)
        self.figures.send_s += time.perf_counter() - t0
        self.figures.sends += 1
        self.figures.bytes_sent += buf.numel() * buf.element_size()
        return work, buf  # the buffer lives until the send completed

    def wait(self, sends: list[tuple[object, object]]) -> None:
        t0 = time.perf_counter()
        for work, _ in sends:
            work.wait()  # type: ignore[attr-defined]
        self.figures.send_s += time.perf_counter() - t0


def check_pipeline_parallel(pp: int, num_layers: int, pp_unsupported: str | None) -> None:
    """ConfigError when `pp` stages cannot split this model (`pp_unsupported`: why the model
    family cannot be staged, None when it can)."""
    if pp == 1:
        return
    if pp_unsupported:
        raise ConfigError(f"pipeline_parallel_size={pp}: {pp_unsupported}")
    partition_layers(num_layers, pp)


__all__ = ["MICROBATCH_ENV", "PARTITION_ENV", "LinkFigures", "Layout", "PPStage", "StageLink",
           "microbatches_for",
           "check_pipeline_parallel", "partition_layers"]
