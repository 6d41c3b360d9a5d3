"""Helpers for the decode-graph tests on the CPU: the Triton kernels in the interpreter, a
stand-in capture (a plain call in place of CUDAGraph replay) that counts replays per rank, and
the graphs-vs-eager comparison."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import triton_interpreted


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    """The Triton kernels interpreted on CPU tensors, on a machine with a GPU too (as in
    tests/unit/kernels/test_triton.py): set for the module, the modules reloaded around it."""
    with triton_interpreted("kvserve.kernels.triton_attention", "kvserve.kernels.triton_cache"):
        yield


class StandIn:
    """The capture of the CPU tests: `capture(fn)` returns a replay that calls fn (no graph),
    and counts each rank's replays in a file of `folder` (picklable: the engine sends it to the
    tensor-parallel workers, spawned processes). `fail_rank`'s capture raises, as an op that
    cannot be captured would."""

    def __init__(self, folder: Path, fail_rank: int | None = None) -> None:
        self.folder, self.fail_rank = folder, fail_rank

    def __call__(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank == self.fail_rank:
            raise RuntimeError(f"injected capture failure on rank {rank}")
        log = self.folder / f"rank{rank}"

        def replay() -> torch.Tensor:
            with open(log, "a") as f:
                f.write(".")
            return fn()
        return replay

    def counts(self, ranks: int) -> list[int]:
        """Replays per rank so far."""
        return [(self.folder / f"rank{r}").stat().st_size
                if (self.folder / f"rank{r}").exists() else 0 for r in range(ranks)]


def assert_same_outputs(got, want, tol: float = 1e-4) -> None:
    """The same greedy tokens, and each sampled token's logprob within `tol`."""
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want):
        assert len(g.outputs[0].logprobs) == len(w.outputs[0].logprobs)
        for lg, lw, tok in zip(g.outputs[0].logprobs, w.outputs[0].logprobs,
                               w.outputs[0].token_ids):
            assert abs(lg[tok].logprob - lw[tok].logprob) < tol
